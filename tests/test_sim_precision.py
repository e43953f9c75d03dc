"""The simulator at the engine's FP8 options: bytes of an FP8 cache and FP8 linears, the FP8 matmul rate, overheads
fitted per precision, the options on the CLI and in the GPU engine's timeline, and the built-in H100 profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from fnvllm.sim import load_profile, save_profile
from fnvllm.sim.checks import SimInputError
from fnvllm.sim.cost import CostModel, StepShape, matmul_bound
from fnvllm.sim.hardware import (
    BUILTIN_PROFILES,
    H200,
    HardwareProfile,
    Overheads,
    PrecisionOverheads,
    builtin_for_device,
    precision_key,
)
from fnvllm.sim.model import ModelShape, load_shape
from fnvllm.sim.spec import SimSpec, core_config, resolve_model

ROOT = Path(__file__).resolve().parent.parent
QWEN3_06B_LAYER_WEIGHTS = 1024 * (2048 + 2 * 1024) + 2048 * 1024 + 3 * 1024 * 3072  # qkv, o, gate/up, down


def test_fp8_cache_halves_kv_bytes_and_fp8_weights_halve_the_linears_only() -> None:
    """Qwen3-0.6B: a token's K and V take 2 x 28 x 1,024 x 2 bytes in bf16 and half that in FP8; FP8 linears take one
    byte a weight plus a float32 scale per 128 x 128 block, while the embedding (tied: the LM head too) stays bf16."""
    plain = load_shape("qwen3-0.6b")
    fp8 = plain.with_precision("fp8", "fp8")
    assert plain.kv_bytes_per_token == 2 * 28 * 1024 * 2 and fp8.kv_bytes_per_token == 2 * 28 * 1024
    linears = 28 * QWEN3_06B_LAYER_WEIGHTS
    embedding = 151936 * 1024 * 2
    assert plain.weight_bytes == 2 * linears + embedding
    assert fp8.weight_bytes == linears + 4 * linears // (128 * 128) + embedding
    kv_only = plain.with_precision("fp8")
    assert kv_only.weight_bytes == plain.weight_bytes and kv_only.kv_bytes_per_token == fp8.kv_bytes_per_token


def test_fp8_checkpoint_config_reads_as_fp8_weights_and_round_trips() -> None:
    """An official FP8 checkpoint's quantization_config makes the shape's linears FP8 (and ``with_precision`` with
    no quantization keeps them so, as the engine loads such a checkpoint); to_config / from_config keep both
    options; another quantization method is refused naming it."""
    config = load_shape("qwen3-8b").to_config()
    checkpoint = {**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    shape = ModelShape.from_config(checkpoint, name="qwen3-8b-fp8")
    assert shape.quantization == "fp8" and shape.with_precision().quantization == "fp8"
    both = shape.with_precision("fp8")
    again = ModelShape.from_config(both.to_config(), name=both.name)
    assert again == both and again.kv_cache_dtype == "fp8"
    with pytest.raises(SimInputError, match="quant_method 'awq'"):
        ModelShape.from_config({**config, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(SimInputError, match="kv_cache_dtype must be one of"):
        attrs.evolve(shape, kv_cache_dtype="fp16")
    with pytest.raises(SimInputError, match="quantization must be None or one of"):
        shape.with_precision(quantization="int4")


def test_cost_model_prices_fp8_bytes_and_the_fp8_matmul_rate() -> None:
    """A decode step's attention roofline with an FP8 cache is its KV bytes at one byte an element plus q and out in
    bf16; a one-token FP8 linear streams half the weight bytes (plus scales); a long prefill's FLOP-bound linear
    runs at the profile's FP8 rate (twice bf16's where the profile does not say)."""
    plain = load_shape("qwen3-0.6b")
    decode = StepShape(64, 64, 64, 0, 64 * 1000, 64 * 1000, 64, True)
    bw = H200.mem_bandwidth_gbs * 1e9
    kv, q = 8 * 128, 16 * 128
    for kv_bytes, shape in ((2, plain), (1, plain.with_precision("fp8"))):
        expected = 28 * (kv_bytes * 2 * kv * (64 * 1000 + 64) + 2 * 2 * q * 64) / bw
        assert CostModel(shape, H200).attention_s(decode) == pytest.approx(expected, rel=1e-12)
    one = StepShape(1, 1, 1, 0, 100, 100, 1, True)
    parts = dict(CostModel(plain, H200).layer_parts_s(one))
    fp8_parts = dict(CostModel(plain.with_precision(quantization="fp8"), H200).layer_parts_s(one))
    assert fp8_parts["gate_up"] == pytest.approx(parts["gate_up"] / 2, rel=0.01)
    prefill = StepShape(1, 8192, 0, 8192, 8192, 8192 * 4096, 1, False)
    no_rate = attrs.evolve(H200, fp8_matmul_tflops=None)
    big_fp8 = dict(CostModel(plain.with_precision(quantization="fp8"), no_rate).layer_parts_s(prefill))["gate_up"]
    weights, width_in, width_out = 2 * 1024 * 3072, 1024, 2 * 3072
    memory = ((1 + 4 / 128**2) * weights + 2 * 8192 * (width_in + width_out)) / (H200.matmul_bandwidth_gbs * 1e9)
    compute = 2 * 8192 * weights / (2 * H200.matmul_tflops * 1e12)  # twice the bf16 rate
    assert big_fp8 == pytest.approx(matmul_bound(memory, compute), rel=1e-12)
    assert no_rate.fp8_flops_per_s == 2 * no_rate.flops_per_s and H200.fp8_flops_per_s == 1396e12


def test_precision_overheads_price_their_precision_only(tmp_path: Path) -> None:
    """A profile's ``precisions`` entry prices models of that precision (here 100 us more a step) and no other;
    precision keys name the engine's options; the entry survives a JSON round trip; an unknown key is refused."""
    assert [precision_key(k, q) for k, q in (("auto", None), ("fp8", None), ("auto", "fp8"), ("fp8", "fp8"))] == [
        None,
        "fp8_kv",
        "fp8_weights",
        "fp8_weights_kv",
    ]
    slower = attrs.evolve(H200.graph, step_us=H200.graph.step_us + 100.0, small_us=())
    base = attrs.evolve(H200, graph=attrs.evolve(H200.graph, small_us=()))
    profile = attrs.evolve(base, precisions={"fp8_kv": PrecisionOverheads(H200.eager, slower)})
    shape = StepShape(32, 32, 32, 0, 3200, 3200, 32, True)
    plain, fp8_kv = load_shape("qwen3-0.6b"), load_shape("qwen3-0.6b").with_precision("fp8")
    with_entry, bytes_only = CostModel(fp8_kv, profile), CostModel(fp8_kv, base)
    assert with_entry.compute_s(shape) - bytes_only.compute_s(shape) == pytest.approx(100e-6, rel=1e-9)
    assert CostModel(plain, profile).compute_s(shape) == CostModel(plain, base).compute_s(shape)
    fp8_weights = plain.with_precision(quantization="fp8")  # no entry: the profile's own overheads
    assert CostModel(fp8_weights, profile).compute_s(shape) == CostModel(fp8_weights, base).compute_s(shape)
    save_profile(profile, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").precisions == profile.precisions
    with pytest.raises(SimInputError, match="precisions key must be one of"):
        attrs.evolve(base, precisions={"int4": PrecisionOverheads()})
    bad = {**profile.to_dict(), "precisions": {"fp8_kv": {"eager": {}, "speed": 2}}}
    with pytest.raises(SimInputError, match="speed"):
        HardwareProfile.from_dict(bad)


def test_fp8_cache_doubles_the_kv_blocks_that_fit() -> None:
    """The memory left after weights and activations holds twice the blocks with an FP8 cache (to one block), and
    FP8 weights leave more of it; the spec's options reach the model it simulates."""
    spec, fp8 = SimSpec(hardware="h100"), SimSpec(hardware="h100", kv_cache_dtype="fp8")
    h100 = load_profile("h100")
    plain_blocks = core_config(spec, resolve_model(None, h100), h100).num_blocks
    model = resolve_model(None, h100).with_precision("fp8")
    assert abs(core_config(fp8, model, h100).num_blocks - 2 * plain_blocks) <= 1
    both = resolve_model(None, h100).with_precision("fp8", "fp8")
    assert core_config(fp8, both, h100).num_blocks > core_config(fp8, model, h100).num_blocks
    with pytest.raises(SimInputError, match="kv_cache_dtype must be one of"):
        SimSpec(kv_cache_dtype="int8")


def _simulate(*flags: str) -> subprocess.CompletedProcess[str]:
    """``fnvllm simulate`` with ``flags`` in a subprocess (the CLI's exit code and messages as a user sees them)."""
    command = [sys.executable, "-m", "fnvllm.cli", "simulate", "--no-progress", *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_cli_takes_the_precision_flags_and_refuses_bad_ones() -> None:
    """``fnvllm simulate --kv-cache-dtype fp8`` runs the bench on the H100 profile faster than bf16 (its KV reads
    halve); a bad value exits 2 with one line naming the flag."""
    runs = {}
    for flags in ((), ("--kv-cache-dtype", "fp8")):
        done = _simulate("--workload", "bench", "--num-requests", "64", "--hardware", "h100", "--json", *flags)
        assert done.returncode == 0, done.stderr
        runs[flags] = json.loads(done.stdout)["output_tok_per_s"]
    assert runs[("--kv-cache-dtype", "fp8")] > 1.2 * runs[()]
    for flag, value in (("--kv-cache-dtype", "fp16"), ("--quantization", "int4")):
        done = _simulate("--workload", "bench", "--num-requests", "4", flag, value)
        assert done.returncode == 2 and flag in done.stderr, done.stderr


def test_builtin_profiles_are_found_by_device_name() -> None:
    """A CUDA device's name picks its built-in profile ("NVIDIA H100 80GB HBM3" -> h100), and none for a device
    without one; the H100's profile carries its own ceilings, fitted FP8 overheads and a served section, which
    ``--serve`` takes (a served decode step priced apart from the offline one)."""
    assert builtin_for_device("NVIDIA H100 80GB HBM3") == "h100"
    assert builtin_for_device("NVIDIA H200") == "h200"
    assert builtin_for_device("NVIDIA A100-SXM4-80GB") is None and builtin_for_device("cpu") is None
    h100 = BUILTIN_PROFILES["h100"]
    assert h100.mem_bandwidth_gbs < H200.mem_bandwidth_gbs and h100.memory_gib < H200.memory_gib
    assert set(h100.precisions) == {"fp8_kv", "fp8_weights", "fp8_weights_kv"}
    assert all(isinstance(p.graph, Overheads) and p.graph.small_us for p in h100.precisions.values())
    assert h100.serving is not None and h100.serving.latency_us > 0 and "H100" in h100.serving.calibrated_from
    decode = StepShape(20, 20, 20, 0, 20 * 400, 20 * 400, 20, True)  # the served run's ~20-row decode steps
    shape = load_shape("qwen3-0.6b")
    served, offline = CostModel(shape, h100, serving=True), CostModel(shape, h100)
    assert served.serving and not offline.serving
    assert served.device_s(decode) != pytest.approx(offline.device_s(decode), rel=1e-3)


def test_engine_timeline_header_carries_the_precision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's FNVLLM_TIMELINE header names an FP8 cache and FP8 weights, so ``fnvllm simulate --check`` and
    calibration price its steps at that precision (the CPU engine, FP8 cache and ``quantization="fp8"``)."""
    from fnvllm.llm import LLM
    from fnvllm.sim.timeline import header_model, read_timeline
    from fnvllm.state import SamplingParams
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3", hidden_size=128, num_layers=2, vocab_size=256)
    monkeypatch.setenv("FNVLLM_TIMELINE", str(tmp_path / "steps.jsonl"))
    llm = LLM(ckpt, load_tokenizer=False, device="cpu", kv_cache_dtype="fp8", quantization="fp8", num_blocks=16)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    llm.executor.timeline.close()
    header, records = read_timeline(tmp_path / "steps.jsonl")
    model = header_model(header)
    assert records and model.kv_cache_dtype == "fp8" and model.quantization == "fp8"
