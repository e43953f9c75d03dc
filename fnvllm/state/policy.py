"""Scheduling policies as values: a policy is a sort key over requests.

Queues are kept sorted by the key: the smallest key is admitted first and preempted last; the running sequence
with the largest key is the preemption victim. Keys must be module-level functions so states pickle.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from fnvllm.state.request import Request

PolicyKey = Callable[[Request], tuple[int, ...]]


def fcfs_key(request: Request) -> tuple[int, ...]:
    """First come, first served: by arrival order."""
    return (request.arrival,)


def priority_key(request: Request) -> tuple[int, ...]:
    """Lower ``priority`` value first (as vLLM), arrival order among equals."""
    return (request.priority, request.arrival)


@attrs.frozen
class Policy:
    """A named ordering of requests. ``key(request)``: smaller is served first and preempted last."""

    name: str
    key: PolicyKey


FCFS = Policy("fcfs", fcfs_key)
PRIORITY = Policy("priority", priority_key)
