"""Qwen3-MoE under tensor parallelism at world size 2 on the CPU (gloo): experts split on their intermediate
dim (every rank holds every expert's slice), the same greedy tokens as one process."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tp import check_tp2_greedy
from tiny_models import MOE_FAMILIES, write_family


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_tp2_greedy_equals_tp1(tmp_path: Path, family: str) -> None:
    """Greedy outputs at tensor_parallel_size=2 equal one process's, with prefix-cache hits and preemptions
    (each rank computes a partial sum over its half of every expert; the dense layer splits as usual)."""
    check_tp2_greedy(write_family(tmp_path, family)).close()
