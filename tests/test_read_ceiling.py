"""The read-ceiling helper (benchmarks/read_ceiling.py) and the FP8 GEMM summary's fractions of it."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks import bench_fp8_gemm, read_ceiling


def test_best_seconds_takes_the_shortest_timing() -> None:
    durations = iter([3.0, 1.5, 2.0])
    calls = []
    assert read_ceiling.best_seconds(lambda: calls.append(1), 3, lambda call: (call(), next(durations))[1]) == 1.5
    assert len(calls) == 3


def test_best_seconds_refuses_no_repeats() -> None:
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        read_ceiling.best_seconds(lambda: None, 0, read_ceiling.wall_clock)


@pytest.mark.parametrize("gib", [0.0, -1.0, 65.0])
def test_read_ceiling_refuses_a_size_out_of_range(gib: float) -> None:
    with pytest.raises(ValueError, match=r"gib must be in \(0, 64\]"):
        read_ceiling.read_ceiling_tb_s("cpu", gib=gib)


def test_read_ceiling_divides_the_bytes_read_by_the_best_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # a 1 MiB tensor "read" in 1 or 2 us by the stubbed clock: 2**20 bytes / 1e-6 s = 1.048576 TB/s
    times = itertools.cycle([2e-6, 1e-6])
    monkeypatch.setattr(read_ceiling, "wall_clock", lambda call: (call(), next(times))[1])
    assert read_ceiling.read_ceiling_tb_s("cpu", gib=1 / 1024, repeats=4) == pytest.approx(1.048576)


def test_summary_prints_each_rate_as_a_fraction_of_the_ceiling(capsys: pytest.CaptureFixture[str]) -> None:
    # two GEMMs of 1e6 fp8 weight bytes each, 1 us each: the layer reads 2e6 bytes in 2 us
    gemms = [SimpleNamespace(name=name, n=1000, k=1000, fp8_bytes=1_000_000) for name in ("a", "b")]
    times = {(name, 16, "shipped"): 1.0 for name in ("a", "b")}
    bench_fp8_gemm.print_summary(gemms, [16], times, {}, ("shipped",), ceiling_tb_s=2.0)
    out = capsys.readouterr().out
    assert "issue 20's small-M target 3.5 of the H200's 4.16 = 0.841" in out
    assert "2.0 (1.00) [0.500]" in out  # 2e6 bytes in 2 us = 1 TB/s, half of 2 TB/s
    bench_fp8_gemm.print_summary(gemms, [16], times, {}, ("shipped",))
    assert "[" not in capsys.readouterr().out.split("\n", 2)[2]  # no fractions without a ceiling


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] >= 9


@pytest.mark.parametrize(
    "pdl", [False, pytest.param(True, marks=pytest.mark.skipif(not HOPPER, reason="PDL needs an sm_90+ CUDA GPU"))]
)
@pytest.mark.parametrize(("words", "programs", "block"), [(10_000, 3, 2048), (2048, 1, 2048), (5000, 4, 2048),
                                                    (40_000, 3, 8192), (9000, 2, 8192)])  # fmt: skip
def test_fold_kernel_matches_its_reference(words: int, programs: int, block: int, pdl: bool) -> None:
    # the plain-read kernel's one word a program: each program's share (whole steps of block words, the last short)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device=device)
    out = torch.zeros(programs, dtype=torch.int32, device=device)
    read_ceiling.fold(x, out, programs, pdl, block)
    expected = read_ceiling.fold_reference(x, programs, block)
    assert torch.equal(out, expected)
    # the shares cover every word once: the programs' words XOR to the XOR of all of x
    assert np.bitwise_xor.reduce(expected.cpu().numpy()) == np.bitwise_xor.reduce(x.cpu().numpy())


def test_fit_line_recovers_a_line_and_refuses_one_x() -> None:
    intercept, slope = read_ceiling.fit_line(
        [16.8, 25.2, 50.3, 100.7], [4.4 + 0.3 * x for x in (16.8, 25.2, 50.3, 100.7)]
    )
    assert intercept == pytest.approx(4.4) and slope == pytest.approx(0.3)
    with pytest.raises(ValueError, match="two distinct xs"):
        read_ceiling.fit_line([1.0, 1.0], [2.0, 3.0])


def test_bench_tiles_variant_returns_the_row_layout_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_fp8_gemm's ``swap_ready_tiles`` (the shipped ready pick over ``tile_major_weight``'s layout) returns
    exactly ``swap_ready``'s product and makes each weight's layout once; ``swap_ready_pre1`` still takes its
    preload from the name (under the Triton interpreter: a CPU stand-in for the GPU's kernel)."""
    monkeypatch.setattr(bench_fp8_gemm, "DEVICE", "cpu")
    monkeypatch.setattr(bench_fp8_gemm, "L2_BYTES", 1)  # one weight copy
    gemm = bench_fp8_gemm.Gemm("small", 192, 384)
    x = gemm.x(3)
    w, s = gemm.fp8[0]
    ready = bench_fp8_gemm.g.quantize_activations(x)
    rows = gemm.call("swap_ready", x, w, s, None, ready)
    assert torch.equal(rows, gemm.call("swap_ready_tiles", x, w, s, None, ready))
    assert torch.equal(rows, gemm.call("swap_ready_tiles", x, w, s, None, ready))
    assert len(gemm._tiles) == 1
    preloaded = gemm.call("swap_ready_pre1", x, w, s, None, ready)
    torch.testing.assert_close(preloaded, rows, atol=1e-2, rtol=1e-2)  # another order of the same sum
