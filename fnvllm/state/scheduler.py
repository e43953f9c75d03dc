"""``schedule(state) -> (state, plan)``: decide what runs this step; the KV seam (kv.py) allocates its blocks.

Policy (docs/design.md): one token budget per step, no prefill/decode phases.
1. Running sequences first, in policy order: a decode feeds 1 token, a sequence mid-prefill its next chunk.
   A sequence that needs a block when none is free preempts the running sequence with the largest policy key
   (possibly itself): its blocks are released, its generated tokens kept, and it rejoins waiting.
2. Then, unless something was preempted this step, waiting sequences in policy order while the budget,
   ``max_num_seqs`` and free blocks allow; each reuses the longest cached prefix of full blocks and may be
   chunked. A request whose first uncached block another request scheduled this step will compute is held back
   one step, so the shared prefix is computed once and then hit.
The scheduler never reads token values except to hash blocks and to copy them into the plan; it mutates nothing.
Blocks, prefix lookups and the same-step bookkeeping are the KV seam's (``KVManager``); this module decides only
budget and policy.

Step 1 works on the running columns (``state.rows``, aligned with ``running``). The leading plain decodes
(``state.decode``) are scheduled column-wise by ``_schedule_decode_prefix`` with the same result as the
one-row-at-a-time loop ``_schedule_rows``, which handles whatever follows them (prefill chunks, shortages,
preemption); tests/properties/test_fast_paths.py checks that the two agree. Preemption only ever removes rows
from the back, so the kept rows are always a prefix of the columns.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import count
from operator import sub
from typing import Any

from fnvllm.state._pmap import PMap
from fnvllm.state._running import DecodePrefix, RunningRows
from fnvllm.state._tokens import as_chunks, join, last_token, token_slice
from fnvllm.state.errors import PlanMismatchError
from fnvllm.state.kv import CachedPrefix, KVManager
from fnvllm.state.plan import StepPlan, TokenHistory
from fnvllm.state.state import EngineState, insert_by_policy, policy_index, with_rows


class _Step:
    """Scratch space of one ``schedule`` call: the running rows kept, their plan rows, the admitted rows."""

    def __init__(self, state: EngineState) -> None:
        self.state = state
        self.rows = state.rows
        self.kv = KVManager(state.pool, state.config)
        self.budget = state.config.max_num_batched_tokens
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
        self._free_slots: Iterator[int] | None = None  # the lowest free slots, ascending (on first admission)

    @property
    def num_scheduled(self) -> int:
        """Plan rows taken from running so far: always the first ``num_scheduled`` running rows."""
        return self.decode_prefix + len(self.inputs)

    def emit(self, tokens: tuple[int, ...], sample: bool) -> None:
        """Add the plan row of the next running row and charge its tokens to the budget."""
        self.inputs.append(tokens)
        self.samples.append(sample)
        self.budget -= len(tokens)

    def set_table(self, index: int, table: tuple[int, ...]) -> None:
        """Running row ``index`` now holds ``table``."""
        if not isinstance(self.tables, list):
            self.tables = list(self.tables)
        self.tables[index] = table

    def take_slot(self) -> int:
        """The lowest slot no running row holds and no admission of this step took. Admissions happen only in
        steps that preempted nothing, so the running rows are all kept."""
        if self._free_slots is None:
            used = set(self.rows.slots)
            self._free_slots = (slot for slot in count() if slot not in used)
        return next(self._free_slots)

    def preempt_last(self) -> int:
        """Preempt the running row with the largest policy key (the last); returns its index."""
        self.num_running -= 1
        self.kv.free(self.tables[self.num_running])
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
    if len(needy) > step.kv.num_free:
        return
    if needy:
        tables = list(step.tables)
        for index, block in zip(needy, step.kv.allocate(len(needy)), strict=True):
            tables[index] += (block,)
        step.tables = tables
    step.decode_prefix = k
    step.budget -= k


def _schedule_rows(step: _Step) -> None:
    """Step 1 for the running rows after the decode prefix, one at a time (prefill chunks, block shortages,
    preemption)."""
    rows, requests, kv = step.rows, step.state.requests, step.kv
    i = step.num_scheduled
    while i < step.num_running and step.budget > 0:
        start, total = rows.num_computed[i], rows.num_tokens[i]
        n = min(total - start, step.budget)
        if not _make_room(step, i, start + n):
            return  # row i itself was preempted: everything after it already was
        prompt, chunks, tail = requests[rows.ids[i]].prompt, rows.output_chunks[i], rows.output_tails[i]
        if n == 1 and start == total - 1:
            tokens: tuple[int, ...] = (last_token(prompt, chunks, tail),)
            if total == len(prompt) and total % step.kv.block_size == 0:
                # the prompt's last token completes a block begun in an earlier step: a request admitted later in
                # this step must wait for it, not compute it again (a decode's token is last step's sample, which
                # schedule never reads: under overlap it is a placeholder)
                kv.note_computing(prompt, chunks, tail, rows.chain_hashes[i], start, total)
        else:
            tokens = token_slice(prompt, chunks, tail, start, start + n)
            kv.note_computing(prompt, chunks, tail, rows.chain_hashes[i], start, start + n)
        step.emit(tokens, start + n == total)
        i += 1


def _make_room(step: _Step, index: int, num_slots: int) -> bool:
    """Give running row ``index`` blocks for ``num_slots`` tokens, preempting from the back while too few are
    free; False when row ``index`` itself had to go."""
    while (table := step.kv.append_slots(step.tables[index], num_slots)) is None:
        if step.preempt_last() == index:
            return False
    if table is not step.tables[index]:
        step.set_table(index, table)
    return True


def _admit_one(step: _Step, rid: str) -> bool:
    """Admit waiting ``rid`` if blocks allow (False leaves everything as it was)."""
    state, kv = step.state, step.kv
    request, output = state.requests[rid], state.outputs.rest[rid]
    num_tokens, chunks = state.num_tokens.rest[rid], as_chunks(output)
    chain = state.chain_hashes.rest[rid]
    if request.params.prompt_logprobs is None:
        prefix = kv.find_cached_prefix(request.prompt, chunks, num_tokens, chain)
    else:  # every prompt position is scored, so none may come from the cache (fnvllm.executor.prompt_logprobs)
        prefix = CachedPrefix((), chain, 0, False)
    if prefix.is_pending:
        return False  # a request scheduled earlier this step computes its next block: wait, then hit it
    start = prefix.num_computed
    n = min(num_tokens - start, step.budget)
    table = kv.allocate_slots(prefix, start + n)
    if table is None:
        return False
    chain = kv.note_computing(request.prompt, chunks, (), prefix.chain, start, start + n)
    step.admitted.append(RunningRows.one(request, start, num_tokens, output, table, chain, step.take_slot()))
    step.admitted_inputs.append(token_slice(request.prompt, chunks, (), start, start + n))
    step.admitted_samples.append(start + n == num_tokens)
    step.budget -= n
    return True


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


def _histories(state: EngineState, ids: tuple[str, ...], first_admitted: int) -> tuple[TokenHistory | None, ...]:
    """Prompt and output of each admitted row whose sampler needs them (penalties), else None. A continuing row
    needs none: the executor keeps each slot's tokens on the device (``fnvllm.executor.history``), so a row's
    history crosses to the device once per admission, not every step."""
    requests, outputs = state.requests, state.outputs
    admitted = ids[first_admitted:]
    return (None,) * first_admitted + tuple(
        TokenHistory(requests[rid].prompt, outputs.rest[rid]) if requests[rid].params.needs_history else None
        for rid in admitted
    )


def _build_plan(step: _Step, after: RunningRows) -> StepPlan:
    """The frozen plan: the first ``num_scheduled`` running rows, then the admitted rows, read column-wise.

    ``after`` is the running columns of the new state. In the usual step every running row is scheduled and the
    admitted rows went to the back, so the plan's ids, starts, tables and params are exactly those columns and
    are shared with the state instead of being assembled again."""
    state = step.state
    k = step.decode_prefix
    decode_inputs = state.decode.inputs
    inputs = (decode_inputs if k == len(decode_inputs) else decode_inputs[:k]) + tuple(step.inputs)
    inputs += tuple(step.admitted_inputs)
    samples = (True,) * k + tuple(step.samples) + tuple(step.admitted_samples)
    shared = _shared_columns(step, after)
    ids, starts, tables, params, generated, slots = _plan_columns(step) if shared is None else shared
    needs_history = any(row.num_needing_history for row in step.admitted)
    histories = _histories(state, ids, len(ids) - len(step.admitted)) if needs_history else (None,) * len(ids)
    return StepPlan(
        state.step,
        state.config.block_size,
        ids,
        inputs,
        starts,
        tables,
        samples,
        params,
        generated,
        histories,
        tuple(step.preempted),
        len(step.admitted),
        slots,
    )


def _shared_columns(step: _Step, after: RunningRows) -> tuple[tuple[Any, ...], ...] | None:
    """The plan's id, start, table, params, num_generated and slot columns read from ``after`` (the new state's
    running columns), when the plan's rows are exactly those rows in that order: every kept running row was
    scheduled and the admitted rows went to the back. None otherwise (then ``_plan_columns`` assembles them)."""
    m, admitted = step.num_scheduled, step.admitted
    if len(after.ids) != m + len(admitted) or after.ids[m:] != tuple(row.ids[0] for row in admitted):
        return None
    generated = tuple(map(sub, after.num_tokens, after.prompt_lens))
    return after.ids, after.num_computed, after.block_tables, after.params, generated, after.slots


def _plan_columns(step: _Step) -> tuple[tuple[Any, ...], ...]:
    """The plan's id, start, table, params, num_generated and slot columns, assembled from the first
    ``num_scheduled`` running rows and the admitted rows (preemption, or an admission ahead of running rows)."""
    rows, m, new = step.rows, step.num_scheduled, step.admitted
    ids = rows.ids[:m] + tuple(row.ids[0] for row in new)
    starts = rows.num_computed[:m] + tuple(row.num_computed[0] for row in new)
    tables = tuple(step.tables[:m]) + tuple(row.block_tables[0] for row in new)
    params = rows.params[:m] + tuple(row.params[0] for row in new)
    generated = tuple(map(sub, rows.num_tokens[:m], rows.prompt_lens))
    generated += tuple(row.num_tokens[0] - row.prompt_lens[0] for row in new)
    slots = rows.slots[:m] + tuple(row.slots[0] for row in new)
    return ids, starts, tables, params, generated, slots


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
        pool=step.kv.freeze(),
        step=state.step + 1,
        pending_step=state.step,
    )


def _decide(state: EngineState) -> _Step:
    """Steps 1 and 2 of the policy, recorded in the step's scratch space (blocks taken in its KV manager)."""
    step = _Step(state)
    _schedule_decode_prefix(step)
    _schedule_rows(step)
    if not step.preempted and step.waiting:
        _admit_waiting(step)
    return step


def schedule(state: EngineState) -> tuple[EngineState, StepPlan]:
    """Plan the next step. Returns the new state (blocks allocated, queues moved) and the plan; mutates nothing.

    Raises PlanMismatchError when the previous plan has not been committed yet.
    """
    if state.pending_step is not None:
        raise PlanMismatchError(f"step {state.pending_step} is planned but not committed; commit it first")
    step = _decide(state)
    new_state = _next_state(step)
    return new_state, _build_plan(step, new_state.rows)
