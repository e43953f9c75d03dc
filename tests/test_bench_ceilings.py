"""The bench's ceilings (the floor's read rate, the roofline's matmul peak) are the card's own measured ones: an
H100's floor is not priced at the H200's 4.16 TB/s."""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import attrs
import pytest
import torch

from fnvllm.bench import (
    Ceilings,
    _engine_ceilings,
    device_ceilings,
    floor_seconds,
    run_bench,
    run_latency,
    write_checkpoint,
)
from fnvllm.cli import bench as cli_bench
from fnvllm.model.config import ModelConfig
from fnvllm.workloads import bench_workload

H100_NAME = "NVIDIA H100 80GB HBM3"  # torch.cuda.get_device_name on the lent H100


@pytest.mark.parametrize(
    ("name", "read", "peak", "source"),
    [
        # BENCHMARKS.md: the H100's read ceiling and 8192^3 bf16 matmul (thirty-seventh session), the H200's
        (H100_NAME, 3.117, 766.8, "h100 profile"),
        ("NVIDIA H200", 4.16, 793.0, "h200 profile"),
        ("NVIDIA H200 NVL", 4.16, 793.0, "h200 profile"),
    ],
)
def test_a_card_with_a_profile_gets_its_measured_ceilings(name: str, read: float, peak: float, source: str) -> None:
    got = device_ceilings(name)
    assert (got.read_tb_s, got.peak_tflops, got.source) == (pytest.approx(read), pytest.approx(peak), source)


def test_a_card_without_a_profile_gets_the_h200s_and_says_so() -> None:
    got = device_ceilings("NVIDIA A100-SXM4-80GB")
    assert (got.read_tb_s, got.peak_tflops) == (4.16, 793.0)
    assert "h200" in got.source and "A100-SXM4-80GB" in got.source


def test_a_given_ceiling_replaces_the_measured_one_and_the_source_says_which() -> None:
    assert device_ceilings(H100_NAME, 2.5, 500.0) == Ceilings(2.5, 500.0, "given")
    read_only = device_ceilings(H100_NAME, read_tb_s=3.0)
    assert (read_only.read_tb_s, read_only.peak_tflops) == (3.0, pytest.approx(766.8))
    assert "given read ceiling" in read_only.source and "h100" in read_only.source
    peak_only = device_ceilings(H100_NAME, peak_tflops=700.0)
    assert (peak_only.read_tb_s, peak_only.peak_tflops) == (pytest.approx(3.117), 700.0)
    assert "given peak" in peak_only.source


@pytest.mark.parametrize(
    ("field", "kwargs"), [("read_tb_s", {"read_tb_s": 0.0}), ("peak_tflops", {"peak_tflops": -1.0})]
)
def test_a_ceiling_not_above_zero_is_refused_by_name(field: str, kwargs: dict[str, float]) -> None:
    """Refused before anything loads: by the resolver, and by both bench modes on any device."""
    with pytest.raises(ValueError, match=f"{field} must be > 0"):
        device_ceilings(H100_NAME, **kwargs)
    with pytest.raises(ValueError, match=f"{field} must be > 0"):
        run_bench(None, "tiny", 2, **kwargs)
    if field == "read_tb_s":
        with pytest.raises(ValueError, match=f"{field} must be > 0"):
            run_latency(None, "tiny", (1,), **kwargs)


def test_the_engine_ceilings_are_one_cards_times_the_tensor_parallel_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each GPU reads its share of the weights and KV: two H100s read at twice one's rate."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100_NAME)
    llm = types.SimpleNamespace(executor=types.SimpleNamespace(device=torch.device("cuda", 0)))
    two = _engine_ceilings(llm, None, None, {"tensor_parallel_size": 2})
    assert (two.read_tb_s, two.peak_tflops, two.source) == (pytest.approx(6.234), pytest.approx(1533.6), "h100 profile")
    given = _engine_ceilings(llm, 4.0, None, {})
    assert (given.read_tb_s, given.peak_tflops) == (4.0, pytest.approx(766.8))


def test_the_cli_leaves_the_ceilings_to_the_card_unless_given(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    cli_bench.register(parser.add_subparsers())
    args = parser.parse_args(["bench"])
    assert (args.read_tb_s, args.peak_tflops) == (None, None)
    given = parser.parse_args(["bench", "--read-tb-s", "3.3", "--peak-tflops", "700"])
    assert (given.read_tb_s, given.peak_tflops) == (3.3, 700.0)
    for flag in ("--read-tb-s", "--peak-tflops"):
        for bad in ("0", "-2", "fast"):
            with pytest.raises(SystemExit):
                parser.parse_args(["bench", flag, bad])
            assert f"argument {flag}: expected a number > 0, got '{bad}'" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_bench_on_a_gpu_prices_its_floor_at_that_cards_ceilings(tmp_path: Path) -> None:
    """A small bench run on the GPU records the ceilings it used, from this card's profile (an H100 or H200) or
    the H200's with the card named, and its floor is the workload's bytes at that read rate."""
    folder = write_checkpoint("tiny", tmp_path)
    # a small cache: the GPU suite runs four test files at once on one card
    result = run_bench(folder, "tiny", 8, 128, 120, num_blocks=256, block_size=16)
    expected = device_ceilings(torch.cuda.get_device_name())
    assert result["ceilings"] == attrs.asdict(expected)
    prompts, params = bench_workload(8, 128, 120)
    lens = [len(p) for p in prompts], [p.max_tokens for p in params]
    floor = floor_seconds(ModelConfig.from_pretrained(folder), *lens, expected.read_tb_s)
    assert result["floor_tok_per_s"] == pytest.approx(result["output_tokens"] / floor, abs=0.1)
