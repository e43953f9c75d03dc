"""CUDA graphs for small mixed steps: a prompt chunk (or several) beside decode rows, up to a few hundred tokens.

Why: run eagerly, such a step is launch-bound. On the H200 a served Poisson load of Qwen3-0.6B (~70 streams, one
or two new prompts a step) spent 17-21 ms of device time on each of its mixed steps of ~460 tokens, against ~2.3 ms
for a decode step of the same rows: the host launching ~300 kernels one by one, not the GPU's work. One captured
forward per token bucket turns that into one graph launch.

What varies from step to step lives in static buffers the graph reads (N = largest bucket, Bm = min(N,
max_num_seqs) sequences, R = N // TOKENS + Bm work rows, W = max blocks per sequence), views of ONE device buffer:

    input_ids (N,) int64   positions (N,) int64   slot_mapping (N,) int64   sample_index (Bm,) int64
    cu_seqlens_q (Bm+1,) int32   seq_lens (Bm,) int32   work (R, 2) int32   block_tables (Bm, W) int32

A step of T tokens in B sequences runs the graph of the smallest bucket n >= T, captured for n tokens, b = min(n,
Bm) sequences and r = n // TOKENS + b work rows. Padding: tokens T..n feed token 0 at position 0 into the scratch
block (as in ``cuda_graphs``) and belong to no sequence; sequences B..b feed no tokens (cu_seqlens_q stays at T,
seq_lens 0); the attention grid comes from the work list (``prefill_work.prefill_work_list``), not from the
longest chunk, so its launch is the same every replay. The padding rows' hidden states are computed and ignored.

Worked example (buckets 16, 32; TOKENS 32): rows "a" (decode at position 40) and "b" (prompt chunk of 9 tokens
from 0) make T = 10, B = 2 -> bucket 16, b = 16 sequences, r = 16 // 32 + 16 = 16 work rows:

    input_ids[:16]    = [a's token, b's 9 tokens, 0 x 6]       positions = [40, 0..8, 0 x 6]
    cu_seqlens_q[:17] = [0, 1, 10, 10 x 14]                     seq_lens[:16] = [41, 9, 0 x 14]
    work[:16]         = [(0, 0), (1, 0), (0, 16) x 14]          sample_index = [0, 9] (the rows that sample)

The host writes all of it into a pinned buffer of the same layout and sends the prefix it needs with one copy
(the tables last, rows :B only); two pinned buffers alternate, as for the decode graphs.
"""

from __future__ import annotations

import itertools

import attrs
import numpy as np
import torch

from fnvllm.executor.cuda_graphs import INLINE_TABLE_BYTES, Forward, HostStages
from fnvllm.executor.device_inputs import token_positions_and_slots, upload
from fnvllm.executor.inputs import Feed, pad_tables
from fnvllm.kernels.attention import AttentionMetadata
from fnvllm.kernels.prefill_work import prefill_work_list
from fnvllm.state import StepPlan

_SMALL_BUCKETS = (16, 32, 64, 128)
_BUCKET_STEP = 128


def mixed_token_buckets(max_tokens: int) -> list[int]:
    """Token buckets of the mixed-step graphs: 16, 32, 64, 128, then every multiple of 128 up to ``max_tokens``
    (and ``max_tokens`` itself). Empty when ``max_tokens`` < 2 (a mixed step feeds at least two tokens).

    >>> mixed_token_buckets(512)
    [16, 32, 64, 128, 256, 384, 512]
    >>> mixed_token_buckets(40)
    [16, 32, 40]
    """
    if max_tokens < 2:
        return []
    sizes = [n for n in _SMALL_BUCKETS if n < max_tokens] + list(range(2 * _BUCKET_STEP, max_tokens, _BUCKET_STEP))
    return sorted({*sizes, max_tokens})


@attrs.frozen
class MixedLayout:
    """Byte offsets of the mixed graphs' inputs in one buffer (see the module docstring): int64 arrays first,
    then the int32 ones, the (Bm, W) tables last so that a prefix covers rows :B of them."""

    num_tokens: int  # N
    num_seqs: int  # Bm
    work_rows: int  # R
    max_blocks: int  # W

    @property
    def tables_offset(self) -> int:
        """Where the tables start: 8 (3N + Bm) bytes of int64, then 4 (2 Bm + 1 + 2R) of int32."""
        return 8 * (3 * self.num_tokens + self.num_seqs) + 4 * (2 * self.num_seqs + 1 + 2 * self.work_rows)

    @property
    def num_bytes(self) -> int:
        """Size of the whole buffer."""
        return self.tables_offset + 4 * self.num_seqs * self.max_blocks

    def views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(input_ids, positions, slot_mapping, sample_index, cu_seqlens_q, seq_lens, work, block_tables) as
        typed views of the uint8 ``buffer``."""
        n, b, r = self.num_tokens, self.num_seqs, self.work_rows
        sizes = ((n, torch.int64), (n, torch.int64), (n, torch.int64), (b, torch.int64))
        sizes += ((b + 1, torch.int32), (b, torch.int32), (2 * r, torch.int32), (b * self.max_blocks, torch.int32))
        views, offset = [], 0
        for count, dtype in sizes:
            width = count * (8 if dtype == torch.int64 else 4)
            views.append(buffer[offset : offset + width].view(dtype))
            offset += width
        views[6] = views[6].view(r, 2)
        views[7] = views[7].view(b, self.max_blocks)
        return tuple(views)


@attrs.frozen
class Bucket:
    """One captured size: ``tokens`` fed, ``seqs`` sequences, ``work_rows`` rows of the attention work list."""

    tokens: int
    seqs: int
    work_rows: int


@attrs.frozen(eq=False)
class StagedStep:
    """What ``stage_mixed`` wrote: the step's ``num_tokens`` (T), ``num_seqs`` (B), ``num_samples`` (S), the
    bytes of the staged buffer to send (``end``; the tables of rows :B when ``inline_tables``), and the step's
    (B, w) block ``tables`` (to upload apart when not inline)."""

    num_tokens: int
    num_seqs: int
    num_samples: int
    end: int
    inline_tables: bool
    tables: np.ndarray


def stage_mixed(
    plan: StepPlan,
    arrays: tuple[np.ndarray, ...],
    layout: MixedLayout,
    bucket: Bucket,
    scratch_slot: int,
    tokens_per_tile: int,
) -> StagedStep:
    """Write ``plan`` (a mixed step of at most ``bucket.tokens`` tokens) and the bucket's padding into the staged
    host ``arrays`` (``MixedLayout.views`` of a pinned buffer, as numpy). The tables of rows :B go in too when they
    fit ``INLINE_TABLE_BYTES`` at full width; otherwise the caller uploads ``StagedStep.tables`` apart."""
    ids, pos, slots, sample_index, cu, seq_lens, work, tables = arrays
    b, n = plan.num_seqs, bucket.tokens
    q_lens = np.fromiter(map(len, plan.input_tokens), dtype=np.int64, count=b)  # (B,)
    t = int(q_lens.sum())
    starts = np.fromiter(plan.start_positions, dtype=np.int64, count=b)  # (B,)
    cu[0] = 0
    cu[1 : b + 1] = np.cumsum(q_lens)
    cu[b + 1 : bucket.seqs + 1] = t  # padding sequences: no tokens
    seq_lens[:b] = starts + q_lens
    seq_lens[b : bucket.seqs] = 0
    ids[:t] = np.fromiter(itertools.chain.from_iterable(plan.input_tokens), dtype=np.int64, count=t)
    table = pad_tables(plan.block_tables)  # (B, w)
    pos[:t], slots[:t] = token_positions_and_slots(starts, q_lens, table, plan.block_size)
    ids[t:n], pos[t:n], slots[t:n] = 0, 0, scratch_slot  # padding tokens
    work[: bucket.work_rows] = prefill_work_list(q_lens, tokens_per_tile, bucket.work_rows)
    sampled = np.flatnonzero(np.asarray(plan.sample, dtype=bool))  # (S,)
    sample_index[: len(sampled)] = (cu[1 : b + 1].astype(np.int64) - 1)[sampled]
    inline = b * layout.max_blocks * 4 <= INLINE_TABLE_BYTES
    if inline:
        tables[:b, : table.shape[1]] = table
    end = layout.tables_offset + (b * layout.max_blocks * 4 if inline else 0)
    return StagedStep(t, b, len(sampled), end, inline, table)


class MixedGraphs:
    """Captured forwards of mixed steps, one per token bucket (``mixed_token_buckets``). ``can_run(plan)`` says
    whether one holds the plan; ``run_plan(plan, feed)`` replays it and returns the hidden states of the rows the
    plan samples, (S, H) (computed on the device after the replay; nothing here waits for the device).

    forward: the model call with caches and backend bound (its attention must take ``prefill_work``: the Triton
    backend). tokens_per_tile: the prefill kernel's query tokens per program (``prefill_tokens_per_tile``).
    """

    def __init__(
        self,
        forward: Forward,
        max_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        tokens_per_tile: int,
        device: torch.device,
    ) -> None:
        sizes = mixed_token_buckets(max_tokens)
        if not sizes:
            raise ValueError(f"max_tokens must be >= 2 (a mixed step feeds at least two tokens), got {max_tokens}")
        self.tokens_per_tile = tokens_per_tile
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        seqs = min(sizes[-1], max_num_seqs)
        self.buckets = [self._bucket(n, seqs) for n in sizes]
        self.layout = MixedLayout(sizes[-1], seqs, self.buckets[-1].work_rows, max_blocks_per_seq)
        self.staged = torch.zeros(self.layout.num_bytes, dtype=torch.uint8, device=device)
        self.inputs = self.layout.views(self.staged)
        self.inputs[2].fill_(self.scratch_slot)
        self.inputs[6][:, 1] = self.layout.work_rows  # every work row asks for no tile until a step writes it
        self.hosts = HostStages(self.layout)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all(forward)

    def _bucket(self, tokens: int, max_seqs: int) -> Bucket:
        seqs = min(tokens, max_seqs)
        return Bucket(tokens, seqs, tokens // self.tokens_per_tile + seqs)

    def _meta(self, bucket: Bucket) -> AttentionMetadata:
        _, positions, slots, _, cu, seq_lens, work, tables = self.inputs
        return AttentionMetadata(
            positions=positions[: bucket.tokens],
            slot_mapping=slots[: bucket.tokens],
            cu_seqlens_q=cu[: bucket.seqs + 1],
            seq_lens=seq_lens[: bucket.seqs],
            block_tables=tables[: bucket.seqs],
            max_seqlen_q=bucket.tokens,
            max_seqlen_k=tables.shape[1] * self.block_size,
            block_size=self.block_size,
            prefill_work=work[: bucket.work_rows],
        )

    def _capture_all(self, forward: Forward) -> None:
        """Capture every bucket, largest first, in one memory pool of their own."""
        pool = None
        ids, positions = self.inputs[0], self.inputs[1]
        for bucket in reversed(self.buckets):
            meta = self._meta(bucket)
            forward(ids[: bucket.tokens], positions[: bucket.tokens], meta)  # warm-up: compiles, sizes the pool
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket.tokens] = forward(ids[: bucket.tokens], positions[: bucket.tokens], meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[bucket.tokens] = graph
        torch.cuda.synchronize()

    def can_run(self, plan: StepPlan) -> bool:
        """True when a captured bucket holds the plan's tokens (sequences never outnumber tokens)."""
        return sum(map(len, plan.input_tokens)) <= self.layout.num_tokens and plan.num_seqs <= self.layout.num_seqs

    def run_plan(self, plan: StepPlan, feed: Feed | None = None) -> torch.Tensor:
        """Stage ``plan``, send it, apply ``feed`` (device ids of rows fed by the previous step's samples), replay
        the bucket and return the sampled rows' hidden states (S, H)."""
        total = sum(map(len, plan.input_tokens))
        bucket = next(b for b in self.buckets if b.tokens >= total)
        host = self.hosts.next()
        step = stage_mixed(plan, host.arrays, self.layout, bucket, self.scratch_slot, self.tokens_per_tile)
        self.staged[: step.end].copy_(host.buffer[: step.end], non_blocking=True)
        host.ready.record()
        ids, sample_index, tables = self.inputs[0], self.inputs[3], self.inputs[7]
        if not step.inline_tables:
            tables[: step.num_seqs, : step.tables.shape[1]].copy_(upload(step.tables, self.staged.device))
        if feed is not None:
            fed = feed.apply(ids[: step.num_tokens], token_rows=True)
            if fed.data_ptr() != ids.data_ptr():
                ids[: step.num_tokens].copy_(fed)
        self.graphs[bucket.tokens].replay()
        return self.outputs[bucket.tokens].index_select(0, sample_index[: step.num_samples])
