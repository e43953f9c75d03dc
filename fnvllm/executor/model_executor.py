"""ModelExecutor: weights, the paged KV cache, CUDA graphs and the sampler, on the CPU or one GPU.

``execute(plan)`` = prepare inputs (host -> device) -> model forward over the step's tokens (a captured CUDA
graph for decode steps, eager otherwise) -> logits at each sampling position -> sampler -> host token ids.

KV cache sizing on a GPU: after loading the weights, one profiling forward of the largest step
(``max_num_batched_tokens`` tokens, plus logits and sampling for ``max_num_seqs`` rows) measures the peak
activation memory; the KV cache gets what ``gpu_memory_utilization`` leaves after weights, that peak and a
reserve for the CUDA-graph pool. The cache holds one block more than the core is told about: the scratch
block that padded graph rows write into. With ``kv_cache_dtype="fp8"`` the caches are float8_e4m3fn (one byte an
element, so about twice the blocks fit) and each layer's carries its (Hkv,) k_scale and v_scale, read from the
checkpoint or 1.0 (``fnvllm.model.kv_scales``).

Under tensor parallelism (``tp``; ``fnvllm.executor.tp`` starts the ranks) every rank builds one of these over
its slice of the model and runs every step: the ranks agree on the smallest block count any of them fits, hold
their local KV heads, capture the same graph buckets and replay the same one each decode step (the collectives
are inside the graphs). Logits are gathered on rank 0, which alone samples; the others return no tokens.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from itertools import compress
from operator import attrgetter
from pathlib import Path
from typing import Literal, Protocol

import attrs
import numpy as np
import torch

from fnvllm.config import EngineConfig
from fnvllm.env import env_switch
from fnvllm.executor.base import ExecuteResult, check_step
from fnvllm.executor.cuda_graphs import DecodeGraphs, GraphSample, graph_batch_sizes
from fnvllm.executor.device_inputs import build_attention_metadata, upload
from fnvllm.executor.fused_sampling import KernelGraphSampler, check_finite, graph_top_k_limit
from fnvllm.executor.history import SlotHistory
from fnvllm.executor.inputs import Feed, PreparedInputs, is_decode_only, prepare_inputs
from fnvllm.executor.logprob_rows import StepLogprobs
from fnvllm.executor.mixed_graphs import MixedGraphs
from fnvllm.executor.prompt_logprobs import PromptScorer, ScoredRow, host_prompt_logprobs, prompt_rows
from fnvllm.executor.sampler import (
    GraphRows,
    Logprobs,
    Sampler,
    SamplingMemo,
    banned_now,
    graph_rows,
    min_tokens_rows,
    prepare_sampling,
)
from fnvllm.executor.structured import Grammars, Matcher, PendingMask
from fnvllm.executor.threads import set_cpu_threads
from fnvllm.executor.timeline import StepTimeline, _StepTimer
from fnvllm.kernels.attention import AttentionMetadata, KVCache, zeros_kv_cache
from fnvllm.kernels.backends import BackendUnavailableError, resolve_backend, resolve_kv_layout
from fnvllm.kernels.fp8 import kv_cache_torch_dtype
from fnvllm.kernels.prefill_work import prefill_tokens_per_tile
from fnvllm.model.config import ModelConfig
from fnvllm.model.kv_scales import read_kv_scales
from fnvllm.model.loader import checkpoint_files, load_model
from fnvllm.model.ops import TORCH_OPS, ModelOps, ops_for
from fnvllm.model.sharding import SINGLE, TensorParallel, broadcast_from_first, local_heads, min_over_ranks
from fnvllm.state import InvalidConfigError, SamplingParams, StepPlan, TokenHistory
from fnvllm.state.overlap import feed_sources

_GIB = 1 << 30
_LOGPROBS = attrgetter("logprobs")  # each sampled row's SamplingParams.logprobs, in one C-level map
# (params sequence, its GraphRows, their logprob rows on the device, its rows with a min_tokens): ``_graph_sample``
_GraphRowsMemo = tuple[Sequence[SamplingParams] | None, GraphRows | None, torch.Tensor | None, tuple[int, ...]]
_LOGPROB_BYTES_PER_ROW = 256  # >= MAX_LOGPROBS (20) x (4 + 8) + 4 + alignment: a row's logprobs on the host
# "0": decode graphs are captured at full table width only (no short-table captures; an A/B switch).
SHORT_GRAPHS_ENV = "FNVLLM_SHORT_GRAPHS"
# "0": decode steps do not stage their rows longest first (the decode kernel takes them in batch order).
DECODE_ORDER_ENV = "FNVLLM_DECODE_ORDER"
# "0": decode graphs do not sample; every step samples eagerly from the graph's logits (an A/B switch).
SAMPLE_IN_GRAPH_ENV = "FNVLLM_SAMPLE_IN_GRAPH"
_GRAPH_POOL_RESERVE = _GIB // 2  # captured decode forwards of <= 512 rows need far less; measured, not guessed


def resolve_device(name: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InvalidConfigError(
            f"device: 'cuda' was asked for, but this torch ({torch.__version__}) sees no CUDA device; "
            "use device='cpu' or 'auto'"
        )
    return torch.device(name)


def rank_device(name: str, tp: TensorParallel) -> torch.device:
    """The device of this rank: ``resolve_device(name)``, pinned to GPU ``tp.local_rank`` under tensor parallelism."""
    device = resolve_device(name)
    if device.type == "cuda" and tp.is_parallel:
        return torch.device("cuda", tp.local_rank)
    return device


def _resolve_ops(name: str, device: torch.device) -> ModelOps:
    """The model's small-op implementation: "auto" = Triton on CUDA when importable, else plain torch. "triton"
    off CUDA is a BackendUnavailableError naming the option, unless Triton's interpreter is on (tests)."""
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise BackendUnavailableError(
            f"model_ops='triton' needs a CUDA device, got {device} (or TRITON_INTERPRET=1, Triton's interpreter, "
            "for tests); use model_ops='auto' or 'torch'"
        )
    if name != "auto":
        return ops_for(name)
    if device.type != "cuda":
        return TORCH_OPS
    try:
        return ops_for("triton")
    except ImportError:
        return TORCH_OPS


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """Bytes of K and V for one block across all layers (of ``num_kv_heads`` heads; default: all the model's)."""
    heads = model.num_key_value_heads if num_kv_heads is None else num_kv_heads
    per_token = 2 * model.num_hidden_layers * heads * model.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


@attrs.define(eq=False)
class Launched:
    """A step queued on the device (``ModelExecutor.launch``), not yet collected.

    plan: the plan it runs. rows: the plan rows that sample, in order. packed: (2, S) int64 on the device, the
    sampled ids then a 0/1 non-finite flag per row (None when nothing is sampled here). host: its copy in host
    memory, and the logprobs tensors' (``HostCopy``), queued right behind the sampler, so that waiting for
    them does not wait for a step launched later. asked: each sampled row's logprobs count. logprobs: the
    sampler's logprobs on the device (None: no row asked), whose layout splits their host copy at collect.
    matchers: per sampled row, its grammar matcher (None: unconstrained), advanced by the tokens at collect.
    deferred: the logits of a step whose sampling waits for the host to accept the previous step's tokens (a
    constrained row fed from a step still in flight); ``packed`` is filled when it samples (``_sample_deferred``).
    fed_by: for a deferred step, the step whose tokens its masks wait for: collecting that step starts filling this
    one's masks on the grammar thread (``pending``), and the next launch (or this step's collect) samples it, so
    the fill runs while the host commits and plans.
    prompt / prompt_host: the prompt logprobs this step scored (``fnvllm.executor.prompt_logprobs``) and their
    copy to the host.
    """

    plan: StepPlan
    rows: tuple[int, ...] = ()
    packed: torch.Tensor | None = None
    host: HostCopy | None = None
    asked: tuple[int | None, ...] = ()
    timer: _StepTimer | None = None
    graph: bool = False
    matchers: tuple[Matcher | None, ...] = ()
    deferred: torch.Tensor | None = None
    fed_by: object | None = None
    pending: PendingMask | None = None
    collected: bool = False
    prompt: tuple[ScoredRow, ...] = ()
    logprobs: Logprobs | None = None
    prompt_host: HostCopy | None = None


@attrs.frozen(eq=False)
class HostCopy:
    """Device tensors being copied to (pinned) host memory; ``wait()`` returns once they have arrived.

    On a GPU the copies are queued on the stream right after the work that produced them and ``done`` is
    recorded behind them: a plain ``.tolist()`` would instead wait for everything queued on the stream,
    including the next step when steps overlap.
    """

    tensors: tuple[torch.Tensor, ...]
    done: torch.cuda.Event | None
    ring_slot: tuple[PinnedRing, int] | None = None

    @classmethod
    def start(cls, tensors: Sequence[torch.Tensor], ring: PinnedRing | None = None) -> HostCopy:
        """Queue the copies (on the CPU the tensors are already there). ``ring``: the first tensor (a step's
        packed (2, S) int64 samples) goes to the ring's next buffer, the others (the step's logprobs) to views of
        that slot's second buffer when they fit, and the ring's event marks the copies done."""
        if not tensors or tensors[0].device.type != "cuda":
            return cls(tuple(tensors), None)
        slot = None if ring is None else ring.take(tensors[0])
        targets: list[torch.Tensor | None] = [None] * len(tensors)
        if ring is not None and slot is not None:
            targets[0], done = ring.view(slot, tensors[0]), ring.events[slot]
            targets[1:] = ring.extra_views(slot, tensors[1:]) or targets[1:]
        else:
            done = torch.cuda.Event()
        copies = tuple(
            (_pinned_like(t) if dst is None else dst).copy_(t, non_blocking=True)
            for dst, t in zip(targets, tensors, strict=True)
        )
        done.record()
        copy = cls(copies, done, None if ring is None or slot is None else (ring, slot))
        if ring is not None and slot is not None:
            ring.owners[slot] = copy
        return copy

    def wait(self) -> tuple[torch.Tensor, ...]:
        """The host tensors, once copied."""
        if self.done is not None:
            self.done.synchronize()
        return self.tensors

    def release(self) -> None:
        """Give the ring buffer back (its values read, or never to be read). Idempotent."""
        if self.ring_slot is not None:
            ring, slot = self.ring_slot
            if ring.owners[slot] is self:
                ring.owners[slot] = None


class PinnedRing:
    """Pinned host buffers for the sampled ids' copies to the host, with one event each, reused in turn.

    A fresh pinned tensor and event per step cost the host more than the copy itself at one request (the caching
    host allocator's lock and lookup, and an event recorded when the block is freed). A buffer is busy from its
    copy until its step is collected or discarded (``HostCopy.release``); the overlapped loop holds at most two.
    With every buffer busy, or a tensor that does not fit, the copy takes a fresh pinned tensor as before. A
    discarded step's copy may still run, but it is ordered on the stream before any later copy into its buffer.
    """

    def __init__(self, max_rows: int, size: int = 4) -> None:
        self.buffers = [torch.empty(2 * max_rows, dtype=torch.int64, pin_memory=True) for _ in range(size)]
        # the same step's logprobs (the kernels' one packed uint8 tensor, or (L, n) float32 and int64 and (L,)
        # float32 from the references; n <= MAX_LOGPROBS), as byte views: a
        # fresh pinned tensor of a new size (every prefill step's L differs) asks the driver for pinned memory
        extra = max_rows * _LOGPROB_BYTES_PER_ROW
        self.extras = [torch.empty(extra, dtype=torch.uint8, pin_memory=True) for _ in range(size)]
        self.events = [torch.cuda.Event() for _ in range(size)]
        self.owners: list[object | None] = [None] * size  # the HostCopy holding each buffer, None when free

    def take(self, packed: torch.Tensor) -> int | None:
        """A free buffer's index for ``packed`` ((2, S) int64), marked busy until its owner is set (by
        ``HostCopy.start``) and released; None when none is free or it does not fit."""
        if packed.dtype != torch.int64 or packed.numel() > self.buffers[0].numel():
            return None
        slot = next((k for k, owner in enumerate(self.owners) if owner is None), None)
        if slot is not None:
            self.owners[slot] = self  # busy; HostCopy.start names the owner next
        return slot

    def view(self, slot: int, packed: torch.Tensor) -> torch.Tensor:
        """Buffer ``slot`` as a contiguous tensor of ``packed``'s shape."""
        return self.buffers[slot][: packed.numel()].view(packed.shape)

    def extra_views(self, slot: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor | None] | None:
        """Views of slot ``slot``'s second buffer shaped like ``tensors`` (each from a 16-byte boundary), None
        when they do not all fit; an empty tensor gets None (a fresh, empty one)."""
        buffer, at, views = self.extras[slot], 0, list[torch.Tensor | None]()
        for t in tensors:
            size = t.numel() * t.element_size()
            if size == 0:
                views.append(None)
                continue
            if at + size > buffer.numel():
                return None
            views.append(buffer[at : at + size].view(t.dtype).view(t.shape))
            at += -(-size // 16) * 16
        return views

    def release_all(self) -> None:
        """Every buffer free (the executor was reset: no step in flight will be collected)."""
        self.owners = [None] * len(self.owners)


class RankGuard(Protocol):
    """A tensor-parallel rank's watch over the others (``fnvllm.executor.tp``), so that rank 0 never blocks on a
    rank that died."""

    def loaded(self) -> None:
        """Return once every rank has loaded its weights (called before the first collective)."""
        ...

    def wait(self, done: torch.cuda.Event | None) -> None:
        """Return once the step's results are on their way (``done``, recorded behind their copy to the host,
        has passed; None on the CPU); raise if a rank died or the deadline passed meanwhile."""
        ...


class ModelExecutor:
    """Owns the model weights, the KV cache tensors, the decode CUDA graphs and the sampler's RNG.

    tp: this rank's place in a tensor-parallel group (default: one process, the whole model).
    guard: under tensor parallelism, waits for the other ranks after loading and for the sampled ids before
        they are copied to the host (with liveness checks and a deadline instead of blocking).
    """

    def __init__(
        self,
        model_path: str | Path,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        tp: TensorParallel = SINGLE,
        guard: RankGuard | None = None,
    ) -> None:
        self.config = config
        self.tp = tp
        self.guard = guard
        self.device = rank_device(config.device, tp)
        self.model_config = model_config or ModelConfig.from_pretrained(
            model_path, dtype=config.dtype, quantization=config.quantization, max_model_len=config.max_model_len
        )
        set_cpu_threads(self.device, self.model_config, tp.world_size)  # one thread for small models (threads.py)
        self.dtype = self.model_config.torch_dtype
        self.num_kv_heads = local_heads(self.model_config, tp)[1]
        self.backend = resolve_backend(  # one that attends within the model's sliding windows, if it has any
            config.attention_backend, self.device, config.kv_cache_dtype, config.kv_layout,
            sliding_window=self.model_config.has_sliding_window,
        )  # fmt: skip
        self.kv_layout = resolve_kv_layout(config.kv_layout, self.backend, config.kv_cache_dtype)  # memory order
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.max_model_len = config.max_model_len or self.model_config.max_seq_len  # the core's default too
        self.ops = _resolve_ops(config.model_ops, self.device)
        self.model = load_model(
            model_path, self.model_config, self.device, self.dtype, self.ops, tp, load_format=config.load_format
        )
        self.kv_scales = self._kv_scales(Path(model_path)) if config.kv_cache_dtype == "fp8" else None
        if guard is not None:
            guard.loaded()
        self.sampler = Sampler(config.seed)
        self.history = SlotHistory(config.max_num_seqs, self.max_model_len, self.model_config.vocab_size, self.device)
        self.num_blocks = min_over_ranks(config.num_blocks or self._blocks_that_fit(), tp, self.device)
        self.kv_caches = self._allocate_kv_cache(self.num_blocks + 1)  # + the scratch block
        self.scratch_block = self.num_blocks
        self.graphs = self._capture_graphs() if self._use_graphs() else None
        self.mixed_graphs = self._capture_mixed_graphs() if self._use_mixed_graphs() else None
        self.timeline = StepTimeline.from_env(self._timeline_header(), self.device) if tp.is_first else None
        self.next_step = 0
        # Grammar matchers of constrained requests (``fnvllm.executor.structured``); set by whoever holds the
        # tokenizer (``fnvllm.engine.build``). None: a constrained request fails at launch with a clear error.
        self.grammars: Grammars | None = None
        self._deferred: Launched | None = None
        self._host_ring = PinnedRing(config.max_num_seqs) if self.device.type == "cuda" else None
        self._sampling_memo = SamplingMemo()  # a decode step with the last one's params reuses its SamplingBatch
        # the last decode params sequence asked about sampling in the graph, the answer (``_graph_sample``), its
        # logprob rows on the device and its rows with a min_tokens
        self._graph_rows_memo: _GraphRowsMemo = (None, None, None, ())
        # The model's EOS ids, which a row short of its min_tokens may not draw (with its stop_token_ids); set
        # with the core's config (``fnvllm.engine.build``). Empty: such a row bans only its stop_token_ids.
        self.eos_token_ids: frozenset[int] = frozenset()
        # Where a deferred step (a constrained row fed by the step in flight) samples: "launch" = at the next launch,
        # its tokens accepted and masks filled by the grammar process (or thread) while the host commits and plans;
        # "collect" = at the end of the collect that accepted its tokens, its masks filled there (on the host's
        # critical path). docs/structured_outputs.md; benchmarks/bench_structured.py times both.
        self.sample_deferred_at: Literal["launch", "collect"] = "launch"
        self.prompt_scorer = PromptScorer()  # prompt logprobs: each slot's last chunk row between steps

    # ---- memory ------------------------------------------------------------------------------------------

    def _blocks_that_fit(self) -> int:
        per_block = kv_bytes_per_block(self.model_config, self.config.block_size, self.kv_dtype, self.num_kv_heads)
        if self.device.type == "cpu":
            return max(int(self.config.cpu_kv_cache_gib * _GIB) // per_block, 1)
        peak = self._profile_peak_activation_bytes()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        reserve = _GRAPH_POOL_RESERVE if self._use_graphs() else 0
        budget = int(total * self.config.gpu_memory_utilization) - used - peak - reserve
        if budget < per_block:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {used / _GIB:.1f} GiB used, gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization} of {total / _GIB:.1f} GiB, {peak / _GIB:.1f} GiB peak "
                f"activations (max_num_batched_tokens={self.config.max_num_batched_tokens})"
            )
        return budget // per_block

    def _warm_sampler(self, logits: torch.Tensor) -> None:
        """Sample a few batches that take every path of the sampler (min-p kernel, top-k candidates, penalised
        float32 copies, seeds, logprobs), so their Triton kernels compile now rather than stalling the first
        request that uses them (measured: one min-p request paid ~16 s of compiles on the H200)."""
        history = TokenHistory((1, 2, 3), (4, 5))
        batches = (
            [SamplingParams(temperature=0.6, min_p=0.05)] * 4 + [SamplingParams(temperature=0.6)] * 4,
            [SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=1, logprobs=5)] * 8,
            [SamplingParams(temperature=0.6, min_p=0.05, repetition_penalty=1.1)] * 4
            + [SamplingParams(temperature=0.6, top_p=0.9, presence_penalty=0.5)] * 4,
            # the settings users send most, each alone and beside plain rows: the penalty kernel with top-k rows,
            # logprobs without a filter (their kernel variants otherwise compile at their first use, mid-run)
            [SamplingParams(temperature=0.6, top_k=20, top_p=0.95, repetition_penalty=1.05)] * 4
            + [SamplingParams(temperature=0.6)] * 4,
            [SamplingParams(temperature=0.6, logprobs=5)] * 4 + [SamplingParams(temperature=0.6)] * 4,
            [SamplingParams(temperature=0.6, logprobs=5)] * 8,
            # min-p alone on penalised rows: ``minp_pick`` reading the penalised rows' dense float32 copy
            [SamplingParams(temperature=0.6, min_p=0.05, repetition_penalty=1.05)] * 4
            + [SamplingParams(temperature=0.6)] * 4,
        )
        for params in batches:
            params = params[: logits.shape[0]]  # max_num_seqs may be below 8
            rows = len(params)
            histories = [history if p.needs_history else None for p in params]
            batch = prepare_sampling(params, [0] * rows, histories, self.model_config.vocab_size, self.device)
            self.sampler.sample(logits[:rows], batch)

    def _profile_peak_activation_bytes(self) -> int:
        """Run the largest step on a throw-away cache and return the peak memory it allocated beyond the weights."""
        bs, budget = self.config.block_size, self.config.max_num_batched_tokens
        seq_len = min(budget, self.max_model_len)
        lens = [seq_len] * (budget // seq_len) + ([budget % seq_len] if budget % seq_len else [])
        tables, next_block = [], 0
        for n in lens:
            tables.append(tuple(range(next_block, next_block + math.ceil(n / bs))))
            next_block += len(tables[-1])
        caches = self._allocate_kv_cache(next_block)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        meta = build_attention_metadata([0] * len(lens), lens, tables, bs, self.device)
        ids = torch.randint(0, self.model_config.vocab_size, (budget,), device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, meta.positions, caches, meta, self.backend)
            rows = hidden[torch.arange(self.config.max_num_seqs, device=self.device) % budget]
            logits = self.model.compute_logits(rows)  # None on ranks > 0, which do not sample
            n = self.config.max_num_seqs
            batch = prepare_sampling(
                [SamplingParams(temperature=0.6, top_p=0.9)] * n,
                [0] * n,
                [None] * n,
                self.model_config.vocab_size,
                self.device,
            )
            if logits is not None:
                self.sampler.sample(logits, batch)
                self._warm_sampler(logits[:8])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del caches, hidden, rows, logits
        torch.cuda.empty_cache()
        return peak

    def _kv_scales(self, model_path: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (k_scale, v_scale) for an FP8 cache, (local KV heads,) float32: the checkpoint's or 1.0."""
        files = [] if self.config.load_format == "dummy" else checkpoint_files(model_path)  # dummy: no files
        return read_kv_scales(files, self.model_config, self.device, self.tp)

    def _allocate_kv_cache(self, num_blocks: int) -> list[KVCache]:
        """One zeroed KVCache per layer of ``num_blocks`` blocks (FP8 ones with their scales)."""
        m = self.model_config
        scales = self.kv_scales or [(None, None)] * m.num_hidden_layers
        return [KVCache(self._zeros(num_blocks), self._zeros(num_blocks), *layer_scales) for layer_scales in scales]

    def _zeros(self, num_blocks: int) -> torch.Tensor:
        """One zeroed (num_blocks, block_size, Hkv, D) cache tensor in the executor's memory order."""
        return zeros_kv_cache(num_blocks, self.config.block_size, self.num_kv_heads, self.model_config.head_dim,
                              self.kv_dtype, self.device, self.kv_layout)  # fmt: skip

    # ---- CUDA graphs -------------------------------------------------------------------------------------

    def _use_graphs(self) -> bool:
        return self.device.type == "cuda" and self.backend.supports_cuda_graphs and not self.config.enforce_eager

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend)

    @torch.inference_mode()
    def _capture_graphs(self) -> DecodeGraphs:
        max_blocks = math.ceil(self.max_model_len / self.config.block_size)
        return DecodeGraphs(
            self._forward,
            self.config.max_num_seqs,
            max_blocks,
            self.config.block_size,
            self.scratch_block,
            self.device,
            None if self.tp.is_parallel else self.model.compute_logits,  # a rank > 0 computes no logits
            short_widths=self._short_graph_widths(max_blocks),
            order_min_rows=self._order_min_rows(),
            sampler=self._graph_sampler(),
        )

    def _graph_sampler(self) -> KernelGraphSampler | None:
        """The sampler's kernels for the decode graphs to capture (``DecodeGraphs``' ``sampler``); None under tensor
        parallelism (rank 0 samples logits gathered outside the graph), without the Triton kernels, or when
        SAMPLE_IN_GRAPH_ENV is "0"."""
        if self.tp.is_parallel or not self.sampler.uses_kernels(self.device):
            return None
        if not env_switch(SAMPLE_IN_GRAPH_ENV, True):
            return None
        return KernelGraphSampler(self.config.max_num_seqs, self.model_config.vocab_size, self.device)

    def _order_min_rows(self) -> int | None:
        """The fewest rows of a decode bucket that stages its rows longest first, for the Triton decode kernel to
        take them in that order (``decode_attention.ordered_min_programs`` programs and up: large batches over an
        FP8 cache, from 32 rows over a 16-bit one at 8 KV heads), unless FNVLLM_DECODE_ORDER=0; None: no bucket
        does."""
        if not env_switch(DECODE_ORDER_ENV, True) or self.backend.name != "triton":
            return None
        from fnvllm.kernels.decode_attention import ordered_min_programs  # Triton: imported where the backend runs

        _, kv_heads = local_heads(self.model_config, self.tp)
        return -(-ordered_min_programs(self.config.kv_cache_dtype == "fp8") // kv_heads)

    def _short_graph_widths(self, max_blocks: int) -> dict[int, int]:
        """Decode buckets captured a second time with short tables (``decode_attention.short_graph_widths``): with
        our Triton attention, unless FNVLLM_SHORT_GRAPHS=0."""
        if self.backend.name != "triton" or not env_switch(SHORT_GRAPHS_ENV, True):
            return {}
        from fnvllm.kernels.decode_attention import short_graph_widths  # Triton: imported where the backend runs

        sizes, bs = graph_batch_sizes(self.config.max_num_seqs), self.config.block_size
        return short_graph_widths(sizes, bs, max_blocks * bs, self.config.kv_cache_dtype == "fp8")

    def _use_mixed_graphs(self) -> bool:
        """Graphs for small mixed steps: with decode graphs, on our Triton attention (its prefill kernel takes a
        work list), in one process (tensor-parallel workers run the plans they receive eagerly)."""
        return (
            self._use_graphs()
            and self.backend.name == "triton"
            and min(self.config.mixed_graph_tokens, self.config.max_num_batched_tokens) >= 2
            and not self.tp.is_parallel
        )

    @torch.inference_mode()
    def _capture_mixed_graphs(self) -> MixedGraphs:
        num_heads, num_kv_heads = local_heads(self.model_config, self.tp)
        return MixedGraphs(
            self._forward,
            min(self.config.mixed_graph_tokens, self.config.max_num_batched_tokens),
            self.config.max_num_seqs,
            math.ceil(self.max_model_len / self.config.block_size),
            self.config.block_size,
            self.scratch_block,
            prefill_tokens_per_tile(num_heads, num_kv_heads),
            self.device,
        )

    # ---- stepping ----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Drop the CUDA graphs (under tensor parallelism they hold the group's collectives); later steps run
        eagerly. Idempotent."""
        self.graphs = None
        self.mixed_graphs = None

    def reset(self, next_step: int) -> None:
        """Treat the KV cache as empty and expect ``next_step`` next (contents are simply overwritten later)."""
        self.next_step = next_step
        self._drop_deferred()
        if self._host_ring is not None:
            self._host_ring.release_all()
        self.prompt_scorer.reset()

    def prepare_inputs(self, plan: StepPlan) -> PreparedInputs:
        """Flatten the plan into device arrays: token ids, attention metadata and the sampled rows."""
        return prepare_inputs(plan, self.device)

    @property
    def shares_samples(self) -> bool:
        """Under tensor parallelism with ``overlap_steps``: rank 0 broadcasts each step's sampled ids to the
        workers (one (S,) int64 broadcast), so that every rank can feed an overlapped next step from device
        memory (``fnvllm.executor.tp``)."""
        return self.tp.is_parallel and self.config.overlap_steps

    @property
    def supports_overlap(self) -> bool:
        """Whether ``EngineLoop`` should overlap steps on this executor: on a GPU (where launching does not wait
        for the device) and in one process (tensor-parallel workers receive host plans), unless
        ``overlap_steps`` is off."""
        return self.config.overlap_steps and self.device.type == "cuda" and not self.tp.is_parallel

    def _hidden_at_samples(
        self, plan: StepPlan, feed: Feed | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, bool, list[ScoredRow], torch.Tensor | None]:
        """Final hidden states (S, H) of the sampled rows; their logits (S, V) when the CUDA graph computed them
        too (a small decode bucket: ``DecodeGraphs``), else None; whether a CUDA graph ran; the prompt
        logprobs of the rows that asked (scored from every fed position's hidden state, so such a step runs
        eagerly); and the (2, S) samples when the graph drew them too (``_graph_sample``), else None. ``feed``:
        input ids on the device that replace some of the plan's (an overlapped step)."""
        scored_rows = prompt_rows(plan)
        if not scored_rows and self.graphs is not None and is_decode_only(plan) and self.graphs.can_run(plan.num_seqs):
            hidden, logits, samples = self.graphs.run_plan(plan, feed, self._graph_sample(plan))
            return hidden, logits, True, [], samples
        if not scored_rows and self.mixed_graphs is not None and self.mixed_graphs.can_run(plan):
            return self.mixed_graphs.run_plan(plan, feed), None, True, [], None
        inputs = self.prepare_inputs(plan)
        input_ids = inputs.input_ids if feed is None else feed.apply(inputs.input_ids, token_rows=True)
        hidden = self._forward(input_ids, inputs.meta.positions, inputs.meta)
        scored = self.prompt_scorer.score(plan, scored_rows, hidden, self.model.compute_logits) if scored_rows else []
        return hidden[inputs.sample_index], None, False, scored, None

    def _graph_sample(self, plan: StepPlan) -> GraphSample | None:
        """How an all-decode plan's rows sample inside the graph (taking the sampler's next Philox key), or None
        when they sample eagerly: the bucket captured no sampler, a row needs more than the graphs sample
        (``graph_rows``: a penalty, a bias, logprobs, a grammar, a filter without a top-k), or a row does not sample.
        The answer for a params sequence is kept while the core hands each step the same one (no per-row pass)."""
        assert self.graphs is not None
        if not self.graphs.samples_in_graph(plan.num_seqs) or plan.num_samples != plan.num_seqs:
            return None
        kept_params, rows, _, waiting = self._graph_rows_memo
        if plan.params is not kept_params:
            vocab = self.model_config.vocab_size
            rows, waiting = graph_rows(plan.params, vocab, graph_top_k_limit(vocab)), min_tokens_rows(plan.params)
            asked = None if rows is None or not rows.logprob_rows else np.array(rows.logprob_rows, dtype=np.int32)
            on_device = None if asked is None else upload(asked, self.device)
            self._graph_rows_memo = (plan.params, rows, on_device, waiting)
        if rows is None or (waiting and banned_now(plan.params, plan.num_generated, waiting)):
            return None  # a row short of its min_tokens samples eagerly, its stop-capable ids masked
        uniforms, key = rows.uniforms(plan.num_generated), self.sampler.next_key()
        return GraphSample(rows.scale, rows.fixed, uniforms, key, rows.top_k, rows.top_p, rows.min_p)

    def _feed(self, plan: StepPlan, fed_by: object) -> Feed | None:
        """The device ids that feed ``plan`` from ``fed_by``'s samples: each row continuing a sequence that
        ``fed_by`` sampled (it must feed one token) takes that sample (``feed_sources``: an admitted row is a new
        request life and never fed). None when no row is fed (all its tokens are the host's)."""
        if not isinstance(fed_by, Launched):
            raise ValueError(f"fed_by must be a step this executor launched, got {type(fed_by).__name__}")
        if fed_by.packed is not None and _feeds_in_order(fed_by, plan):
            return Feed(fed_by.packed[0], None, None)  # the common decode step: no index upload, no gather
        sources = feed_sources(fed_by.plan, plan) if fed_by.packed is not None else (None,) * plan.num_seqs
        fed = np.fromiter((s is not None for s in sources), dtype=bool, count=plan.num_seqs)  # (B,) device-fed
        if not fed.any():
            return None
        lens = np.fromiter(map(len, plan.input_tokens), dtype=np.int64, count=plan.num_seqs)  # (B,)
        if np.any(lens[fed] != 1):
            row = int(np.flatnonzero(fed & (lens != 1))[0])
            raise ValueError(
                f"{plan.seq_ids[row]!r} feeds {lens[row]} tokens in step {plan.step}; a row fed from the device by "
                f"step {fed_by.plan.step} feeds one"
            )
        assert fed_by.packed is not None  # some row is fed, so the previous step sampled
        samples = fed_by.packed[0]
        source = np.fromiter((0 if s is None else s for s in sources), dtype=np.int64, count=plan.num_seqs)  # (B,)
        if fed.all():
            return Feed(samples.index_select(0, upload(source, self.device)), None, None)
        rows = np.flatnonzero(fed)  # (F,)
        token_rows = (np.cumsum(lens) - 1)[rows]  # (F,) where those rows' single tokens sit in the flat batch
        packed = upload(np.stack([source[rows], rows, token_rows]), self.device)  # (3, F): one copy
        return Feed(samples.index_select(0, packed[0]), packed[1], packed[2])

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> ExecuteResult:
        """Run one step; returns one token per sampling sequence (plan order) and logprobs where asked."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, fed_by: object | None = None) -> Launched:
        """Queue one step on the device (forward, logits, sampling) without waiting for it; ``collect`` brings
        its tokens to the host. ``fed_by``: the step launched before; each row whose sequence it sampled feeds
        that sample (still on the device) in place of its one token in ``plan.input_tokens``."""
        check_step(self.next_step, plan)
        self._sample_deferred()  # a step waiting for its mask samples now, before anything reads its tokens
        feed = self._feed(plan, fed_by) if fed_by is not None else None
        self.next_step += 1
        self.history.admit(plan)
        if plan.is_empty:
            return Launched(plan)
        timer = self.timeline.begin() if self.timeline is not None else None
        hidden, logits, graph, scored, samples = self._hidden_at_samples(plan, feed)
        prompt, prompt_host = tuple(scored), _copy_scored(scored)
        if logits is None and plan.num_samples:
            logits = self.model.compute_logits(hidden)  # None on ranks > 0 too
        rows = _sampled_rows(plan)
        if logits is None and plan.num_samples and self.shares_samples:  # a worker: rank 0's samples arrive
            ids = broadcast_from_first(torch.empty(len(rows), dtype=torch.int64, device=self.device), self.tp)
            return Launched(plan, rows, ids.unsqueeze(0))
        if logits is None:  # nothing to sample, or a worker rank (it sent rank 0 its slice of the logits)
            if timer is not None:
                timer.launched()
            return Launched(plan, timer=timer, graph=graph, prompt=prompt, prompt_host=prompt_host)
        # a step the graph sampled has no constrained row (``graph_rows``): no per-row pass for its matchers
        matchers = (None,) * len(rows) if samples is not None else self._matchers(plan, rows)
        launched = Launched(
            plan, rows, timer=timer, graph=graph, matchers=matchers, prompt=prompt, prompt_host=prompt_host
        )
        if samples is not None:  # drawn by the graph (no matcher: ``graph_rows``)
            self._sampled(launched, samples, plan.params, self._graph_logprobs(logits, samples))
            return launched
        if any(matchers) and fed_by is not None and self._waits_for_tokens(plan, rows, matchers, fed_by):
            launched.deferred = logits  # its masks need the tokens of ``fed_by``, not yet accepted
            launched.fed_by = fed_by
            self._deferred = launched
            return launched
        self._sample(launched, logits)
        return launched

    def _graph_logprobs(self, logits: torch.Tensor, samples: torch.Tensor) -> Logprobs | None:
        """The logprobs of a step the graph sampled (its rows: ``_graph_rows_memo``), from the graph's raw logits
        as the eager sampler computes them; None when no row asked."""
        _, rows, asked, _ = self._graph_rows_memo
        if rows is None or asked is None or rows.max_logprobs is None:
            return None
        return self.sampler.logprobs(logits, samples[0], asked, rows.max_logprobs)

    def _matchers(self, plan: StepPlan, rows: tuple[int, ...]) -> tuple[Matcher | None, ...]:
        """Per sampled row, its grammar matcher (all None when no row is constrained)."""
        if not any(plan.params[i].structured is not None for i in rows):
            return (None,) * len(rows)
        if self.grammars is None:
            raise RuntimeError("a constrained request reached an executor without a tokenizer's grammars")
        return self.grammars.matchers(plan, rows)

    @staticmethod
    def _waits_for_tokens(
        plan: StepPlan, rows: tuple[int, ...], matchers: tuple[Matcher | None, ...], fed_by: object
    ) -> bool:
        """True when a constrained row of ``plan`` is fed by ``fed_by`` (its mask depends on that sample)."""
        if not isinstance(fed_by, Launched) or fed_by.collected or (fed_by.packed is None and fed_by.deferred is None):
            return False
        sources = feed_sources(fed_by.plan, plan)
        return any(m is not None and sources[i] is not None for i, m in zip(rows, matchers, strict=True))

    def _sample_deferred(self) -> None:
        """Sample the step whose masks waited for the host (its previous step's tokens are accepted by now; its
        masks are being filled on the grammar thread, or are filled now)."""
        launched, self._deferred = self._deferred, None
        if launched is not None and launched.deferred is not None:
            logits, launched.deferred = launched.deferred, None
            self._sample(launched, logits)

    def _accept(self, collected: Launched, tokens: list[int]) -> None:
        """The constrained rows' matchers accept ``collected``'s tokens. When the deferred step waits for them, it
        samples now, its masks filled here (``sample_deferred_at`` "collect"), or the grammar thread accepts them
        and goes on to fill that step's masks while the host commits and plans, and the next launch samples it
        ("launch")."""
        assert self.grammars is not None  # a constrained row ran
        ids = [collected.plan.seq_ids[i] for i in collected.rows]
        deferred = self._deferred
        if deferred is None or deferred.fed_by is not collected or self.sample_deferred_at == "collect":
            self.grammars.accept(ids, collected.matchers, tokens)
            if deferred is not None and deferred.fed_by is collected:
                self._sample_deferred()
            return
        pinned = self.device.type == "cuda"
        deferred.pending = self.grammars.advance(ids, collected.matchers, tokens, deferred.matchers, pinned)

    def _drop_deferred(self) -> None:
        """Forget the deferred step (it will not be sampled), once the grammar thread (which holds its matchers) is
        done with it; what that thread raised is dropped with it."""
        launched, self._deferred = self._deferred, None
        if launched is not None and launched.pending is not None and self.grammars is not None:
            self.grammars.cancel(launched.pending)

    @torch.inference_mode()  # also from collect (a deferred step), whose logits are inference tensors
    def _sample(self, launched: Launched, logits: torch.Tensor) -> None:
        """Sample ``launched``'s rows from ``logits`` (grammar masks applied) and queue the copy to the host."""
        plan, rows = launched.plan, launched.rows
        every = len(rows) == plan.num_seqs  # a decode step: the plan's columns as they are, no per-row copies
        params = plan.params if every else [plan.params[i] for i in rows]
        batch = prepare_sampling(
            params,
            plan.num_generated if every else [plan.num_generated[i] for i in rows],
            plan.histories if every else [plan.histories[i] for i in rows],
            self.model_config.vocab_size,
            self.device,
            self.history.penalties(plan, rows),  # penalised rows read their slot's tokens on the device
            self._sampling_memo,
            self.eos_token_ids,
        )
        if self.grammars is not None and any(launched.matchers):
            pending, launched.pending = launched.pending, None
            if pending is not None:  # filled on the grammar thread while the host committed and planned
                host = self.grammars.wait(pending)
            else:
                host = self.grammars.masks(launched.matchers, pinned=self.device.type == "cuda")
            if host is not None:  # one non-blocking copy; the logits are this step's own, masked in place
                batch = attrs.evolve(batch, grammar_mask=host.upload(self.device, scratch=True))
        out = self.sampler.sample(logits, batch)  # every row on one per-row path (fnvllm.executor.sampler)
        self._sampled(launched, out.packed, params, out.logprobs)

    def _sampled(
        self,
        launched: Launched,
        packed: torch.Tensor,
        params: Sequence[SamplingParams],
        logprobs: Logprobs | None = None,
    ) -> None:
        """Record ``launched``'s samples ((2, S) tokens and non-finite flags on the device, of ``params``' rows)
        and queue their copy to the host."""
        self.history.record(launched.plan, launched.rows, packed[0])
        if self.shares_samples:  # the workers feed an overlapped next step from these, as rank 0 does
            broadcast_from_first(packed[0], self.tp)
        copied = [packed] if logprobs is None else [packed, *logprobs.copied()]  # the kernels' logprobs: one tensor
        launched.packed, launched.host = packed, HostCopy.start(copied, self._host_ring)
        launched.logprobs = logprobs
        launched.asked = tuple(map(_LOGPROBS, params))
        if launched.timer is not None:
            launched.timer.launched()

    def collect(self, launched: object) -> ExecuteResult:
        """Wait for a launched step; its sampled ids (plan order) and logprobs. The step's one device -> host
        copy; raises NonFiniteLogitsError naming the sequences whose logits were not finite."""
        if not isinstance(launched, Launched):
            raise TypeError(f"collect takes what launch returned, got {type(launched).__name__}")
        if launched is self._deferred:
            self._sample_deferred()
        timer, plan = launched.timer, launched.plan
        prompt = {}
        if launched.prompt_host is not None:
            prompt = host_prompt_logprobs(launched.prompt, launched.prompt_host.wait())
        if launched.packed is None or launched.host is None:
            if timer is not None:
                timer.finish(plan, launched.graph)
            return ExecuteResult((), prompt_logprobs=prompt)
        if timer is not None:
            timer.waiting()
        if self.guard is not None:
            self.guard.wait(launched.host.done)
        packed, *copies = launched.host.wait()
        tokens, flags = packed.tolist()
        device_lp = launched.logprobs
        rows = None if device_lp is None else _host_logprobs(device_lp.host_views(copies), tokens, launched.asked)
        launched.host.release()  # read: its ring buffers may take a later step's samples
        if timer is not None:
            timer.finish(plan, launched.graph)
        if any(flags):
            check_finite(flags, [plan.seq_ids[i] for i in launched.rows])
        if any(launched.matchers):
            self._accept(launched, tokens)
        launched.collected = True
        if rows is None:
            return ExecuteResult(tuple(tokens), prompt_logprobs=prompt)
        return ExecuteResult(tuple(tokens), rows, prompt)

    def discard(self, launched: object) -> None:
        """A launched step will not be collected: expect its step number next. Its device work still runs (in
        order, before anything launched later); its KV writes are the caller's to account for."""
        if not isinstance(launched, Launched):
            raise TypeError(f"discard takes what launch returned, got {type(launched).__name__}")
        if launched is self._deferred:
            self._drop_deferred()
        if launched.host is not None:
            launched.host.release()
        self.next_step = launched.plan.step

    def _timeline_header(self) -> dict[str, object]:
        return {
            "model": timeline_model(self.model_config, self.dtype, self.config.kv_cache_dtype),
            "block_size": self.config.block_size,
            "device": str(self.device),
            # the GPU's name picks the simulator's base profile when a profile is fitted to this log
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "backend": self.backend.name,
            "graphs": self.graphs is not None,
            "max_model_len": self.max_model_len,
            "num_blocks": self.num_blocks,
        }


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor of ``t``'s shape and dtype in pinned host memory (torch's caching pinned allocator)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def _sampled_rows(plan: StepPlan) -> tuple[int, ...]:
    """The plan rows that sample, in order (every row, in a decode step: then one C-level ``range``)."""
    if plan.num_samples == plan.num_seqs:
        return tuple(range(plan.num_seqs))
    return tuple(compress(range(plan.num_seqs), plan.sample))


def _feeds_in_order(fed_by: Launched, plan: StepPlan) -> bool:
    """True when every row of ``plan`` feeds one token, the sample ``fed_by`` drew for the same row: the same
    sequences in the same order, all of them sampled by ``fed_by``, none admitted by ``plan`` (``feed_sources``
    is then 0, 1, ..., B-1). Costs C-level passes only: B tokens in B rows means one token a row."""
    previous = fed_by.plan
    return (
        plan.num_admitted == 0
        and len(fed_by.rows) == previous.num_seqs
        and (plan.seq_ids is previous.seq_ids or plan.seq_ids == previous.seq_ids)
        and sum(map(len, plan.input_tokens)) == plan.num_seqs
    )


def _copy_scored(scored: list[ScoredRow]) -> HostCopy | None:
    """The copy to the host of a step's scored prompt positions, None when there are none."""
    return HostCopy.start([t for row in scored for t in row.tensors()]) if scored else None


def _host_logprobs(lp: Logprobs, tokens: list[int], asked: Sequence[int | None]) -> StepLogprobs:
    """Per sampled row, its TokenLogprobs (the sampled token's logprob and its first n top entries; n may be 0) or
    None where it did not ask. ``lp`` holds the rows that asked, in order (host tensors).

    This runs every step (256 rows x 6 entries at the bench's --logprobs 5), so the rows are not built here: the
    step's three lists are kept and each row's TokenLogprobs is built when read (``StepLogprobs``)."""
    return StepLogprobs.from_host(tokens, asked, lp.sampled_logprobs, lp.top_ids, lp.top_logprobs)


_TIMELINE_DENSE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "max_position_embeddings",
)


def timeline_model(m: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str) -> dict[str, object]:
    """The timeline header's ``model``: config.json fields, as the engine resolved them, from which the simulator's
    ``ModelShape.from_config`` prices the run (a profile fitted to the log, ``fnvllm simulate calibrate``): the
    dense sizes, the precision, a mixture of experts' experts (Hugging Face's keys, Mixtral's as Qwen's) and each
    layer's sliding window (``layer_types``, whatever rule of its family chose the layers)."""
    model: dict[str, object] = {k: getattr(m, k) for k in _TIMELINE_DENSE_FIELDS}
    model["torch_dtype"] = str(dtype).removeprefix("torch.")
    # the precision as the simulator's ModelShape.from_config reads it (an FP8 checkpoint's config key)
    if m.quantization is not None:
        model["quantization_config"] = {"quant_method": "fp8"}
    if kv_cache_dtype != "auto":
        model["kv_cache_dtype"] = kv_cache_dtype
    if m.moe is not None:
        model.update(
            num_experts=m.moe.num_experts,
            num_experts_per_tok=m.moe.num_experts_per_tok,
            moe_intermediate_size=m.moe.moe_intermediate_size,
            decoder_sparse_step=m.moe.decoder_sparse_step,
            mlp_only_layers=list(m.moe.mlp_only_layers),
        )
        if m.moe.shared_expert_intermediate_size is not None:
            model["shared_expert_intermediate_size"] = m.moe.shared_expert_intermediate_size
    windows = [m.layer_window(i) for i in range(m.num_hidden_layers)]
    if any(w is not None for w in windows):
        model.update(
            sliding_window=m.sliding_window,
            use_sliding_window=True,
            layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
        )
    return model
