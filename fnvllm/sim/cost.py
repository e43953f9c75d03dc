"""The cost model: a step's shape -> its device time, by a roofline per layer part plus fitted overheads.

A step's device time is its kernels' time or, when the host launches them one by one slower than the device runs
them (an eager step: ~20 ms of Python launches on the H200 for the 0.6B shape), its launch time.

Each part of a decoder layer (qkv projection, attention, o projection, gate_up, down) takes
max(bytes / bandwidth, FLOPs / matmul rate): a matmul reads its weights once per step plus its input and output
activations, and does 2 FLOPs per weight per token; attention reads every scheduled sequence's KV context,
writes the fed tokens' K and V, and does 4 * q_heads * head_dim FLOPs per (query, key) pair. The layers' sum is
times the layer count, plus the LM head over the sampled rows. So a decode batch is bound by weights and KV
reads, a long prefill by FLOPs, and neither is summed where they overlap. Matmuls and attention are scaled
separately by the profile (``scale``, ``attn_scale``): their kernels reach different fractions of the ceilings.

A mixture of experts' sparse layer runs its router (hidden -> experts, model dtype), the experts its tokens touch
(each read once: ``families.expected_experts_touched`` of the step's tokens, E (1 - (1 - k / E)^tokens)), each
token's top-k of them (2 FLOPs a weight), and Qwen2-MoE's shared expert with its gate, instead of a dense MLP. A
layer with a sliding window reads at most ``window`` keys of K/V for each query row and computes at most
``window`` pairs a query: the step's counts are sums over its sequences, so the model takes min(context,
tokens + seqs x (window - 1)) keys and min(pairs, tokens x window) pairs, exact when every sequence is past the
window or none is, an upper bound between.

FP8 (the model's ``kv_cache_dtype`` / ``quantization``, as the engine's options): an FP8 cache is read and written
at one byte an element; FP8 linears stream one byte a weight plus their block scales and multiply at the profile's
FP8 rate (``fp8_flops_per_s``); the experts stream one byte a weight too but multiply at the model dtype's rate
(weight-only FP8: dequantized in registers); activations, routers, the LM head and attention's arithmetic keep
the model's dtype. The
fitted scales and overheads are the profile's, unless it holds overheads fitted at that precision
(``HardwareProfile.precisions``): the FP8 paths' fixed costs (quantization launches) are not in their bytes.

A served run (``serving``) prices its steps with the profile's ``serving`` overheads instead (the server's engine
process pays more host time per step; ``fnvllm.sim.hardware.Serving``).

Host time is a linear function of the step (rows, new rows, tokens, sampled rows), and a step's wall time follows
the loop: max(device, host) when steps overlap, device + the plain loop's gap when they do not
(``fnvllm.sim.hardware.Overheads``).

The shape of a step is what the GPU engine logs per step (``FNVLLM_TIMELINE``), so the same numbers drive both
the simulation and the calibration.
"""

from __future__ import annotations

import math

import attrs

from fnvllm.sim.families import expected_experts_touched
from fnvllm.sim.hardware import SMALL_BATCHES, HardwareProfile, Overheads, precision_key
from fnvllm.sim.model import ModelShape
from fnvllm.state.plan import StepShape, step_shape

__all__ = ["SMALL_BATCHES", "CostModel", "DeviceTerms", "StepShape", "graph_batch_sizes", "step_shape"]

_US = 1e-6
_CACHE_LIMIT = 1 << 16  # (tokens, samples) -> matmul roofline entries kept per cost model
GRAPH_LOGITS_MAX_ROWS = 64  # decode graphs of at most this many rows compute the LM head in the graph, padding too


MATMUL_BOUND_POWER = 2.5  # how sharply a matmul turns from weight-bound to FLOP-bound (``matmul_bound``)


def matmul_bound(memory_s: float, compute_s: float) -> float:
    """A matmul's roofline time from its memory and compute times: (memory^p + compute^p)^(1/p) with p =
    MATMUL_BOUND_POWER, the larger of the two where one dominates, above both where they are close (a GEMM of a
    few hundred rows neither streams its weights at full bandwidth nor computes at the full rate: one Qwen3-8B
    layer's bf16 GEMMs on the H200 took 108.5 / 112.0 / 153.3 / 3,867.5 us at 1 / 64 / 256 / 8192 rows, this
    gives 108.6 / 109.1 / 155.3 / 3,987 with the h200 ceilings)."""
    if not compute_s:
        return memory_s
    return (memory_s**MATMUL_BOUND_POWER + compute_s**MATMUL_BOUND_POWER) ** (1 / MATMUL_BOUND_POWER)


def graph_batch_sizes(max_seqs: int) -> list[int]:
    """The batch sizes the engine captures decode graphs for, up to ``max_seqs`` (as
    ``fnvllm.executor.cuda_graphs.graph_batch_sizes``: 1, 2, 4, 8, then every multiple of 16, and max_seqs)."""
    if max_seqs < 1:
        return []
    sizes = [b for b in (1, 2, 4, 8) if b < max_seqs] + list(range(16, max_seqs, 16))
    return sorted({*sizes, max_seqs})


def _bucket_table(max_seqs: int) -> list[int]:
    """rows -> the captured batch size that runs them, for rows 0..max_seqs (0 -> 0)."""
    table, sizes = [0], graph_batch_sizes(max_seqs)
    for size, below in zip(sizes, [0, *sizes], strict=False):
        table += [size] * (size - below)
    return table


@attrs.frozen
class DeviceTerms:
    """The device model's inputs for one step (``CostModel.device_terms``): the matmul and attention rooflines
    (seconds), the rows and tokens the device computes (a decode graph's padding included), and the index of its
    graph in SMALL_BATCHES (None when it is not one of those)."""

    linear_s: float
    attention_s: float
    rows: int
    tokens: int
    small: int | None


class CostModel:
    """Times steps of ``model`` on ``hardware``; ``overlap``: the engine overlaps host work with the device (the
    default on CUDA); ``serving``: the steps run under ``fnvllm serve`` (priced by the profile's ``serving``
    overheads when it has them). Stateless after construction; cheap per call (no allocation)."""

    def __init__(
        self, model: ModelShape, hardware: HardwareProfile, overlap: bool = True, serving: bool = False
    ) -> None:
        self.model, self.hardware, self.overlap = model, hardware, overlap
        precision = hardware.precisions.get(precision_key(model.kv_cache_dtype, model.quantization) or "")
        kinds = hardware.serving if serving and hardware.serving is not None else (precision or hardware)
        self.serving = kinds is hardware.serving
        self._eager, self._graph = kinds.eager, kinds.graph
        m = model
        h, q, kv, i = m.hidden, m.q_size, m.kv_size, m.intermediate
        # (weights, input width, output width) of each matmul of a layer
        self._attention = ((h * (q + 2 * kv), h, q + 2 * kv), (q * h, q, h))
        self._matmuls = (*self._attention, (2 * h * i, h, 2 * i), (i * h, i, h))  # a dense layer's
        self._bw, self._flops = hardware.bytes_per_s, hardware.flops_per_s
        self._mm_bw = hardware.matmul_bytes_per_s
        fp8 = model.quantization == "fp8"
        self._linear_flops = hardware.fp8_flops_per_s if fp8 else self._flops  # the layers' linears' rate
        self._buckets = _bucket_table(hardware.graph_max_seqs)
        self._linear_cache: dict[tuple[int, int], float] = {}

    def _layer_matmul_s(self, weights: int, width_in: int, width_out: int, tokens: int) -> float:
        """Roofline seconds of one layer linear of ``weights`` weights over ``tokens`` tokens: its weights (at the
        model's bytes per linear weight) and its input and output activations streamed, 2 FLOPs a weight a token."""
        m = self.model
        nbytes = m.linear_bytes_per_weight * weights + m.dtype_bytes * tokens * (width_in + width_out)
        return matmul_bound(nbytes / self._mm_bw, 2 * tokens * weights / self._linear_flops)

    def layer_parts_s(self, shape: StepShape) -> list[tuple[str, float]]:
        """Roofline seconds of each matmul of one layer: qkv, o, then a dense layer's gate_up, down (when the model
        has dense layers) and a sparse layer's router, experts and shared_expert (when it has sparse ones)."""
        tokens, m = shape.num_tokens, self.model
        parts = [
            (name, self._layer_matmul_s(*mm, tokens)) for name, mm in zip(("qkv", "o"), self._attention, strict=True)
        ]
        if m.sparse_layers < m.layers:
            parts += [
                (name, self._layer_matmul_s(*mm, tokens))
                for name, mm in zip(("gate_up", "down"), self._matmuls[2:], strict=True)
            ]
        if m.sparse_layers:
            parts += [("router", self._router_s(tokens)), ("experts", self._experts_s(tokens))]
            parts += [("shared_expert", self._shared_expert_s(tokens))] if m.shared_intermediate else []
        return parts

    def _router_s(self, tokens: int) -> float:
        """Roofline seconds of one sparse layer's router and shared-expert gate, in the model's dtype."""
        m = self.model
        outputs = m.experts + (1 if m.shared_intermediate else 0)
        nbytes = m.dtype_bytes * (m.router_params + tokens * (m.hidden + outputs))
        return matmul_bound(nbytes / self._mm_bw, 2 * tokens * m.router_params / self._flops)

    def _experts_s(self, tokens: int) -> float:
        """Roofline seconds of one sparse layer's routed experts: the experts the tokens touch read once (at the
        linears' bytes a weight), each token's top-k multiplied at the model dtype's rate (weight-only FP8), the
        routed rows' activations in and out."""
        m = self.model
        per_expert = 3 * m.hidden * m.expert_intermediate
        touched = expected_experts_touched(m.experts, m.experts_per_tok, tokens)
        rows = tokens * m.experts_per_tok
        acts = m.dtype_bytes * rows * 2 * (m.hidden + 2 * m.expert_intermediate)  # gate_up in / out, down in / out
        nbytes = m.linear_bytes_per_weight * touched * per_expert + acts
        return matmul_bound(nbytes / self._mm_bw, 2 * rows * per_expert / self._flops)

    def _shared_expert_s(self, tokens: int) -> float:
        """Roofline seconds of one sparse layer's shared expert (a dense MLP: gate_up and down, FP8 GEMMs with
        FP8 weights)."""
        h, i = self.model.hidden, self.model.shared_intermediate
        return self._layer_matmul_s(2 * h * i, h, 2 * i, tokens) + self._layer_matmul_s(i * h, i, h, tokens)

    def _layers_s(self, tokens: int) -> float:
        """Roofline seconds of every layer's matmuls over ``tokens`` tokens (each kind of layer times its count)."""
        m = self.model
        total = m.layers * sum(self._layer_matmul_s(*mm, tokens) for mm in self._attention)
        if m.sparse_layers < m.layers:
            dense = sum(self._layer_matmul_s(*mm, tokens) for mm in self._matmuls[2:])
            total += (m.layers - m.sparse_layers) * dense
        if m.sparse_layers:
            shared = self._shared_expert_s(tokens) if m.shared_intermediate else 0.0
            total += m.sparse_layers * (self._router_s(tokens) + self._experts_s(tokens) + shared)
        return total

    def attention_s(self, shape: StepShape) -> float:
        """Roofline seconds of attention in all layers: KV context read, fed K/V written (at the cache's bytes an
        element), q read and out written; a windowed layer reads and pairs at most its window a query (see the
        module docstring)."""
        m = self.model
        full = (m.layers - m.window_layers) * self._attention_layer_s(shape, shape.context_tokens, shape.attn_pairs)
        if m.window is None:
            return full
        rows, t = shape.num_seqs, shape.num_tokens
        context = min(shape.context_tokens, t + rows * (m.window - 1))
        return full + m.window_layers * self._attention_layer_s(shape, context, min(shape.attn_pairs, t * m.window))

    def _attention_layer_s(self, shape: StepShape, context: int, pairs: int) -> float:
        """Roofline seconds of one layer's attention reading ``context`` keys of K/V and computing ``pairs``
        (query, key) pairs."""
        m, b, t = self.model, self.model.dtype_bytes, shape.num_tokens
        kv_bytes = m.kv_element_bytes * 2 * m.kv_size * (context + t) + b * 2 * m.q_size * t
        return max(kv_bytes / self._bw, 4 * m.q_heads * m.head_dim * pairs / self._flops)

    def lm_head_s(self, shape: StepShape) -> float:
        """Roofline seconds of the LM head over the sampled rows (fp32 logits written and read once)."""
        return self._lm_head_of(shape.num_samples)

    def _lm_head_of(self, samples: int) -> float:
        """``lm_head_s`` of ``samples`` sampled rows (0 for none): the model's dtype, whatever the linears'."""
        if not samples:
            return 0.0
        m = self.model
        weights = m.vocab * m.hidden
        nbytes = m.dtype_bytes * weights + 8 * samples * m.vocab
        return matmul_bound(nbytes / self._mm_bw, 2 * samples * weights / self._flops)

    def linear_s(self, shape: StepShape) -> float:
        """Roofline seconds of every matmul of the step: the layers' projections and the LM head."""
        if not shape.num_seqs:
            return 0.0
        return self._layers_s(shape.num_tokens) + self.lm_head_s(shape)

    def _linear_of(self, tokens: int, samples: int) -> float:
        """``linear_s`` of a step of ``tokens`` fed tokens and ``samples`` sampled rows (no object built)."""
        if (tokens, samples) in self._linear_cache:
            return self._linear_cache[tokens, samples]
        value = self._layers_s(tokens) + self._lm_head_of(samples)
        if len(self._linear_cache) < _CACHE_LIMIT:
            self._linear_cache[tokens, samples] = value
        return value

    def padded_rows(self, shape: StepShape) -> int:
        """The rows the device computes for the step: a decode-only CUDA-graph step runs the graph of the smallest
        captured batch size that holds its rows (``graph_batch_sizes``), its padding rows included; any other
        step its own rows."""
        rows = shape.num_seqs
        if shape.graph and not shape.num_prefill_tokens and rows < len(self._buckets):
            return self._buckets[rows]
        return rows

    def device_terms(self, shape: StepShape) -> DeviceTerms:
        """What the device model multiplies by the profile's overheads (``compute_s``; the fit's columns)."""
        rows = self.padded_rows(shape)
        if shape.graph and not shape.num_prefill_tokens:  # a decode graph: its padding rows feed and sample too
            samples = rows if rows <= GRAPH_LOGITS_MAX_ROWS else shape.num_samples
            small = SMALL_BATCHES.index(rows) if rows in SMALL_BATCHES else None
            return DeviceTerms(self._linear_of(rows, samples), self.attention_s(shape), rows, rows, small)
        linear = self._linear_of(shape.num_tokens, shape.num_samples)
        return DeviceTerms(linear, self.attention_s(shape), rows, shape.num_tokens, None)

    def roofline_s(self, shape: StepShape) -> float:
        """The step's roofline time: matmuls plus attention, each part at its own bound."""
        return self.linear_s(shape) + self.attention_s(shape) if shape.num_seqs else 0.0

    def overheads(self, shape: StepShape) -> Overheads:
        """The overheads of this kind of step (graph or eager; the serving ones when serving)."""
        return self._graph if shape.graph else self._eager

    def device_s(self, shape: StepShape) -> float:
        """Predicted device time of the step (0 for an empty step): its kernels' time (``compute_s``), or its
        launch when the kernels wait for the host to launch them one by one (``launch_s``, an eager step)."""
        if not shape.num_seqs:
            return 0.0
        return max(self.compute_s(shape), self.launch_s(shape))

    def compute_s(self, shape: StepShape) -> float:
        """Predicted time of the step's kernels on the device, launched: scaled rooflines plus the fitted
        per-step, per-row and per-token terms (0 for an empty step). A decode-only graph step is priced at its
        graph's batch size (``padded_rows``: the padding rows compute too), and one of the smallest graphs
        (``SMALL_BATCHES``) takes its own per-step constant when the profile has them (``Overheads.small_us``)
        instead of step_us + log_seq_us * log2(rows)."""
        if not shape.num_seqs:
            return 0.0
        o = self.overheads(shape)
        t = self.device_terms(shape)
        if t.small is not None and t.small < len(o.small_us):
            constant = o.small_us[t.small]
        else:
            constant = o.step_us + (o.log_seq_us * math.log2(t.rows) if o.log_seq_us else 0.0)
        extra = constant + o.seq_us * t.rows + o.token_us * t.tokens
        return o.scale * t.linear_s + o.attn_scale * t.attention_s + extra * _US

    def gap_s(self, shape: StepShape, num_new_seqs: int = 0) -> float:
        """Predicted host gap of a plain (not overlapped) loop after the step (0 for an empty step)."""
        if not shape.num_seqs:
            return 0.0
        o = self.overheads(shape)
        gap = o.gap_us + o.gap_seq_us * shape.num_seqs + o.gap_new_seq_us * num_new_seqs
        return (gap + o.gap_token_us * shape.num_tokens + o.gap_context_us * shape.context_tokens) * _US

    def host_s(self, shape: StepShape, num_new_seqs: int = 0) -> float:
        """Predicted host time of the loop cycle that runs the step (0 for an empty step)."""
        if not shape.num_seqs:
            return 0.0
        o = self.overheads(shape)
        host = o.host_us + o.host_seq_us * shape.num_seqs + o.host_new_seq_us * num_new_seqs
        host += o.host_token_us * shape.num_tokens + o.host_sample_us * shape.num_samples
        return (host + o.host_context_us * shape.context_tokens) * _US

    def launch_s(self, shape: StepShape) -> float:
        """Predicted host time of launching the step's kernels one by one, which the device waits for
        (``Overheads`` launch_*: an eager step's; 0 for a graph replay and for an empty step)."""
        if not shape.num_seqs:
            return 0.0
        o = self.overheads(shape)
        return (o.launch_us + o.launch_seq_us * shape.num_seqs + o.launch_token_us * shape.num_tokens) * _US

    def wall_s(
        self, shape: StepShape, num_new_seqs: int = 0, overlap: bool | None = None, hidden_s: float = 0.0
    ) -> float:
        """Wall time the step occupies: max(device, host) when steps overlap (``overlap`` None: this model's
        setting) and the profile has a host model, else device + plain gap. ``hidden_s``: see ``step_times``."""
        return self.step_times(shape, num_new_seqs, overlap, hidden_s)[2]

    def step_times(
        self, shape: StepShape, num_new_seqs: int = 0, overlap: bool | None = None, hidden_s: float = 0.0
    ) -> tuple[float, float, float]:
        """(device, host, wall) seconds of the step, each priced once (see ``wall_s``). ``hidden_s``: the device
        time of the step before, when the loop overlaps steps: the host launches this step while the device runs
        that one, so that much of this step's launch (``launch_s``) is hidden and the device waits only for the
        rest (a plain loop, or the first step after an idle device, waits for all of it)."""
        overlapped = (self.overlap if overlap is None else overlap) and self.overheads(shape).has_host_model
        host = self.host_s(shape, num_new_seqs)
        device = max(self.compute_s(shape), self.launch_s(shape) - hidden_s) if shape.num_seqs else 0.0
        if overlapped:
            return device, host, max(device, host)
        return device, host, device + self.gap_s(shape, num_new_seqs)

    def step_s(self, shape: StepShape, num_new_seqs: int = 0) -> float:
        """Wall time the step occupies on the simulated clock (``wall_s``)."""
        return self.wall_s(shape, num_new_seqs)
