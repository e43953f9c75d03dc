"""What every tensor-parallel rank runs: joining the group, the message protocol, and the worker loop.

Messages (``Step``, ``Reset``, ``Stop``) are pickled and broadcast by rank 0 on a gloo group of their own (the
control group), size-prefixed: an int64 length, then the bytes. Workers block on the next message for as long as
rank 0 stays idle (the control group's timeout is a year); when rank 0's process goes away the broadcast fails
(its connection closes) and the worker exits. A worker that fails writes its traceback to the group's store,
where rank 0 reads it when it reports the failure (``tp.Ranks``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from fnvllm.config import EngineConfig
from fnvllm.executor.model_executor import ModelExecutor, resolve_device
from fnvllm.model.config import ModelConfig
from fnvllm.model.sharding import TensorParallel
from fnvllm.state import StepPlan

_IDLE = datetime.timedelta(days=365)  # how long a worker waits for rank 0's next message (rank 0 may sit idle)
_MAX_TRACEBACK = 8000  # characters of a worker's traceback carried back to rank 0


@attrs.frozen
class Step:
    """Run this plan (sent without the fields only sampling reads)."""

    plan: StepPlan


@attrs.frozen
class Reset:
    """Forget the KV cache and expect ``next_step``."""

    next_step: int


@attrs.frozen
class Stop:
    """Leave the serving loop."""


Message = Step | Reset | Stop


def encode(message: Message) -> tuple[torch.Tensor, torch.Tensor]:
    """(length (1,) int64, payload (length,) uint8) of a pickled message, the two broadcasts rank 0 makes."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.tensor([len(payload)], dtype=torch.int64), torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def receive(group: Any) -> Message:
    """The next message rank 0 broadcasts on ``group`` (blocks until it comes)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=group)
    message = pickle.loads(payload.numpy().tobytes())  # sent by rank 0 of our own group, never by a stranger
    if not isinstance(message, Step | Reset | Stop):
        raise TypeError(f"rank 0 sent {type(message).__name__}; expected Step, Reset or Stop")
    return message


def worker_plan(plan: StepPlan) -> StepPlan:
    """``plan`` without its sampling fields (workers do not sample): less to pickle every step."""
    return attrs.evolve(plan, params=(), num_generated=(), histories=())


def error_key(rank: int) -> str:
    """The store key under which worker ``rank`` leaves its traceback."""
    return f"fnvllm/error/{rank}"


def join_group(
    rank: int, world: int, local_rank: int, is_cuda: bool, timeout_s: float, store: Any
) -> tuple[TensorParallel, Any, Any]:
    """Join the model's process group (through ``store``, else ``env://``: torchrun) and the control group.

    Returns (this rank's TensorParallel, the control group, the store for error reports). NCCL on CUDA, gloo on
    the CPU; the model's collectives time out after ``timeout_s``."""
    if is_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if is_cuda else "gloo",
            init_method=None if store is not None else "env://",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if dist.get_world_size() != world:
        raise ValueError(f"tensor_parallel_size={world} but the torch.distributed world has {dist.get_world_size()}")
    control = dist.new_group(backend="gloo", timeout=_IDLE)
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    return TensorParallel(rank, world, local_rank, None), control, store


@attrs.frozen(eq=False)
class WorkerGuard:
    """A worker's side of rank 0's ``RankGuard``: it meets rank 0 after loading, and never waits on tokens."""

    control: Any

    def loaded(self) -> None:
        """Meet rank 0 and the other workers once this rank's weights are loaded."""
        dist.barrier(group=self.control)

    def wait(self, tensor: torch.Tensor) -> None:
        """Nothing: workers do not copy tokens to the host."""


def serve(
    model_path: str | Path,
    config: EngineConfig,
    model_config: ModelConfig,
    rank: int,
    local_rank: int,
    store: Any,
) -> None:
    """A worker rank: build this rank's executor, then apply every message rank 0 sends until Stop. Any error
    is written to the store for rank 0 and re-raised."""
    is_cuda = resolve_device(config.device).type == "cuda"
    world = config.tensor_parallel_size
    tp, control, store = join_group(rank, world, local_rank, is_cuda, config.distributed_timeout_s, store)
    try:
        executor = ModelExecutor(model_path, config, model_config, tp, guard=WorkerGuard(control))
        while not isinstance(message := receive(control), Stop):
            if isinstance(message, Reset):
                executor.reset(message.next_step)
            else:
                executor.execute(message.plan)
    except BaseException:
        _report(store, rank)
        raise
    executor.close()
    dist.destroy_process_group()


def _report(store: Any, rank: int) -> None:
    """Leave the current exception's traceback for rank 0 (best effort: rank 0 may be gone)."""
    with contextlib.suppress(Exception):  # rank 0 is gone: nobody is left to tell
        store.set(error_key(rank), traceback.format_exc()[-_MAX_TRACEBACK:])


def worker_main(
    rank: int, port: int, parent_pid: int, model_path: Path, config: EngineConfig, model_config: ModelConfig
) -> None:
    """Entry point of a spawned worker: reach rank 0's store on ``port``, serve, exit 1 on any error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; its exit stops us
    _exit_with_parent(parent_pid)
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False)
    store.set(f"fnvllm/up/{rank}", "1")
    try:
        serve(model_path, config, model_config, rank, rank, store)
    except BaseException:
        sys.exit(1)  # the traceback went to rank 0, which reports it


def _exit_with_parent(parent_pid: int) -> None:
    """Exit this worker when rank 0's process is gone, even if the worker is stuck in a collective."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="fnvllm-parent-watch").start()


def torchrun_rank(world: int) -> int | None:
    """This process's rank when torchrun started it (RANK and WORLD_SIZE set), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    if int(os.environ["WORLD_SIZE"]) != world:
        raise ValueError(f"tensor_parallel_size={world} but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']}")
    return int(os.environ["RANK"])


def local_rank() -> int:
    """This process's GPU index on its host (torchrun's LOCAL_RANK; 0 for the process that spawns workers)."""
    return int(os.environ.get("LOCAL_RANK", "0"))
