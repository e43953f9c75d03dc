"""Counter-based uniforms for seeded sampling rows: a pure function of (seed, n).

The sampler draws one uniform per row and inverts the row's CDF at it. A seeded request's n-th draw must not
depend on its batch mates, its row, earlier steps or the device, so it cannot come from a stateful generator.
Instead, on the host (numpy, a few microseconds per step):

    key = splitmix64(splitmix64(seed mod 2**64) xor n)          -> two 32-bit keys (k0, k1) per row
    h   = lowbias32(lowbias32(k0) xor k1)                       -> 32 random bits per draw
    u   = ((h >> 8) + 0.5) / 2**24  in (0, 1)                   -> 24-bit resolution like torch's

lowbias32 (Chris Wellons' hash-prospector) is a bijection on 32-bit integers with strong avalanche; splitmix64
spreads any Python int seed over 64 bits. The same (seed, n) gives the same u on every machine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
_LOWBIAS_MUL1 = 0x7FEB352D  # lowbias32's multipliers
_LOWBIAS_MUL2 = 0x846CA68B


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """One splitmix64 step on a uint64 array (numpy's uint64 arithmetic wraps modulo 2**64)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seed_keys(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray:
    """(S, 2) int64 keys, each in [0, 2**32), of the draws (seed, counter); any Python int seed works."""
    seeds_u64 = np.array([s & _MASK64 for s in seeds], dtype=np.uint64)
    key = _splitmix64(_splitmix64(seeds_u64) ^ np.array(counters, dtype=np.uint64))  # (S,)
    return np.stack([key & np.uint64(_MASK32), key >> np.uint64(32)], axis=1).astype(np.int64)


def _lowbias32_np(x: np.ndarray) -> np.ndarray:
    """lowbias32 of a uint32 array (numpy's uint32 products wrap modulo 2**32)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(_LOWBIAS_MUL1)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(_LOWBIAS_MUL2)
    return x ^ (x >> np.uint32(16))


def seeded_uniforms(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray:
    """(S,) float32 uniforms strictly in (0, 1), one per draw (seed, counter), with 24 random bits."""
    keys = seed_keys(seeds, counters).astype(np.uint32)  # (S, 2)
    h = _lowbias32_np(_lowbias32_np(keys[:, 0]) ^ keys[:, 1])
    return (((h >> np.uint32(8)).astype(np.float64) + 0.5) / (1 << 24)).astype(np.float32)
