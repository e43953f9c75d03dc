"""benchmarks/step_summary.py: the latency table of a device call's runs and the variants it sends to a second look."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.step_summary import latency_rows, winners


def test_winners_beat_base_mean_by_one_percent_at_some_batch_best_first() -> None:
    rows = [
        ("base_1-1", 16, 1.00), ("base_1-4", 16, 1.02), ("base_1-1", 64, 1.50), ("base_1-4", 64, 1.50),
        ("a_1-2", 16, 0.99), ("a_1-2", 64, 1.47),  # 2.0 % below the means (1.01, 1.50) at both
        ("b_1-3", 16, 1.005), ("b_1-3", 64, 1.49),  # 0.5 % / 0.7 %: not picked
        ("c-x_1-5", 16, 0.95), ("c-x_1-5", 64, 1.60),  # 5.9 % at 16 requests, slower at 64: picked, first
    ]  # fmt: skip
    assert winners(rows, {"c-x": "cuda:x"}) == ["cuda:x", "a"]
    assert winners([("a_1", 16, 0.5)], {}) == []  # no base run at that batch: nothing to beat


def test_latency_rows_read_the_last_json_line_and_report_missing_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = {"latency": [{"requests": 16, "ms_per_step": 1.1, "decode_timeline": {"mean_gpu_ms": 1.02,
                                                                                    "mean_cpu_ms": 0.3}}]}  # fmt: skip
    (tmp_path / "base_1.log").write_text("variant base\nlogs\n" + json.dumps(report) + "\n")
    assert latency_rows(tmp_path, ["base_1", "gone_1"]) == [("base_1", 16, 1.02)]
    printed = capsys.readouterr().out
    assert "gone_1" in printed and "no report" in printed and "1.02" in printed
