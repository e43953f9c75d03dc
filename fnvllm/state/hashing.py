"""Chained block hashes for the prefix cache: h_i = H(h_{i-1}, tokens of block i).

The hashes only index the cache: a hit is trusted only when the stored tokens are equal too and the block was
registered as the child of the very registration hit at the previous block (``PoolTxn.lookup`` compares
registration serials, not hashes). So the whole prefix matches whatever the hasher does, even one that collides
or ignores the parent: a colliding hash costs a miss (or a block left unregistered), never a wrong answer. The
hasher is a plain function so tests can inject a deliberately colliding one.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from functools import cache

import xxhash

BlockHasher = Callable[[int | None, Sequence[int]], int]

_ROOT = 0x9E3779B97F4A7C15  # parent value of the first block; any fixed constant works


@cache
def _int64s(count: int) -> Callable[..., bytes]:
    """The packer of ``count`` native int64s: the bytes of ``array("q", tokens)``, built about 3x faster (array
    parses each item through the generic argument parser)."""
    return struct.Struct(f"={count}q").pack


def hash_block_xxh3(parent: int | None, tokens: Sequence[int]) -> int:
    """64-bit xxh3 of the parent hash followed by the block's token ids (as little-endian int64s).

    Worked example: block 0 of [5, 6 | 7, 8] with block_size 2 has h0 = H(None, [5, 6]); block 1 has
    h1 = H(h0, [7, 8]); a prompt [9, 6 | 7, 8] shares no hash with it because its h0 differs.
    """
    seed = _ROOT if parent is None else parent
    return xxhash.xxh3_64_intdigest(_int64s(len(tokens))(*tokens), seed=seed)


def chain_hashes(hasher: BlockHasher, tokens: Sequence[int], block_size: int, num_blocks: int) -> list[int]:
    """The chained hashes of the first ``num_blocks`` full blocks of ``tokens``."""
    hashes: list[int] = []
    parent: int | None = None
    for i in range(num_blocks):
        parent = hasher(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
