"""benchmarks/open_targets.py's table: each open target read from its bench's JSON and judged (CPU; the benches'
own runs need the GPU)."""

from __future__ import annotations

import math

import pytest

from benchmarks import open_targets as ot


def _kv(fp8_us: float, bf16_us: float, tb_s: float) -> dict:
    """The part of ``bench_fp8_kv.py --json``'s record the table reads."""
    return {"decode": {"fp8_default_ordered": {"us": fp8_us, "tb_s": tb_s}, "bf16": {"us": bf16_us}, "layout": "HND"}}


def test_layer_bytes_are_the_four_weights_and_their_block_scales() -> None:
    # qkv 6144 x 4096 has 48 x 32 scale blocks, o 32 x 32, gate_up 192 x 32, down 32 x 96: 9,728 float32 scales
    weights = 6144 * 4096 + 4096 * 4096 + 24576 * 4096 + 4096 * 12288
    assert ot.layer_fp8_bytes() == weights + 4 * (48 * 32 + 32 * 32 + 192 * 32 + 32 * 96)


def test_attention_on_an_h200_judges_both_forms() -> None:
    ratio, rate = ot.attention_rows(_kv(150.0, 300.0, 3.95), h200=True, ceiling_tb_s=None)
    assert ratio.met and ratio.measured == "2.00x"
    assert rate.met and rate.measured.startswith("3.95 TB/s")
    short_ratio, short_rate = ot.attention_rows(_kv(200.0, 360.0, 3.18), h200=True, ceiling_tb_s=None)
    assert not short_ratio.met and not short_rate.met  # 1.80x, 3.18 TB/s


def test_attention_off_the_h200_judges_the_rate_as_a_fraction_of_the_card_ceiling() -> None:
    # 2.87 of a 3.0 TB/s ceiling is 0.957, over 3.9 / 4.16 = 0.9375; of a 3.124 ceiling 0.919, under
    _, above = ot.attention_rows(_kv(202.6, 394.2, 2.87), h200=False, ceiling_tb_s=3.0)
    _, below = ot.attention_rows(_kv(202.6, 394.2, 2.87), h200=False, ceiling_tb_s=3.124)
    _, unjudged = ot.attention_rows(_kv(202.6, 394.2, 2.87), h200=False, ceiling_tb_s=None)
    assert above.met is True and below.met is False and unjudged.met is None
    assert "0.938 of its ceiling" in below.target and "0.919 of 3.124" in below.measured


def test_gemm_rows_sum_the_layer_and_skip_a_variant_missing_a_gemm() -> None:
    nbytes = ot.layer_fp8_bytes()
    fast_us = nbytes / 3.6e6  # the whole layer at 3.6 TB/s, split over the four GEMMs
    times = {f"{name} M=1 swap_ready": fast_us / 4 for name in ot.LAYER_GEMMS}
    times |= {f"{name} M=16 swap_ready": 64.0 / 4 for name in ot.LAYER_GEMMS}
    times["qkv M=1 shipped"] = 10.0  # the other three missing: no row
    rows = ot.gemm_rows({"times_us": times}, h200=True)
    assert [r.target.split(" at ")[1] for r in rows] == [
        "M = 1, from ready activations",
        "M = 16, from ready activations",
    ]
    assert rows[0].met and rows[0].measured.startswith("3.60 TB/s")
    assert not rows[1].met and rows[1].measured == f"{nbytes / 64.0 / 1e6:.2f} TB/s (64.0 us)"


def test_latency_rows_average_the_rounds_and_judge_only_on_an_h200() -> None:
    def report(ms16: float, ms64: float) -> dict:
        timeline = {"mean_gpu_ms": None}
        return {"latency": [{"requests": 16, "decode_timeline": {"mean_gpu_ms": ms16}},
                            {"requests": 64, "decode_timeline": {"mean_gpu_ms": ms64}},
                            {"requests": 1, "decode_timeline": timeline}]}  # fmt: skip

    rows = ot.latency_rows([report(0.99, 1.44), report(1.03, 1.46)], h200=True)
    assert [r.target for r in rows] == [
        "16 request(s) <= 1.0 device ms a step",
        "64 request(s) <= 1.3 device ms a step",
    ]
    assert rows[0].measured == "1.010 (0.990-1.030)" and rows[0].met is False  # the mean decides
    assert rows[1].met is False
    assert ot.latency_rows([report(0.9, 1.2)], h200=True)[0].met is True
    assert all(r.met is None for r in ot.latency_rows([report(0.9, 1.2)], h200=False))


def test_the_report_is_the_last_json_line() -> None:
    assert ot.last_json_line('progress\n{"a": 1}\n{"b": 2}\n--- done') == {"b": 2}
    with pytest.raises(ValueError, match="no JSON report"):
        ot.last_json_line("progress only\n{broken")


def test_rounds_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ot.main(["/tmp/x", "--rounds", "0"])
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err


def test_table_marks_unjudged_rows(capsys: pytest.CaptureFixture[str]) -> None:
    ot.print_table([ot.Row(19, "t", "m", None), ot.Row(20, "u", "n", True)], "some GPU")
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == ["| 19 | t | m | - |", "| 20 | u | n | yes |"] and "some GPU" in out[1]
    assert math.isclose(ot.ATTENTION_TB_S / ot.H200_READ_TB_S, 0.9375)
