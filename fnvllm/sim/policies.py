"""Scheduling policies the simulator can name: the core's FCFS and priority, plus two length-aware ones.

A policy is a sort key over requests (``fnvllm.state.policy``): the smallest key is admitted first and preempted
last. Keys are module-level functions so states pickle (sweeps send them to other processes).
"""

from __future__ import annotations

from collections.abc import Mapping

from fnvllm.state import FCFS, PRIORITY, Policy, Request


def shortest_job_key(request: Request) -> tuple[int, ...]:
    """Shortest job first: fewest tokens to generate (max_tokens), arrival order among equals."""
    return (request.params.max_tokens, request.arrival)


def shortest_prompt_key(request: Request) -> tuple[int, ...]:
    """Shortest prompt first, arrival order among equals."""
    return (len(request.prompt), request.arrival)


POLICIES: Mapping[str, Policy] = {
    "fcfs": FCFS,
    "priority": PRIORITY,
    "sjf": Policy("sjf", shortest_job_key),
    "spf": Policy("spf", shortest_prompt_key),
}


def get_policy(name: str) -> Policy:
    """The named policy; ValueError listing the known names otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None
