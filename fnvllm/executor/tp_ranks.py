"""What every tensor-parallel rank runs: joining the group, the message protocol, and the worker loop.

Messages (``Step``, ``Reset``, ``Report``, ``Stop``) are pickled and broadcast by rank 0 on a gloo group of their
own (the control group), one ``Channel`` frame each: an 8-byte length, then the bytes, in one broadcast of
``frame_bytes`` (a decode step of 256 sequences pickles to ~8 KB with 256-token blocks, ~58 KB with 16-token
blocks). A larger message (a long prefill chunk) sends its rest in a second broadcast, and both ends then widen the
frame to fit it (up to ``_MAX_FRAME``), so a run settles on one broadcast per step. Rank 0 posts a step's
broadcast without waiting for it and launches its own shard meanwhile (``tp.Ranks.post``).

Workers block on the next message for as long as rank 0 stays idle (the control group's timeout is a year); when
rank 0's process goes away the broadcast fails (its connection closes) and the worker exits. A worker that fails
writes its traceback to the group's store, where rank 0 reads it when it reports the failure (``tp.Ranks``).
A ``Report`` makes each worker write its timing since the last one (``WorkerStats``) to the store.
"""

from __future__ import annotations

import contextlib
import datetime
import json
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
from fnvllm.executor.prompt_logprobs import prompt_rows
from fnvllm.model.config import ModelConfig
from fnvllm.model.sharding import TensorParallel
from fnvllm.state import StepPlan

_IDLE = datetime.timedelta(days=365)  # how long a worker waits for rank 0's next message (rank 0 may sit idle)
_MAX_TRACEBACK = 8000  # characters of a worker's traceback carried back to rank 0
_FIRST_FRAME = 16 << 10  # bytes of a control broadcast until a larger message widens it
_MAX_FRAME = 1 << 20  # the frame never widens past this; larger messages take two broadcasts
_HEADER = 8  # the frame's little-endian payload length


@attrs.frozen
class Step:
    """Run this plan (sent without the fields only sampling reads). posted_at: rank 0's ``time.perf_counter()``
    when it sent the step (one clock for every process of a host; only the workers' timing reads it). fed: the
    plan's input ids are the previous step's samples, which rank 0 broadcast to every rank after sampling."""

    plan: StepPlan
    posted_at: float = 0.0
    fed: bool = False  # overlapped: feed the plan from the previous step's sampled ids (on the device)


@attrs.frozen
class Reset:
    """Forget the KV cache and expect ``next_step``."""

    next_step: int


@attrs.frozen
class Report:
    """Write this worker's ``WorkerStats`` since the last Report to the store (``stats_key``), then start anew."""


@attrs.frozen
class Stop:
    """Leave the serving loop."""


Message = Step | Reset | Report | Stop


@attrs.define(eq=False)
class Channel:
    """One end of the control group: rank 0 ``post``s messages, workers ``receive`` them, in frames of
    ``frame_bytes`` (see the module docstring). Both ends widen the frame alike, after every message."""

    group: Any
    frame_bytes: int = _FIRST_FRAME
    _inbox: torch.Tensor | None = None  # a worker's receive frame, reused while the frame size holds

    def post(self, message: Message) -> tuple[list[Any], list[torch.Tensor]]:
        """Start broadcasting ``message`` (rank 0); returns the async works and the buffers they read, which
        must stay alive until the works complete."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        room = self.frame_bytes - _HEADER
        frame = bytearray(self.frame_bytes)
        frame[:_HEADER] = len(payload).to_bytes(_HEADER, "little")
        frame[_HEADER : _HEADER + min(room, len(payload))] = payload[:room]
        buffers = [torch.frombuffer(frame, dtype=torch.uint8)]
        if len(payload) > room:
            buffers.append(torch.frombuffer(bytearray(payload[room:]), dtype=torch.uint8))
        works = [dist.broadcast(b, src=0, group=self.group, async_op=True) for b in buffers]
        self._widen(len(payload))
        return works, buffers

    def receive(self) -> Message:
        """The next message rank 0 broadcasts (a worker; blocks until it comes)."""
        if self._inbox is None or self._inbox.numel() != self.frame_bytes:
            self._inbox = torch.empty(self.frame_bytes, dtype=torch.uint8)
        dist.broadcast(self._inbox, src=0, group=self.group)
        frame = memoryview(self._inbox.numpy())
        size, room = int.from_bytes(frame[:_HEADER], "little"), self.frame_bytes - _HEADER
        payload: bytes | memoryview = frame[_HEADER : _HEADER + size]
        if size > room:
            rest = torch.empty(size - room, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            payload = bytes(payload) + rest.numpy().tobytes()
        message = pickle.loads(payload)  # sent by rank 0 of our own group, never by a stranger
        self._widen(size)
        if not isinstance(message, Step | Reset | Report | Stop):
            raise TypeError(f"rank 0 sent {type(message).__name__}; expected Step, Reset, Report or Stop")
        return message

    def _widen(self, size: int) -> None:
        """After a message of ``size`` bytes: grow the frame to the power of two that holds it (capped)."""
        if size + _HEADER > self.frame_bytes:
            self.frame_bytes = min(_MAX_FRAME, 1 << (size + _HEADER - 1).bit_length())


@attrs.define
class WorkerStats:
    """A worker's timing of the steps since the last Report, in seconds summed over ``steps``.

    idle_s: blocked waiting for the next message. delivery_s: from rank 0 posting a step to this worker holding
    the unpickled plan (perf_counter is one clock per host). execute_s: ``ModelExecutor.launch`` on the host
    (input preparation and kernel launches; a worker never waits for its device)."""

    steps: int = 0
    idle_s: float = 0.0
    delivery_s: float = 0.0
    execute_s: float = 0.0
    max_execute_s: float = 0.0

    def add(self, idle_s: float, delivery_s: float, execute_s: float) -> None:
        """Count one step."""
        self.steps += 1
        self.idle_s += idle_s
        self.delivery_s += delivery_s
        self.execute_s += execute_s
        self.max_execute_s = max(self.max_execute_s, execute_s)


def worker_plan(plan: StepPlan) -> StepPlan:
    """``plan`` without its sampling fields (workers do not sample): less to pickle every step.

    A step that scores prompt logprobs keeps ``params`` and ``num_generated``, from which every rank finds the
    rows to score (``prompt_rows``): scoring runs the LM head over those rows, and its logits gather is a
    collective, so a worker that found no rows would skip it, and run the step's other collectives out of step
    with rank 0's (a hang until the timeout). Only such steps pay for pickling the params."""
    if prompt_rows(plan):
        return attrs.evolve(plan, histories=())
    return attrs.evolve(plan, params=(), num_generated=(), histories=())


def error_key(rank: int) -> str:
    """The store key under which worker ``rank`` leaves its traceback."""
    return f"fnvllm/error/{rank}"


def stats_key(rank: int) -> str:
    """The store key under which worker ``rank`` answers a Report (JSON of its WorkerStats and executor)."""
    return f"fnvllm/stats/{rank}"


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

    def wait(self, done: torch.cuda.Event | None) -> None:
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
        _serve_loop(executor, Channel(control), store, rank)
    except BaseException:
        _report(store, rank)
        raise
    executor.close()
    dist.destroy_process_group()


def _serve_loop(executor: ModelExecutor, channel: Channel, store: Any, rank: int) -> None:
    """Apply rank 0's messages until Stop, timing each step (two clock reads). A step is launched, never waited
    for (a worker returns no tokens); the last one's handle feeds the next step when rank 0 says ``fed``."""
    stats = WorkerStats()
    previous = None
    while True:
        waited = time.perf_counter()
        message = channel.receive()
        received = time.perf_counter()
        if isinstance(message, Step):
            previous = executor.launch(message.plan, fed_by=previous if message.fed else None)
            stats.add(received - waited, received - message.posted_at, time.perf_counter() - received)
        elif isinstance(message, Reset):
            executor.reset(message.next_step)
        elif isinstance(message, Report):
            info = {"graphs": executor.graphs is not None, "backend": executor.backend.name}
            store.set(stats_key(rank), json.dumps({**attrs.asdict(stats), **info}))
            stats = WorkerStats()
        else:
            return


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
