"""Shared pytest configuration: Hypothesis profiles, and Triton's interpreter on machines without a GPU.

``ci`` (the default when the ``CI`` environment variable is set) runs many examples deterministically;
``dev`` (the default otherwise) is a quick pass. ``HYPOTHESIS_PROFILE=ci|dev`` picks one explicitly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

# Triton decides at @triton.jit time whether to interpret, so this must run before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from _interpreter_speed import speed_up_nested_jit_calls

    speed_up_nested_jit_calls()

settings.register_profile(
    "ci",
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

MAX_AUTO_WORKERS = 4


@pytest.hookimpl(hookwrapper=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> Iterator[None]:
    """``-n auto`` (the README's test command): xdist's worker per CPU, at most four. Each worker imports torch and
    Triton and runs mostly one busy thread, so past a few workers a big machine gains little and pays memory.
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` (read by xdist) is not capped."""
    outcome = yield
    if not os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        outcome.force_result(min(MAX_AUTO_WORKERS, outcome.get_result()))
