"""The work list of a captured prefill-attention launch (``prefill_attention``'s ``work`` argument), in numpy: the
executor builds it on the host every mixed step, without importing Triton (a CPU-only install has none).
"""

from __future__ import annotations

import numpy as np

# The prefill kernel's default query rows per program (tokens x GQA group); a work list is built for it.
PREFILL_BLOCK_M = 64


def prefill_tokens_per_tile(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens one program of the default config covers: block_m // (Hq / Hkv)."""
    return PREFILL_BLOCK_M // (num_heads // num_kv_heads)


def prefill_work_list(q_lens: np.ndarray, tokens_per_tile: int, capacity: int) -> np.ndarray:
    """The (capacity, 2) int32 work list of a captured launch: (sequence, tile counter) for every tile of the
    sequences feeding ``q_lens`` (B,) tokens, tile counter 0 (a sequence's last, longest-running tile) of every
    sequence first; rows past them ask for tile counter ``capacity``, which no sequence has, so they exit.

    Example (tokens_per_tile 4, capacity 6): q_lens (1, 9) -> rows (0, 0), (1, 0), (1, 1), (1, 2), then (0, 6) x 2.
    Raises ValueError when the tiles need more than ``capacity`` rows.
    """
    tiles = -(-q_lens.astype(np.int64) // tokens_per_tile)  # (B,) ceil
    total = int(tiles.sum())
    if total > capacity:
        raise ValueError(f"the work list holds {capacity} tiles, the step needs {total}")
    seqs = np.repeat(np.arange(len(q_lens), dtype=np.int64), tiles)  # (total,)
    counters = np.arange(total) - np.repeat(np.cumsum(tiles) - tiles, tiles)  # 0 .. tiles_b - 1 per sequence
    order = np.lexsort((seqs, counters))  # counter 0 of every sequence first
    work = np.zeros((capacity, 2), dtype=np.int32)
    work[:, 1] = capacity
    work[:total, 0], work[:total, 1] = seqs[order], counters[order]
    return work
