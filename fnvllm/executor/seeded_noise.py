"""Counter-based Exp(1) noise for seeded sampling rows: a pure function of (seed, n, vocabulary index).

A seeded request's n-th draw must not depend on its batch mates, its row, earlier steps or the device, so it
cannot come from a stateful generator. Instead:

    host:   key = splitmix64(splitmix64(seed mod 2**64) xor n)          -> two 32-bit keys (k0, k1) per row
    device: h = lowbias32(lowbias32(v xor k0) xor k1)  for v in 0..V-1   -> 32 random bits per (row, token)
            u = (h >> 8 + 0.5) / 2**24  in (0, 1);  E = -log(u)          -> Exp(1), 24-bit resolution like torch's

lowbias32 (Chris Wellons' hash-prospector) is a bijection on 32-bit integers with strong avalanche. The device
side keeps 32-bit values in int64 tensors and stores lowbias32's second multiplier as (c - 2**32), so no product
ever leaves the int64 range: the arithmetic is exact on every backend and the noise is bit-identical on CPU and
CUDA up to the float32 log.

Cost: about 20 elementwise int64 passes over (S, V); 4.8 ms for 256 seeded rows of a 152k vocabulary on an H200
(unseeded rows cost a single exponential_ pass). A fused kernel would do it in one pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
# lowbias32's multipliers; the second is stored as (c - 2**32) so int64 products never overflow.
_LOWBIAS_MUL1 = 0x7FEB352D
_LOWBIAS_MUL2 = 0x846CA68B - (1 << 32)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """One splitmix64 step on a uint64 array (numpy's uint64 arithmetic wraps modulo 2**64)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seed_keys(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray:
    """(S, 2) int64 noise keys, each in [0, 2**32), of the draws (seed, counter); any Python int seed works."""
    seeds_u64 = np.array([s & _MASK64 for s in seeds], dtype=np.uint64)
    key = _splitmix64(_splitmix64(seeds_u64) ^ np.array(counters, dtype=np.uint64))  # (S,)
    return np.stack([key & np.uint64(_MASK32), key >> np.uint64(32)], axis=1).astype(np.int64)


def _lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """In place: lowbias32 of int64 tensors holding 32-bit values."""
    x.bitwise_xor_(x >> 16).mul_(_LOWBIAS_MUL1).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15).mul_(_LOWBIAS_MUL2).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def seeded_exponential(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise (S, V) float32, a pure function of each row's keys (S, 2) int64 and the vocabulary index."""
    x = torch.arange(vocab_size, device=keys.device, dtype=torch.int64).expand(keys.shape[0], -1)  # (S, V)
    x = _lowbias32_(x.bitwise_xor(keys[:, :1]))
    x = _lowbias32_(x.bitwise_xor_(keys[:, 1:]))
    uniform = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 random bits, strictly in (0, 1)
    return uniform.log_().neg_()
