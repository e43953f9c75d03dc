"""benchmarks/sweep_small.py prints table literals to paste into skinny_gemm.py: each key at most once, even when
the sweep measured several row counts of one rows bucket (``--rows 16,32,64``: 32 and 64 share the 17-64 bucket)."""

from __future__ import annotations

import ast

import pytest

from benchmarks import sweep_small
from fnvllm.kernels.skinny_gemm import SkinnyConfig


def _row(m: int, gemm: str = "o", n: int = 1024, k: int = 2048) -> dict:
    cfg = SkinnyConfig(16 if m <= 16 else 64, 32, 256, 4, 4, 3)
    return {"part": "partials", "shape": "0.6b", "gemm": gemm, "m": m, "n": n, "k": k, "best_cfg": cfg,
            "best_us": 4.0 + m / 100, "checkout_us": 9.0}  # fmt: skip


def _printed_keys(text: str) -> list[tuple]:
    """The keys of the one dict literal in ``text``, as tuples."""
    start = text.index("{")
    tree = ast.parse(text[start : text.rindex("}") + 1], mode="eval")
    assert isinstance(tree.body, ast.Dict)
    return [ast.literal_eval(key) for key in tree.body.keys if key is not None]


def test_one_per_key_keeps_the_row_at_the_buckets_own_count() -> None:
    rows = [_row(16), _row(32), _row(64), _row(32, "down", k=3072), _row(20, "down", k=3072)]
    kept, dropped = sweep_small.one_per_key(rows, sweep_small._tuned_key)
    assert [(r["gemm"], r["m"]) for r in kept] == [("o", 16), ("o", 64), ("down", 32)]
    assert [(r["gemm"], r["m"]) for r in dropped] == [("o", 32), ("down", 20)]
    # the order of the measurements does not decide
    kept_reversed, _ = sweep_small.one_per_key(rows[::-1], sweep_small._tuned_key)
    assert {(r["gemm"], r["m"]) for r in kept_reversed} == {(r["gemm"], r["m"]) for r in kept}


def test_partials_literal_names_each_key_once(capsys: pytest.CaptureFixture[str]) -> None:
    sweep_small.print_partials_literal([_row(16), _row(32), _row(64)])
    text = capsys.readouterr().out
    keys = _printed_keys(text)
    assert keys == [(1024, 2048, 16), (1024, 2048, 64)]
    assert "at 32 rows: measured, left out" in text
    # the 64-row entry carries the 64-row measurement, not the 32-row one
    assert "4.64, 9.00" in text and "4.32, 9.00" not in text
