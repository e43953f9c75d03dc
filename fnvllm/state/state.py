"""EngineState and the request-level transitions: ``initial_state``, ``add_request``, ``abort``.

Per-sequence data is stored in columns (mappings keyed by request id) rather than one object per sequence: a
decode step touches every running sequence, and rebuilding a column once per step is far cheaper than building
hundreds of small objects. ``state.sequence(id)`` assembles a readable snapshot on demand.

Every transition returns a new EngineState and mutates nothing; columns are plain dicts that are copied, never
written, once they belong to a state (treat them as read-only).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import TypeVar

import attrs

from fnvllm.state.config import CoreConfig
from fnvllm.state.errors import InvalidRequestError
from fnvllm.state.params import SamplingParams
from fnvllm.state.policy import FCFS, Policy
from fnvllm.state.pool import BlockPool
from fnvllm.state.request import Request, SequenceView
from fnvllm.state.tokens import TokenLog, flatten

V = TypeVar("V")


@attrs.frozen
class EngineState:
    """Everything the scheduler knows, as one immutable value.

    config / policy: static settings and the queue ordering.
    requests: live requests (waiting or running) by id.
    waiting / running: request ids, each sorted by the policy key (running = admitted, holding KV blocks).
    num_tokens: prompt + generated length of each live request.
    outputs: generated tokens of each live request (a persistent log, see tokens.py; read it with
        ``state.sequence(id).output`` or ``tokens.flatten``).
    num_computed: tokens whose KV is written, running requests only (absent = 0).
    block_tables: KV block ids, running requests only (absent = no blocks).
    chain_hashes: prefix-cache chain hashes of each live request's full blocks computed so far.
    pool: KV block bookkeeping and the prefix cache.
    step: index of the next plan ``schedule`` will produce.
    pending_step: the step planned but not yet committed, if any.
    next_arrival: arrival stamp of the next added request.
    stop_token_union: the config's EOS ids and every live-or-past request's stop_token_ids; a sampled token
        outside it cannot stop anything, which lets commit skip per-sequence checks.
    """

    config: CoreConfig
    policy: Policy
    requests: Mapping[str, Request]
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    num_tokens: Mapping[str, int]
    outputs: Mapping[str, TokenLog]
    num_computed: Mapping[str, int]
    block_tables: Mapping[str, tuple[int, ...]]
    chain_hashes: Mapping[str, tuple[int, ...]]
    pool: BlockPool
    step: int = 0
    pending_step: int | None = None
    next_arrival: int = 0
    stop_token_union: frozenset[int] = frozenset()

    def sequence(self, request_id: str) -> SequenceView:
        """A snapshot of one live request (KeyError if it is not live)."""
        request = self.requests[request_id]
        return SequenceView(
            request=request,
            status="running" if request_id in self.block_tables or request_id in self.running else "waiting",
            output=flatten(self.outputs[request_id]),
            num_computed=self.num_computed.get(request_id, 0),
            block_table=self.block_tables.get(request_id, ()),
        )

    @property
    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)


def initial_state(config: CoreConfig, policy: Policy = FCFS) -> EngineState:
    """An empty engine state: no requests, every block free."""
    return EngineState(
        config=config,
        policy=policy,
        requests={},
        waiting=(),
        running=(),
        num_tokens={},
        outputs={},
        num_computed={},
        block_tables={},
        chain_hashes={},
        pool=BlockPool.create(config.num_blocks),
        stop_token_union=config.eos_token_ids,
    )


def _reject(field: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {message}")


def validate_request(state: EngineState, request_id: str, prompt: tuple[int, ...], params: SamplingParams) -> None:
    """Raise InvalidRequestError (naming the field and range) when the request can never run."""
    cfg = state.config
    if not isinstance(request_id, str) or not request_id:
        raise _reject("request_id", f"must be a non-empty str, got {request_id!r}")
    if request_id in state.requests:
        raise _reject("request_id", f"{request_id!r} is already live (waiting or running)")
    if not isinstance(params, SamplingParams):
        raise _reject("params", f"must be SamplingParams, got {type(params).__name__}")
    if len(prompt) == 0:
        raise _reject("prompt", "must hold at least 1 token")
    upper = cfg.vocab_size
    bad = [t for t in prompt if not isinstance(t, int) or t < 0 or (upper is not None and t >= upper)]
    if bad:
        allowed = f"[0, {upper})" if upper is not None else ">= 0"
        raise _reject("prompt", f"token ids must be ints in {allowed}; got {bad[:5]}")
    total = len(prompt) + params.max_tokens
    if total > cfg.max_model_len:
        raise _reject(
            "max_tokens",
            f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"max_model_len ({cfg.max_model_len})",
        )
    blocks = -(-(total - 1) // cfg.block_size)
    if blocks > cfg.num_blocks:
        raise _reject(
            "prompt",
            f"prompt + max_tokens needs {blocks} KV blocks of {cfg.block_size} tokens; the pool has {cfg.num_blocks}",
        )


def add_request(
    state: EngineState,
    request_id: str,
    prompt: Sequence[int],
    params: SamplingParams,
    priority: int = 0,
) -> EngineState:
    """The state with the request queued as waiting. Raises InvalidRequestError, leaving ``state`` as it was."""
    prompt = tuple(prompt)
    validate_request(state, request_id, prompt, params)
    request = Request(request_id, prompt, params, arrival=state.next_arrival, priority=priority)
    return attrs.evolve(
        state,
        requests={**state.requests, request_id: request},
        waiting=insert_by_policy(state, state.waiting, request_id, request),
        num_tokens={**state.num_tokens, request_id: len(prompt)},
        outputs={**state.outputs, request_id: ()},
        chain_hashes={**state.chain_hashes, request_id: ()},
        next_arrival=state.next_arrival + 1,
        stop_token_union=state.stop_token_union.union(params.stop_token_ids)
        if params.stop_token_ids
        else state.stop_token_union,
    )


def insert_by_policy(
    state: EngineState, queue: tuple[str, ...], request_id: str, request: Request | None = None
) -> tuple[str, ...]:
    """``queue`` with ``request_id`` inserted at its policy position (after equal keys)."""
    requests = state.requests
    key = state.policy.key
    new_key = key(request if request is not None else requests[request_id])
    index = bisect.bisect_right(queue, new_key, key=lambda rid: key(requests[rid]))
    return (*queue[:index], request_id, *queue[index:])


def abort(state: EngineState, request_id: str) -> EngineState:
    """The state without the request, its blocks released. KeyError if it is not live.

    Read ``state.sequence(request_id)`` first if you need what it generated. Aborting between ``schedule`` and
    ``commit`` is allowed: commit then ignores the request's entry in the plan.
    """
    if request_id not in state.requests:
        raise KeyError(f"request_id {request_id!r} is not live (never added, finished or aborted)")
    txn = state.pool.txn()
    txn.release(state.block_tables.get(request_id, ()))
    return drop_requests(state, {request_id}, txn.freeze())


def _without(mapping: Mapping[str, V], gone: set[str]) -> dict[str, V]:
    copy = dict(mapping)
    for key in gone:
        copy.pop(key, None)
    return copy


def drop_requests(
    state: EngineState,
    gone: set[str],
    pool: BlockPool,
    *,
    num_tokens: Mapping[str, int] | None = None,
    outputs: Mapping[str, TokenLog] | None = None,
    num_computed: Mapping[str, int] | None = None,
    chain_hashes: Mapping[str, tuple[int, ...]] | None = None,
) -> EngineState:
    """The state with the ``gone`` requests removed from every column (their blocks already released in
    ``pool``). Keyword columns, when given, replace the state's before the removal."""
    return attrs.evolve(
        state,
        requests=_without(state.requests, gone),
        num_tokens=_without(state.num_tokens if num_tokens is None else num_tokens, gone),
        outputs=_without(state.outputs if outputs is None else outputs, gone),
        num_computed=_without(state.num_computed if num_computed is None else num_computed, gone),
        block_tables=_without(state.block_tables, gone),
        chain_hashes=_without(state.chain_hashes if chain_hashes is None else chain_hashes, gone),
        waiting=tuple(r for r in state.waiting if r not in gone),
        running=tuple(r for r in state.running if r not in gone),
        pool=pool,
    )


def forget_kv(state: EngineState) -> EngineState:
    """The state as seen by an executor with an empty KV cache (a fresh engine restoring a snapshot).

    Every running request rejoins waiting with its generated tokens kept, the pool is emptied (the prefix cache
    too, since its contents are gone), and a planned-but-uncommitted step is dropped. Scheduling resumes at
    ``state.step``; the running requests are re-prefilled from their prompt and outputs.
    """
    waiting = state.waiting
    for rid in state.running:
        waiting = insert_by_policy(state, waiting, rid)
    return attrs.evolve(
        state,
        waiting=waiting,
        running=(),
        num_computed={},
        block_tables={},
        pool=BlockPool.create(state.config.num_blocks),
        pending_step=None,
    )
