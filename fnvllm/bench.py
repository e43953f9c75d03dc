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
(``quantization="fp8"``) one byte a weight plus their block scales. A mixture of experts reads, per sparse layer
and decode step, the experts its running sequences touch (``moe.expected_experts_touched``: all 128 of
Qwen3-30B-A3B at 256 sequences, ~61 GB a step; fewer as the batch drains).

The roofline adds compute to the floor (``roofline_seconds``): decode step s (the sequences with more than s
outputs) costs at least max(its bytes / read ceiling, its FLOPs / peak), and the prompts' FLOPs fit only into the
compute the bytes-bound steps leave idle, the rest adding to the time. On the bench workload every decode step is
bytes-bound (Qwen3-0.6B at 256 sequences: ~0.34 TFLOP against ~19 GB of weights and KV) and the prompts fit in
the idle compute, so the roofline equals the floor; a prefill-heavy workload (long prompts, short outputs) is
compute-bound and its roofline exceeds it. ``fnvllm bench --profile`` also reports the roofline of the steps the
engine actually ran (each step at max(bytes, FLOPs) per layer part, ``fnvllm.sim.CostModel.roofline_s``): there
the Qwen3-8B shape's prefill steps count at the matmul peak, which the bytes-only floor leaves out.

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
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from fnvllm.state import SamplingParams
from fnvllm.workloads import bench_workload, within_vocab

H200_READ_TB_S = 4.16  # measured on the lent H200 (sum over a 2 GiB bf16 tensor)
H200_PEAK_TFLOPS = 793.0  # measured on the lent H200: a bf16 8192^3 matmul (FP8 weights: twice, the tensor-core rate)
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


def weight_bytes(config: Any, dtype_bytes: int = 2, num_seqs: int | None = None) -> int:
    """Bytes of weights one decode step reads: every layer, the final norm and the LM head (not the embedding
    table, of which only the batch's rows are read — unless tied, when the LM head reads all of it). A sparse
    layer reads its router and the experts ``num_seqs`` sequences touch on average (None: all of them)."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    attention = h * (q + 2 * kv) + q * h + 2 * h
    layers = sum(attention + _mlp_weights(config, i, num_seqs) for i in range(config.num_hidden_layers))
    total = int(layers + config.vocab_size * h + h) * dtype_bytes
    if getattr(config, "quantization", None) is None:
        return total
    # FP8 weights (dense models only): the decoder linears are 1 byte each plus a float32 scale per 128 x 128 block
    shapes = ((q + 2 * kv, h), (h, q), (2 * config.intermediate_size, h), (h, config.intermediate_size))
    linears = sum(n * k for n, k in shapes)
    scales = sum(math.ceil(n / 128) * math.ceil(k / 128) for n, k in shapes)
    return total - config.num_hidden_layers * (linears * (dtype_bytes - 1) - 4 * scales)


def _mlp_weights(config: Any, layer: int, num_seqs: int | None) -> float:
    """Weights of layer ``layer``'s MLP a decode step of ``num_seqs`` sequences reads (see weight_bytes)."""
    from fnvllm.model.moe import expected_experts_touched

    moe, h = getattr(config, "moe", None), config.hidden_size
    if moe is None or not moe.is_sparse(layer):
        return float(3 * h * config.intermediate_size)
    e, k = moe.num_experts, moe.num_experts_per_tok
    touched = e if num_seqs is None else expected_experts_touched(e, k, num_seqs)
    return float(h * e + touched * 3 * h * moe.moe_intermediate_size + _shared_expert_weights(moe, h))


def _shared_expert_weights(moe: Any, hidden: int) -> int:
    """Weights of a sparse layer's shared expert (Qwen2-MoE: a dense SwiGLU MLP and its hidden -> 1 gate, which
    every token goes through), 0 without one."""
    width = getattr(moe, "shared_expert_intermediate_size", None)
    return 0 if width is None else 3 * hidden * width + hidden


def kv_bytes_per_token(config: Any, dtype_bytes: int = 2) -> int:
    """Bytes of K and V of one token over all layers."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes


def floor_seconds(
    config: Any, prompt_lens: Sequence[int], output_lens: Sequence[int], read_tb_s: float, kv_dtype_bytes: int = 2
) -> float:
    """The workload's bandwidth floor in seconds (see the module docstring); KV elements of ``kv_dtype_bytes``."""
    kv_tokens = sum(p * o + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens, strict=True))
    if getattr(config, "moe", None) is None:
        weights = max(output_lens) * weight_bytes(config)
    else:  # decode step s runs the sequences with more than s outputs; the experts they touch shrink with them
        weights = sum(weight_bytes(config, num_seqs=sum(o > s for o in output_lens)) for s in range(max(output_lens)))
    total = kv_tokens * kv_bytes_per_token(config, kv_dtype_bytes) + weights
    return total / (read_tb_s * 1e12)


def flops_per_token(config: Any) -> int:
    """FLOPs of one token through the linear layers and the LM head (2 a weight it multiplies; a sparse layer
    counts its router, its top-k experts and its shared expert, if any), attention's score and value products not
    included."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    moe = getattr(config, "moe", None)
    per_layer = [h * (q + 2 * kv) + q * h for _ in range(config.num_hidden_layers)]
    for i in range(config.num_hidden_layers):
        if moe is None or not moe.is_sparse(i):
            per_layer[i] += 3 * h * config.intermediate_size
        else:
            per_layer[i] += h * moe.num_experts + moe.num_experts_per_tok * 3 * h * moe.moe_intermediate_size
            per_layer[i] += _shared_expert_weights(moe, h)
    return 2 * (sum(per_layer) + config.vocab_size * h)


def attention_flops(config: Any, context: int) -> int:
    """FLOPs of one query token's attention over ``context`` tokens, all layers (scores and values: 4 a head
    dimension a key)."""
    return 4 * config.num_hidden_layers * config.q_size * context


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
    sequences with more than s outputs, each reading the KV of its prompt and s outputs (as ``floor_seconds``)."""
    bandwidth, peak = read_tb_s * 1e12, peak_tflops * 1e12
    per_token, kv_token = flops_per_token(config), kv_bytes_per_token(config, kv_dtype_bytes)
    dense = getattr(config, "moe", None) is None
    weights_all = weight_bytes(config) if dense else 0
    total, slack = 0.0, 0.0
    pairs = sorted(zip(output_lens, prompt_lens, strict=True), reverse=True)
    for s in range(max(output_lens, default=0)):
        running = [p for o, p in pairs if o > s]
        context = sum(running) + s * len(running)
        weights = weights_all if dense else weight_bytes(config, num_seqs=len(running))
        read = (weights + context * kv_token) / bandwidth
        compute = (len(running) * per_token + attention_flops(config, context)) / peak
        total += max(read, compute)
        slack += max(read - compute, 0.0)
    prompts = sum(p * per_token + attention_flops(config, p * (p + 1) // 2) for p in prompt_lens) / peak
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
    (bf16; FP8 weights double the peak); None: the measured ones of the GPU it runs on (``device_ceilings``),
    recorded in the result as "ceilings". ``progress_every_s``: print a plain progress line that often (None: none).
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
        peak_tflops = rates.peak_tflops
        if getattr(llm.model_config, "quantization", None) is not None:
            peak_tflops *= 2  # FP8 tensor cores
        floor = floor_seconds(llm.model_config, *lens, rates.read_tb_s, kv_dtype_bytes=kv_bytes)
        roof = roofline_seconds(llm.model_config, *lens, rates.read_tb_s, peak_tflops, kv_dtype_bytes=kv_bytes)
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
        result.update(_steps_roofline(folder, llm.executor.timeline.records, rates, seconds, tokens))
    return result


def _kv_element_bytes(llm: Any) -> int:
    """Bytes of one K/V element in the engine's cache: 1 for FP8, else 2 (bf16, as weight_bytes assumes)."""
    return 1 if llm.config.kv_cache_dtype == "fp8" else 2


def _steps_roofline(
    folder: Path, records: Sequence[Mapping[str, Any]], ceilings: Ceilings, seconds: float, tokens: int
) -> dict[str, Any]:
    """The roofline of the steps the engine actually ran (the timeline's step shapes): each step at
    max(bytes, FLOPs) per layer part (``fnvllm.sim.CostModel.roofline_s``, ceilings only, no fitted overheads).
    Where the workload roofline assumes perfect mixing, this one is the engine's own schedule at full speed: a
    compute-bound prefill step counts at the matmul peak. Empty for a mixture of experts (the simulator's model
    is dense)."""
    import json

    from fnvllm.sim.cost import CostModel
    from fnvllm.sim.hardware import H200
    from fnvllm.sim.model import ModelShape
    from fnvllm.sim.timeline import record_shape

    config = json.loads((folder / "config.json").read_text())
    if "num_experts" in config:
        return {}
    hardware = attrs.evolve(H200, mem_bandwidth_gbs=ceilings.read_tb_s * 1e3, matmul_tflops=ceilings.peak_tflops)
    cost = CostModel(ModelShape.from_config(config), hardware)
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
