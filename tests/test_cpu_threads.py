"""The CPU thread policy (fnvllm.executor.threads): one thread for small models, the user's choice always kept."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from fnvllm.demo import model_path
from fnvllm.executor import threads
from fnvllm.executor.threads import SMALL_MODEL_PARAMS, cpu_threads_for, matmul_params, set_cpu_threads
from fnvllm.model.config import ModelConfig

CPU = torch.device("cpu")


@pytest.fixture
def restore_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No thread variables in the environment during the test; torch's count and the policy's memory restored."""
    for name in threads.THREAD_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    before, chosen = torch.get_num_threads(), list(threads._chosen_here)
    yield
    torch.set_num_threads(before)
    threads._chosen_here[:] = chosen


def demo_config() -> ModelConfig:
    """The embedded demo model's config (4.5M matmul parameters)."""
    return ModelConfig.from_pretrained(model_path())


def test_small_models_get_one_thread_large_ones_share_the_default() -> None:
    """Below the threshold the count is 1; above it torch's default split among the ranks on this host."""
    assert cpu_threads_for(SMALL_MODEL_PARAMS - 1, 1, default_threads=8) == 1
    assert cpu_threads_for(SMALL_MODEL_PARAMS, 1, default_threads=8) == 8
    assert cpu_threads_for(SMALL_MODEL_PARAMS, 2, default_threads=8) == 4
    assert cpu_threads_for(SMALL_MODEL_PARAMS, 16, default_threads=8) == 1


def test_demo_model_counts_as_small() -> None:
    """The demo model's matmul parameters (projections + LM head) are counted, and it falls below the threshold."""
    cfg = demo_config()
    per_layer = 256 * (256 + 2 * 128) + 256 * 256 + 3 * 256 * 640
    assert matmul_params(cfg) == 5 * per_layer + 4096 * 256
    assert matmul_params(cfg) < SMALL_MODEL_PARAMS


def test_set_cpu_threads_sets_one_thread_for_the_demo_model(restore_threads: None) -> None:
    """With no user choice, building for the demo model on the CPU sets torch to one thread."""
    torch.set_num_threads(threads._STARTUP_THREADS)
    assert set_cpu_threads(CPU, demo_config()) == 1
    assert torch.get_num_threads() == 1


def test_environment_variable_is_respected(restore_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """OMP_NUM_THREADS in the environment means the count is left alone."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(threads._STARTUP_THREADS)
    assert set_cpu_threads(CPU, demo_config()) is None
    assert torch.get_num_threads() == threads._STARTUP_THREADS


def test_explicit_set_num_threads_is_respected(restore_threads: None) -> None:
    """A torch.set_num_threads call with a count of the user's own is not overridden."""
    mine = threads._STARTUP_THREADS + 2
    torch.set_num_threads(mine)
    assert set_cpu_threads(CPU, demo_config()) is None
    assert torch.get_num_threads() == mine


def test_gpu_devices_are_left_alone(restore_threads: None) -> None:
    """The policy applies only to CPU executors."""
    torch.set_num_threads(threads._STARTUP_THREADS)
    assert set_cpu_threads(torch.device("cuda"), demo_config()) is None
    assert torch.get_num_threads() == threads._STARTUP_THREADS


def test_llm_on_cpu_runs_the_demo_model_on_one_thread() -> None:
    """A fresh process without thread variables builds the demo LLM and ends up with one torch thread."""
    env = {k: v for k, v in os.environ.items() if k not in threads.THREAD_ENV_VARS}
    code = (
        "import torch; from fnvllm.llm import LLM; from fnvllm.demo import model_path; "
        "LLM(model_path(), device='cpu', num_blocks=16); print(torch.get_num_threads())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "1"
