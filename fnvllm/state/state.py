"""EngineState and the request-level transitions: ``initial_state``, ``add_request``, ``abort``, ``forget_kv``.

Per-sequence data is stored in columns rather than one object per sequence: a decode step touches every running
sequence, and rewriting a column once per step is far cheaper than building hundreds of small objects. The
running sequences' columns are tuples aligned with ``running`` (see _rows.py); each public per-request field is a
``RowMap`` that reads like a plain mapping keyed by request id. ``state.sequence(id)`` assembles a snapshot.

Every transition returns a new EngineState and mutates nothing; the tuples and maps that belong to a state are
never written again (treat them as read-only). Requests and the waiting requests' entries live in persistent maps
(PMap), so adding, admitting or finishing one request copies one small shard instead of every live entry.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from functools import partial
from operator import attrgetter
from typing import Any, TypeVar

import attrs

from fnvllm.state._pmap import PMap
from fnvllm.state._rows import RowMap
from fnvllm.state._running import DecodePrefix, RunningRows
from fnvllm.state._tokens import Chunks, join
from fnvllm.state.config import CoreConfig
from fnvllm.state.kv import KVManager
from fnvllm.state.params import SamplingParams
from fnvllm.state.policy import FCFS, Policy
from fnvllm.state.pool import BlockPool
from fnvllm.state.request import Request, SequenceView, check_request

V = TypeVar("V")


@attrs.frozen
class EngineState:
    """Everything the scheduler knows, as one immutable value.

    config / policy: static settings and the queue ordering.
    requests: live requests (waiting or running) by id (a PMap).
    waiting / running: request ids, each sorted by the policy key (running = admitted, holding KV blocks).
    num_tokens: prompt + generated length of each live request.
    outputs: generated tokens of each live request.
    num_computed: tokens whose KV is written, running requests only (absent = 0).
    block_tables: KV block ids, running requests only (absent = no blocks).
    chain_hashes: prefix-cache chain hashes of each live request's full blocks computed so far.
    slots: each running request's slot, an index in [0, max_num_seqs) that no other running request holds, from
        its admission until it leaves running (finish, abort, preemption); an admitted request takes the lowest
        free one. Executors key per-request device state by it (a preempted request is re-admitted, possibly to
        another slot, and its state rebuilt). Running requests only.
    pool: KV block bookkeeping and the prefix cache.
    step: index of the next plan ``schedule`` will produce.
    pending_step: the step planned but not yet committed, if any.
    next_arrival: arrival stamp of the next added request.
    stop_token_union: the config's EOS ids and every live-or-past request's stop_token_ids; a sampled token
        outside it cannot stop anything, which lets commit skip per-sequence checks.

    The six per-request fields are RowMaps (read them as mappings): their running part is the column of the same
    name in ``rows`` (for ``outputs``: joined from its chunks and tails when first read), their ``rest`` the
    waiting requests' entries.

    Derived fields (functions of the above, kept so each step can work column-wise; not compared by ``==``):
    rows: the running sequences' columns, aligned with ``running``.
    decode: the leading plain decodes of ``running`` (see DecodePrefix).
    """

    config: CoreConfig
    policy: Policy
    requests: PMap[str, Request]
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    num_tokens: RowMap[int]
    outputs: RowMap[tuple[int, ...]]
    num_computed: RowMap[int]
    block_tables: RowMap[tuple[int, ...]]
    chain_hashes: RowMap[tuple[int, ...]]
    slots: RowMap[int]
    pool: BlockPool
    step: int = 0
    pending_step: int | None = None
    next_arrival: int = 0
    stop_token_union: frozenset[int] = frozenset()
    rows: RunningRows = attrs.field(factory=RunningRows, eq=False, repr=False)
    decode: DecodePrefix = attrs.field(factory=DecodePrefix, eq=False, repr=False)

    def sequence(self, request_id: str) -> SequenceView:
        """A snapshot of one live request (KeyError if it is not live)."""
        request = self.requests[request_id]
        return SequenceView(
            request=request,
            status="running" if request_id in self.running else "waiting",
            output=self.outputs[request_id],
            num_computed=self.num_computed.get(request_id, 0),
            block_table=self.block_tables.get(request_id, ()),
        )

    @property
    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)


_FIELD_NAMES = tuple(field.name for field in attrs.fields(EngineState))
_all_fields = attrgetter(*_FIELD_NAMES)
_FIELD_INDEX = {name: index for index, name in enumerate(_FIELD_NAMES)}


def replace(state: EngineState, **changes: Any) -> EngineState:
    """``attrs.evolve(state, **changes)`` at a fraction of the cost (schedule and commit build a new state every
    step): the fields are read by one C-level ``attrgetter`` and passed positionally, instead of evolve's
    per-call field introspection and keyword arguments."""
    values = list(_all_fields(state))
    for name, value in changes.items():
        values[_FIELD_INDEX[name]] = value
    return EngineState(*values)


def with_rows(
    state: EngineState,
    rows: RunningRows,
    rest_tokens: PMap[str, int] | None = None,
    rest_outputs: PMap[str, tuple[int, ...]] | None = None,
    rest_chains: PMap[str, tuple[int, ...]] | None = None,
    *,
    pending_step: int | None,
    requests: PMap[str, Request] | None = None,
    waiting: tuple[str, ...] | None = None,
    pool: BlockPool | None = None,
    step: int | None = None,
    decode: DecodePrefix | None = None,
) -> EngineState:
    """The state with the running part of every per-request field taken from ``rows``, the waiting parts from the
    ``rest_*`` maps and the other fields from the keywords (None keeps the state's; ``pending_step`` is always
    given). Built positionally in one call: schedule and commit build two states every step."""
    ids, old = rows.ids, state.rows
    outputs = state.outputs
    rest_outputs = outputs.rest if rest_outputs is None else rest_outputs
    if not (
        rows.output_tails is old.output_tails
        and rows.output_chunks is old.output_chunks
        and ids is old.ids
        and rest_outputs is outputs.rest
    ):  # else keep the old map, with whatever it has already joined
        outputs = RowMap.derived(ids, partial(_joined, rows.output_chunks, rows.output_tails), rest_outputs)
    return EngineState(
        state.config,
        state.policy,
        state.requests if requests is None else requests,
        state.waiting if waiting is None else waiting,
        ids,
        _row_map(state.num_tokens, ids, rows.num_tokens, rest_tokens),
        outputs,
        state.num_computed.with_rows(ids, rows.num_computed),
        state.block_tables.with_rows(ids, rows.block_tables),
        _row_map(state.chain_hashes, ids, rows.chain_hashes, rest_chains),
        state.slots.with_rows(ids, rows.slots),
        state.pool if pool is None else pool,
        state.step if step is None else step,
        pending_step,
        state.next_arrival,
        state.stop_token_union,
        rows,
        state.decode if decode is None else decode,
    )


def _row_map(old: RowMap[V], ids: tuple[str, ...], values: tuple[V, ...], rest: PMap[str, V] | None) -> RowMap[V]:
    """``old`` itself when neither part changed, so a mapping's merged-dict cache survives quiet steps."""
    if rest is None or rest is old.rest:
        return old.with_rows(ids, values)
    return RowMap(ids, values, rest)


def _joined(chunks: tuple[Chunks, ...], tails: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """Each running row's generated tokens, flat (only readers of ``state.outputs`` need them)."""
    return tuple(map(join, chunks, tails))


def initial_state(config: CoreConfig, policy: Policy = FCFS) -> EngineState:
    """An empty engine state: no requests, every block free."""
    return EngineState(
        config=config,
        policy=policy,
        requests=PMap(),
        waiting=(),
        running=(),
        num_tokens=RowMap.empty(),
        outputs=RowMap.empty(),
        num_computed=RowMap.empty(),
        block_tables=RowMap.empty(),
        chain_hashes=RowMap.empty(),
        slots=RowMap.empty(),
        pool=BlockPool.create(config.num_blocks),
        stop_token_union=config.eos_token_ids,
    )


def validate_request(
    state: EngineState, request_id: str, prompt: Sequence[int], params: SamplingParams, priority: int = 0
) -> None:
    """Raise InvalidRequestError (naming the field, the allowed range and the value) when the request can never
    run; see ``request.check_request`` for what is checked."""
    check_request(state.config, state.requests, request_id, prompt, params, priority)


def add_request(
    state: EngineState,
    request_id: str,
    prompt: Sequence[int],
    params: SamplingParams,
    priority: int = 0,
) -> EngineState:
    """The state with the request queued as waiting. Raises InvalidRequestError, leaving ``state`` as it was.

    ``prompt``: token ids as a list, tuple or 1-D integer array (stored as a tuple of ints)."""
    prompt, priority = check_request(state.config, state.requests, request_id, prompt, params, priority)
    request = Request(request_id, prompt, params, arrival=state.next_arrival, priority=priority)
    return replace(
        state,
        requests=state.requests.updated([(request_id, request)]),
        waiting=insert_by_policy(state, state.waiting, request_id, request),
        num_tokens=state.num_tokens.with_rest(state.num_tokens.rest.updated([(request_id, len(prompt))])),
        outputs=state.outputs.with_rest(state.outputs.rest.updated([(request_id, ())])),
        chain_hashes=state.chain_hashes.with_rest(state.chain_hashes.rest.updated([(request_id, ())])),
        next_arrival=state.next_arrival + 1,
        stop_token_union=state.stop_token_union.union(params.stop_token_ids)
        if params.stop_token_ids
        else state.stop_token_union,
    )


def add_requests(state: EngineState, requests: Iterable[tuple[str, Sequence[int], SamplingParams, int]]) -> EngineState:
    """The state ``add_request`` would give for each ``(request_id, prompt, params, priority)`` in turn, built in
    one pass: the waiting queue and the per-request maps are rebuilt once, not once per request (a simulator adds
    a step's arrivals together; with tens of thousands waiting, each single add copies the whole queue). Raises
    InvalidRequestError for the first bad request, leaving ``state`` as it was."""
    live, key = state.requests.evolver(), state.policy.key
    head, tail = state.waiting, list[str]()  # the queue is head + tail; tail holds the new ids while each sorts last
    arrival, stops = state.next_arrival, state.stop_token_union
    added: list[tuple[str, int]] = []
    for request_id, prompt, params, priority in requests:
        prompt, priority = check_request(state.config, live, request_id, prompt, params, priority)
        request = Request(request_id, prompt, params, arrival=arrival, priority=priority)
        live.set(request_id, request)
        last = tail[-1] if tail else head[-1] if head else None
        k = key(request)
        if last is not None and k < key(live[last]):  # not last in policy order: merge, then search
            tail, head = [*head, *tail], ()
            tail.insert(bisect.bisect_right(tail, k, key=lambda rid: key(live[rid])), request_id)
        else:
            tail.append(request_id)
        added.append((request_id, len(prompt)))
        arrival += 1
        stops = stops.union(params.stop_token_ids) if params.stop_token_ids else stops
    if not added:
        return state
    empty = [(rid, ()) for rid, _ in added]
    return replace(
        state,
        requests=live.persistent(),
        waiting=head + tuple(tail),
        num_tokens=state.num_tokens.with_rest(state.num_tokens.rest.updated(added)),
        outputs=state.outputs.with_rest(state.outputs.rest.updated(empty)),
        chain_hashes=state.chain_hashes.with_rest(state.chain_hashes.rest.updated(empty)),
        next_arrival=arrival,
        stop_token_union=stops,
    )


def policy_index(state: EngineState, queue: Sequence[str], request: Request) -> int:
    """Where ``request`` goes in ``queue`` (sorted by the policy key): after every equal key."""
    requests, key = state.requests, state.policy.key
    return bisect.bisect_right(queue, key(request), key=lambda rid: key(requests[rid]))


def insert_by_policy(
    state: EngineState, queue: tuple[str, ...], request_id: str, request: Request | None = None
) -> tuple[str, ...]:
    """``queue`` with ``request_id`` inserted at its policy position (after equal keys)."""
    request = request if request is not None else state.requests[request_id]
    if not queue or not state.policy.key(request) < state.policy.key(state.requests[queue[-1]]):
        return (*queue, request_id)  # after every key (the usual FCFS arrival): no search, one copy
    index = policy_index(state, queue, request)
    return (*queue[:index], request_id, *queue[index:])


def abort(state: EngineState, request_id: str) -> EngineState:
    """The state without the request, its blocks released. KeyError if it is not live.

    Read ``state.sequence(request_id)`` first if you need what it generated. Aborting between ``schedule`` and
    ``commit`` is allowed: commit then ignores the request's entry in the plan.
    """
    if request_id not in state.requests:
        raise KeyError(f"request_id {request_id!r} is not live (never added, finished or aborted)")
    if request_id not in state.running:
        return remove_requests(state, (), (request_id,), state.pool)
    index = state.running.index(request_id)
    kv = KVManager(state.pool, state.config)
    kv.free(state.rows.block_tables[index])
    return remove_requests(state, (index,), (), kv.freeze())


def remove_requests(
    state: EngineState, row_indices: Sequence[int], waiting_ids: Sequence[str], pool: BlockPool
) -> EngineState:
    """The state without the running rows at ``row_indices`` (ascending) and the waiting ``waiting_ids``; their
    blocks must already be released in ``pool``."""
    gone = [state.running[i] for i in row_indices] + list(waiting_ids)
    changes: dict[str, Any] = {
        "requests": state.requests.without(gone),
        "pool": pool,
        "pending_step": state.pending_step,
    }
    if waiting_ids:
        leaving = set(waiting_ids)
        changes["waiting"] = tuple(r for r in state.waiting if r not in leaving)
        changes["rest_tokens"] = state.num_tokens.rest.without(waiting_ids)
        changes["rest_outputs"] = state.outputs.rest.without(waiting_ids)
        changes["rest_chains"] = state.chain_hashes.rest.without(waiting_ids)
    if row_indices:
        changes["decode"] = state.decode.drop(row_indices)
    return with_rows(state, state.rows.drop(row_indices), **changes)


def forget_kv(state: EngineState) -> EngineState:
    """The state as seen by an executor with an empty KV cache (a fresh engine restoring a snapshot).

    Every running request rejoins waiting with its generated tokens kept, the pool is emptied (the prefix cache
    too, since its contents are gone), and a planned-but-uncommitted step is dropped. Scheduling resumes at
    ``state.step``; the running requests are re-prefilled from their prompt and outputs.
    """
    waiting = state.waiting
    for rid in state.running:
        waiting = insert_by_policy(state, waiting, rid)
    rows = state.rows
    return with_rows(
        state,
        RunningRows(),
        rest_tokens=state.num_tokens.rest.updated(zip(rows.ids, rows.num_tokens, strict=True)),
        rest_outputs=state.outputs.rest.updated(
            zip(rows.ids, _joined(rows.output_chunks, rows.output_tails), strict=True)
        ),
        rest_chains=state.chain_hashes.rest.updated(zip(rows.ids, rows.chain_hashes, strict=True)),
        waiting=waiting,
        decode=DecodePrefix(),
        pool=BlockPool.create(state.config.num_blocks),
        pending_step=None,
    )
