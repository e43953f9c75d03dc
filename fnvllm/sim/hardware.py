"""Hardware profiles: the roofline ceilings of one accelerator plus the fitted overheads of our engine on it.

A profile is a JSON file (``fnvllm simulate calibrate`` writes one; ``--hardware PATH`` reads it) or a built-in
name. The ceilings come from microbenchmarks (for the H200: the read bandwidth a memory-bound kernel reaches and
the bf16 dense matmul rate, both measured on one H200); the overheads are what the roofline misses (kernel
launches, the sampler, host gaps), fitted per kind of step: "graph" steps (decode-only batches replayed from CUDA
graphs) and "eager" steps (everything else).

Worked example: an eager step whose matmul roofline is 1.5 ms and attention roofline 0.5 ms, with 64 sequences
and 900 tokens, under ``Overheads(scale=1.1, attn_scale=1.6, step_us=300, seq_us=2, token_us=0.1, gap_us=50,
gap_seq_us=0.5)`` takes 1.1 * 1500 + 1.6 * 500 + 300 + 64 * 2 + 900 * 0.1 = 2968 us on the device, then
50 + 64 * 0.5 = 82 us of host gap.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from fnvllm.sim.checks import (
    SimInputError,
    check_bool_field,
    check_count,
    check_mapping,
    check_positive,
    check_real_in,
    check_text,
)

MAX_US = 1e9  # an overhead of more than ~17 minutes per step is a typo
MAX_SCALE = 1e6
MAX_BANDWIDTH_GBS = 1e7  # GB/s, TFLOP/s and GiB: far above any device, finite
MAX_TFLOPS = 1e7
MAX_MEMORY_GIB = 1e7
MAX_GRAPH_SEQS = 1 << 20
MAX_GRAPH_TOKENS = 1 << 24
SMALL_BATCHES = (1, 2, 4, 8)  # the smallest decode graphs the engine captures: each has its own constant (small_us)


def _as_tuple(value: Any) -> Any:
    """A list read from JSON as a tuple (anything else unchanged, for the check to name)."""
    return tuple(value) if isinstance(value, list) else value


@attrs.frozen
class Overheads:
    """What the roofline misses, for one kind of step (times in microseconds, all >= 0).

    Device time = scale * matmul roofline + attn_scale * attention roofline + step_us + seq_us * seqs +
    token_us * tokens + log_seq_us * log2(seqs). A scale of 1.25 means the kernels reach 80% of the ceilings. The
    log term is the small-batch step: going from one row to a few costs more per row than going from 64 to 128
    (kernels that run one row in one block run several in as many, and the sampler's per-row passes). A decode
    graph step counts the rows of the graph it replays (its padding rows compute too: 5 rows run the 8-row graph),
    and those of 1, 2, 4 and 8 rows (SMALL_BATCHES: each with kernels of its own, e.g. a matrix-vector product at
    one row) take small_us[i] instead of step_us + log_seq_us * log2(rows) when small_us has an i-th value.

    Host time of one loop cycle (schedule, commit, output routing, input preparation, kernel launches: the
    timeline's ``cpu_ms``) = host_us + host_seq_us * seqs + host_new_seq_us * new seqs (rows admitted this step,
    whose data crosses to the device once) + host_token_us * tokens + host_sample_us * sampled rows +
    host_context_us * context tokens (the KV the rows read: their block tables grow with it).

    Plain-loop gap (the host time the device waits for between steps when the loop does not overlap: the part of
    the cycle before the launch; the launch itself overlaps the device) = gap_us + gap_seq_us * seqs +
    gap_new_seq_us * new seqs + gap_token_us * tokens + gap_context_us * context tokens. The calibration fits the
    two context terms only when asked (``fit_profile``'s ``context_terms``); the built-in h200 has them at 0.

    Launch: host time to launch the step's kernels, which the device waits for = launch_us + launch_seq_us * seqs
    + launch_token_us * tokens. An eager step launches kernel by kernel (~20 ms on the H200 for the 0.6B shape), so
    its device time is max(the above, this); a graph replay is one call (its launch is in the host cycle: 0 here).
    In a served loop the previous step's tokens also wait for it on the host (``Serving``).

    A step's wall time: max(device, host) with overlapped steps (host work hides behind the device, or the device
    waits for it); device + gap without. A profile without a host model (every host_* 0, as in profiles written
    before it existed) charges device + gap either way.
    """

    scale: float = 1.0
    attn_scale: float = 1.0
    step_us: float = 0.0
    seq_us: float = 0.0
    token_us: float = 0.0
    log_seq_us: float = 0.0
    gap_us: float = 0.0
    gap_seq_us: float = 0.0
    gap_new_seq_us: float = 0.0
    gap_token_us: float = 0.0
    host_us: float = 0.0
    host_seq_us: float = 0.0
    host_new_seq_us: float = 0.0
    host_token_us: float = 0.0
    host_sample_us: float = 0.0
    host_context_us: float = 0.0
    gap_context_us: float = 0.0
    launch_us: float = 0.0
    launch_seq_us: float = 0.0
    launch_token_us: float = 0.0
    small_us: tuple[float, ...] = attrs.field(default=(), converter=_as_tuple)

    @property
    def has_host_model(self) -> bool:
        """True when any host-time coefficient is set (the overlap rule applies)."""
        host = (self.host_us, self.host_seq_us, self.host_new_seq_us, self.host_token_us, self.host_sample_us)
        return any((*host, self.host_context_us))

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(type(self)):
            if field.name == "small_us":
                continue
            high = MAX_SCALE if field.name.endswith("scale") else MAX_US
            check_real_in(getattr(self, field.name), f"Overheads.{field.name}", 0.0, high)
        if not isinstance(self.small_us, tuple) or len(self.small_us) > len(SMALL_BATCHES):
            raise SimInputError(
                f"Overheads.small_us must be a list of at most {len(SMALL_BATCHES)} numbers (the step constants of "
                f"decode graphs of {', '.join(map(str, SMALL_BATCHES))} rows, in order), got {self.small_us!r}"
            )
        for batch, value in zip(SMALL_BATCHES, self.small_us, strict=False):
            check_real_in(value, f"Overheads.small_us (batch {batch})", 0.0, MAX_US)


@attrs.frozen
class Serving:
    """How steps run under ``fnvllm serve`` (``fnvllm simulate --serve``), fitted from a served run's timeline.

    The server's engine process runs the same loop as ``LLM.generate`` but pays more per step: each step's events
    are pickled to the web process, and eager (mixed prefill + decode) steps, which launch their kernels one by one,
    are host-bound there (on the H200, ~15-20 ms for a step of a few hundred tokens beside ~70 decodes, against
    ~10 ms offline). eager / graph: the overheads of each kind of step while serving (same meaning as the
    profile's). latency_us: the server's own time on every request outside the engine (HTTP, the pipe to and from
    the engine process, server-sent events, and the overlapped loop's one-step lag before a new request joins a
    plan), added to each request's first token and finish as the client sees them: TTFT and end-to-end latency
    grow by it, TPOT does not. latency_stream_us: more of that latency per request in flight when the request
    arrived (the web process and the client handle every stream's events in one event loop each: a new stream's
    first token waits behind the others'; measured on the H200, ~0.18 ms per stream on top of ~3.7 ms).
    calibrated_from: the served timeline it was fitted from. cycle: time the served loop
    cycle by cycle (``SimExecutor``'s served timing: an eager step's launch holds back the step before it, arrivals
    join the step launched after they come); False: step by step, max(device, host) per step as offline, with
    these overheads (the served check keeps whichever of the two predicts its run better).
    """

    eager: Overheads = Overheads()
    graph: Overheads = Overheads()
    latency_us: float = 0.0
    calibrated_from: str = ""
    cycle: bool = True
    latency_stream_us: float = 0.0

    def __attrs_post_init__(self) -> None:
        for kind in ("eager", "graph"):
            if not isinstance(getattr(self, kind), Overheads):
                raise SimInputError(f"Serving.{kind} must be Overheads")
        check_real_in(self.latency_us, "Serving.latency_us", 0.0, MAX_US)
        check_real_in(self.latency_stream_us, "Serving.latency_stream_us", 0.0, MAX_US)
        check_text(self.calibrated_from, "Serving.calibrated_from", non_empty=False)
        check_bool_field(self.cycle, "Serving.cycle")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Serving:
        """From ``attrs.asdict`` output; unknown keys and out-of-range values are a SimInputError naming the
        field."""
        check_mapping(data, "hardware profile serving")
        _check_keys(data, cls, "hardware profile serving")
        return cls(**{**data, **_overheads_of(data, "hardware profile serving")})


@attrs.frozen
class PrecisionOverheads:
    """The overheads of an engine run at another precision (``HardwareProfile.precisions``), fitted from a
    calibration run with those options (``benchmarks/sim_calibration.py --kv-cache-dtype fp8 ...``): the FP8 paths
    cost more than their bytes say (the 0.6B shape on an H100, with FP8 weights and cache, ran 64-request decode
    steps at 2.2 ms against 1.6 with FP8 KV alone: the activations' quantization launches), so their steps take
    their own fitted overheads. eager / graph: as the profile's. calibrated_from: the timeline they were fitted
    from."""

    eager: Overheads = Overheads()
    graph: Overheads = Overheads()
    calibrated_from: str = ""

    def __attrs_post_init__(self) -> None:
        for kind in ("eager", "graph"):
            if not isinstance(getattr(self, kind), Overheads):
                raise SimInputError(f"PrecisionOverheads.{kind} must be Overheads")
        check_text(self.calibrated_from, "PrecisionOverheads.calibrated_from", non_empty=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrecisionOverheads:
        """From ``attrs.asdict`` output; unknown keys and out-of-range values are a SimInputError naming the
        field."""
        check_mapping(data, "hardware profile precision")
        _check_keys(data, cls, "hardware profile precision")
        return cls(**{**data, **_overheads_of(data, "hardware profile precision")})


PRECISIONS = ("fp8_kv", "fp8_weights", "fp8_weights_kv")  # the keys of HardwareProfile.precisions


def precision_key(kv_cache_dtype: str, quantization: str | None) -> str | None:
    """The ``HardwareProfile.precisions`` key of an engine's options: "fp8_kv" (an FP8 cache), "fp8_weights" (FP8
    linears), "fp8_weights_kv" (both); None for the model's dtype throughout (the profile's own overheads)."""
    parts = (["weights"] if quantization == "fp8" else []) + (["kv"] if kv_cache_dtype == "fp8" else [])
    return "_".join(["fp8", *parts]) if parts else None


def _overheads_of(data: Mapping[str, Any], what: str) -> dict[str, Overheads]:
    """The ``eager`` / ``graph`` entries of ``data`` read as Overheads (SimInputError naming a bad field)."""
    out = {}
    for kind in ("eager", "graph"):
        if kind in data:
            overheads = check_mapping(data[kind], f"{what} {kind}")
            _check_keys(overheads, Overheads, f"{what} {kind}")
            out[kind] = Overheads(**overheads)
    return out


@attrs.frozen
class HardwareProfile:
    """One accelerator (or CPU) as the simulator sees it.

    name: label. mem_bandwidth_gbs: achievable read bandwidth, GB/s (1e9 bytes). matmul_tflops: dense matmul
    rate in the model's dtype. matmul_bandwidth_gbs: the bandwidth matmuls stream their weights at (None: the
    read bandwidth; on the H200 cuBLAS bf16 GEMMs of a few rows reach ~3,560 GB/s of the 4,160 a copy reaches).
    fp8_matmul_tflops: the dense e4m3 matmul rate that FP8 linears (``quantization="fp8"``) multiply at (None:
    twice matmul_tflops, the tensor cores' FP8 rate on Hopper).
    precisions: overheads fitted on runs at another precision (``PRECISIONS``: "fp8_kv", "fp8_weights",
    "fp8_weights_kv"; ``PrecisionOverheads``), used for a model of that precision; a precision without an entry
    takes ``eager`` / ``graph``, its rooflines priced in its own bytes.
    memory_gib: device memory (sizes the KV cache when num_blocks is not given).
    graph_max_seqs: decode-only steps with at most this many sequences count as CUDA-graph steps (0: never).
    graph_mixed_tokens: mixed steps (some row prefills) of at most this many tokens, and at most graph_max_seqs
    rows, count as CUDA-graph steps too (0: a mixed step always runs eagerly).
    eager / graph: the overheads of each kind of step. calibrated_from: the log a fit came from ("" if none).
    model: the model a fit was measured with, as config.json fields plus its ``name`` (None if none): the model
    ``fnvllm simulate`` uses with this profile unless told another. request_us: host time to take in one arriving
    request (validation, prefix hashing, bookkeeping: ~0.4 ms each when ``generate`` adds 256 at once), charged to
    the clock before the next step.
    """

    name: str
    mem_bandwidth_gbs: float
    matmul_tflops: float
    memory_gib: float
    graph_max_seqs: int = 512
    graph_mixed_tokens: int = 0
    eager: Overheads = Overheads()
    graph: Overheads = Overheads()
    calibrated_from: str = ""
    model: Mapping[str, Any] | None = attrs.field(default=None, eq=False)
    request_us: float = 0.0
    serving: Serving | None = None
    matmul_bandwidth_gbs: float | None = None
    fp8_matmul_tflops: float | None = None
    precisions: Mapping[str, PrecisionOverheads] = attrs.field(factory=dict, hash=False)

    def __attrs_post_init__(self) -> None:
        check_text(self.name, "HardwareProfile.name")
        check_positive(self.mem_bandwidth_gbs, "HardwareProfile.mem_bandwidth_gbs", MAX_BANDWIDTH_GBS)
        check_positive(self.matmul_tflops, "HardwareProfile.matmul_tflops", MAX_TFLOPS)
        check_positive(self.memory_gib, "HardwareProfile.memory_gib", MAX_MEMORY_GIB)
        check_count(self.graph_max_seqs, "HardwareProfile.graph_max_seqs", 0, MAX_GRAPH_SEQS)
        check_count(self.graph_mixed_tokens, "HardwareProfile.graph_mixed_tokens", 0, MAX_GRAPH_TOKENS)
        for kind in ("eager", "graph"):
            if not isinstance(getattr(self, kind), Overheads):
                raise SimInputError(f"HardwareProfile.{kind} must be Overheads")
        check_text(self.calibrated_from, "HardwareProfile.calibrated_from", non_empty=False)
        check_real_in(self.request_us, "HardwareProfile.request_us", 0.0, MAX_US)
        if self.matmul_bandwidth_gbs is not None:
            check_positive(self.matmul_bandwidth_gbs, "HardwareProfile.matmul_bandwidth_gbs", MAX_BANDWIDTH_GBS)
        if self.fp8_matmul_tflops is not None:
            check_positive(self.fp8_matmul_tflops, "HardwareProfile.fp8_matmul_tflops", MAX_TFLOPS)
        if self.serving is not None and not isinstance(self.serving, Serving):
            raise SimInputError("HardwareProfile.serving must be Serving or None")
        for key, value in check_mapping(self.precisions, "HardwareProfile.precisions").items():
            if key not in PRECISIONS:
                raise SimInputError(f"HardwareProfile.precisions key must be one of {list(PRECISIONS)}, got {key!r}")
            if not isinstance(value, PrecisionOverheads):
                raise SimInputError(f"HardwareProfile.precisions[{key!r}] must be PrecisionOverheads")
        if self.model is not None:
            from fnvllm.sim.model import ModelShape

            ModelShape.from_config(check_mapping(self.model, "HardwareProfile.model"))  # checks every dimension

    @property
    def bytes_per_s(self) -> float:
        """Memory bandwidth in bytes per second."""
        return self.mem_bandwidth_gbs * 1e9

    @property
    def matmul_bytes_per_s(self) -> float:
        """The bandwidth matmuls stream their weights at, bytes per second (``matmul_bandwidth_gbs``, else the
        memory bandwidth)."""
        gbs = self.mem_bandwidth_gbs if self.matmul_bandwidth_gbs is None else self.matmul_bandwidth_gbs
        return gbs * 1e9

    @property
    def flops_per_s(self) -> float:
        """Matmul rate in FLOP per second."""
        return self.matmul_tflops * 1e12

    @property
    def fp8_flops_per_s(self) -> float:
        """FP8 (e4m3) matmul rate in FLOP per second (``fp8_matmul_tflops``, else twice ``matmul_tflops``)."""
        tflops = 2 * self.matmul_tflops if self.fp8_matmul_tflops is None else self.fp8_matmul_tflops
        return tflops * 1e12

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``from_dict`` reads it back)."""
        data = attrs.asdict(self)
        if self.model is None:
            del data["model"]
        if self.serving is None:
            del data["serving"]
        if not self.precisions:
            del data["precisions"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HardwareProfile:
        """From ``to_dict``'s output; unknown or missing keys and out-of-range values are a SimInputError naming
        the field (fields added since a profile was written take their defaults)."""
        check_mapping(data, "hardware profile")
        _check_keys(data, cls, "hardware profile")
        values = {**data, **_overheads_of(data, "hardware profile")}
        if values.get("serving") is not None:
            values["serving"] = Serving.from_dict(values["serving"])
        if "precisions" in values:
            precisions = check_mapping(values["precisions"], "hardware profile precisions")
            values["precisions"] = {key: PrecisionOverheads.from_dict(v) for key, v in precisions.items()}
        return cls(**values)


# Fitted on 2026-12-04 by `benchmarks/sim_calibration.py --out RUN1 --refit --pool RUN2` from two H200 calibration
# runs of the 18 regimes (main 98d9544 and 2cb4bb7: the same engine; RUN2's host ran ~40 % slower, device within 2 %):
# qwen3-0.6b shape, block 256, budget 16384, max_num_seqs 512, CUDA graphs, overlapped and plain loops; the context
# terms not fitted. Error per regime on the first run / the second: decode-1 -0.1% / -2.6%, decode-1-plain +5.6% /
# -7.9%, decode-16 +2.0% / -0.4%, decode-16-plain +7.8% / -3.4%, decode-64 +4.1% / +2.3%, decode-64-plain +8.4% /
# -6.9%, decode-256 -0.9% / -6.9%, decode-256-plain +3.5% / -8.2%, prefill-16 +1.7% / -14.9%, prefill-16-plain
# +9.4% / -5.6%, prefill-64 +1.6% / -2.4%, prefill-64-plain -1.8% / -8.6%, prefill-512 +1.8% / -0.4%,
# prefill-512-plain +3.5% / -6.1%, long-128 -2.7% / -2.6%, long-128-plain -1.5% / -10.0%, bench +2.2% / -0.4%,
# bench-plain +2.9% / -0.9%. The serving section is kept from the 2026-12-02 fit (main e24beba, refit at c6d97a3; its
# served TTFT / TPOT errors are in BENCHMARKS.md): no served run was refit this time.
H200 = HardwareProfile(
    name="h200",
    mem_bandwidth_gbs=4160.0,
    matmul_tflops=793.0,
    memory_gib=139.8,
    graph_max_seqs=512,
    graph_mixed_tokens=2048,
    eager=Overheads(
        scale=1.0,
        attn_scale=2.886175174230784,
        step_us=1500.526380275504,
        seq_us=0.0,
        token_us=0.5170474923534623,
        log_seq_us=0.0,
        gap_us=0.0,
        gap_seq_us=0.0,
        gap_new_seq_us=0.0,
        gap_token_us=0.2761105866240062,
        host_us=829.4394185454863,
        host_seq_us=4.5561277172605426,
        host_new_seq_us=0.0,
        host_token_us=0.10989469929336422,
        host_sample_us=0.0,
        host_context_us=0.0,
        gap_context_us=0.0,
        launch_us=29300.28,
        launch_seq_us=0.0,
        launch_token_us=0.0,
        small_us=(),
    ),
    graph=Overheads(
        scale=1.0,
        attn_scale=1.0126922775595428,
        step_us=480.60359789223264,
        seq_us=0.0,
        token_us=0.0,
        log_seq_us=40.501446852319816,
        gap_us=398.8663838503449,
        gap_seq_us=2.822584360017122,
        gap_new_seq_us=0.0,
        gap_token_us=0.0,
        host_us=425.43908990025335,
        host_seq_us=5.8408528597504805,
        host_new_seq_us=0.0,
        host_token_us=0.0,
        host_sample_us=0.0,
        host_context_us=0.0,
        gap_context_us=0.0,
        launch_us=0.0,
        launch_seq_us=0.0,
        launch_token_us=0.0,
        small_us=(421.76844256760876, 587.0102476461709, 623.9514300084764, 654.9400300456421),
    ),
    calibrated_from="benchmarks/sim_calibration.py",
    model={
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 40960,
        "name": "qwen3-0.6b",
    },
    request_us=156.74530334773323,
    serving=Serving(
        eager=Overheads(
            scale=1.0,
            attn_scale=2.9696244333926964,
            step_us=380.84867436542726,
            seq_us=0.0,
            token_us=0.4873562598031398,
            log_seq_us=0.0,
            gap_us=4041.287095920118,
            gap_seq_us=0.0,
            gap_new_seq_us=0.0,
            gap_token_us=0.0,
            host_us=0.0,
            host_seq_us=0.0,
            host_new_seq_us=0.0,
            host_token_us=1.77915,
            host_sample_us=0.0,
            host_context_us=0.0,
            gap_context_us=0.0,
            launch_us=0.0,
            launch_seq_us=0.0,
            launch_token_us=0.0,
            small_us=(),
        ),
        graph=Overheads(
            scale=1.0,
            attn_scale=1.0,
            step_us=687.2204123834612,
            seq_us=0.0,
            token_us=2.797535224619245,
            log_seq_us=32.591661603337926,
            gap_us=269.9059007646935,
            gap_seq_us=0.8004405580594164,
            gap_new_seq_us=0.0,
            gap_token_us=0.0,
            host_us=892.6993020323799,
            host_seq_us=16.052639121394932,
            host_new_seq_us=140.06212536119466,
            host_token_us=0.0,
            host_sample_us=0.0,
            host_context_us=0.0,
            gap_context_us=0.003021477957555164,
            launch_us=0.0,
            launch_seq_us=0.0,
            launch_token_us=0.0,
            small_us=(620.9240491302027, 677.1643398882786, 731.8004037821746, 707.6561589781513),
        ),
        latency_us=2601.4612229786744,
        calibrated_from="benchmarks/sim_serve_check.py (H200, 2026-12-02, main e24beba): served_timeline.jsonl",
        cycle=False,
        latency_stream_us=142.17596421301295,
    ),
    matmul_bandwidth_gbs=3560.0,
    fp8_matmul_tflops=1396.0,
)
# The H100's ceilings, measured on one H100 80GB HBM3 (torch 2.11, 2026-12-07): read 3,117 GB/s
# (benchmarks/read_ceiling.py), bf16 8192^3 matmul 766.8 TFLOP/s, e4m3 row-wise _scaled_mm 1,326.3 TFLOP/s (the FP8
# linears' large-M GEMM); matmul_bandwidth_gbs 2,766: cuBLAS bf16 GEMMs of one Qwen3-8B layer at one row read 388 MB
# in 140.3 us (BENCHMARKS.md, thirty-third session). The overheads below were fitted on two bf16 calibration runs of
# that machine and, per precision (sim_calibration.py --precision-of), on one run each with an FP8 cache, FP8 weights
# and both; the serving section on a served run there (benchmarks/sim_serve_check.py --hardware h100, 2026-12-07:
# 600 requests at 50/s, checked out of sample at 25/s and 75/s; without it, TTFT p50 was priced -63.7 %).

# Fitted by benchmarks/sim_calibration.py on 2026-12-07 (commit a608344): qwen3-0.6b shape, block 256, budget 16384,
# max_num_seqs 512, CUDA graphs, overlapped and plain loops. Error per regime, fitted / held out (leave one regime
# out): decode-1 -1.2% / -3.3%, decode-1-plain +3.2% / +3.8%, decode-16 +2.0% / +9.1%, decode-16-plain +4.1% / +10.9%,
# decode-64 +2.7% / +5.0%, decode-64-plain +1.7% / +3.2%, decode-256 +1.0% / +0.6%, decode-256-plain +2.6% / +3.1%,
# prefill-16 -2.7% / -2.9%, prefill-16-plain -3.9% / -4.8%, prefill-64 -2.3% / -2.8%, prefill-64-plain -5.6% / -6.2%,
# prefill-512 +3.5% / +6.4%, prefill-512-plain +3.0% / +5.8%, long-128 -8.0% / -12.9%, long-128-plain -9.0% / -12.6%,
# bench +3.2% / +6.5%, bench-plain +1.9% / +4.5%, decode-1@1 -1.7% / -3.8%, decode-1-plain@1 -0.6% / -0.0%,
# decode-16@1 -0.4% / +6.6%, decode-16-plain@1 -0.7% / +5.8%, decode-64@1 +1.3% / +3.5%, decode-64-plain@1 -2.0% /
# -0.5%, decode-256@1 -1.2% / -1.7%, decode-256-plain@1 -2.6% / -2.2%, prefill-16@1 -3.7% / -3.9%, prefill-16-plain@1
# -7.5% / -8.3%, prefill-64@1 -3.1% / -3.7%, prefill-64-plain@1 -6.8% / -7.4%, prefill-512@1 +2.3% / +5.2%,
# prefill-512-plain@1 +1.5% / +4.3%, long-128@1 -8.9% / -13.7%, long-128-plain@1 -9.5% / -13.0%, bench@1 +0.8% /
# +4.1%, bench-plain@1 -2.7% / -0.3%; fp8_kv overheads, worst over its 18 runs: 3.4% / 8.5%; fp8_weights_kv overheads,
# worst over its 18 runs: 9.3% / 15.8%; fp8_weights overheads, worst over its 18 runs: 9.8% / 16.6%. Served (TTFT p50
# / p90, TPOT p50 / p90 errors): fitted run -0.1% / -1.3%, -0.9% / -1.3%; 25/s out of sample +11.3% / +11.1%, +5.6% /
# +5.0%; 75/s out of sample -6.1% / -12.5%, +8.7% / +15.9%; latency fitted on every rate, fitted run -0.2% / -0.9%,
# -0.9% / -1.3%; latency fitted on every rate, rate-25 +2.8% / +5.0%, +5.6% / +5.0%; latency fitted on every rate,
# rate-75 +0.4% / -5.0%, +8.7% / +15.9%.
H100 = HardwareProfile(
    name="h100",
    mem_bandwidth_gbs=3117.0,
    matmul_tflops=766.8,
    memory_gib=79.2,
    graph_max_seqs=512,
    graph_mixed_tokens=2048,
    eager=Overheads(
        scale=1.0,
        attn_scale=2.337567301719347,
        step_us=681.4295423280449,
        seq_us=0.0,
        token_us=0.5618518571887198,
        log_seq_us=0.0,
        gap_us=2506.5535584821755,
        gap_seq_us=0.0,
        gap_new_seq_us=0.0,
        gap_token_us=0.0,
        host_us=856.1315962119031,
        host_seq_us=1.3161907474972712,
        host_new_seq_us=0.0,
        host_token_us=0.08164814781170007,
        host_sample_us=0.0,
        host_context_us=0.0,
        gap_context_us=0.0,
        launch_us=0.0,
        launch_seq_us=0.0,
        launch_token_us=0.0,
        small_us=(),
    ),
    graph=Overheads(
        scale=1.0,
        attn_scale=1.0560015146582042,
        step_us=367.60935637015143,
        seq_us=0.0,
        token_us=0.0,
        log_seq_us=53.68147865652167,
        gap_us=188.8313949620562,
        gap_seq_us=2.2962541937991654,
        gap_new_seq_us=0.0,
        gap_token_us=0.0,
        host_us=258.8467989956206,
        host_seq_us=4.271933677604987,
        host_new_seq_us=0.0,
        host_token_us=0.0,
        host_sample_us=0.0,
        host_context_us=0.0,
        gap_context_us=0.0,
        launch_us=0.0,
        launch_seq_us=0.0,
        launch_token_us=0.0,
        small_us=(404.15963577798004, 530.194928968268, 540.5625818216939, 576.837804493701),
    ),
    calibrated_from="benchmarks/sim_calibration.py",
    model={
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 40960,
        "name": "qwen3-0.6b",
    },
    request_us=86.02429067103874,
    serving=Serving(
        eager=Overheads(
            scale=1.0,
            attn_scale=2.337567301719347,
            step_us=681.4295423280449,
            seq_us=0.0,
            token_us=0.5618518571887198,
            log_seq_us=0.0,
            gap_us=2506.5535584821755,
            gap_seq_us=0.0,
            gap_new_seq_us=0.0,
            gap_token_us=0.0,
            host_us=856.1315962119031,
            host_seq_us=1.3161907474972712,
            host_new_seq_us=0.0,
            host_token_us=0.08164814781170007,
            host_sample_us=0.0,
            host_context_us=0.0,
            gap_context_us=0.0,
            launch_us=0.0,
            launch_seq_us=0.0,
            launch_token_us=0.0,
            small_us=(),
        ),
        graph=Overheads(
            scale=1.0,
            attn_scale=1.0560015146582042,
            step_us=466.3453634632801,
            seq_us=0.0,
            token_us=2.241055108459582,
            log_seq_us=53.68147865652167,
            gap_us=188.8313949620562,
            gap_seq_us=2.2962541937991654,
            gap_new_seq_us=0.0,
            gap_token_us=0.0,
            host_us=469.6108810734898,
            host_seq_us=9.658454257188465,
            host_new_seq_us=110.760080728158,
            host_token_us=0.2278938503251057,
            host_sample_us=0.0,
            host_context_us=0.0,
            gap_context_us=0.0,
            launch_us=0.0,
            launch_seq_us=0.0,
            launch_token_us=0.0,
            small_us=(409.8676977533393, 544.4781543391799, 538.7324205469772, 537.2533752126396),
        ),
        latency_us=2268.803008873873,
        calibrated_from="benchmarks/sim_serve_check.py (H100, 2026-12-07, main 17364da): served_timeline.jsonl",
        cycle=False,
        latency_stream_us=40.75413775365193,
    ),
    matmul_bandwidth_gbs=2766.0,
    fp8_matmul_tflops=1326.3,
    precisions={
        "fp8_kv": PrecisionOverheads(
            eager=Overheads(
                scale=1.0,
                attn_scale=3.3333333333333335,
                step_us=990.1301062747855,
                seq_us=0.0,
                token_us=0.7242242398579339,
                log_seq_us=0.0,
                gap_us=3309.383811285013,
                gap_seq_us=0.0,
                gap_new_seq_us=0.0,
                gap_token_us=0.0,
                host_us=856.1315962119031,
                host_seq_us=1.3161907474972712,
                host_new_seq_us=0.0,
                host_token_us=0.08164814781170007,
                host_sample_us=0.0,
                host_context_us=0.0,
                gap_context_us=0.0,
                launch_us=0.0,
                launch_seq_us=0.0,
                launch_token_us=0.0,
                small_us=(),
            ),
            graph=Overheads(
                scale=1.0,
                attn_scale=1.101758582486489,
                step_us=462.7875504434965,
                seq_us=0.0,
                token_us=0.0,
                log_seq_us=47.28612228335874,
                gap_us=203.4665793781894,
                gap_seq_us=1.9906254535799888,
                gap_new_seq_us=0.0,
                gap_token_us=0.0,
                host_us=271.9529804305232,
                host_seq_us=3.8785781823455387,
                host_new_seq_us=0.0,
                host_token_us=0.0,
                host_sample_us=0.0,
                host_context_us=0.0,
                gap_context_us=0.0,
                launch_us=0.0,
                launch_seq_us=0.0,
                launch_token_us=0.0,
                small_us=(427.08550640337484, 504.5865388223939, 534.1371955876331, 659.0507492813226),
            ),
            calibrated_from="benchmarks/sim_calibration.py --precision-of (2026-12-07, commit 233ede4)",
        ),
        "fp8_weights_kv": PrecisionOverheads(
            eager=Overheads(
                scale=1.0,
                attn_scale=3.3333333333333335,
                step_us=1019.401498961041,
                seq_us=0.0,
                token_us=0.8491970424376218,
                log_seq_us=0.0,
                gap_us=0.0,
                gap_seq_us=0.0,
                gap_new_seq_us=0.0,
                gap_token_us=0.17736994337752643,
                host_us=856.1315962119031,
                host_seq_us=1.3161907474972712,
                host_new_seq_us=0.0,
                host_token_us=0.08164814781170007,
                host_sample_us=0.0,
                host_context_us=0.0,
                gap_context_us=0.0,
                launch_us=23722.9,
                launch_seq_us=0.0,
                launch_token_us=0.0,
                small_us=(),
            ),
            graph=Overheads(
                scale=1.0,
                attn_scale=1.0,
                step_us=108.85663868919481,
                seq_us=0.0,
                token_us=0.0,
                log_seq_us=218.36736302681322,
                gap_us=145.90320833026104,
                gap_seq_us=1.127620954819661,
                gap_new_seq_us=0.0,
                gap_token_us=0.0,
                host_us=241.3367939590382,
                host_seq_us=3.8066284740105245,
                host_new_seq_us=0.0,
                host_token_us=0.0,
                host_sample_us=0.0,
                host_context_us=0.0,
                gap_context_us=0.0,
                launch_us=0.0,
                launch_seq_us=0.0,
                launch_token_us=0.0,
                small_us=(852.6104410394908, 845.5752039015176, 872.4284317126359, 1001.6015911584038),
            ),
            calibrated_from="benchmarks/sim_calibration.py --precision-of (2026-12-07, commit 233ede4)",
        ),
        "fp8_weights": PrecisionOverheads(
            eager=Overheads(
                scale=1.0,
                attn_scale=2.3007812863467887,
                step_us=1577.3241001606839,
                seq_us=0.0,
                token_us=0.6116513859272957,
                log_seq_us=0.0,
                gap_us=0.0,
                gap_seq_us=0.0,
                gap_new_seq_us=0.0,
                gap_token_us=0.18002848819162934,
                host_us=856.1315962119031,
                host_seq_us=1.3161907474972712,
                host_new_seq_us=0.0,
                host_token_us=0.08164814781170007,
                host_sample_us=0.0,
                host_context_us=0.0,
                gap_context_us=0.0,
                launch_us=23031.475,
                launch_seq_us=0.0,
                launch_token_us=0.0,
                small_us=(),
            ),
            graph=Overheads(
                scale=1.0,
                attn_scale=1.0,
                step_us=0.0,
                seq_us=0.0,
                token_us=0.0,
                log_seq_us=235.53035329621116,
                gap_us=142.72773507869599,
                gap_seq_us=1.875871863816059,
                gap_new_seq_us=0.0,
                gap_token_us=0.0,
                host_us=283.80090837483164,
                host_seq_us=4.734856695092939,
                host_new_seq_us=0.0,
                host_token_us=0.0,
                host_sample_us=0.0,
                host_context_us=0.0,
                gap_context_us=0.0,
                launch_us=0.0,
                launch_seq_us=0.0,
                launch_token_us=0.0,
                small_us=(833.8195313798118, 885.1224076627877, 869.7581969395841, 917.6701017697167),
            ),
            calibrated_from="benchmarks/sim_calibration.py --precision-of (2026-12-07, commit 233ede4)",
        ),
    },
)
BUILTIN_PROFILES: Mapping[str, HardwareProfile] = {"h200": H200, "h100": H100}


def builtin_for_device(device: str) -> str | None:
    """The built-in profile (``BUILTIN_PROFILES``) of a device by its name ("NVIDIA H100 80GB HBM3" -> "h100",
    "NVIDIA H200" -> "h200"), None when no built-in one is that device's."""
    words = "".join(c if c.isalnum() else " " for c in device.lower()).split()
    return next((name for name in BUILTIN_PROFILES if name in words), None)


def _check_keys(data: Mapping[str, Any], cls: type, what: str) -> None:
    """SimInputError for keys ``cls`` does not have, or required ones missing."""
    fields = attrs.fields(cls)
    known = {f.name for f in fields}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SimInputError(f"unknown {what} field(s) {unknown}; known: {sorted(known)}")
    missing = [f.name for f in fields if f.default is attrs.NOTHING and f.name not in data]
    if missing:
        raise SimInputError(f"{what} lacks {missing}")


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A built-in profile by name, or a profile JSON file. Raises ValueError for anything else."""
    key = str(name_or_path).lower()
    if key in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[key]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"hardware {str(name_or_path)!r} is neither one of {sorted(BUILTIN_PROFILES)} nor a file")
    try:
        return HardwareProfile.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise SimInputError(f"{path} is not a hardware profile JSON: {e}") from None
    except SimInputError as e:
        raise type(e)(f"{path}: {e}") from None


def save_profile(profile: HardwareProfile, path: str | Path) -> None:
    """Write ``profile`` as indented JSON."""
    Path(path).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
