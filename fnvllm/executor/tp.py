"""Tensor parallelism over torch.distributed: rank 0 drives, every rank runs the same executor step.

Rank 0 is the process holding the ``LLM``; it alone owns the pure state and the scheduler. One step:

    rank 0:   workers alive? -> post(Step(plan)) -> ModelExecutor.launch(plan) -> collect: sampled tokens
    rank k:   plan = receive()                  -> ModelExecutor.launch(plan)  (no sampling)

Overlapped steps (on CUDA, ``overlap_steps``): after sampling, rank 0 broadcasts the step's sampled ids to every
rank (one (S,) int64 NCCL broadcast); a speculative next step goes out as ``Step(plan, fed=True)`` and every rank
feeds it from those ids on its device, so rank 0 launches step N+1 before it waits for step N's tokens.
Dropping a speculative step is a ``Reset`` to its step number.

``post`` starts one gloo broadcast and returns: rank 0 prepares and launches its own shard while the plan travels,
and checks that the broadcast completed before it waits for the step's tokens. A worker's launch therefore trails
rank 0's by the delivery plus the worker's unpickling (tens of microseconds), not by a round trip per message and
a sleeping poll (a blocking two-broadcast send cost far more per step: BENCHMARKS.md).

Both ``execute`` calls run the same forward on their slice of the model (``fnvllm.model.sharding``: all-reduces
inside, the same CUDA-graph bucket replayed), then gather the logits on rank 0, which samples. The message
protocol and the worker loop are in ``tp_ranks.py``. The model's collectives use NCCL on CUDA, gloo on the CPU.

Launch. ``LLM(path, tensor_parallel_size=N)`` spawns N-1 workers (torch.multiprocessing, spawn) that meet rank 0
at a TCPStore on a port the OS picks; as with any spawn, a script must guard its entry with
``if __name__ == "__main__":``. A process started by ``torchrun`` (RANK / WORLD_SIZE set) joins that group
(``env://``) instead: every rank runs the script, and on ranks > 0 ``LLM(...)`` serves rank 0, then exits the
process (``SystemExit(0)``) when rank 0 closes. Across nodes:

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE --rdzv-backend c10d --rdzv-endpoint $HOST:29500 app.py

Failures. Rank 0 never waits without a bound (``distributed_timeout_s``): start-up polls worker liveness, each
step checks the workers are alive before sending, a dead peer fails gloo collectives at once, and on CUDA rank 0
polls the step's completion instead of blocking in the host copy (spinning: the poll is what a blocking copy
would do, without the hang). A failure mid-step leaves the ranks out of
step, so the executor is then broken: that call and every later one raise ``TensorParallelError`` naming the
cause (the dead worker's exit code or signal, or the traceback a failing worker left in the store).

Shutdown. ``close()`` (also a finalizer and an atexit hook) sends Stop, joins the workers, terminates any that
linger and destroys the process group. Workers ignore SIGINT (Ctrl-C interrupts rank 0, whose exit stops them)
and exit by themselves when rank 0 disappears.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fnvllm.config import EngineConfig
from fnvllm.executor.base import ExecuteResult, check_step
from fnvllm.executor.model_executor import Launched, ModelExecutor, resolve_device
from fnvllm.executor.tp_ranks import (
    Channel,
    Message,
    Report,
    Reset,
    Step,
    Stop,
    error_key,
    join_group,
    local_rank,
    serve,
    stats_key,
    torchrun_rank,
    worker_main,
    worker_plan,
)
from fnvllm.model.config import ModelConfig
from fnvllm.model.sharding import check_shardable
from fnvllm.state import InvalidConfigError, StepPlan

_JOIN_S = 10.0  # a stopped worker's time to exit before it is terminated
_DYING_S = 2.0  # after a failed collective, how long to wait for the failed worker's exit to show
_SPIN_S = 2e-3  # a poll spins this long before it starts to sleep (time.sleep's floor is ~50-60 us on Linux)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, failed or timed out; this LLM cannot continue (build a new one)."""


@attrs.define(eq=False)
class Ranks:
    """Rank 0's handle on the group: the worker processes (none under torchrun), the store they report errors
    to, the control channel and the message still in flight on it, and whether the group is broken or closed.
    The ``RankGuard`` of rank 0's executor."""

    world_size: int
    timeout_s: float
    is_cuda: bool
    processes: tuple[Any, ...] = ()
    store: Any = None
    owns_group: bool = True
    channel: Channel | None = None
    in_flight: tuple[list[Any], list[torch.Tensor], str] | None = None  # works, their buffers, what it was for
    broken: str | None = None
    closed: bool = False

    def check_alive(self, what: str) -> None:
        """Raise TensorParallelError if the group is closed, broken, or a worker process has exited."""
        if self.closed:
            raise TensorParallelError("this tensor-parallel executor is closed")
        if self.broken is None and any(not p.is_alive() for p in self.processes):
            raise self.fail(what, None)
        if self.broken is not None:
            raise TensorParallelError(self.broken)

    def _dead(self) -> str | None:
        """The exited workers and any traceback a worker left, or None when every worker lives and none failed."""
        lines = [
            f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}{_signal_name(p.exitcode)}"
            for rank, p in enumerate(self.processes, start=1)
            if not p.is_alive()
        ]
        return "\n".join(lines + self._tracebacks()) or None

    def _tracebacks(self) -> list[str]:
        """What failing workers wrote to the store (nothing if it cannot be reached)."""
        keys = [error_key(rank) for rank in range(1, self.world_size)]
        try:
            found = [(rank, k) for rank, k in enumerate(keys, start=1) if self.store.check([k])]
            return [f"worker rank {rank} raised:\n{self.store.get(k).decode()}" for rank, k in found]
        except Exception:
            return []

    def fail(self, what: str, cause: BaseException | None) -> TensorParallelError:
        """Mark the group broken; return the error naming the cause (a dead worker's exit, if one died)."""
        deadline = time.monotonic() + _DYING_S
        while (dead := self._dead()) is None and self.processes and time.monotonic() < deadline:
            time.sleep(0.05)
        if dead is None:
            dead = f"rank 0 failed: {cause!r}" if cause is not None else f"no answer within {self.timeout_s} s"
        self.broken = f"{what} failed: {dead}\nThis LLM cannot continue: close it and build a new one."
        return TensorParallelError(self.broken)

    def poll(self, is_done: Callable[[], bool], what: str, max_sleep_s: float) -> None:
        """Wait until ``is_done()``: spin for ``_SPIN_S``, then sleep up to ``max_sleep_s`` between looks; every
        0.1 s check that the workers live and ``timeout_s`` has not passed, else raise TensorParallelError."""
        now = time.monotonic()
        deadline, next_check, spin_until, sleep_s = now + self.timeout_s, now + 0.1, now + _SPIN_S, 0.0
        while not is_done():
            time.sleep(sleep_s)  # sleep(0) only yields the GIL
            if (now := time.monotonic()) > spin_until:
                sleep_s = min(max_sleep_s, 2 * sleep_s + 1e-5)
            if now > next_check:
                if now > deadline or any(not p.is_alive() for p in self.processes):
                    _abort_nccl(self.is_cuda)
                    raise self.fail(what, None)
                next_check = now + 0.1

    def await_work(self, work: Any, what: str, max_sleep_s: float = 1e-3) -> None:
        """Poll an async gloo operation to completion (see ``poll``); raise if it failed."""
        self.poll(work.is_completed, what, max_sleep_s)
        try:
            work.wait()
        except Exception as e:
            raise self.fail(what, e) from e

    def post(self, message: Message, what: str) -> None:
        """Start broadcasting ``message`` to every worker and return (``finish_send`` waits for it)."""
        self.finish_send()
        assert self.channel is not None  # set once the group is joined, before any message
        self.in_flight = (*self.channel.post(message), what)

    def finish_send(self) -> None:
        """Wait (bounded) until the posted message has gone out; usually it has, and this costs one look."""
        if self.in_flight is not None:
            works, _, what = self.in_flight
            self.in_flight = None  # the buffers may go once the works are done or failed
            for work in works:
                self.await_work(work, what)

    def send(self, message: Message, what: str) -> None:
        """Broadcast ``message`` to every worker and wait until it has gone out."""
        self.post(message, what)
        self.finish_send()

    def worker_stats(self) -> list[dict[str, Any]]:
        """Each worker's ``WorkerStats`` since the previous call (and whether it replays CUDA graphs)."""
        keys = [stats_key(rank) for rank in range(1, self.world_size)]
        for key in keys:
            with contextlib.suppress(Exception):  # absent: nothing to clear
                self.store.delete_key(key)
        self.send(Report(), "collecting worker timings")
        self.poll(lambda: self.store.check(keys), "collecting worker timings", 0.01)
        return [json.loads(self.store.get(key)) for key in keys]

    def loaded(self) -> None:
        """Wait until every rank has loaded its weights, before the first collective (which could hang on NCCL)."""
        assert self.channel is not None
        self.await_work(dist.barrier(group=self.channel.group, async_op=True), "loading the weights", 0.01)

    def wait(self, done: torch.cuda.Event | None) -> None:
        """The step's plan has reached the workers; on CUDA, poll ``done`` (recorded behind the step's copy of its
        samples to the host) instead of blocking on it: a dead worker would hang a blocking wait forever."""
        self.finish_send()
        if done is not None:
            self.poll(done.query, "a step", 0.0)  # spin, as a blocking wait would

    def shutdown(self, local: ModelExecutor | None) -> None:
        """Stop the workers (terminating any that linger) and destroy the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.broken is None and self.channel is not None and all(p.is_alive() for p in self.processes):
            with contextlib.suppress(TensorParallelError):  # a worker that cannot hear it is terminated below
                self.send(Stop(), "stopping the workers")
        _join_or_kill(self.processes, _JOIN_S if self.broken is None else 0.5)
        if local is not None:
            local.close()
        if self.owns_group and dist.is_initialized():
            if self.broken is not None and self.is_cuda:
                _abort_nccl(True)  # a destroy could wait on a collective that never ends
            else:
                dist.destroy_process_group()


def check_fp8_shards(model_config: ModelConfig, world: int) -> None:
    """InvalidConfigError naming tensor_parallel_size when FP8 weights cannot be split over ``world`` ranks on their
    128-wide scale blocks, found before any worker starts: every rank's modules are built on the meta device (no
    memory, no init), where the layers check their shards (``quant.check_block_aligned``)."""
    if model_config.quantization is None:
        return
    from fnvllm.model.loader import build_on_meta
    from fnvllm.model.sharding import TensorParallel

    for rank in range(world):
        try:
            build_on_meta(model_config, tp=TensorParallel(rank, world))
        except ValueError as error:
            raise InvalidConfigError(f"EngineConfig.tensor_parallel_size={world}: rank {rank}: {error}") from None


class TensorParallelExecutor:
    """Rank 0 of a tensor-parallel group: the ``Executor`` that ``LLM`` drives when tensor_parallel_size > 1.

    ``execute`` sends the plan to the workers and runs rank 0's shard; ``reset`` is sent too; ``close`` stops the
    workers. What the engine and benchmarks read (device, backend, graphs, num_blocks, timeline, model) is rank
    0's ``ModelExecutor``'s.
    """

    def __init__(self, model_path: str | Path, config: EngineConfig, model_config: ModelConfig) -> None:
        world = config.tensor_parallel_size
        check_shardable(model_config, world)
        check_fp8_shards(model_config, world)
        is_cuda = resolve_device(config.device).type == "cuda"
        if is_cuda and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs; torch sees {torch.cuda.device_count()}")
        rank = torchrun_rank(world)
        if rank is not None and rank != 0:
            serve(model_path, config, model_config, rank, local_rank(), store=None)
            raise SystemExit(0)
        self.ranks = _launch(model_path, config, model_config, is_cuda, torchrun=rank is not None)
        try:
            timeout = config.distributed_timeout_s
            tp, control, self.ranks.store = join_group(0, world, local_rank(), is_cuda, timeout, self.ranks.store)
            self.ranks.channel = Channel(control)
            self.local = ModelExecutor(model_path, config, model_config, tp, guard=self.ranks)
        except BaseException as e:
            error = self.ranks.fail("starting the tensor-parallel group", e) if isinstance(e, Exception) else None
            self.ranks.broken = self.ranks.broken or "start-up was interrupted"
            self.ranks.shutdown(None)
            if error is not None:
                raise error from e
            raise
        self._finalizer = weakref.finalize(self, self.ranks.shutdown, self.local)
        _OPEN.add(self._finalizer)

    def __getattr__(self, name: str) -> Any:
        """device, backend, graphs, num_blocks, timeline, model, ...: rank 0's executor's."""
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def supports_overlap(self) -> bool:
        """Overlap steps on CUDA when ``overlap_steps`` is on: the workers get each step's sampled ids from rank 0
        by one broadcast and feed the next step from them, as rank 0 does."""
        return self.ranks.is_cuda and self.local.shares_samples

    def execute(self, plan: StepPlan) -> ExecuteResult:
        """Run ``plan`` on every rank; returns rank 0's sampled tokens. A stale plan is rejected before sending."""
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan, fed_by: object | None = None) -> Launched:
        """Send ``plan`` to the workers and launch rank 0's shard without waiting (``OverlapExecutor.launch``;
        with ``fed_by``, every rank feeds the plan from the previous step's samples on its device)."""
        what = f"step {plan.step}"
        self.ranks.check_alive(what)
        check_step(self.local.next_step, plan)
        with self._failing(what):
            self.ranks.post(Step(worker_plan(plan), time.perf_counter(), fed_by is not None), what)
            return self.local.launch(plan, fed_by)

    def collect(self, launched: object) -> ExecuteResult:
        """Rank 0's sampled tokens of a launched step (bounded waits: a dead worker raises, never hangs)."""
        assert isinstance(launched, Launched)
        what = f"step {launched.plan.step}"
        with self._failing(what):
            result = self.local.collect(launched)
            self.ranks.finish_send()  # steps that sample did this in ``wait``; empty and prefill-only ones do it here
            return result

    def discard(self, launched: object) -> None:
        """Every rank forgets a launched step that will not be collected and expects its step number again."""
        assert isinstance(launched, Launched)
        self.reset(launched.plan.step)

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """Turn an error inside ``what`` into a broken group (the ranks may be out of step)."""
        try:
            yield
        except TensorParallelError:
            raise
        except Exception as e:
            raise self.ranks.fail(what, e) from e
        except BaseException:
            self.ranks.broken = f"{what} was interrupted; the ranks are out of step: close this LLM, build a new one"
            raise

    def reset(self, next_step: int) -> None:
        """Every rank forgets its KV contents and expects ``next_step`` (after a broken step, rank 0 only)."""
        if self.ranks.broken is None and not self.ranks.closed:
            self.ranks.send(Reset(next_step), "reset")
        self.local.reset(next_step)

    def worker_stats(self) -> list[dict[str, Any]]:
        """Each worker's host timing since the previous call (``tp_ranks.WorkerStats``, summed seconds), for
        profiling: how long plans took to arrive and how long a worker took to launch its shard."""
        self.ranks.check_alive("collecting worker timings")
        return self.ranks.worker_stats()

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent; also run at collection and at exit)."""
        self._finalizer()
        _OPEN.discard(self._finalizer)


_OPEN: set[weakref.finalize] = set()  # type: ignore[type-arg]  # finalizers of executors not closed by hand


@atexit.register
def _close_all() -> None:
    """Close every open executor before multiprocessing's exit hook joins (and would wait forever on) workers;
    registered after it (torch imports multiprocessing first), so it runs before it."""
    for finalizer in list(_OPEN):
        finalizer()


def _launch(
    model_path: str | Path, config: EngineConfig, model_config: ModelConfig, is_cuda: bool, torchrun: bool
) -> Ranks:
    """Spawn the workers (not under torchrun) and wait until each has reached rank 0's store."""
    world, timeout = config.tensor_parallel_size, config.distributed_timeout_s
    if torchrun:
        return Ranks(world, timeout, is_cuda, owns_group=not dist.is_initialized())
    if dist.is_initialized():
        raise TensorParallelError("a torch.distributed group is already open in this process; close() its LLM first")
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)  # the OS picks the port
    ctx = mp.get_context("spawn")
    args = (store.port, os.getpid(), Path(model_path), config, model_config)
    processes = tuple(ctx.Process(target=worker_main, args=(rank, *args)) for rank in range(1, world))
    ranks = Ranks(world, timeout, is_cuda, processes, store)
    for p in processes:
        p.start()
    keys = [f"fnvllm/up/{rank}" for rank in range(1, world)]
    ranks.poll(lambda: store.check(keys), "starting the workers", 0.01)
    return ranks


def _join_or_kill(processes: tuple[Any, ...], grace_s: float) -> None:
    """Join each process within ``grace_s``; terminate, then kill, any still running."""
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()


def _abort_nccl(is_cuda: bool) -> None:
    """Abort the NCCL communicators so that kernels stuck on a dead peer end (best effort; experimental API)."""
    if not is_cuda or not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # an abort that cannot run leaves the process to exit as it is
        dist.distributed_c10d._abort_process_group()


def _signal_name(exitcode: int | None) -> str:
    """', killed by SIGKILL' for a negative exit code, else ''."""
    if exitcode is None or exitcode >= 0:
        return ""
    try:
        return f", killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return ""
