"""How many CPU threads torch uses when the model runs on the CPU.

torch starts with one intra-op thread per core. For a small model every operator is too short to split well, and
when other processes share the cores a thread waiting at an OpenMP barrier waits for one that is descheduled.
Measured on the 2-core development VM with ``benchmarks/cpu_threads.py`` (BENCHMARKS.md), two threads against
one: on an idle machine 1.17x (demo model, 4.5M matmul parameters), 1.23x (bench tiny, 1.8M), 1.45x (27M) and
1.34x (77M); with one other process spinning, 0.43x, 0.27x and 0.17x; on the machine shared with other test runs
(load ~4), 0.03x, 0.06x, 0.10x and 0.63x. Two threads win at most ~1.45x and lose up to ~30x below a few tens of
millions of parameters, so small models get one thread.

The rule, applied when an executor is built on the CPU (``set_cpu_threads``):

* The user's choice stands: ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` set in the environment, or a
  ``torch.set_num_threads(n)`` call (a count that differs from the one torch started with and from the one
  fnvllm last set).
* Otherwise one thread below ``SMALL_MODEL_PARAMS`` matmul parameters per rank, else torch's default split among
  the tensor-parallel ranks that share this host (at least one each).
"""

from __future__ import annotations

import os
from typing import Any

import torch

SMALL_MODEL_PARAMS = 50_000_000
"""Below this many matmul parameters (per rank) a model runs on one CPU thread unless the user chose otherwise."""

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Environment variables that fix torch's thread count; when one is set, fnvllm leaves the count alone."""

_STARTUP_THREADS = torch.get_num_threads()  # torch's own default, read before any fnvllm code could change it
_chosen_here: list[int] = []  # the count set_cpu_threads last set (a later executor may choose again)


def matmul_params(config: Any) -> int:
    """Weights one token multiplies through: attention and MLP projections of every layer, and the LM head."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    return int(config.num_hidden_layers * per_layer + config.vocab_size * h)


def user_chose_threads() -> bool:
    """True when the thread count is the user's: an environment variable, or ``torch.set_num_threads`` was called
    with a count other than torch's start-up default and the last count fnvllm set."""
    if any(os.environ.get(name) for name in THREAD_ENV_VARS):
        return True
    return torch.get_num_threads() not in (_STARTUP_THREADS, *_chosen_here[-1:])


def cpu_threads_for(num_params: int, world_size: int = 1, default_threads: int = _STARTUP_THREADS) -> int:
    """The thread count for a model of ``num_params`` matmul parameters per rank, with ``world_size`` ranks on
    this host: 1 for a small model, else ``default_threads`` shared among the ranks (at least 1)."""
    if num_params < SMALL_MODEL_PARAMS:
        return 1
    return max(1, default_threads // world_size)


def host_memory_bytes() -> int:
    """The host's physical memory, in bytes (what a CPU KV cache and the CPU buffers are checked against)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def set_cpu_threads(device: torch.device, config: Any, world_size: int = 1) -> int | None:
    """Set torch's intra-op thread count for a model run on the CPU; returns the count set, or None when nothing
    was changed (a GPU device, or a count the user chose)."""
    if device.type != "cpu" or user_chose_threads():
        return None
    threads = cpu_threads_for(matmul_params(config) // world_size, world_size)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    _chosen_here[:] = [threads]
    return threads
