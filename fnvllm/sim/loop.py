"""The simulation loop: the engine's own ``EngineLoop`` driven by a SimExecutor and a clock.

    while requests remain:
        add every request whose arrival time the clock has reached    (add_due: the core knows no time)
        if nothing is live: jump the clock to the next arrival
        loop.step()          # EngineLoop: schedule, executor.execute (advances the clock by the cost model), commit

The step sequence is written once, in ``fnvllm.engine.loop.EngineLoop``: the simulator is a client of it with a
simulated executor (``SimExecutor``) and the simulated clock as the loop's time source, exactly as the LLM and
the server are clients with a GPU executor. The loop steps plainly in the core; overlap is a matter of price
(the cost model charges max(device, host) per overlapped step).

A step starts when the previous one ended (plus the host time of taking in the requests that arrived, the
profile's ``request_us`` each); its tokens are emitted when it ends; a request that arrives during a step is added
before the next schedule. A served, overlapped loop (``SimExecutor.served``) times host and device apart: a step's
tokens reach the clients one host cycle later (after the next step's launch), and arrivals join the step launched
after they come. ``Recorder`` notes what the metrics need on the way (from the loop's step hook).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import attrs

from fnvllm.engine.core import Engine, EngineOutput
from fnvllm.engine.loop import EngineLoop
from fnvllm.sim.executor import SimExecutor
from fnvllm.sim.recorder import Recorder
from fnvllm.sim.workloads import SimRequest, prompt_tokens
from fnvllm.state import FCFS, CoreConfig, EngineState, Policy, SamplingParams, StepOutput, StepPlan, fcfs_key

StepHook = Callable[[EngineState, StepPlan, StepOutput], None]
Progress = Callable[[int], None]  # called with the number of requests finished since the last call


class SimulationStalledError(RuntimeError):
    """A step planned nothing while requests were live and none could arrive (a scheduler livelock)."""


@attrs.frozen
class SimResult:
    """A finished simulation: the recorder's per-request and per-step data, and the final state and clock."""

    recorder: Recorder
    final_state: EngineState
    end_s: float
    num_steps: int


class _Arrivals:
    """The workload's requests not yet added, and how to add them: ids are workload indices as strings, and
    SamplingParams are shared per output length (100,000 requests need only a few hundred distinct values).

    Holding back (``hold`` = the core's waiting length to keep, or None to add every request on arrival): under
    FCFS an arrival sorts after every live request, and ``schedule`` reads at most ``max_num_seqs + 1`` waiting
    requests from the front (it admits at most ``max_num_seqs`` and stops at the first that does not fit). So a
    request that arrived while more than that many wait cannot change the next plan; it is kept here, already
    arrived, and added once the queue shrinks. The plans, token streams and per-request times are those of adding
    every request on arrival (tests/test_sim_core.py checks it); what changes is the cost: with 50,000 waiting,
    every add, admission and map update would otherwise copy structures whose size grows with the queue.
    """

    def __init__(self, requests: Sequence[SimRequest], ignore_eos: bool, vocab: int, hold: int | None) -> None:
        self.requests, self.ignore_eos, self.vocab, self.hold = requests, ignore_eos, vocab, hold
        self.next_index = 0  # the first request not added to the core yet
        self.num_arrived = 0  # requests [0, num_arrived) have arrived; [next_index, num_arrived) are held back
        self._params: dict[int, SamplingParams] = {}

    @property
    def pending(self) -> bool:
        """True while some request has not been added to the core yet (not arrived, or held back)."""
        return self.next_index < len(self.requests)

    @property
    def num_held(self) -> int:
        """Requests that arrived and wait here, not yet in the core's waiting queue."""
        return self.num_arrived - self.next_index

    @property
    def next_time(self) -> float:
        """Arrival time of the next request not added (call only while ``pending``)."""
        return self.requests[self.next_index].arrival_s

    def add_due(self, loop: EngineLoop, clock: float) -> None:
        """Queue on ``loop`` the requests whose arrival time is <= ``clock``, in arrival order (while holding
        back, only as many as keep ``hold`` waiting), by one ``EngineLoop.add_many`` (one pass over the queue)."""
        requests, first = self.requests, self.next_index
        arrived, n = max(self.num_arrived, first), len(requests)
        while arrived < n and requests[arrived].arrival_s <= clock:
            arrived += 1
        self.num_arrived = arrived
        end = arrived if self.hold is None else min(arrived, first + max(self.hold - len(loop.state.waiting), 0))
        if end <= first:
            return
        self.next_index = end
        due = requests[first:end]
        loop.add_many(
            [
                (str(i), prompt_tokens(r, i, self.vocab), self._sampling(r.output_len), None)
                for i, r in enumerate(due, first)
            ],
            [r.priority for r in due],
        )

    def _sampling(self, output_len: int) -> SamplingParams:
        params = self._params.get(output_len)
        if params is None:
            params = SamplingParams(max_tokens=output_len, ignore_eos=self.ignore_eos, temperature=0.0)
            self._params[output_len] = params
        return params


def simulate(
    requests: Sequence[SimRequest],
    config: CoreConfig,
    executor: SimExecutor,
    policy: Policy = FCFS,
    *,
    ignore_eos: bool = True,
    on_step: StepHook | None = None,
    progress: Progress | None = None,
    hold_back: bool = True,
) -> SimResult:
    """Run ``requests`` (sorted by arrival) to completion on the pure core; returns what was recorded.

    Request ids are the workload indices as strings. ``ignore_eos=False`` lets the executor's EOS tokens end
    requests early. ``hold_back`` (FCFS only; see ``_Arrivals``) keeps arrivals that cannot affect the next plan
    out of the core while the queue is long: same plans and times, far less work under overload (False: add each
    request on arrival). Raises InvalidRequestError for a request that can never run (e.g. longer than
    max_model_len; with holding back, when it is added) and SimulationStalledError if the core plans nothing
    while requests wait.
    """
    hold = config.max_num_seqs + 1 if hold_back and policy.key is fcfs_key else None
    with _fewer_collections():
        return _simulate(requests, config, executor, policy, ignore_eos, on_step, progress, hold)


@contextmanager
def _fewer_collections() -> Iterator[None]:
    """Run with the objects alive now frozen out of the cyclic GC and a 100x larger young generation: the loop
    allocates many short-lived acyclic values, and default collections cost 20-35% of its time when the pool is
    large (measured: poisson workload, 70,000 blocks of 16 tokens; no difference with 4,000 blocks). Settings are
    restored afterwards."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(thresholds[0], 1) * 100, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def _simulate(
    requests: Sequence[SimRequest],
    config: CoreConfig,
    executor: SimExecutor,
    policy: Policy,
    ignore_eos: bool,
    on_step: StepHook | None,
    progress: Progress | None,
    hold: int | None,
) -> SimResult:
    """The loop of ``simulate``: arrivals on the simulated clock, steps by ``EngineLoop``."""
    loop = EngineLoop(Engine(executor, config, policy), overlap=False, clock=lambda: executor.clock)
    recorder = Recorder(requests, config.num_blocks, deferred=getattr(executor, "served", False))
    arrivals = _Arrivals(requests, ignore_eos, config.vocab_size or 1 << 31, hold)
    start = executor.clock

    def noted(state: EngineState, plan: StepPlan, out: EngineOutput) -> None:
        """The loop's step hook: record the step, catch a livelock, then the caller's hook and progress."""
        finished = recorder.step(state, plan, out.output, start, executor, arrivals.num_held)
        if plan.is_empty and state.has_unfinished:
            raise SimulationStalledError(f"step {plan.step} planned nothing with {len(state.waiting)} waiting")
        if on_step is not None:
            on_step(state, plan, out.output)
        if progress is not None and finished:
            progress(finished)

    def delivered() -> None:
        """No step follows the last one (served timing): its tokens reach the clients now."""
        if recorder.deferred:
            finished = recorder.flush(executor.drain())
            if progress is not None and finished:
                progress(finished)

    loop.on_step = noted
    while arrivals.pending or loop.has_unfinished:
        if not loop.has_unfinished:
            delivered()
            executor.advance_to(arrivals.next_time)  # idle: jump to the next arrival
        arrived = arrivals.num_arrived
        arrivals.add_due(loop, executor.clock)
        if arrivals.num_arrived > arrived:  # the host's work of taking them in (profile's request_us)
            executor.add_requests(arrivals.num_arrived - arrived)
        start = executor.clock
        loop.step()
    delivered()
    return SimResult(recorder, loop.state, executor.clock, loop.stats.num_steps)
