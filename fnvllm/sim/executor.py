"""SimExecutor: the executor protocol of ``fnvllm.executor.base`` with a cost model instead of a GPU.

``execute(plan)`` checks the step like every executor, advances a simulated clock by the cost model's time for
exactly the plan's work, and returns tokens from a token source: a fixed filler token (optionally an EOS with a
given probability per token, seeded), or a replay of tokens recorded from a real run (to compare plans).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

import attrs

from fnvllm.executor.base import ExecuteResult, check_step
from fnvllm.sim.cost import CostModel, StepShape, step_shape
from fnvllm.state import StepPlan


class TokenSource(Protocol):
    """Where simulated tokens come from: one id per sampling sequence of the plan, in plan order."""

    def tokens(self, plan: StepPlan) -> tuple[int, ...]:
        """The sampled ids of ``plan``."""
        ...


class FillerTokens:
    """Every sampled token is ``token_id``, except an ``eos_id`` drawn with probability ``eos_prob`` (seeded).

    With ``eos_prob`` 0 the source draws no random numbers, and requests run to max_tokens (with ignore_eos).
    """

    def __init__(self, token_id: int = 3, eos_id: int = 0, eos_prob: float = 0.0, seed: int = 0) -> None:
        if not 0 <= eos_prob <= 1:
            raise ValueError(f"eos_prob must be in [0, 1], got {eos_prob}")
        if eos_prob and token_id == eos_id:
            raise ValueError("token_id must differ from eos_id")
        self.token_id, self.eos_id, self.eos_prob = token_id, eos_id, eos_prob
        self._rng = random.Random(seed)

    def tokens(self, plan: StepPlan) -> tuple[int, ...]:
        """``token_id`` per sampled row, or an EOS with probability ``eos_prob``."""
        n = plan.num_samples
        if not self.eos_prob:
            return (self.token_id,) * n
        draw, p = self._rng.random, self.eos_prob
        return tuple(self.eos_id if draw() < p else self.token_id for _ in range(n))


class ReplayTokens:
    """The tokens of a recorded run, step by step (``steps[k]`` = the sampled ids of step k)."""

    def __init__(self, steps: Sequence[Sequence[int]]) -> None:
        self.steps = [tuple(s) for s in steps]

    def tokens(self, plan: StepPlan) -> tuple[int, ...]:
        """The recorded ids of ``plan.step``; ValueError if the recording has a different count there."""
        if plan.step >= len(self.steps) or len(self.steps[plan.step]) != plan.num_samples:
            raise ValueError(f"recorded tokens do not fit step {plan.step} ({plan.num_samples} samples)")
        return self.steps[plan.step]


def mixed_graph(shape: StepShape, graph_max_seqs: int) -> StepShape:
    """``shape`` (a mixed step within the profile's ``graph_mixed_tokens``) as a CUDA-graph step when its rows fit
    the captured graphs (at most ``graph_max_seqs``)."""
    return attrs.evolve(shape, graph=True) if 0 < shape.num_seqs <= graph_max_seqs else shape


class SimExecutor:
    """Applies plans to a simulated device: a clock (seconds) advanced by ``cost``, tokens from ``tokens``.

    clock: simulated time now (the end of the last step). last_plain: the last step came after an idle device, so
    it was priced as a plain loop's step (device + gap: no step before hides its host work or launch). last_shape /
    last_device_s / last_gap_s / last_host_s / last_new_seqs: the last plan's shape, device time, the wall time
    beyond it (device idle), its
    host time and its rows new since the plan before (for logs and plots). ``advance_to(t)`` moves an idle clock
    forward (a jump to the next arrival).

    Served timing (``served``: a cost model pricing a served, overlapped loop): the host and the device each keep
    their own time, as in the server's engine process. ``execute(plan k)`` is the host cycle that launches step k
    (``launch_s``; the device waits for an eager launch), waits for step k-1 on the device, then commits and
    reports it (``host_s``): the clock moves to the end of that cycle, when step k-1's tokens reach the clients
    (``delivered_s``), and step k runs on the device meanwhile (until ``device_free``). ``drain()`` delivers the
    last step when no step follows it.
    """

    def __init__(self, cost: CostModel, tokens: TokenSource | None = None, clock: float = 0.0) -> None:
        self.cost = cost
        self.token_source = tokens if tokens is not None else FillerTokens()
        self.clock = clock
        self.next_step = 0
        self.last_shape: StepShape | None = None
        self.last_device_s = self.last_gap_s = self.last_host_s = 0.0
        self.last_new_seqs = 0
        self._times = getattr(cost, "step_times", None) or self._device_plus_gap
        self._hides = isinstance(cost, CostModel)  # its step_times takes the step before's device time (hidden_s)
        self._device_before = 0.0  # the last step's device time (0 after an idle device): it hides the next launch
        self.last_plain = False  # the last step ran after an idle device: priced as a plain loop's step
        serving = getattr(cost.hardware, "serving", None) if getattr(cost, "serving", False) else None
        self.served = bool(serving is not None and serving.cycle and getattr(cost, "overlap", False))
        self.device_free = clock  # served timing: when the device finishes the last launched step
        self.delivered_s = clock  # served timing: when the step before the last one reached the clients
        self._undelivered = False  # served timing: the last step's tokens have not reached the clients yet
        self._last_cycle_s = 0.0

    def _device_plus_gap(self, shape: StepShape, num_new_seqs: int) -> tuple[float, float, float]:
        """(device, host, wall) of a cost object with only ``device_s`` and ``gap_s`` (the protocol before the
        host model): wall = device + gap, no host time."""
        device = self.cost.device_s(shape)
        return device, 0.0, device + self.cost.gap_s(shape)

    def execute(self, plan: StepPlan) -> ExecuteResult:
        """Advance the clock by the plan's predicted wall time; return its sampled tokens."""
        check_step(self.next_step, plan)
        self.next_step += 1
        hardware = self.cost.hardware
        shape = step_shape(plan, hardware.graph_max_seqs)
        if not shape.graph and shape.num_tokens <= getattr(hardware, "graph_mixed_tokens", 0):
            shape = mixed_graph(shape, hardware.graph_max_seqs)
        self.last_shape = shape
        new = self.last_new_seqs = plan.num_admitted  # admitted (or resumed) this step: the core says so
        if self.served:
            self._served_cycle(shape, new)
        else:
            self.last_plain = self._hides and self._device_before == 0.0
            if self._hides:  # after an idle device, the host's work for the step is not hidden: priced plainly
                # a plain loop launches a step after the one before it finished: nothing hides its launch
                hidden = self._device_before if self.cost.overlap else 0.0
                device, host, wall = self._times(shape, new, False if self.last_plain else None, hidden)
            else:
                device, host, wall = self._times(shape, new)
            self.last_device_s, self.last_gap_s, self.last_host_s = device, wall - device, host
            self._device_before = device
            self.clock += wall
        return ExecuteResult(self.token_source.tokens(plan) if plan.num_samples else ())

    def _served_cycle(self, shape: StepShape, num_new_seqs: int) -> None:
        """One host cycle of the served loop (class docstring): launch this step, wait for the previous one on the
        device, commit and report it."""
        cost = self.cost
        device, host, launch = cost.device_s(shape), cost.host_s(shape, num_new_seqs), cost.launch_s(shape)
        launched = self.clock + launch
        ready = max(launched, self.device_free)  # the previous step's tokens are on the host
        if launch:  # kernels run as they are launched: the step ends its device time's remainder after the launch
            end = max(self.device_free, launched) + max(device - launch, 0.0)
        else:
            end = max(self.device_free, self.clock) + device
        self.last_device_s, self.last_host_s = device, host + launch
        self.last_gap_s = max(end - self.device_free - device, 0.0)
        self.device_free = end
        self.clock = self.delivered_s = ready + host
        self._last_cycle_s, self._undelivered = host, True

    def drain(self) -> float:
        """Served timing: deliver the last step (no step follows it): the clock moves to when its tokens reach
        the clients (its device end, then one host cycle's commit). Returns the clock."""
        if self.served and self._undelivered:
            self.clock = self.delivered_s = max(self.clock, self.device_free) + self._last_cycle_s
            self._undelivered = False
        return self.clock

    def add_requests(self, count: int) -> None:
        """``count`` requests arrived: advance the clock by the host time of taking them in (the hardware
        profile's ``request_us`` each; 0 for a cost object without one)."""
        self.clock += count * getattr(self.cost.hardware, "request_us", 0.0) * 1e-6

    def reset(self, next_step: int) -> None:
        """Expect ``next_step`` next (a simulated cache has no contents to forget); the clock keeps running."""
        self.next_step = next_step

    def advance_to(self, time_s: float) -> None:
        """Move the clock forward to ``time_s`` (never backward); a device left idle hides no launch."""
        if time_s > self.clock:
            self._device_before = 0.0
        self.clock = max(self.clock, time_s)
        self.device_free = max(self.device_free, min(self.clock, time_s))
