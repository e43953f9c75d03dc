"""SimSpec: one simulation described by plain values (CLI flags, a sweep grid point, a JSON object).

``run_spec(spec)`` builds the workload, the model shape, the hardware profile, the core config and the executor
from it, simulates, and returns the result with its metric summary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import attrs

from fnvllm.sim.checks import (
    MAX_MODEL_LEN,
    MAX_NUM_BLOCKS,
    MAX_REQUESTS,
    SimInputError,
    check_bool_field,
    check_count,
    check_mapping,
    check_optional_count,
    check_rate,
    check_real_in,
    check_text,
)
from fnvllm.sim.cost import CostModel
from fnvllm.sim.executor import FillerTokens, SimExecutor
from fnvllm.sim.hardware import HardwareProfile, load_profile
from fnvllm.sim.loop import SimResult, StepHook, simulate
from fnvllm.sim.metrics import summarize
from fnvllm.sim.model import ModelShape, check_precision, load_shape
from fnvllm.sim.policies import get_policy
from fnvllm.sim.timeline import TimelineWriter
from fnvllm.sim.workloads import (
    SimRequest,
    bench_requests,
    poisson_requests,
    read_trace,
    shared_prefix_requests,
)
from fnvllm.state import CoreConfig, EngineState, StepOutput, StepPlan
from fnvllm.state.config import MAX_NUM_SEQS, MAX_SIZE
from fnvllm.state.request import kv_blocks_needed

_GIB = 1 << 30
_EOS_ID, _FILLER_ID = 0, 3
WORKLOADS = ("bench", "poisson", "shared-prefix")


@attrs.frozen(kw_only=True)
class SimSpec:
    """Everything one simulation needs.

    workload: "bench", "poisson", "shared-prefix", or the path of a JSONL trace. num_requests: None = 256 for
    bench, 1000 otherwise. rate: Poisson arrivals per second (inf = all at t=0). prompt_mean / output_mean /
    len_sigma: log-normal lengths (for shared-prefix, prompt_mean is the suffix after the shared prefix).
    num_prefixes / prefix_len: the shared system prompts (also the trace's default prefix_len). num_priorities:
    priorities drawn in [0, n). seed: workload and EOS draws. eos_prob: chance each token is an EOS (0: every
    request generates exactly output_len tokens).
    model / hardware: a named shape or config.json (None: the profile's model, else qwen3-0.6b); a profile name or
    JSON file. policy: see POLICIES.
    The rest are the engine's scheduling options; num_blocks None = sized from the profile's memory. overlap: the
    engine overlaps host work with the device (its default on CUDA; priced by the profile's host model). serve:
    the requests are served by ``fnvllm serve``: steps are priced by the profile's ``serving`` overheads and each
    request's tokens reach its client the profile's ``serving.latency_us`` (+ ``latency_stream_us`` per request in
    flight when it arrived) later (a profile without a serving section prices serving like ``LLM.generate``).
    kv_cache_dtype / quantization: the engine's options of those names ("auto" | "fp8"; None | "fp8"): an FP8
    cache holds twice the tokens in the same memory and is read at one byte an element, FP8 linears stream one
    byte a weight (``ModelShape.with_precision``; a model whose config.json is an FP8 checkpoint's is FP8 already).
    """

    workload: str = "poisson"
    num_requests: int | None = None
    rate: float = 20.0
    prompt_mean: float = 512
    output_mean: float = 256
    len_sigma: float = 0.8
    num_prefixes: int = 8
    prefix_len: int = 1024
    num_priorities: int = 1
    seed: int = 0
    eos_prob: float = 0.0
    model: str | None = None
    hardware: str = "h200"
    policy: str = "fcfs"
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    overlap: bool = True
    serve: bool = False
    kv_cache_dtype: str = "auto"
    quantization: str | None = None

    def __attrs_post_init__(self) -> None:
        check_spec(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SimSpec:
        """From plain values; unknown names are an error listing the known ones."""
        check_mapping(values, "simulation options")
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown simulation option(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain values."""
        return attrs.asdict(self)


_INTS: dict[str, tuple[int, int]] = {
    "num_prefixes": (1, 1_000_000),
    "prefix_len": (1, MAX_MODEL_LEN),
    "num_priorities": (1, 1_000_000),
    "seed": (0, (1 << 63) - 1),
    "block_size": (1, MAX_MODEL_LEN),
    "max_num_batched_tokens": (1, MAX_SIZE),
    "max_num_seqs": (1, MAX_NUM_SEQS),
}
_OPTIONAL_INTS: dict[str, tuple[int, int]] = {
    "num_requests": (1, MAX_REQUESTS),
    "num_blocks": (1, MAX_NUM_BLOCKS),
    "max_model_len": (1, MAX_MODEL_LEN),
}
_REALS: dict[str, tuple[float, float, bool]] = {  # (low, high, low end open)
    "prompt_mean": (1.0, MAX_MODEL_LEN, False),
    "output_mean": (1.0, MAX_MODEL_LEN, False),
    "len_sigma": (0.0, 10.0, False),
    "gpu_memory_utilization": (0.0, 1.0, True),
}


def check_spec(spec: SimSpec) -> None:
    """SimInputError naming the first option of ``spec`` that is of the wrong type or out of its range. Sizes
    are bounded here, before any workload or pool is built."""
    for name in ("workload", "hardware", "policy"):
        check_text(getattr(spec, name), name)
    if spec.model is not None:
        check_text(spec.model, "model")
    for name, (low, high) in _INTS.items():
        check_count(getattr(spec, name), name, low, high)
    for name, (low, high) in _OPTIONAL_INTS.items():
        check_optional_count(getattr(spec, name), name, low, high)
    for name, (real_low, real_high, low_open) in _REALS.items():
        check_real_in(getattr(spec, name), name, real_low, real_high, low_open=low_open)
    check_rate(spec.rate, "rate", 1e12)
    check_real_in(spec.eos_prob, "eos_prob", 0.0, 1.0)
    if spec.eos_prob == 1.0:
        raise SimInputError("eos_prob must be a number in [0, 1), got 1.0")
    check_bool_field(spec.enable_prefix_caching, "enable_prefix_caching")
    check_bool_field(spec.overlap, "overlap")
    check_bool_field(spec.serve, "serve")
    check_precision(spec.kv_cache_dtype, spec.quantization)


def build_requests(spec: SimSpec, max_len: int) -> list[SimRequest]:
    """The spec's workload (lengths capped so prompt + output <= max_len)."""
    n = spec.num_requests
    if spec.workload == "bench":
        return bench_requests(n or 256, seed=spec.seed)
    lengths = (spec.prompt_mean, spec.output_mean, spec.len_sigma, spec.seed, max_len)
    if spec.workload == "poisson":
        return poisson_requests(n or 1000, spec.rate, *lengths, num_priorities=spec.num_priorities)
    if spec.workload == "shared-prefix":
        return shared_prefix_requests(n or 1000, spec.rate, spec.num_prefixes, spec.prefix_len, *lengths)
    if not spec.workload.endswith(".jsonl"):
        raise ValueError(f"workload must be one of {list(WORKLOADS)} or a .jsonl trace, got {spec.workload!r}")
    requests = read_trace(spec.workload, spec.prefix_len, max_len=max_len)
    return requests[:n] if n else requests


DEFAULT_MODEL = "qwen3-0.6b"


def resolve_model(model: str | None, hardware: HardwareProfile) -> ModelShape:
    """``model`` (a named shape or config.json) when given, else the model ``hardware`` was calibrated with, else
    DEFAULT_MODEL."""
    if model is not None:
        return load_shape(model)
    if hardware.model is not None:
        return ModelShape.from_config(hardware.model, name=str(hardware.model.get("name", hardware.name + "-model")))
    return load_shape(DEFAULT_MODEL)


def kv_blocks_that_fit(model: ModelShape, hardware: HardwareProfile, spec: SimSpec) -> int:
    """KV blocks the engine would allocate: the memory the utilisation allows, minus weights, ~0.5 GiB of
    runtime context and an estimate of the activation peak that ``ModelExecutor`` measures with a profiling
    forward of the largest step before it sizes its cache (docs/design.md, "KV sizing")."""
    width = max(2 * model.intermediate, model.q_size + 2 * model.kv_size, 4 * model.hidden)
    activations = spec.max_num_batched_tokens * width * 16 + spec.max_num_seqs * model.vocab * 24 + _GIB
    used = model.weight_bytes + _GIB // 2
    budget = hardware.memory_gib * _GIB * spec.gpu_memory_utilization - used - activations
    per_block = model.kv_bytes_per_token * spec.block_size
    if budget < per_block:
        raise ValueError(f"{model.name} leaves no memory for the KV cache on {hardware.name}")
    return int(budget // per_block)


def core_config(spec: SimSpec, model: ModelShape, hardware: HardwareProfile) -> CoreConfig:
    """The pure core's settings for the spec."""
    num_blocks = spec.num_blocks if spec.num_blocks is not None else kv_blocks_that_fit(model, hardware, spec)
    if num_blocks > MAX_NUM_BLOCKS:
        raise SimInputError(
            f"{hardware.name}'s memory_gib ({hardware.memory_gib:g}) sizes a KV cache of {num_blocks} blocks of "
            f"{spec.block_size} tokens, above the most the simulator holds ({MAX_NUM_BLOCKS}); pass num_blocks"
        )
    return CoreConfig(
        block_size=spec.block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_num_seqs=spec.max_num_seqs,
        max_model_len=spec.max_model_len if spec.max_model_len is not None else min(model.max_len, MAX_MODEL_LEN),
        enable_prefix_caching=spec.enable_prefix_caching,
        eos_token_ids=(_EOS_ID,),
        vocab_size=model.vocab,
    )


def run_spec(
    spec: SimSpec,
    progress: Callable[[int], None] | None = None,
    timeline: IO[str] | None = None,
    on_requests: Callable[[int], None] | None = None,
) -> tuple[SimResult, dict[str, float]]:
    """Simulate ``spec``; returns the result and its metric summary. ``progress(n)`` hears of finished requests,
    ``timeline`` receives the predicted per-step log, ``on_requests`` the workload's size before the run."""
    hardware = load_profile(spec.hardware)
    model = resolve_model(spec.model, hardware).with_precision(spec.kv_cache_dtype, spec.quantization)
    config = core_config(spec, model, hardware)
    requests = build_requests(spec, config.max_model_len)
    check_pool_fits(requests, config)
    if on_requests is not None:
        on_requests(len(requests))
    tokens = FillerTokens(_FILLER_ID, _EOS_ID, spec.eos_prob, spec.seed)
    executor = SimExecutor(CostModel(model, hardware, spec.overlap, spec.serve), tokens)
    # the log says "overlapped" only when host time could hide (a profile without a host model charges gaps)
    overlapped = spec.overlap and (hardware.eager.has_host_model or hardware.graph.has_host_model)
    hook = _timeline_hook(timeline, executor, model, config, hardware.name, overlapped) if timeline else None
    result = simulate(
        requests,
        config,
        executor,
        get_policy(spec.policy),
        ignore_eos=spec.eos_prob == 0,
        on_step=hook,
        progress=progress,
    )
    serving = hardware.serving
    if spec.serve and serving is not None and (serving.latency_us or serving.latency_stream_us):
        result.recorder.delay_delivery(serving.latency_us * 1e-6, serving.latency_stream_us * 1e-6)
    return result, summarize(result.recorder, result.end_s)


def check_pool_fits(requests: Sequence[SimRequest], config: CoreConfig) -> None:
    """SimInputError naming ``--num-blocks`` when a request of the workload needs more KV blocks than the pool has,
    before anything is simulated (the engine would refuse it when it arrives, mid-run)."""
    bs = config.block_size
    for request in requests:
        blocks = kv_blocks_needed(bs, request.prompt_len, request.output_len)
        if blocks > config.num_blocks:
            raise SimInputError(
                f"a request of {request.prompt_len} prompt + {request.output_len} output tokens (arriving at "
                f"{request.arrival_s:g} s) needs {blocks} KV blocks of {bs} tokens; the pool has {config.num_blocks} "
                "(--num-blocks)"
            )


def _timeline_hook(
    stream: IO[str], executor: SimExecutor, model: ModelShape, config: CoreConfig, device: str, overlap: bool
) -> StepHook:
    """An on_step hook writing the predicted timeline (header first)."""
    writer = TimelineWriter(stream)
    writer.header(model.to_config(), config.block_size, f"simulated {device}", overlap)

    def hook(state: EngineState, plan: StepPlan, output: StepOutput) -> None:
        ex = executor
        if ex.last_shape is not None and not plan.is_empty:
            times = (ex.last_device_s, ex.last_gap_s, ex.last_host_s)
            writer.step(plan.step, ex.last_shape, *times, ex.last_new_seqs, overlap and ex.last_plain)

    return hook
