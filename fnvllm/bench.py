"""The throughput benchmark behind ``fnvllm bench``: the nano-vllm workload on a random-weight checkpoint.

Workload (nano-vllm's bench.py, same draw order): ``random.seed(0)``; 256 requests; prompt ids randint(0, 10000)
of length randint(100, 1024); max_tokens randint(100, 1024); temperature 0.6; ignore_eos. Throughput does not
depend on weight values when EOS is ignored, so a locally written random checkpoint of the real shape stands in
for the real model.

The bandwidth floor: the fewest bytes any engine must read from device memory for this workload, over the read
ceiling. Each request's n-th output token reads the KV of its whole context (prompt + n tokens, all layers), and
each decode step reads the weights once; with every request in one batch there are max(max_tokens) decode steps.
For Qwen3-0.6B on the full workload: 13.87 TB of KV + 1.22 TB of weights = 15.09 TB; at 4.16 TB/s that is 3.63 s,
i.e. ~36,900 output tok/s at most. The floor counts the bytes actually read: with ``kv_cache_dtype="fp8"`` the KV
is one byte an element (6.93 TB for Qwen3-0.6B: 8.15 TB in all, 1.96 s, ~68,300 tok/s), and FP8 weights
(``quantization="fp8"``) one byte a weight plus their block scales, the experts' too. A mixture of experts reads,
per sparse layer and decode step, the experts its running sequences touch (``moe.expected_experts_touched``: all
128 of Qwen3-30B-A3B at 256 sequences, ~61 GB a step, ~30.5 GB with FP8 weights; fewer as the batch drains). A
layer that attends within a sliding window (``ModelConfig.layer_window``: Mistral, Mixtral, Phi-3, Gemma 3's local
layers) reads at most the window's K/V of a sequence, and its queries see at most that many keys.

The roofline adds compute to the floor (``roofline_seconds``): decode step s (the sequences with more than s
outputs) costs at least max(its bytes / read ceiling, its FLOPs / peak), and the prompts' FLOPs fit only into the
compute the bytes-bound steps leave idle, the rest adding to the time. On the bench workload every decode step is
bytes-bound (Qwen3-0.6B at 256 sequences: ~0.34 TFLOP against ~19 GB of weights and KV) and the prompts fit in
the idle compute, so the roofline equals the floor; a prefill-heavy workload (long prompts, short outputs) is
compute-bound and its roofline exceeds it. ``fnvllm bench --profile`` also reports the roofline of the steps the
engine actually ran (each step at max(bytes, FLOPs) per layer part, ``fnvllm.sim.CostModel.roofline_s``): there
the Qwen3-8B shape's prefill steps count at the matmul peak, which the bytes-only floor leaves out. The peak is the
bf16 one; with FP8 weights the dense linears (attention's projections, dense MLPs, a shared expert) multiply on FP8
GEMMs at twice it, while the experts (weight-only FP8, dequantized to bf16 in registers), the LM head and attention
stay at it (``fp8_gemm_flops_per_token``).

With ``load_format="dummy"`` (the default for qwen3-30b-a3b and mixtral-8x7b, whose 61 and 93 GB checkpoints are
impractical to write and read back) only config.json is written and the engine fills random weights on the device.
qwen1.5-moe-a2.7b (Qwen2-MoE, 29 GB) and mixtral-8x7b are the other MoE families' published shapes. ``tiny-moe``
is a tiny Qwen3-MoE (8 experts, top-2) for running the MoE path end to end on a CPU.
"""

from __future__ import annotations

import contextlib
import math
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from fnvllm.state import SamplingParams
from fnvllm.workloads import bench_workload, within_vocab

H200_READ_TB_S = 4.16  # measured on the lent H200 (sum over a 2 GiB bf16 tensor)
H200_PEAK_TFLOPS = 793.0  # measured on the lent H200: a bf16 8192^3 matmul (FP8 dense linears: twice, FP8_GEMM_SPEEDUP)
SHAPES = ("tiny", "tiny-moe", "qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-8x7b")
DUMMY_BY_DEFAULT = (
    "qwen3-30b-a3b",
    "mixtral-8x7b",
)  # shapes benchmarked with load_format="dummy" unless told otherwise
TINY_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}
WARMUP_REQUESTS = 4  # the warm-up runs the workload's first 4 prompts (or all, when fewer), 8 tokens each


@attrs.frozen
class Ceilings:
    """One GPU's read ceiling (TB/s) and bf16 matmul peak (TFLOP/s), the floor's and the roofline's rates, and
    where they come from (``source``: "h100 profile", "given", ...)."""

    read_tb_s: float
    peak_tflops: float
    source: str


def device_ceilings(device_name: str, read_tb_s: float | None = None, peak_tflops: float | None = None) -> Ceilings:
    """The ceilings of the GPU named ``device_name`` (``torch.cuda.get_device_name``): the measured ones of its
    built-in simulator profile (``fnvllm.sim.hardware.builtin_for_device``; "NVIDIA H100 80GB HBM3": 3.117 TB/s,
    766.8 TFLOP/s), else the H200's (4.16, 793) with a source that says the card has no profile. A value given
    replaces the measured one. Example: ``device_ceilings("NVIDIA H100 80GB HBM3", read_tb_s=3.0)`` is
    ``Ceilings(3.0, 766.8, "given read ceiling, h100 profile's peak")``."""
    from fnvllm.sim.hardware import BUILTIN_PROFILES, builtin_for_device

    check_ceilings(read_tb_s, peak_tflops)
    profile = builtin_for_device(device_name)
    origin = f"{profile} profile" if profile else f"h200 profile (none for {device_name!r})"
    hw = BUILTIN_PROFILES[profile or "h200"]
    measured = hw.mem_bandwidth_gbs / 1e3, hw.matmul_tflops
    if read_tb_s is not None and peak_tflops is not None:
        return Ceilings(read_tb_s, peak_tflops, "given")
    if read_tb_s is not None:
        return Ceilings(read_tb_s, measured[1], f"given read ceiling, {origin}'s peak")
    if peak_tflops is not None:
        return Ceilings(measured[0], peak_tflops, f"given peak, {origin}'s read ceiling")
    return Ceilings(*measured, origin)


def check_ceilings(read_tb_s: float | None, peak_tflops: float | None) -> None:
    """Raise ValueError naming the field unless each ceiling given is a number > 0 (None: the card's own)."""
    for name, value in (("read_tb_s", read_tb_s), ("peak_tflops", peak_tflops)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def _engine_ceilings(
    llm: Any, read_tb_s: float | None, peak_tflops: float | None, engine_options: Mapping[str, Any]
) -> Ceilings:
    """``device_ceilings`` of the GPU ``llm`` runs on, times the tensor-parallel size (each GPU reads its share of
    the weights and KV and does its share of the FLOPs)."""
    import torch

    one = device_ceilings(torch.cuda.get_device_name(llm.executor.device), read_tb_s, peak_tflops)
    tp = engine_options.get("tensor_parallel_size", 1)
    return attrs.evolve(one, read_tb_s=one.read_tb_s * tp, peak_tflops=one.peak_tflops * tp)


FP8_SCALE_BLOCK = 128  # an FP8 linear holds one float32 scale per 128 x 128 block of its weight
FP8_GEMM_SPEEDUP = 2.0  # the dense FP8 linears' e4m3 GEMMs run at twice the bf16 tensor-core rate

Matrix = tuple[int, int]  # a linear's weight: (rows, columns) = (output width, input width)


def weight_bytes(config: Any, dtype_bytes: int = 2, num_seqs: int | None = None) -> int:
    """Bytes of weights one decode step reads: every layer (linears, norms, biases), the final norm and the LM head
    (not the embedding table, of which only the batch's rows are read — unless tied, when the LM head reads all of
    it). A sparse layer reads its router, its shared expert (if any) and the experts ``num_seqs`` sequences touch on
    average (None: all of them). FP8 weights (``config.quantization``): every decoder-layer linear — attention's,
    the dense MLPs', the experts' and the shared expert's — is one byte a weight plus a float32 scale per
    128 x 128 block; norms, biases, routers, the shared expert's gate and the LM head keep ``dtype_bytes``.

    Worked example (Qwen3-30B-A3B with quantization="fp8", 256 sequences, which touch all 128 experts): 48 layers
    of 128 x 3 x 2,048 x 768 expert and 18.9 M attention weights = 29.90 G weights at one byte (+ 7.3 MB of scales),
    48 routers of 128 x 2,048 (25 MB) and the LM head's 151,936 x 2,048 (622 MB) at two: ~30.55 GB a step (60.4 GB
    in bf16); at 16 sequences (82.4 experts a layer touched) ~20.2 GB."""
    fp8 = getattr(config, "quantization", None) is not None
    attention = _matrix_bytes(_attention_matrices(config), fp8, dtype_bytes)
    vectors = _layer_vectors(config) * dtype_bytes
    mlps = sum(_mlp_bytes(config, i, num_seqs, fp8, dtype_bytes) for i in range(config.num_hidden_layers))
    head = (config.vocab_size * config.hidden_size + config.hidden_size) * dtype_bytes  # LM head and final norm
    return int(config.num_hidden_layers * (attention + vectors) + mlps + head)


def _matrix_bytes(matrices: Iterable[Matrix], fp8: bool, dtype_bytes: int) -> int:
    """Bytes of these linears' weights: ``dtype_bytes`` a weight, or with ``fp8`` one byte a weight plus a float32
    scale per 128 x 128 block (a partial block at an edge takes a whole scale)."""
    if not fp8:
        return dtype_bytes * sum(n * k for n, k in matrices)
    blocks = sum(math.ceil(n / FP8_SCALE_BLOCK) * math.ceil(k / FP8_SCALE_BLOCK) for n, k in matrices)
    return sum(n * k for n, k in matrices) + 4 * blocks


def _attention_matrices(config: Any) -> tuple[Matrix, ...]:
    """One layer's q, k, v and o projection weights."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    return ((q, h), (kv, h), (kv, h), (h, q))


def _glu_matrices(hidden: int, width: int) -> tuple[Matrix, ...]:
    """A gated MLP's gate, up and down weights (SwiGLU, or Gemma 3's GeGLU: the same three matrices)."""
    return ((width, hidden), (width, hidden), (hidden, width))


def _layer_vectors(config: Any) -> int:
    """Weights of one layer's norms and biases: two hidden-wide norms (four for Gemma 3, which also norms before and
    after its MLP), per-head q and k norms (Qwen3, Gemma 3), q/k/v biases (Qwen2) and an o bias."""
    h = config.hidden_size
    norms = (4 if getattr(config, "gemma", None) is not None else 2) * h
    norms += 2 * config.head_dim if getattr(config, "qk_norm", False) else 0
    qkv_bias = config.q_size + 2 * config.kv_size if getattr(config, "attention_bias", False) else 0
    return norms + qkv_bias + (h if getattr(config, "o_proj_bias", False) else 0)


def _mlp_bytes(config: Any, layer: int, num_seqs: int | None, fp8: bool, dtype_bytes: int) -> float:
    """Bytes of layer ``layer``'s MLP a decode step of ``num_seqs`` sequences reads (see weight_bytes): a dense
    MLP's, or a sparse layer's router (model dtype), the experts touched and the shared expert."""
    from fnvllm.model.moe import expected_experts_touched

    moe, h = getattr(config, "moe", None), config.hidden_size
    if moe is None or not moe.is_sparse(layer):
        return float(_matrix_bytes(_glu_matrices(h, config.intermediate_size), fp8, dtype_bytes))
    e, k = moe.num_experts, moe.num_experts_per_tok
    touched = e if num_seqs is None else expected_experts_touched(e, k, num_seqs)
    expert = _matrix_bytes(_glu_matrices(h, moe.moe_intermediate_size), fp8, dtype_bytes)
    return dtype_bytes * h * e + touched * expert + _shared_expert_bytes(moe, h, fp8, dtype_bytes)


def _shared_expert_weights(moe: Any, hidden: int) -> int:
    """Weights of a sparse layer's shared expert and its gate (Qwen2-MoE), 0 without one."""
    width = getattr(moe, "shared_expert_intermediate_size", None)
    return 0 if width is None else 3 * hidden * width + hidden


def _shared_expert_bytes(moe: Any, hidden: int, fp8: bool, dtype_bytes: int) -> int:
    """Bytes of a sparse layer's shared expert (Qwen2-MoE: a dense SwiGLU MLP, FP8 with the dense linears, and its
    hidden -> 1 gate in the model dtype; every token goes through both), 0 without one."""
    width = getattr(moe, "shared_expert_intermediate_size", None)
    if width is None:
        return 0
    return _matrix_bytes(_glu_matrices(hidden, width), fp8, dtype_bytes) + dtype_bytes * hidden


def kv_bytes_per_token(config: Any, dtype_bytes: int = 2) -> int:
    """Bytes of K and V of one token over all layers (what it occupies in the cache)."""
    return config.num_hidden_layers * _kv_bytes_per_layer_token(config, dtype_bytes)


def _kv_bytes_per_layer_token(config: Any, dtype_bytes: int) -> int:
    """Bytes of K and V of one token in one layer."""
    return 2 * config.num_key_value_heads * config.head_dim * dtype_bytes


def _layer_windows(config: Any) -> list[tuple[int | None, int]]:
    """(window, how many layers attend within it) over the decoder layers, None for full attention
    (``ModelConfig.layer_window``; a config without one attends fully everywhere). Gemma-3-4B: [(1024, 29),
    (None, 5)]."""
    window_of = getattr(config, "layer_window", None)
    windows = [None if window_of is None else window_of(i) for i in range(config.num_hidden_layers)]
    return list(Counter(windows).items())


def keys_seen(first: int, last: int, window: int | None) -> int:
    """Keys one layer's queries at contexts ``first`` .. ``last`` see, summed (a query's context: the tokens up
    to and including its own; it sees min(context, window) of them, all without a window). Example: contexts 3 to
    6 under a window of 4 see 3 + 4 + 4 + 4 = 15 keys."""
    if last < first:
        return 0
    if window is None or last <= window:
        return (first + last) * (last - first + 1) // 2
    if first >= window:
        return window * (last - first + 1)
    return (first + window) * (window - first + 1) // 2 + window * (last - window)


def layer_keys(config: Any, first: int, last: int) -> int:
    """``keys_seen`` summed over the layers, each under its own window: the (query, key) pairs of one sequence's
    queries at contexts ``first`` .. ``last``, and the tokens of K/V they read, all layers."""
    return sum(count * keys_seen(first, last, window) for window, count in _layer_windows(config))


def floor_seconds(
    config: Any, prompt_lens: Sequence[int], output_lens: Sequence[int], read_tb_s: float, kv_dtype_bytes: int = 2
) -> float:
    """The workload's bandwidth floor in seconds (see the module docstring); KV elements of ``kv_dtype_bytes``. A
    sequence's n-th output token (n from 0) reads the KV of its context, prompt + n tokens, in every layer, at most
    the window in a windowed layer (``layer_keys``)."""
    windows = _layer_windows(config)
    kv_tokens = sum(
        count * keys_seen(p, p + o - 1, window)
        for p, o in zip(prompt_lens, output_lens, strict=True)
        for window, count in windows
    )
    if getattr(config, "moe", None) is None:
        weights = max(output_lens) * weight_bytes(config)
    else:  # decode step s runs the sequences with more than s outputs; the experts they touch shrink with them
        weights = sum(weight_bytes(config, num_seqs=sum(o > s for o in output_lens)) for s in range(max(output_lens)))
    total = kv_tokens * _kv_bytes_per_layer_token(config, kv_dtype_bytes) + weights
    return total / (read_tb_s * 1e12)


def flops_per_token(config: Any) -> int:
    """FLOPs of one token through the linear layers and the LM head (2 a weight it multiplies; a sparse layer
    counts its router, its top-k experts and its shared expert with its gate, if any), attention's score and value
    products not included (``attention_flops``)."""
    h, moe = config.hidden_size, getattr(config, "moe", None)
    weights = config.num_hidden_layers * sum(n * k for n, k in _attention_matrices(config))
    for i in range(config.num_hidden_layers):
        if moe is None or not moe.is_sparse(i):
            weights += 3 * h * config.intermediate_size
        else:
            weights += h * moe.num_experts + moe.num_experts_per_tok * 3 * h * moe.moe_intermediate_size
            weights += _shared_expert_weights(moe, h)
    return 2 * (weights + config.vocab_size * h)


def fp8_gemm_flops_per_token(config: Any) -> int:
    """The part of ``flops_per_token`` that runs on FP8 GEMMs (at FP8_GEMM_SPEEDUP times the bf16 peak): with FP8
    weights, the dense linears (attention's q/k/v/o, dense MLPs, Qwen2-MoE's shared expert), whose activations are
    quantized to e4m3 too (``fnvllm.model.quant.linear_forward``); 0 without FP8 weights. The experts are
    weight-only FP8 (dequantized in registers, multiplied in the model dtype: ``fnvllm.model.moe``); routers, the
    shared expert's gate and the LM head keep the model dtype."""
    if getattr(config, "quantization", None) is None:
        return 0
    h, moe = config.hidden_size, getattr(config, "moe", None)
    weights = config.num_hidden_layers * sum(n * k for n, k in _attention_matrices(config))
    for i in range(config.num_hidden_layers):
        if moe is None or not moe.is_sparse(i):
            weights += 3 * h * config.intermediate_size
        elif moe.shared_expert_intermediate_size is not None:
            weights += 3 * h * moe.shared_expert_intermediate_size
    return 2 * weights


def attention_flops(config: Any, context: int) -> int:
    """FLOPs of one query token's attention over a context of ``context`` tokens (its own included), all layers
    (scores and values: 4 a head dimension a key; a windowed layer's query sees at most its window of keys)."""
    return 4 * config.q_size * layer_keys(config, context, context)


def _decode_keys(windows: Sequence[tuple[int | None, int]], contexts: Sequence[int]) -> int:
    """Keys a decode step's queries at ``contexts`` see, all layers (``layer_keys`` of each, summed)."""
    full = sum(contexts)
    return sum(count * (full if w is None else sum(min(c, w) for c in contexts)) for w, count in windows)


def roofline_seconds(
    config: Any,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    read_tb_s: float,
    peak_tflops: float,
    kv_dtype_bytes: int = 2,
) -> float:
    """The workload's roofline in seconds (see the module docstring): per decode step max(bytes, FLOPs) at the
    ceilings, plus the prompts' FLOPs that the bytes-bound steps' idle compute cannot hold. Decode step s runs the
    sequences with more than s outputs, each reading the KV of its prompt and s outputs (as ``floor_seconds``).
    ``peak_tflops``: the bf16 peak; with FP8 weights the dense linears' FLOPs (``fp8_gemm_flops_per_token``) run
    at FP8_GEMM_SPEEDUP times it, the experts', the LM head's and attention's at it."""
    bandwidth, peak = read_tb_s * 1e12, peak_tflops * 1e12
    fast = fp8_gemm_flops_per_token(config)
    token_s = (flops_per_token(config) - fast) / peak + fast / (FP8_GEMM_SPEEDUP * peak)  # one token's linears
    kv_token, windows = _kv_bytes_per_layer_token(config, kv_dtype_bytes), _layer_windows(config)
    attention_s = 4 * config.q_size / peak  # a (query, key) pair in one layer
    dense = getattr(config, "moe", None) is None
    weights_all = weight_bytes(config) if dense else 0
    total, slack = 0.0, 0.0
    pairs = sorted(zip(output_lens, prompt_lens, strict=True), reverse=True)
    for s in range(max(output_lens, default=0)):
        contexts = [p + s for o, p in pairs if o > s]
        keys = _decode_keys(windows, contexts)
        weights = weights_all if dense else weight_bytes(config, num_seqs=len(contexts))
        read = (weights + keys * kv_token) / bandwidth
        compute = len(contexts) * token_s + keys * attention_s
        total += max(read, compute)
        slack += max(read - compute, 0.0)
    prompts = sum(p * token_s + layer_keys(config, 1, p) * attention_s for p in prompt_lens)
    return total + max(prompts - slack, 0.0)


def write_checkpoint(shape: str, folder: Path, config_only: bool = False) -> Path:
    """A random checkpoint of ``shape`` (one of SHAPES) in ``folder``; ``config_only``: its config.json (and
    generation_config.json) alone, for ``load_format="dummy"``."""
    from fnvllm.testing.checkpoints import write_random_checkpoint, write_tiny_checkpoint

    if shape in ("tiny", "tiny-moe"):  # one small file: no "Writing model shards" bar from transformers
        from transformers.utils import logging as hf_logging

        family, moe = ("qwen3", None) if shape == "tiny" else ("qwen3_moe", TINY_MOE)
        was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            return write_tiny_checkpoint(
                folder, family, vocab_size=10240, hidden_size=128, num_layers=2, moe=moe, config_only=config_only
            )
        finally:
            if was_enabled:
                hf_logging.enable_progress_bar()
    return write_random_checkpoint(folder, shape, config_only=config_only)


class Progress:
    """Plain progress lines on stderr every ``every_s`` seconds while the timed run goes (for logs and pipes,
    where a progress bar cannot redraw): elapsed time, output tokens so far of the total, tok/s.

    A daemon thread reads ``llm.stats`` (a frozen value the engine replaces after each step), so the engine loop
    itself does no extra work."""

    def __init__(self, llm: Any, total_tokens: int, every_s: float) -> None:
        self.llm, self.total_tokens, self.every_s = llm, total_tokens, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._report, name="bench-progress", daemon=True)

    def __enter__(self) -> Progress:
        """Start reporting."""
        self._start, self._base = time.perf_counter(), self.llm.stats.num_generated_tokens
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop reporting."""
        self._stop.set()
        self._thread.join()

    def _report(self) -> None:
        """The thread's body: one line per period until stopped."""
        while not self._stop.wait(self.every_s):
            done = self.llm.stats.num_generated_tokens - self._base
            print(self.line(time.perf_counter() - self._start, done), file=sys.stderr, flush=True)

    def line(self, seconds: float, done: int) -> str:
        """One progress line: ``done`` output tokens after ``seconds``."""
        share = 100 * done / max(1, self.total_tokens)
        rate = done / seconds if seconds > 0 else 0.0
        total = f"{self.total_tokens:,} output tokens ({share:.0f} %)"
        return f"bench: {seconds:.0f} s, {done:,} of {total}, {rate:,.0f} tok/s"


def run_bench(
    model: str | Path | None,
    model_shape: str,
    num_requests: int,
    max_input_len: int = 1024,
    max_output_len: int = 1024,
    read_tb_s: float | None = None,
    peak_tflops: float | None = None,
    use_tqdm: bool = False,
    progress_every_s: float | None = None,
    sampling: Mapping[str, Any] | None = None,
    **engine_options: Any,
) -> dict[str, Any]:
    """Run the workload once to warm up (its first 4 requests, 8 tokens each), then time it; returns the result
    record. Without ``model``, a random checkpoint of ``model_shape`` is written to a temporary folder that is
    deleted afterwards. ``read_tb_s`` / ``peak_tflops``: one GPU's ceilings, for the floor and the roofline
    (bf16; with FP8 weights the dense linears' GEMMs count at twice the peak, ``roofline_seconds``); None: the
    measured ones of the GPU it runs on (``device_ceilings``), recorded in the result as "ceilings".
    ``progress_every_s``: print a plain progress line that often (None: none).
    ``sampling``: SamplingParams fields set on every request (e.g. top_p, repetition_penalty, logprobs) on top of
    the workload's temperature 0.6, ignore_eos and max_tokens; recorded in the result."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    check_ceilings(read_tb_s, peak_tflops)
    prompts, params = bench_workload(num_requests, max_input_len, max_output_len)
    if sampling:
        params = [attrs.evolve(p, **sampling) for p in params]  # SamplingParams validates each field
    dummy = engine_options.get("load_format") == "dummy"
    with checkpoint_folder(model, model_shape, announce=progress_every_s is not None, dummy=dummy) as folder:
        workload = within_vocab(prompts, _vocab_size(folder)), params
        if engine_options.get("max_model_len") is None:  # the workload needs <= 2048; a short cap keeps graphs narrow
            engine_options["max_model_len"] = capped_model_len(folder, max(4096, max_input_len + max_output_len))
        longest = max(len(p) + sp.max_tokens for p, sp in zip(*workload, strict=True))
        if longest > engine_options["max_model_len"]:
            raise ValueError(
                f"the workload's longest request takes {longest} tokens (max_input_len {max_input_len}, "
                f"max_output_len {max_output_len}), more than max_model_len {engine_options['max_model_len']}: "
                "lower them (--max-input-len / --max-output-len)"
            )
        name = str(model) if model else model_shape
        ceilings = read_tb_s, peak_tflops
        result = _run(folder, name, workload, ceilings, use_tqdm, progress_every_s, engine_options)
        return {**result, "sampling": dict(sampling)} if sampling else result


def _vocab_size(folder: Path) -> int:
    from fnvllm.model.config import ModelConfig

    return ModelConfig.from_pretrained(folder).vocab_size


def capped_model_len(folder: Path, wanted: int) -> int:
    """``wanted`` tokens, or the checkpoint's longest sequence (``ModelConfig.max_seq_len``) when that is shorter
    (the bench's max_model_len: short enough to keep the decode graphs' tables narrow)."""
    from fnvllm.model.config import ModelConfig

    return min(wanted, ModelConfig.from_pretrained(folder).max_seq_len)


@contextlib.contextmanager
def checkpoint_folder(
    model: str | Path | None, model_shape: str, announce: bool, dummy: bool = False
) -> Iterator[Path]:
    """``model`` as a Path, or a random ``model_shape`` checkpoint in a temporary folder removed on exit
    (``dummy``: its config alone; the engine fills the weights)."""
    if model:
        yield Path(model)
        return
    with tempfile.TemporaryDirectory(prefix="fnvllm-bench-") as tmp:
        if announce and dummy:
            default = " (the default for this shape)" if model_shape in DUMMY_BY_DEFAULT else ""
            print(f"bench: {model_shape} with dummy weights{default}: only its config.json is written, to {tmp}; "
                  "random weights are filled on the device (--load-format auto writes a checkpoint)",
                  file=sys.stderr)  # fmt: skip
        elif announce:
            print(f"bench: writing a random {model_shape} checkpoint to {tmp} (deleted afterwards)", file=sys.stderr)
        yield write_checkpoint(model_shape, Path(tmp), config_only=dummy)


def _run(
    folder: Path,
    name: str,
    workload: tuple[list[list[int]], list[SamplingParams]],
    ceilings: tuple[float | None, float | None],
    use_tqdm: bool,
    progress_every_s: float | None,
    engine_options: dict[str, Any],
) -> dict[str, Any]:
    """``run_bench`` on a checkpoint folder."""
    from fnvllm.llm import LLM

    prompts, params = workload
    llm = LLM(folder, load_tokenizer=False, **engine_options)
    warm = prompts[:WARMUP_REQUESTS]
    llm.generate(warm, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=8)] * len(warm), use_tqdm=False)
    start_stats, start_overlap = llm.stats, llm.loop.overlap_stats
    if llm.executor.timeline is not None:
        llm.executor.timeline.records.clear()
    total = sum(p.max_tokens for p in params)
    with Progress(llm, total, progress_every_s) if progress_every_s is not None else contextlib.nullcontext():
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    on_gpu = llm.executor.device.type == "cuda"
    result: dict[str, Any] = {
        "model": name,
        "device": str(llm.executor.device),
        "backend": llm.executor.backend.name,
        "cuda_graphs": llm.executor.graphs is not None,
        "num_blocks": llm.executor.num_blocks,
        "kv_cache_dtype": llm.config.kv_cache_dtype,
        "kv_layout": llm.executor.kv_layout,
        "requests": len(prompts),
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 1),
    }
    rates = _engine_ceilings(llm, *ceilings, engine_options) if on_gpu else None
    if rates is not None:  # the floor is a GPU roofline: meaningless for a CPU run
        kv_bytes = _kv_element_bytes(llm)
        lens = [len(p) for p in prompts], [p.max_tokens for p in params]
        floor = floor_seconds(llm.model_config, *lens, rates.read_tb_s, kv_dtype_bytes=kv_bytes)
        roof = roofline_seconds(llm.model_config, *lens, rates.read_tb_s, rates.peak_tflops, kv_dtype_bytes=kv_bytes)
        result.update(floor_tok_per_s=round(tokens / floor, 1), fraction_of_floor=round(floor / seconds, 3))
        result.update(roofline_tok_per_s=round(tokens / roof, 1), fraction_of_roofline=round(roof / seconds, 3))
        result["ceilings"] = attrs.asdict(rates)
    result.update(
        steps=llm.stats.num_steps - start_stats.num_steps,
        preemptions=llm.stats.num_preemptions - start_stats.num_preemptions,
        overlap=llm.loop.overlap,
        speculative_steps_kept=llm.loop.overlap_stats.kept - start_overlap.kept,
        speculative_steps_dropped=llm.loop.overlap_stats.dropped - start_overlap.dropped,
        timeline=_timeline_summary(llm.executor.timeline, on_gpu),
    )
    if rates is not None and llm.executor.timeline is not None:
        precision = llm.config.kv_cache_dtype, "fp8" if llm.model_config.quantization is not None else None
        result.update(_steps_roofline(folder, llm.executor.timeline.records, rates, seconds, tokens, *precision))
    return result


def _kv_element_bytes(llm: Any) -> int:
    """Bytes of one K/V element in the engine's cache: 1 for FP8, else 2 (bf16, as weight_bytes assumes)."""
    return 1 if llm.config.kv_cache_dtype == "fp8" else 2


def _steps_roofline(
    folder: Path,
    records: Sequence[Mapping[str, Any]],
    ceilings: Ceilings,
    seconds: float,
    tokens: int,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
) -> dict[str, Any]:
    """The roofline of the steps the engine actually ran (the timeline's step shapes): each step at
    max(bytes, FLOPs) per layer part (``fnvllm.sim.CostModel.roofline_s``, ceilings only, no fitted overheads),
    the model as the simulator reads its config.json (experts, sliding windows, Gemma 3's text_config) at the
    engine's precision (``kv_cache_dtype``, ``quantization``). Where the workload roofline assumes perfect mixing,
    this one is the engine's own schedule at full speed: a compute-bound prefill step counts at the matmul peak."""
    import json

    from fnvllm.sim.cost import CostModel
    from fnvllm.sim.hardware import H200
    from fnvllm.sim.model import ModelShape
    from fnvllm.sim.timeline import record_shape

    config = json.loads((folder / "config.json").read_text())
    hardware = attrs.evolve(H200, mem_bandwidth_gbs=ceilings.read_tb_s * 1e3, matmul_tflops=ceilings.peak_tflops)
    model = ModelShape.from_config(config).with_precision(kv_cache_dtype, quantization)
    cost = CostModel(model, hardware)
    roof = sum(cost.roofline_s(record_shape(r)) for r in records)
    if roof <= 0:
        return {}
    return {"steps_roofline_tok_per_s": round(tokens / roof, 1), "fraction_of_steps_roofline": round(roof / seconds, 3)}


def _timeline_summary(timeline: Any, on_gpu: bool) -> dict[str, Any] | None:
    """The timeline's summary; on a CPU its "gpu" times are step wall times, and are named so."""
    if timeline is None:
        return None
    summary: dict[str, Any] = timeline.summary()
    if on_gpu:
        return summary
    renamed = {"mean_gpu_ms": "mean_step_ms", "total_gpu_s": "total_step_s"}
    return {
        kind: {renamed.get(k, k): v for k, v in part.items()} if isinstance(part, dict) else part
        for kind, part in summary.items()
    }


# ---- latency mode ---------------------------------------------------------------------------------------------

LATENCY_BATCHES = (1, 16, 64)
LATENCY_PROMPT_LENS = (100, 128)  # prompt lengths are drawn from this range
LATENCY_OUTPUT_TOKENS = 256


def latency_workload(
    num_requests: int, sampling: Mapping[str, Any] | None = None, output_tokens: int = LATENCY_OUTPUT_TOKENS
) -> tuple[list[list[int]], list[Any]]:
    """``num_requests`` prompts of LATENCY_PROMPT_LENS random ids (seeded by the count), each generating exactly
    ``output_tokens`` tokens at temperature 0.6 (EOS ignored), plus ``sampling``'s fields."""
    import random

    rng = random.Random(num_requests)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(*LATENCY_PROMPT_LENS))] for _ in range(num_requests)]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=output_tokens)
    return prompts, [attrs.evolve(params, **(sampling or {}))] * num_requests


def latency_floor_ms(
    config: Any, prompt_lens: Sequence[int], output_tokens: int, read_tb_s: float, kv_dtype_bytes: int = 2
) -> float:
    """The bandwidth floor of one step of a latency run, in ms: the run's ``floor_seconds`` (each of its
    ``output_tokens`` steps reads the weights once and every sequence's K/V so far) over its steps."""
    lens = [output_tokens] * len(prompt_lens)
    return 1e3 * floor_seconds(config, prompt_lens, lens, read_tb_s, kv_dtype_bytes) / output_tokens


def _percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_latency(
    model: str | Path | None,
    model_shape: str,
    batches: Sequence[int] = LATENCY_BATCHES,
    sampling: Mapping[str, Any] | None = None,
    announce: bool = False,
    output_tokens: int = LATENCY_OUTPUT_TOKENS,
    read_tb_s: float | None = None,
    **engine_options: Any,
) -> dict[str, Any]:
    """Decode latency at small batches, warm: for each N in ``batches``, N concurrent requests
    (``latency_workload``) run once untimed, then timed. Per N: milliseconds per decode step (the timed run's wall
    time over its ``output_tokens`` steps, prefill included), TPOT and TTFT p50 / p99 over the requests, and
    the timeline's decode-step summary (device and host ms per step) when FNVLLM_TIMELINE is set. On a GPU also
    the step's bandwidth floor at ``read_tb_s`` (``latency_floor_ms``: weights and K/V, the bytes that grow with
    N) and ms per step's fraction of it; ``read_tb_s`` is one GPU's read ceiling (None: the measured one of the GPU
    it runs on, ``device_ceilings``), recorded in the result as "ceilings"."""
    from fnvllm.llm import LLM

    if not batches or min(batches) < 1:
        raise ValueError(f"latency batches must be >= 1 requests each, got {tuple(batches)}")
    if output_tokens < 2:
        raise ValueError(f"output_tokens must be >= 2 (TPOT needs two tokens), got {output_tokens}")
    check_ceilings(read_tb_s, None)
    dummy = engine_options.get("load_format") == "dummy"
    with checkpoint_folder(model, model_shape, announce=announce, dummy=dummy) as folder:
        if engine_options.get("max_model_len") is None:  # prompts + outputs stay under 400 tokens
            engine_options["max_model_len"] = capped_model_len(folder, 4096)
        llm = LLM(folder, load_tokenizer=False, **engine_options)
        on_gpu = llm.executor.device.type == "cuda"
        rates = _engine_ceilings(llm, read_tb_s, None, engine_options) if on_gpu else None
        rows = []
        for num_requests in batches:
            prompts, params = latency_workload(num_requests, sampling, output_tokens)
            prompts = within_vocab(prompts, llm.engine.config.vocab_size)
            llm.generate(prompts, params, use_tqdm=False)  # warm: graphs, compiles, the allocator's pools
            if llm.executor.timeline is not None:
                llm.executor.timeline.records.clear()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tpots = [o.metrics.tpot(len(o.token_ids)) for o in outputs if o.metrics is not None]
            ttfts = [o.metrics.ttft for o in outputs if o.metrics is not None]
            tpot_ms = [1e3 * t for t in tpots if t is not None]
            ttft_ms = [1e3 * t for t in ttfts if t is not None]
            summary = _timeline_summary(llm.executor.timeline, on_gpu)
            row: dict[str, Any] = {
                "requests": num_requests,
                "ms_per_step": round(1e3 * seconds / output_tokens, 3),
                "tpot_p50_ms": round(_percentile(tpot_ms, 0.5), 3),
                "tpot_p99_ms": round(_percentile(tpot_ms, 0.99), 3),
                "ttft_p50_ms": round(_percentile(ttft_ms, 0.5), 3),
                "ttft_p99_ms": round(_percentile(ttft_ms, 0.99), 3),
                "decode_timeline": None if summary is None else summary.get("decode"),
            }
            if rates is not None:  # a GPU roofline, as the throughput mode's floor
                lens = [len(p) for p in prompts]
                kv_bytes = _kv_element_bytes(llm)
                floor_ms = latency_floor_ms(llm.model_config, lens, output_tokens, rates.read_tb_s, kv_bytes)
                row.update(
                    floor_ms_per_step=round(floor_ms, 3), fraction_of_floor=round(floor_ms / row["ms_per_step"], 3)
                )
            rows.append(row)
        result = {
            "model": str(model) if model else model_shape,
            "device": str(llm.executor.device),
            "overlap": llm.loop.overlap,
            "cuda_graphs": llm.executor.graphs is not None,
            "latency": rows,
        }
        if rates is not None:
            result["ceilings"] = attrs.asdict(rates)
        llm.close()
    return {**result, "sampling": dict(sampling)} if sampling else result
