"""CUDA graphs for decode steps: one captured forward per bucketed batch size, replayed on static buffers.

A decode step (every sequence feeds one token) of B sequences runs the graph of the smallest bucket >= B. Rows
past B are padding: they feed token 0 at position 0, write their K/V into the executor's scratch block (a real
block the core never hands out, so no sentinel slot is needed) and have context length 0, which the decode
kernel answers with zeros without reading any KV. Their hidden states are computed and ignored.

Static buffers (N = largest bucket, W = max blocks per sequence), views of ONE device byte buffer:

    input_ids (N,) int64   positions (N,) int64   slot_mapping (N,) int64
    seq_lens (N,) int32    order (N,) int32
    scale (N,) float32   fixed (N,) int32   uniforms (N,) float32   top_k (N,) int32   top_p (N,) float32
    min_p (N,) float32   live (2,) int32   (sampling in the graph)
    block_tables (N, W) int32
    cu_seqlens_q (N+1,) int32 = 0, 1, ..., N (fixed, apart)

``order`` is the bucket's rows longest first (``longest_first``), written by the host when the decode kernel
follows it (``order_min_rows``: FP8 caches at large batches, ``decode_attention.orders_longest_first``).

A step writes its rows into a pinned host buffer of the same layout and sends the prefix it needs (the four (N,)
arrays and table rows :B) with one host-to-device copy: a decode step of a small batch is launch-bound, and one copy
replaces three uploads and five device copies (profile: BENCHMARKS.md, "Small batches"). Two pinned buffers
alternate, so the host fills one while the copy from the other may still be queued behind the step in flight; an
event per buffer says when it is free again. When table rows at full width W would be large (long contexts in small
blocks), the tables go as a separate ``(B, w)`` upload of this step's widest table instead. Columns past a
sequence's end hold stale ids that the kernel never reads (it stops at seq_lens).

Sampling in the graph (``sampler``): the buckets that capture the lm_head capture the sampler's two kernels behind
it (``GraphSampler.sample``: ``fnvllm.kernels.sampling.sample_rows_graphed``), reading each row's inverse
temperature, seeded uniform and the step's live row count and Philox key from the staged buffer, and capture its
top-k redraw (``GraphSampler.filter``: ``fnvllm.kernels.sampling_segments.segmented_pick_graphed``, reading the rows'
top-k / top-p / min-p) in a second, small graph per capture, replayed right behind the first only by steps with
top-k rows. A step whose rows the graphs can sample (``GraphSample``: temperature, top-k with top-p / min-p; no
penalty, bias or grammar; logprob rows' logprobs are computed after the replay) stages them and its tokens come out
of the replay: no eager sampler launches, which cost a one-request step 0.19 ms of host time at temperature only
(H200, ``benchmarks/host_step.py``). Any other step stages a live count of 0 (the captured kernels read nothing and
store nothing) and samples eagerly from the logits as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import attrs
import numpy as np
import torch

from fnvllm.executor.device_inputs import upload
from fnvllm.executor.inputs import Feed, prepare_decode, stage_decode
from fnvllm.kernels.attention import AttentionMetadata
from fnvllm.state import StepPlan

# forward(input_ids, positions, meta) -> hidden (T, H); the model call with caches and backend bound.
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
# logits(hidden (B, H)) -> (B, V): the lm_head, captured behind the forward in the small buckets.
Logits = Callable[[torch.Tensor], torch.Tensor | None]


class GraphSampler(Protocol):
    """The sampler's kernels as the decode graphs capture them (``fnvllm.executor.fused_sampling.KernelGraphSampler``).
    Arguments are a bucket's N rows; ``live`` (2,) int32 holds the step's live rows n and Philox key; ``out`` (2 N,)
    int64 receives rows :n's tokens then their non-finite flags."""

    def sample(
        self, logits: torch.Tensor, scale: torch.Tensor, fixed: torch.Tensor, uniforms: torch.Tensor,
        live: torch.Tensor, out: torch.Tensor,
    ) -> None:  # fmt: skip
        """Sample every live row by its temperature (``sample_rows_graphed``)."""
        ...

    def filter(
        self, logits: torch.Tensor, filters: tuple[torch.Tensor, ...], live: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Redraw the live rows with a top-k after ``sample`` (``segmented_pick_graphed``); filters: (scale, top_k,
        top_p, min_p), (N,) each."""
        ...


# Table rows at full width go with the staged copy while they are at most this many bytes (B x W x 4).
INLINE_TABLE_BYTES = 256 * 1024


@attrs.frozen(eq=False)
class GraphSample:
    """How a decode step's B rows sample inside the graphs (a batch ``fnvllm.executor.sampler.graph_rows`` takes).

    scale: (B,) float32 inverse temperature, 0 = greedy. fixed: (B,) int32, 1 where ``uniforms`` holds the row's
    uniform (a seeded row). uniforms: (B,) float32. key: the step's Philox key for the other rows, in
    [0, 2**31) (``Sampler.next_key``). top_k / top_p / min_p: (B,) int32 / float32 / float32 (neutral 0 / 1 / 0
    on rows without a top-k), or None when no row has a top-k (then the filter graph does not run).
    """

    scale: np.ndarray
    fixed: np.ndarray
    uniforms: np.ndarray
    key: int
    top_k: np.ndarray | None = None
    top_p: np.ndarray | None = None
    min_p: np.ndarray | None = None


@attrs.frozen
class StagedLayout:
    """Byte offsets of the decode graphs' inputs in one buffer, for N rows and tables W blocks wide: the int64
    arrays first (8-byte aligned), then the int32 ones, the tables last so a prefix covers rows :B of them."""

    num_rows: int
    max_blocks: int

    @property
    def tables_offset(self) -> int:
        """Where the (N, W) int32 tables start: after ids, positions, slots (8N bytes each), seq_lens, the order
        and the six sampling arrays (4N each), and live (8 bytes, padded to 16)."""
        return 56 * self.num_rows + 16

    def order(self, buffer: torch.Tensor) -> torch.Tensor:
        """The (N,) int32 order (rows longest first) as a view of the uint8 ``buffer``."""
        return buffer[28 * self.num_rows : 32 * self.num_rows].view(torch.int32)

    def sampling(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(scale (N,) float32, fixed (N,) int32, uniforms (N,) float32, top_k (N,) int32, top_p (N,) float32,
        min_p (N,) float32, live (2,) int32) as views of the uint8 ``buffer``: what ``GraphSample`` stages for the
        sampler captured in the graphs."""
        n = self.num_rows
        dtypes = (torch.float32, torch.int32, torch.float32, torch.int32, torch.float32, torch.float32)
        arrays = [buffer[(32 + 4 * k) * n : (36 + 4 * k) * n].view(dtype) for k, dtype in enumerate(dtypes)]
        return (*arrays, buffer[56 * n : 56 * n + 8].view(torch.int32))

    @property
    def num_bytes(self) -> int:
        """Size of the whole buffer."""
        return self.tables_offset + 4 * self.num_rows * self.max_blocks

    def views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(input_ids, positions, slot_mapping, seq_lens, block_tables) as typed views of the uint8 ``buffer``."""
        n = self.num_rows
        int64 = [buffer[i * 8 * n : (i + 1) * 8 * n].view(torch.int64) for i in range(3)]
        seq_lens = buffer[24 * n : 28 * n].view(torch.int32)
        tables = buffer[self.tables_offset : self.num_bytes].view(torch.int32).view(n, self.max_blocks)
        return (*int64, seq_lens, tables)


class Layout(Protocol):
    """A staged buffer's layout: its size and its typed views (``StagedLayout``, ``mixed_graphs.MixedLayout``)."""

    @property
    def num_bytes(self) -> int: ...

    def views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]: ...


class HostStage:
    """A pinned host buffer in a ``Layout`` with numpy views to fill, and the event of its last copy.

    table_rows: rows whose staged block table objects are tracked in ``staged_tables`` (the decode graphs'
    ``stage_decode`` rewrites only the rows whose table changed)."""

    def __init__(self, layout: Layout, table_rows: int = 0) -> None:
        self.buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8, pin_memory=True)
        self.arrays = tuple(t.numpy() for t in layout.views(self.buffer))
        sampling = layout.sampling(self.buffer) if isinstance(layout, StagedLayout) else ()
        self.sampling = tuple(t.numpy() for t in sampling)  # StagedLayout.sampling's views, or ()
        self.ready = torch.cuda.Event()
        # the block table object staged in each row (``stage_decode``); None where a row's table is unknown
        self.staged_tables: list[tuple[int, ...] | None] = [None] * table_rows


class HostStages:
    """Two pinned ``HostStage`` buffers used in turn, so the host fills one while the copy from the other may
    still be queued behind the step in flight."""

    def __init__(self, layout: Layout, table_rows: int = 0) -> None:
        self.stages = [HostStage(layout, table_rows) for _ in range(2)]
        self.next_index = 0

    def next(self) -> HostStage:
        """The buffer to fill next, once the copy that last read it has run."""
        host = self.stages[self.next_index]
        self.next_index = 1 - self.next_index
        host.ready.synchronize()
        return host


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted({*sizes, max_num_seqs})


def longest_first(lens: np.ndarray, out: np.ndarray) -> None:
    """out[:n] = the rows of lens (n,) longest first, equal lengths in row order (a stable sort): the order in which
    the decode kernel takes a large batch's sequences, so its last wave holds short ones. Worked example: lens
    (3, 9, 0, 9) -> (1, 3, 0, 2)."""
    out[: len(lens)] = np.argsort(-lens.astype(np.int64), kind="stable")


def capture_key(
    sizes: list[int],
    short_widths: Mapping[int, int],
    full_width: int,
    block_size: int,
    num_seqs: int,
    longest: Callable[[], int],
) -> tuple[int, int]:
    """(bucket, table width in blocks) of the capture that runs a decode step of num_seqs rows whose longest
    context is ``longest()`` tokens (asked only of buckets with a short capture): the bucket's short-table capture
    when every context fits it, else its full one. Worked example: buckets (1, 2, 4, 8, 16, 32), short_widths {16:
    2}, blocks of 256: 12 rows up to 512 tokens -> (16, 2); 12 rows with one of 513 -> (16, W); 20 rows -> (32, W)."""
    bucket = next(s for s in sizes if s >= num_seqs)
    short = short_widths.get(bucket)
    if short is not None and longest() <= short * block_size:
        return bucket, short
    return bucket, full_width


class DecodeGraphs:
    """Captured decode forwards. ``run(...)`` replays the right one; ``can_run(B)`` says whether one fits.

    logits: when given, buckets of at most ``logits_max_rows`` rows capture the lm_head too, so that a small decode
    step launches one graph instead of a graph and an eager GEMM (the host's launch work dominates such a step).
    Each of those buckets keeps its (bucket, V) logits in the graph pool (64 rows of Qwen3's 151,936-id vocabulary
    in bfloat16: 175 rows over 8 buckets, 53 MB); larger buckets, where the device's work hides the launch, leave
    the lm_head to the caller.

    short_widths: buckets captured a second time with tables of that many blocks (``decode_attention.
    short_graph_widths``: the attention knobs of short tables); a step of such a bucket whose contexts all fit
    replays that capture (a view of the same staged tables, so the host stages the step the same way).

    sampler: the sampler's kernels (``GraphSampler``), captured behind the lm_head in the buckets that have one
    (its top-k redraw in a small graph of its own per capture, ``filters``); ``samples_in_graph(B)`` says whether a
    step of B rows can sample there (``run_plan``'s ``sample``).
    """

    def __init__(
        self,
        forward: Forward,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        logits: Logits | None = None,
        logits_max_rows: int = 64,
        short_widths: Mapping[int, int] | None = None,
        order_min_rows: int | None = None,
        sampler: GraphSampler | None = None,
    ) -> None:
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.short_widths = {
            b: w for b, w in (short_widths or {}).items() if b in self.sizes and w < max_blocks_per_seq
        }
        self.logits_max_rows = logits_max_rows if logits is not None else 0
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        n = self.sizes[-1]
        self.layout = StagedLayout(n, max_blocks_per_seq)
        self.staged = torch.zeros(self.layout.num_bytes, dtype=torch.uint8, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables = self.layout.views(
            self.staged
        )
        self.slot_mapping.fill_(self.scratch_slot)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.order = self.layout.order(self.staged)
        self.order.copy_(torch.arange(n, dtype=torch.int32))
        self.sampling = self.layout.sampling(self.staged)  # scale .. min_p, live: live[0] = 0 until staged
        self.sampler = sampler if logits is not None else None
        sampled_rows = max((b for b in self.sizes if b <= self.logits_max_rows), default=0)
        self.samples = torch.zeros(2 * sampled_rows, dtype=torch.int64, device=device)  # (2 B,) tokens, flags
        self.order_min_rows = order_min_rows  # buckets of at least this many rows stage their order (None: none)
        self.hosts = HostStages(self.layout, table_rows=n)
        self.host_orders = {id(h): self.layout.order(h.buffer).numpy() for h in self.hosts.stages}  # numpy views
        # keyed by (bucket, table width in blocks): the full width W, and the short width of short_widths' buckets
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}  # captures that compute the lm_head too
        self.filters: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # their top-k redraws (with a sampler)
        self._capture_all(forward, logits)

    def _meta(self, b: int, width: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b],
            cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b, :width],
            max_seqlen_q=1,
            max_seqlen_k=width * self.block_size,
            block_size=self.block_size,
            decode_order=self.order[:b] if self._orders(b) else None,
        )

    def _orders(self, bucket: int) -> bool:
        """Whether the bucket's steps stage their rows' order (``longest_first``)."""
        return self.order_min_rows is not None and bucket >= self.order_min_rows

    def _capture_all(self, forward: Forward, logits: Logits | None) -> None:
        """Capture every bucket (and the short-table ones), largest first, in one shared memory pool (the small
        ones with the lm_head)."""
        pool = None
        full = self.layout.max_blocks
        for key in [(b, w) for b in reversed(self.sizes) for w in (full, self.short_widths.get(b)) if w is not None]:
            b, width = key
            meta = self._meta(b, width)
            head = logits if b <= self.logits_max_rows else None
            hidden = forward(self.input_ids[:b], self.positions[:b], meta)  # warm-up: compiles, sizes the pool
            if head is not None:
                self._sample_rows(head(hidden), b)  # live[0] is 0 here: compiles, stores nothing
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = forward(self.input_ids[:b], self.positions[:b], meta)
                out = head(self.outputs[key]) if head is not None else None
                if out is not None:
                    self._sample_rows(out, b)
            if out is not None:
                self.logits[key] = out
            pool = graph.pool() if pool is None else pool
            self.graphs[key] = graph
            if out is not None and self.sampler is not None:
                self._filter_rows(out, b)  # warm-up: compiles, stores nothing (live[0] is 0)
                torch.cuda.synchronize()
                self.filters[key] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.filters[key], pool=pool):
                    self._filter_rows(out, b)
        torch.cuda.synchronize()

    def _sample_rows(self, logits: torch.Tensor | None, b: int) -> None:
        """Launch (or capture) the sampler's kernels over a bucket's (b, V) logits, when sampling in the graph."""
        if self.sampler is not None and logits is not None:
            scale, fixed, uniforms, *_, live = self.sampling
            self.sampler.sample(logits, scale[:b], fixed[:b], uniforms[:b], live, self.samples[: 2 * b])

    def _filter_rows(self, logits: torch.Tensor, b: int) -> None:
        """Launch (or capture) the top-k redraw over a bucket's (b, V) logits (``GraphSampler.filter``)."""
        assert self.sampler is not None
        scale, _, _, top_k, top_p, min_p, live = self.sampling
        filters = (scale[:b], top_k[:b], top_p[:b], min_p[:b])
        self.sampler.filter(logits, filters, live, self.samples[: 2 * b])

    def samples_in_graph(self, num_seqs: int) -> bool:
        """True when a decode step of ``num_seqs`` rows replays a capture that samples (``run_plan``'s
        ``sample``)."""
        return self.sampler is not None and num_seqs <= self.logits_max_rows

    def graph_key(self, num_seqs: int, longest: Callable[[], int]) -> tuple[int, int]:
        """``capture_key`` of this object's captures."""
        return capture_key(self.sizes, self.short_widths, self.layout.max_blocks, self.block_size, num_seqs, longest)

    def can_run(self, num_seqs: int) -> bool:
        """True when a captured bucket holds ``num_seqs`` decode rows."""
        return num_seqs <= self.sizes[-1]

    def run_plan(
        self, plan: StepPlan, feed: Feed | None = None, sample: GraphSample | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``run`` for an all-decode ``plan``, its rows written straight into the pinned stage (``stage_decode``)
        when its tables go with the staged copy; otherwise through ``prepare_decode`` and ``run``. ``sample``:
        the rows' sampling, when they sample in the graph (``samples_in_graph``); then the third result is their
        (2, B) int64 tokens and non-finite flags (a view of the graph's buffer, valid until the next replay),
        else None."""
        b = plan.num_seqs
        if b * self.layout.max_blocks * 4 > INLINE_TABLE_BYTES:
            a = prepare_decode(plan)
            return self.run(a.input_ids, a.positions, a.slots, a.seq_lens, a.block_tables, feed, sample)
        host = self.hosts.next()
        stage_decode(plan, host.arrays, fill_ids=feed is None or feed.rows is not None, staged=host.staged_tables)
        key = self.graph_key(b, lambda: max(plan.start_positions) + 1)  # a decode row's context: start + 1
        end = self.layout.tables_offset + b * self.layout.max_blocks * 4
        return self._replay(host, key, b, end, None, feed, sample)

    def _stage_sample(self, host: HostStage, b: int, sample: GraphSample | None) -> bool:
        """Write ``sample`` into the stage (live = (B, key)), or live = (0, 0) so that the captured sampler reads
        and stores nothing; True when the step samples in the graph."""
        if not host.sampling:
            return False
        scale, fixed, uniforms, top_k, top_p, min_p, live = host.sampling
        if sample is None or not self.samples_in_graph(b):
            live[0] = 0
            return False
        if not 0 <= sample.key < 2**31:
            raise ValueError(f"sample.key must be in [0, 2**31), got {sample.key}")
        scale[:b], fixed[:b], uniforms[:b] = sample.scale, sample.fixed, sample.uniforms
        if sample.top_k is not None:
            top_k[:b], top_p[:b], min_p[:b] = sample.top_k, sample.top_p, sample.min_p
        live[0], live[1] = b, sample.key
        return True

    def _replay(
        self,
        host: HostStage,
        key: tuple[int, int],
        b: int,
        end: int,
        tables: np.ndarray | None,
        feed: Feed | None,
        sample: GraphSample | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Pad rows b.. of the capture ``key`` ((bucket, table width)), stage ``sample``, send the stage's first
        ``end`` bytes (``tables``: the block tables to upload apart, when they are not among them), apply ``feed``
        and replay; returns the capture's outputs, rows :b, and the samples when the graph drew them."""
        bucket = key[0]
        ids, pos, slots, lens, _ = host.arrays
        ids[b:bucket], pos[b:bucket], slots[b:bucket], lens[b:bucket] = 0, 0, self.scratch_slot, 0  # padding
        sampled = self._stage_sample(host, b, sample)
        if self._orders(bucket):
            longest_first(lens[:bucket], self.host_orders[id(host)])
        self.staged[:end].copy_(host.buffer[:end], non_blocking=True)
        host.ready.record()
        if tables is not None:
            self.block_tables[:b, : tables.shape[1]].copy_(upload(tables, self.staged.device))
        if feed is not None:
            fed = feed.apply(self.input_ids[:b], token_rows=False)
            if fed.data_ptr() != self.input_ids.data_ptr():
                self.input_ids[:b].copy_(fed)
        self.graphs[key].replay()
        if sampled and sample is not None and sample.top_k is not None:
            self.filters[key].replay()
        logits = self.logits.get(key)
        samples = self.samples[: 2 * b].view(2, b) if sampled else None
        return self.outputs[key][:b], None if logits is None else logits[:b], samples

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        feed: Feed | None = None,
        sample: GraphSample | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Replay the bucket for B = len(input_ids) decode rows; returns hidden (B, H), when the bucket
        captured the lm_head logits (B, V), else None, and when the rows sampled in the graph (``sample``, see
        ``run_plan``) their (2, B) samples, else None (views of the graph's outputs, valid until the next replay;
        the device reads them in stream order, so work queued before that replay sees this step's values).
        ``feed``: device ids replacing some or all of ``input_ids`` (the previous step's samples, for an
        overlapped step). Nothing here waits for the device."""
        b = len(input_ids)
        host = self.hosts.next()
        ids, pos, slots_, lens, tables = host.arrays
        ids[:b], pos[:b], slots_[:b], lens[:b] = input_ids, positions, slots, seq_lens
        width = block_tables.shape[1]
        inline_tables = b * self.layout.max_blocks * 4 <= INLINE_TABLE_BYTES
        if inline_tables:
            tables[:b, :width] = block_tables
            host.staged_tables[:b] = [None] * b  # rows written from an array: no table object to match
        end = self.layout.tables_offset + (b * self.layout.max_blocks * 4 if inline_tables else 0)
        key = self.graph_key(b, lambda: int(seq_lens.max(initial=0)))
        return self._replay(host, key, b, end, None if inline_tables else block_tables, feed, sample)
