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

Step 1 works on the running columns (``state.rows``, aligned with ``running``). The leading plain decodes
(``state.decode``) are scheduled column-wise by ``_schedule_decode_prefix`` with the same result as the
one-row-at-a-time loop ``_schedule_rows``, which handles whatever follows them (prefill chunks, shortages,
preemption). Preemption only ever removes rows from the back, so the kept rows are always a prefix of the columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import sub
from typing import Any

from fnvllm.state.errors import PlanMismatchError
from fnvllm.state.plan import StepPlan, TokenHistory
from fnvllm.state.pmap import PMap
from fnvllm.state.pool import PoolTxn
from fnvllm.state.request import Request
from fnvllm.state.running import DecodePrefix, RunningRows
from fnvllm.state.state import EngineState, insert_by_policy, policy_index, with_rows
from fnvllm.state.tokens import Chunks, as_chunks, join, last_token, token_slice


class _Step:
    """Scratch space of one ``schedule`` call: the running rows kept, their plan rows, the admitted rows."""

    def __init__(self, state: EngineState) -> None:
        self.state = state
        self.rows = state.rows
        self.bs = state.config.block_size
        self.budget = state.config.max_num_batched_tokens
        self._txn: PoolTxn | None = None
        self.num_running = len(state.running)  # running rows kept; preemption removes them from the back
        self.tables: Sequence[tuple[int, ...]] = state.rows.block_tables  # becomes a list once a row grows
        self.decode_prefix = 0  # running rows [0, decode_prefix) are scheduled as decodes, column-wise
        self.inputs: list[tuple[int, ...]] = []  # plan rows of running rows [decode_prefix, num_scheduled)
        self.samples: list[bool] = []
        self.preempted: list[str] = []
        self.waiting = state.waiting
        self.admitted: list[RunningRows] = []  # one row each, in admission order
        self.admitted_inputs: list[tuple[int, ...]] = []
        self.admitted_samples: list[bool] = []
        self.pending_hashes: set[int] = set()

    @property
    def txn(self) -> PoolTxn:
        """The pool transaction, opened on first use: a step that allocates nothing keeps the pool object."""
        if self._txn is None:
            self._txn = self.state.pool.txn()
        return self._txn

    @property
    def num_free(self) -> int:
        """Free blocks right now."""
        return self.state.pool.num_free if self._txn is None else self._txn.num_free

    @property
    def num_scheduled(self) -> int:
        """Plan rows taken from running so far: always the first ``num_scheduled`` running rows."""
        return self.decode_prefix + len(self.inputs)

    def emit(self, tokens: tuple[int, ...], sample: bool) -> None:
        """Add the plan row of the next running row and charge its tokens to the budget."""
        self.inputs.append(tokens)
        self.samples.append(sample)
        self.budget -= len(tokens)

    def blocks_short(self, index: int, num_slots: int) -> int:
        """How many more blocks running row ``index`` needs to hold ``num_slots`` tokens."""
        return max(-(-num_slots // self.bs) - len(self.tables[index]), 0)

    def grow(self, index: int, num_blocks: int) -> None:
        """Append ``num_blocks`` fresh blocks to running row ``index``'s table."""
        if not isinstance(self.tables, list):
            self.tables = list(self.tables)
        self.tables[index] = self.tables[index] + tuple(self.txn.allocate(num_blocks))

    def preempt_last(self) -> int:
        """Preempt the running row with the largest policy key (the last); returns its index."""
        self.num_running -= 1
        self.txn.release(self.tables[self.num_running])
        self.preempted.append(self.rows.ids[self.num_running])
        return self.num_running


def _schedule_decode_prefix(step: _Step) -> None:
    """Schedule the leading plain decodes column-wise when the budget covers them and free blocks cover those
    whose next token opens a block; otherwise leave them to ``_schedule_rows`` (which may preempt)."""
    decode = step.state.decode
    k = len(decode.inputs)
    if k == 0 or k > step.budget:
        return
    needy = decode.block_due  # commit found them: the decodes whose last token filled their last block
    if len(needy) > step.num_free:
        return
    for index in needy:
        step.grow(index, 1)
    step.decode_prefix = k
    step.budget -= k


def _schedule_rows(step: _Step) -> None:
    """Step 1 for the running rows after the decode prefix, one at a time (prefill chunks, block shortages,
    preemption)."""
    rows, requests = step.rows, step.state.requests
    i = step.num_scheduled
    while i < step.num_running and step.budget > 0:
        start, total = rows.num_computed[i], rows.num_tokens[i]
        n = min(total - start, step.budget)
        short = step.blocks_short(i, start + n)
        if short and not _make_room(step, i, short):
            return  # row i itself was preempted: everything after it already was
        if short:
            step.grow(i, short)
        prompt, chunks, tail = requests[rows.ids[i]].prompt, rows.output_chunks[i], rows.output_tails[i]
        if n == 1 and start == total - 1:
            tokens: tuple[int, ...] = (last_token(prompt, chunks, tail),)
        else:
            tokens = token_slice(prompt, chunks, tail, start, start + n)
            _note_running_chunk(step, prompt, chunks, tail, rows.chain_hashes[i], start, start + n)
        step.emit(tokens, start + n == total)
        i += 1


def _note_running_chunk(
    step: _Step,
    prompt: tuple[int, ...],
    output: Chunks,
    tail: tuple[int, ...],
    chain: tuple[int, ...],
    start: int,
    end: int,
) -> None:
    """Mark the full blocks a running prefill chunk computes this step as pending, so a waiting twin admitted in
    the same step waits for them instead of computing them again. Its full blocks before ``start`` are already
    hashed (commit extends ``chain`` as blocks fill), so only this chunk's blocks are hashed, and commit hashes
    them again when it registers them: a few hashes per prefill chunk, never on decode steps."""
    if not step.state.config.enable_prefix_caching or end // step.bs <= len(chain):
        return
    _note_pending(step, prompt, output, tail, list(chain), start, end, chain)


def _make_room(step: _Step, index: int, short: int) -> bool:
    """Preempt from the back until ``short`` blocks are free; False when row ``index`` itself had to go."""
    while step.num_free < short:
        if step.preempt_last() == index:
            return False
    return True


def _cached_prefix(
    step: _Step, request: Request, output: Chunks, num_tokens: int, chain: tuple[int, ...]
) -> tuple[list[int], list[int], bool]:
    """The hit blocks of the request's longest cached prefix, the chain hashes computed so far, and whether its
    first missed block is being computed by a request admitted earlier this step (then it should wait)."""
    state, bs = step.state, step.bs
    known = list(chain)
    hits: list[int] = []
    parent: int | None = None
    for index in range(num_tokens // bs):
        tokens = token_slice(request.prompt, output, (), index * bs, (index + 1) * bs)
        block_hash = known[index] if index < len(known) else state.config.hash_block(parent, tokens)
        if index == len(known):
            known.append(block_hash)
        block = step.txn.lookup(block_hash, hits[-1] if hits else None, tokens)
        if block is None or block in hits:
            return hits, known, block_hash in step.pending_hashes
        hits.append(block)
        parent = block_hash
    return hits, known, False


def _admit_one(step: _Step, rid: str) -> bool:
    """Admit waiting ``rid`` if blocks allow (False leaves everything as it was)."""
    state, bs = step.state, step.bs
    request, output = state.requests[rid], state.outputs.rest[rid]
    num_tokens, chain = state.num_tokens.rest[rid], state.chain_hashes.rest[rid]
    chunks = as_chunks(output)
    caching = state.config.enable_prefix_caching
    hits, known, wait = _cached_prefix(step, request, chunks, num_tokens, chain) if caching else ([], [], False)
    if wait:
        return False
    start = min(len(hits) * bs, num_tokens - 1)  # a fully cached prompt still computes its last token
    n = min(num_tokens - start, step.budget)
    need = max(-(-(start + n) // bs) - len(hits), 0)
    free_hits = sum(1 for b in hits if step.txn.ref_count(b) == 0)
    if need > step.num_free - free_hits:
        return False
    for block in hits:
        step.txn.share(block)
    table = tuple(hits) + tuple(step.txn.allocate(need))
    if caching:
        chain = _note_pending(step, request.prompt, chunks, (), known, start, start + n, chain)
    step.admitted.append(RunningRows.one(request, start, num_tokens, output, table, chain))
    step.admitted_inputs.append(token_slice(request.prompt, chunks, (), start, start + n))
    step.admitted_samples.append(start + n == num_tokens)
    step.budget -= n
    return True


def _note_pending(
    step: _Step,
    prompt: tuple[int, ...],
    output: Chunks,
    tail: tuple[int, ...],
    known: list[int],
    start: int,
    end: int,
    chain: tuple[int, ...],
) -> tuple[int, ...]:
    """Remember the hashes of full blocks the request computes this step; returns its chain hashes known so far."""
    hash_block, bs = step.state.config.hash_block, step.bs
    for index in range(len(known), end // bs):
        parent = known[index - 1] if index else None
        known.append(hash_block(parent, token_slice(prompt, output, tail, index * bs, (index + 1) * bs)))
    # Every full block computed this step, from the first missed one: a preempted request recomputes blocks whose
    # hashes it already knows (``chain``), and those must be pending too, or a twin prompt computes them again.
    step.pending_hashes.update(known[-(-start // bs) : end // bs])
    return tuple(known) if len(known) > len(chain) else chain


def _admit_waiting(step: _Step) -> None:
    """Step 2: admit waiting requests in policy order while budget, cap and blocks allow."""
    cap = step.state.config.max_num_seqs
    waiting = step.waiting
    admitted = 0
    while admitted < len(waiting) and step.budget > 0 and step.num_running + admitted < cap:
        if not _admit_one(step, waiting[admitted]):
            break
        admitted += 1
    if admitted:
        step.waiting = waiting[admitted:]


def _histories(state: EngineState, ids: tuple[str, ...]) -> tuple[TokenHistory | None, ...]:
    """Prompt and output of each row whose sampler needs them (penalties), else None."""
    requests, outputs = state.requests, state.outputs
    return tuple(
        TokenHistory(requests[rid].prompt, outputs[rid]) if requests[rid].params.needs_history else None for rid in ids
    )


def _build_plan(step: _Step, after: RunningRows) -> StepPlan:
    """The frozen plan: the first ``num_scheduled`` running rows, then the admitted rows, read column-wise.

    ``after`` is the running columns of the new state. In the usual step every running row is scheduled and the
    admitted rows went to the back, so the plan's ids, starts, tables and params are exactly those columns and
    are shared with the state instead of being assembled again."""
    state, rows = step.state, step.rows
    m, k = step.num_scheduled, step.decode_prefix
    decode_inputs = state.decode.inputs
    inputs = (decode_inputs if k == len(decode_inputs) else decode_inputs[:k]) + tuple(step.inputs)
    inputs += tuple(step.admitted_inputs)
    samples = (True,) * k + tuple(step.samples) + tuple(step.admitted_samples)
    if len(after.ids) == m + len(step.admitted) and after.ids[m:] == tuple(row.ids[0] for row in step.admitted):
        ids, starts, tables, params = after.ids, after.num_computed, after.block_tables, after.params
        generated = tuple(map(sub, after.num_tokens, after.prompt_lens))
    else:
        ids, starts, tables, params, generated = _plan_columns(step)
    needs_history = rows.num_needing_history or any(row.num_needing_history for row in step.admitted)
    histories = _histories(state, ids) if needs_history else (None,) * len(ids)
    return StepPlan(
        state.step, step.bs, ids, inputs, starts, tables, samples, params, generated, histories, tuple(step.preempted)
    )


def _plan_columns(step: _Step) -> tuple[tuple[Any, ...], ...]:
    """The plan's id, start, table, params and num_generated columns, assembled from the first
    ``num_scheduled`` running rows and the admitted rows (preemption, or an admission ahead of running rows)."""
    rows, m, new = step.rows, step.num_scheduled, step.admitted
    ids = rows.ids[:m] + tuple(row.ids[0] for row in new)
    starts = rows.num_computed[:m] + tuple(row.num_computed[0] for row in new)
    tables = tuple(step.tables[:m]) + tuple(row.block_tables[0] for row in new)
    params = rows.params[:m] + tuple(row.params[0] for row in new)
    generated = tuple(map(sub, rows.num_tokens[:m], rows.prompt_lens))
    generated += tuple(row.num_tokens[0] - row.prompt_lens[0] for row in new)
    return ids, starts, tables, params, generated


def _policy_positions(state: EngineState, kept: tuple[str, ...], admitted: list[RunningRows]) -> list[int]:
    """Where each admitted row goes in running, inserted one after another at its policy position."""
    ids = list(kept)
    positions = []
    for row in admitted:
        position = policy_index(state, ids, state.requests[row.ids[0]])
        ids.insert(position, row.ids[0])
        positions.append(position)
    return positions


Rests = tuple[PMap[str, int], PMap[str, tuple[int, ...]], PMap[str, tuple[int, ...]]]  # waiting-side maps


def _requeue_victims(step: _Step, rows: RunningRows, rests: Rests) -> tuple[RunningRows, Rests, tuple[str, ...]]:
    """Preempted rows (the back of the columns) become waiting requests that keep their tokens and hashes."""
    state, gone = step.state, slice(step.num_running, None)
    ids, (tokens, outputs, chains) = rows.ids[gone], rests
    tokens = tokens.updated(zip(ids, rows.num_tokens[gone], strict=True))
    outputs = outputs.updated(zip(ids, map(join, rows.output_chunks[gone], rows.output_tails[gone]), strict=True))
    chains = chains.updated(zip(ids, rows.chain_hashes[gone], strict=True))
    waiting = step.waiting
    for rid in reversed(step.preempted):  # victims rejoin waiting at their policy positions
        waiting = insert_by_policy(state, waiting, rid)
    return rows.take(step.num_running), (tokens, outputs, chains), waiting


def _insert_admitted(step: _Step, rows: RunningRows, rests: Rests) -> tuple[RunningRows, Rests, int]:
    """The admitted rows inserted at their policy positions (and gone from the waiting-side maps); also returns
    the first position, the end of the running rows that kept their places."""
    positions = _policy_positions(step.state, rows.ids, step.admitted)
    ids = [row.ids[0] for row in step.admitted]
    tokens, outputs, chains = rests
    rests = (tokens.without(ids), outputs.without(ids), chains.without(ids))
    return rows.insert(positions, step.admitted), rests, positions[0]


def _decode_after(step: _Step, kept_in_place: int) -> DecodePrefix:
    """The decode prefix of the new state: cut where rows left or were inserted; the due rows that were scheduled
    got their block."""
    decode = step.state.decode
    prefix = min(len(decode.inputs), kept_in_place)
    if prefix == len(decode.inputs) and not decode.block_due:
        return decode
    return decode.take(prefix, tuple(i for i in decode.block_due if step.num_scheduled <= i < prefix))


def _next_state(step: _Step) -> EngineState:
    """The state after planning: victims back in waiting, admitted rows inserted into the running columns."""
    state, rows = step.state, step.rows
    if step.tables is not rows.block_tables:
        rows = rows.with_tables(tuple(step.tables))
    rests: Rests = (state.num_tokens.rest, state.outputs.rest, state.chain_hashes.rest)
    waiting, kept_in_place = step.waiting, step.num_running
    if step.num_running < len(rows.ids):
        rows, rests, waiting = _requeue_victims(step, rows, rests)
    if step.admitted:
        rows, rests, kept_in_place = _insert_admitted(step, rows, rests)
    return with_rows(
        state,
        rows,
        *rests,
        waiting=waiting,
        decode=_decode_after(step, kept_in_place),
        pool=state.pool if step._txn is None else step._txn.freeze(),
        step=state.step + 1,
        pending_step=state.step,
    )


def schedule(state: EngineState) -> tuple[EngineState, StepPlan]:
    """Plan the next step. Returns the new state (blocks allocated, queues moved) and the plan; mutates nothing.

    Raises PlanMismatchError when the previous plan has not been committed yet.
    """
    if state.pending_step is not None:
        raise PlanMismatchError(f"step {state.pending_step} is planned but not committed; commit it first")
    step = _Step(state)
    _schedule_decode_prefix(step)
    _schedule_rows(step)
    if not step.preempted and step.waiting:
        _admit_waiting(step)
    new_state = _next_state(step)
    return new_state, _build_plan(step, new_state.rows)
