"""The bench's floor and roofline: the roofline adds compute to the bytes-only floor, and each bound is what the
other ceiling makes of it when one ceiling is taken out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fnvllm.bench import (
    attention_flops,
    floor_seconds,
    flops_per_token,
    latency_floor_ms,
    roofline_seconds,
    weight_bytes,
)
from fnvllm.model.config import ModelConfig
from fnvllm.testing.checkpoints import _QWEN3_COMMON, QWEN3_MOE_SHAPES, QWEN3_SHAPES
from fnvllm.workloads import bench_workload

UNLIMITED = 1e12  # a ceiling so high (TB/s or TFLOP/s) that its side of the roofline vanishes


def _config(shape: str, tmp_path: Path) -> ModelConfig:
    """The ModelConfig of a real shape, from its config.json alone."""
    (tmp_path / "config.json").write_text(json.dumps({**_QWEN3_COMMON, **{**QWEN3_SHAPES, **QWEN3_MOE_SHAPES}[shape]}))
    return ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"])
def test_roofline_is_the_floor_when_compute_is_free(shape: str, tmp_path: Path) -> None:
    """With an unlimited matmul rate the roofline is exactly the bytes-only floor, for dense and sparse shapes."""
    config, (prompts, params) = _config(shape, tmp_path), bench_workload(32, 1024, 256)
    lens = [len(p) for p in prompts], [p.max_tokens for p in params]
    assert roofline_seconds(config, *lens, 4.16, UNLIMITED) == pytest.approx(floor_seconds(config, *lens, 4.16))


def test_roofline_is_all_the_flops_when_bytes_are_free(tmp_path: Path) -> None:
    """With unlimited bandwidth the roofline is every FLOP of the workload at the peak: each prompt token and each
    output token once through the weights, plus attention over its context."""
    config = _config("qwen3-0.6b", tmp_path)
    prompts, outputs = [300, 40], [3, 1]
    contexts = [300, 301, 302, 40]  # the first sequence's 3 outputs read 300, 301, 302 tokens; the second's one 40
    flops = sum(outputs) * flops_per_token(config) + sum(attention_flops(config, c) for c in contexts)
    flops += sum(p * flops_per_token(config) + attention_flops(config, p * (p + 1) // 2) for p in prompts)
    assert roofline_seconds(config, prompts, outputs, UNLIMITED, 100.0) == pytest.approx(flops / 100e12)


def test_a_prefill_heavy_workload_is_compute_bound(tmp_path: Path) -> None:
    """Long prompts with one output each: the bytes-bound steps cannot hold the prompts' FLOPs, so the roofline
    exceeds the floor; it never falls below either bound."""
    config = _config("qwen3-8b", tmp_path)
    prompts, outputs = [8192] * 16, [1] * 16
    floor = floor_seconds(config, prompts, outputs, 4.16)
    roof = roofline_seconds(config, prompts, outputs, 4.16, 793.0)
    assert roof > 5 * floor  # ~2.2 PFLOP of prompts at 793 TFLOP/s against ~20 GB of reads
    assert roof >= sum(prompts) * flops_per_token(config) / 793e12


def test_flops_per_token_counts_two_per_weight(tmp_path: Path) -> None:
    """A dense shape's FLOPs per token are twice the weights it multiplies: weight_bytes over 2 bytes, less the
    norms (two hidden-wide and Qwen3's per-head q and k norms a layer, and the final one), plus the LM head (untied
    here, so weight_bytes counts it once already)."""
    config = _config("qwen3-8b", tmp_path)
    layer_norms = 2 * config.hidden_size + 2 * config.head_dim
    norms = config.num_hidden_layers * layer_norms + config.hidden_size
    assert flops_per_token(config) == 2 * (weight_bytes(config) // 2 - norms)


def _decode_record(num_seqs: int, context: int) -> dict[str, object]:
    """A timeline record of one decode step (the fields ``fnvllm.sim.timeline.record_shape`` reads)."""
    return {"num_seqs": num_seqs, "num_tokens": num_seqs, "num_decode_seqs": num_seqs, "num_prefill_tokens": 0,
            "context_tokens": context, "graph": True}  # fmt: skip


def test_steps_roofline_charges_what_the_steps_read(tmp_path: Path) -> None:
    """The roofline of the steps run: one decode step of the 0.6B shape at unlimited compute costs its weights and
    KV over the bandwidth (so twice the KV costs more); a MoE checkpoint is priced too (its experts touched)."""
    from fnvllm.bench import Ceilings, _steps_roofline

    _config("qwen3-0.6b", tmp_path)
    small = _steps_roofline(tmp_path, [_decode_record(64, 64 * 500)], Ceilings(4.16, 1e6, "given"), 0.005, 64)
    large = _steps_roofline(tmp_path, [_decode_record(64, 64 * 1000)], Ceilings(4.16, 1e6, "given"), 0.005, 64)
    assert 0 < large["fraction_of_steps_roofline"] < small["fraction_of_steps_roofline"] * 2
    assert large["fraction_of_steps_roofline"] > small["fraction_of_steps_roofline"] * 1.5  # KV dominates here
    assert small["steps_roofline_tok_per_s"] == pytest.approx(
        64 / (small["fraction_of_steps_roofline"] * 0.005), rel=1e-2
    )
    moe = tmp_path / "moe"
    moe.mkdir()
    _config("qwen3-30b-a3b", moe)
    priced = _steps_roofline(moe, [_decode_record(64, 64 * 500)], Ceilings(4.16, 793.0, "given"), 0.005, 64)
    assert priced["fraction_of_steps_roofline"] > 0


@pytest.mark.parametrize("kv_dtype_bytes", [2, 1])
def test_latency_floor_is_one_steps_bytes_at_the_read_rate(kv_dtype_bytes: int, tmp_path: Path) -> None:
    """A latency run's floor per step: each of its steps reads the weights once and each sequence's K/V so far
    (prompt + the tokens before it), averaged over the steps; summed here step by step, from the shape's fields."""
    config = _config("qwen3-0.6b", tmp_path)
    prompts, steps, tb_s = [100, 128, 117], 256, 4.0
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * kv_dtype_bytes
    step_bytes = [weight_bytes(config) + sum(p + s for p in prompts) * per_token for s in range(steps)]
    expected_ms = 1e3 * sum(step_bytes) / len(step_bytes) / (tb_s * 1e12)
    assert latency_floor_ms(config, prompts, steps, tb_s, kv_dtype_bytes) == pytest.approx(expected_ms)
    # the K/V share grows with the batch, the weights' does not: 64 sequences of ~240 tokens read more K/V than
    # the 0.6B shape's weights
    many = latency_floor_ms(config, [114] * 64, steps, tb_s)
    assert many > 2 * 1e3 * weight_bytes(config) / (tb_s * 1e12)
