"""``schedule(state) -> (state, plan)``: decide what runs this step and allocate its KV blocks.

Policy (DESIGN.md): one token budget per step, no prefill/decode phases.
1. Running sequences first, in policy order: a decode feeds 1 token, a sequence mid-prefill its next chunk.
   A sequence that needs a block when none is free preempts the running sequence with the largest policy key
   (possibly itself): its blocks are released, its generated tokens kept, and it rejoins waiting.
2. Then, unless something was preempted this step, waiting sequences in policy order while the budget,
   ``max_num_seqs`` and free blocks allow; each reuses the longest cached prefix of full blocks and may be
   chunked. A request whose first uncached block another request admitted this step will compute is held back
   one step, so the shared prefix is computed once and then hit.
The scheduler never reads token values except to hash blocks and to copy them into the plan; it mutates nothing.

When every running sequence is a plain decode (the steady state), step 1 is done column-wise by
``_schedule_decodes`` with the same result as the general loop, ``_schedule_running``.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, itemgetter, mod, not_, sub

import attrs

from fnvllm.state.errors import PlanMismatchError
from fnvllm.state.plan import StepPlan, TokenHistory
from fnvllm.state.pool import PoolTxn
from fnvllm.state.state import EngineState, insert_by_policy
from fnvllm.state.tokens import flatten, last_token, token_slice

_params = attrgetter("params")
_prompt = attrgetter("prompt")
_needs_history = attrgetter("needs_history")
_last = itemgetter(-1)


class _Step:
    """Scratch space of one ``schedule`` call: the columns it edits and the plan rows it emits."""

    def __init__(self, state: EngineState) -> None:
        self.state = state
        self.bs = state.config.block_size
        self.budget = state.config.max_num_batched_tokens
        self.txn: PoolTxn = state.pool.txn()
        self.running = list(state.running)
        self.waiting = state.waiting
        self.tables = dict(state.block_tables)
        self.computed = dict(state.num_computed)
        self.chains = state.chain_hashes
        self.preempted: list[str] = []
        self.pending_hashes: set[int] = set()
        self.ids: list[str] = []
        self.tokens: list[tuple[int, ...]] = []
        self.starts: list[int] = []
        self.samples: list[bool] = []

    def emit(self, rid: str, tokens: tuple[int, ...], start: int, sample: bool) -> None:
        """Add one plan row and charge its tokens to the budget."""
        self.ids.append(rid)
        self.tokens.append(tokens)
        self.starts.append(start)
        self.samples.append(sample)
        self.budget -= len(tokens)

    def blocks_short(self, rid: str, num_slots: int) -> int:
        """How many more blocks ``rid`` needs to hold ``num_slots`` tokens."""
        return max(-(-num_slots // self.bs) - len(self.tables.get(rid, ())), 0)

    def grow(self, rid: str, num_blocks: int) -> None:
        """Append ``num_blocks`` fresh blocks to ``rid``'s table."""
        self.tables[rid] = self.tables[rid] + tuple(self.txn.allocate(num_blocks))

    def preempt_last(self) -> str:
        """Preempt the running sequence with the largest policy key; returns its id."""
        victim = self.running.pop()
        self.txn.release(self.tables.pop(victim))
        del self.computed[victim]
        self.preempted.append(victim)
        return victim


def _schedule_decodes(step: _Step) -> bool:
    """Column-wise step 1 for the common case where every running sequence decodes one token and the budget and
    free blocks cover them all. Returns False (having changed nothing) when the case does not apply."""
    state, running = step.state, step.running
    n = len(running)
    if n == 0 or n > step.budget:
        return False
    logs = list(map(state.outputs.__getitem__, running))
    starts = list(map(step.computed.__getitem__, running))
    if not all(logs) or set(map(sub, map(state.num_tokens.__getitem__, running), starts)) != {1}:
        return False
    at_boundary = list(map(not_, map(mod, starts, repeat(step.bs))))  # next position opens a new block
    needy = list(compress(running, at_boundary))
    if len(needy) > step.txn.num_free:
        return False
    for rid in needy:
        step.grow(rid, 1)
    step.ids = list(running)
    step.tokens = list(zip(map(_last, logs)))  # each feeds its last sampled token, as a 1-tuple
    step.starts = starts
    step.samples = [True] * n
    step.budget -= n
    return True


def _schedule_running(step: _Step) -> None:
    """Step 1, one sequence at a time (prefill chunks, block shortages, preemption)."""
    state = step.state
    num_tokens, requests, outputs = state.num_tokens, state.requests, state.outputs
    i = 0
    while i < len(step.running) and step.budget > 0:
        rid = step.running[i]
        start = step.computed[rid]
        n = min(num_tokens[rid] - start, step.budget)
        short = step.blocks_short(rid, start + n)
        if short and not _make_room(step, rid, short):
            return  # rid itself was preempted: everything after it already was
        if short:
            step.grow(rid, short)
        request = requests[rid]
        if n == 1 and start == num_tokens[rid] - 1:
            tokens: tuple[int, ...] = (last_token(request.prompt, outputs[rid]),)
        else:
            tokens = token_slice(request.prompt, outputs[rid], start, start + n)
        step.emit(rid, tokens, start, start + n == num_tokens[rid])
        i += 1


def _make_room(step: _Step, rid: str, short: int) -> bool:
    """Preempt from the back until ``short`` blocks are free; False when ``rid`` itself had to go."""
    while step.txn.num_free < short:
        if step.preempt_last() == rid:
            return False
    return True


def _cached_prefix(step: _Step, rid: str) -> tuple[list[int], list[int], bool]:
    """The hit blocks of ``rid``'s longest cached prefix, the chain hashes computed so far, and whether its first
    missed block is being computed by a request admitted earlier this step (then it should wait)."""
    state, bs = step.state, step.bs
    request, log = state.requests[rid], state.outputs[rid]
    known = list(step.chains[rid])
    hits: list[int] = []
    parent: int | None = None
    for index in range(state.num_tokens[rid] // bs):
        tokens = token_slice(request.prompt, log, index * bs, (index + 1) * bs)
        block_hash = known[index] if index < len(known) else state.config.hash_block(parent, tokens)
        if index == len(known):
            known.append(block_hash)
        block = step.txn.lookup(block_hash, parent, tokens)
        if block is None or block in hits:
            return hits, known, block_hash in step.pending_hashes
        hits.append(block)
        parent = block_hash
    return hits, known, False


def _admit_one(step: _Step, rid: str) -> bool:
    """Admit ``rid`` if blocks allow (False leaves everything as it was)."""
    state, bs = step.state, step.bs
    caching = state.config.enable_prefix_caching
    hits, known, wait = _cached_prefix(step, rid) if caching else ([], [], False)
    if wait:
        return False
    num_tokens = state.num_tokens[rid]
    start = min(len(hits) * bs, num_tokens - 1)  # a fully cached prompt still computes its last token
    n = min(num_tokens - start, step.budget)
    need = max(-(-(start + n) // bs) - len(hits), 0)
    free_hits = sum(1 for b in hits if step.txn.ref_count(b) == 0)
    if need > step.txn.num_free - free_hits:
        return False
    for block in hits:
        step.txn.share(block)
    step.tables[rid] = tuple(hits) + tuple(step.txn.allocate(need))
    step.computed[rid] = start
    if caching:
        _note_pending(step, rid, known, start + n)
    request = state.requests[rid]
    step.emit(rid, token_slice(request.prompt, state.outputs[rid], start, start + n), start, start + n == num_tokens)
    return True


def _note_pending(step: _Step, rid: str, known: list[int], end: int) -> None:
    """Remember the hashes of full blocks ``rid`` computes this step, and keep its hashes known so far."""
    state, bs = step.state, step.bs
    request, log = state.requests[rid], state.outputs[rid]
    for index in range(len(known), end // bs):
        parent = known[index - 1] if index else None
        known.append(state.config.hash_block(parent, token_slice(request.prompt, log, index * bs, (index + 1) * bs)))
    step.pending_hashes.update(known[len(step.chains[rid]) : end // bs])
    if len(known) > len(step.chains[rid]):
        step.chains = {**step.chains, rid: tuple(known)}


def _admit_waiting(step: _Step) -> None:
    """Step 2: admit waiting requests in policy order while budget, cap and blocks allow."""
    cap = step.state.config.max_num_seqs
    waiting = step.waiting
    admitted = 0
    while admitted < len(waiting) and step.budget > 0 and len(step.running) < cap:
        rid = waiting[admitted]
        if not _admit_one(step, rid):
            break
        step.running = list(insert_by_policy(step.state, tuple(step.running), rid))
        admitted += 1
    step.waiting = waiting[admitted:]


def _build_plan(state: EngineState, step: _Step) -> StepPlan:
    """The frozen plan of the rows ``step`` emitted; per-row facts are gathered column-wise."""
    ids = tuple(step.ids)
    requests = list(map(state.requests.__getitem__, ids))
    params = tuple(map(_params, requests))
    generated = tuple(map(sub, map(state.num_tokens.__getitem__, ids), map(len, map(_prompt, requests))))
    histories: tuple[TokenHistory | None, ...] = (None,) * len(ids)
    if any(map(_needs_history, params)):
        histories = tuple(
            TokenHistory(r.prompt, flatten(state.outputs[rid])) if r.params.needs_history else None
            for rid, r in zip(ids, requests, strict=True)
        )
    return StepPlan(
        step=state.step,
        block_size=step.bs,
        seq_ids=ids,
        input_tokens=tuple(step.tokens),
        start_positions=tuple(step.starts),
        block_tables=tuple(map(step.tables.__getitem__, ids)),
        sample=tuple(step.samples),
        params=params,
        num_generated=generated,
        histories=histories,
        preempted=tuple(step.preempted),
    )


def schedule(state: EngineState) -> tuple[EngineState, StepPlan]:
    """Plan the next step. Returns the new state (blocks allocated, queues moved) and the plan; mutates nothing.

    Raises PlanMismatchError when the previous plan has not been committed yet.
    """
    if state.pending_step is not None:
        raise PlanMismatchError(f"step {state.pending_step} is planned but not committed; commit it first")
    step = _Step(state)
    if not _schedule_decodes(step):
        _schedule_running(step)
    waiting = state.waiting
    for rid in reversed(step.preempted):  # victims rejoin waiting at their policy positions
        waiting = insert_by_policy(state, waiting, rid)
    step.waiting = waiting
    if not step.preempted and step.waiting:
        _admit_waiting(step)
    plan = _build_plan(state, step)
    new_state = attrs.evolve(
        state,
        waiting=step.waiting,
        running=tuple(step.running),
        block_tables=step.tables,
        num_computed=step.computed,
        chain_hashes=step.chains,
        pool=step.txn.freeze(),
        step=state.step + 1,
        pending_step=state.step,
    )
    return new_state, plan
