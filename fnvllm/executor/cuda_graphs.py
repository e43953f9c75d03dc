"""CUDA graphs for decode steps: one captured forward per bucketed batch size, replayed on static buffers.

A decode step (every sequence feeds one token) of B sequences runs the graph of the smallest bucket >= B. Rows
past B are padding: they feed token 0 at position 0, write their K/V into the executor's scratch block (a real
block the core never hands out, so no sentinel slot is needed) and have context length 0, which the decode
kernel answers with zeros without reading any KV. Their hidden states are computed and ignored.

Static buffers (N = largest bucket, W = max blocks per sequence):

    input_ids (N,) int64   positions (N,) int64   slot_mapping (N,) int64
    seq_lens (N,) int32    block_tables (N, W) int32   cu_seqlens_q (N+1,) int32 = 0, 1, ..., N (fixed)

Only ``block_tables[:B, :w]`` (w = this step's widest table) is copied per step; columns past a sequence's end
hold stale ids that the kernel never reads (it stops at seq_lens).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from fnvllm.executor.device_inputs import upload
from fnvllm.executor.inputs import Feed
from fnvllm.kernels.attention import AttentionMetadata

# forward(input_ids, positions, meta) -> hidden (T, H); the model call with caches and backend bound.
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted({*sizes, max_num_seqs})


class DecodeGraphs:
    """Captured decode forwards. ``run(...)`` replays the right one; ``can_run(B)`` says whether one fits."""

    def __init__(
        self,
        forward: Forward,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
    ) -> None:
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all(forward)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b],
            cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            max_seqlen_q=1,
            max_seqlen_k=self.block_tables.shape[1] * self.block_size,
            block_size=self.block_size,
        )

    def _capture_all(self, forward: Forward) -> None:
        """Capture every bucket, largest first, in one shared memory pool."""
        pool = None
        for b in reversed(self.sizes):
            meta = self._meta(b)
            forward(self.input_ids[:b], self.positions[:b], meta)  # warm-up: compiles kernels, sizes the pool
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = forward(self.input_ids[:b], self.positions[:b], meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int) -> bool:
        """True when a captured bucket holds ``num_seqs`` decode rows."""
        return num_seqs <= self.sizes[-1]

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        feed: Feed | None = None,
    ) -> torch.Tensor:
        """Replay the bucket for B = len(input_ids) decode rows; returns hidden (B, H) (a view of the graph's
        output, valid until the next replay). ``feed``: device ids replacing some or all of ``input_ids`` (the
        previous step's samples, for an overlapped step). Nothing here waits for the device."""
        b = len(input_ids)
        bucket = next(s for s in self.sizes if s >= b)
        device = self.input_ids.device
        dev = upload(np.concatenate([input_ids, positions, slots]), device)
        ids = dev[:b] if feed is None else feed.apply(dev[:b], token_rows=False)
        self.input_ids[:b].copy_(ids)
        self.positions[:b].copy_(dev[b : 2 * b])
        self.slot_mapping[:b].copy_(dev[2 * b :])
        self.seq_lens[:b].copy_(upload(seq_lens, device))
        width = block_tables.shape[1]
        self.block_tables[:b, :width].copy_(upload(block_tables, device))
        if bucket > b:  # padding rows: scratch slot, empty context
            self.slot_mapping[b:bucket].fill_(self.scratch_slot)
            self.seq_lens[b:bucket].zero_()
        self.graphs[bucket].replay()
        return self.outputs[bucket][:b]
