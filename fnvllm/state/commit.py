"""``commit(state, plan, sampled) -> (state, output)``: fold one executed step back into the state.

For each planned sequence: its fed tokens are now computed; blocks that became full are registered in the
prefix cache (through the KV seam, kv.py); a sampled token is appended and the stop conditions are applied
(EOS ids unless ignore_eos, and stop_token_ids, both only past min_tokens; max_tokens). Finished requests release
their blocks and leave the state. Stop *strings* need the detokenizer, so the shell applies them by calling ``finish``.

When the plan's rows are exactly the running rows (every step that no abort interrupted and whose admissions
went to the back), the leading plain decodes (``state.decode``) are folded column-wise, each column
rewritten by one C-level ``map``/``zip`` or table lookup: a Python loop over hundreds of decoding sequences per
step would cost more than the rest of the step (BENCHMARKS.md, section "CPU": the cachegrind row).
Only the rows that need attention are visited one by one: those that reached a compaction point or filled a
block, those that may have stopped, and the rows after the decode prefix. ``_commit_rows`` is the general path;
tests/properties/test_fast_paths.py checks that the two agree.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence, Sized
from collections.abc import Set as AbstractSet
from functools import cache
from itertools import compress
from operator import add, index, sub
from typing import Any

from fnvllm.state._rows import byte_positions, zero_positions
from fnvllm.state._running import DecodePrefix, RunningRows
from fnvllm.state._tokens import COMPACT_EVERY, Chunks, compact, join, last_token
from fnvllm.state.checks import show
from fnvllm.state.errors import PlanMismatchError
from fnvllm.state.kv import KVManager
from fnvllm.state.plan import StepPlan
from fnvllm.state.request import FinishedRequest, FinishReason, StepOutput
from fnvllm.state.state import EngineState, abort, with_rows

Tokens = tuple[int, ...]


def _check_plan(state: EngineState, plan: StepPlan, sampled: Sequence[int]) -> None:
    if isinstance(sampled, (str, bytes, bytearray, Mapping, AbstractSet)) or not isinstance(sampled, Sized):
        raise PlanMismatchError(f"sampled must be a list of token ids, got {show(sampled)}")
    if state.pending_step != plan.step:
        expected = "no plan (schedule first)" if state.pending_step is None else f"step {state.pending_step}"
        raise PlanMismatchError(f"plan.step is {plan.step} but the state expects {expected}")
    if len(sampled) != plan.num_samples:
        raise PlanMismatchError(
            f"sampled has {len(sampled)} tokens; plan {plan.step} samples {plan.num_samples} sequences"
        )


def _check_rows(state: EngineState, plan: StepPlan) -> None:
    """PlanMismatchError unless each plan row still running in ``state`` starts at its computed count, holds its
    block table and feeds no more than its tokens: a plan scheduled from another state (with the same step
    number) must not be folded into this one. Rows aborted since ``schedule`` are not checked. The usual plan
    shares these columns with the state it was scheduled into, so three identity tests settle it."""
    rows = state.rows
    shared = plan.start_positions is rows.num_computed and plan.block_tables is rows.block_tables
    if shared and plan.seq_ids is rows.ids:
        return
    index_of = {rid: i for i, rid in enumerate(rows.ids)}
    for row, rid in enumerate(plan.seq_ids):
        i = index_of.get(rid)
        if i is None:
            continue  # aborted since it was scheduled
        start = plan.start_positions[row]
        if (
            start != rows.num_computed[i]
            or plan.block_tables[row] != rows.block_tables[i]
            or start + len(plan.input_tokens[row]) > rows.num_tokens[i]
        ):
            raise PlanMismatchError(
                f"plan row {row} ({rid!r}, start {start}) does not match the state's sequence (computed "
                f"{rows.num_computed[i]} of {rows.num_tokens[i]} tokens): the plan was scheduled from another state"
            )


def _as_ints(sampled: Sequence[int], vocab_size: int | None) -> Sequence[int]:
    """The sampled ids as a list or tuple of ints in [0, vocab_size) (>= 0 when the vocabulary is unknown);
    PlanMismatchError naming the first bad one otherwise. A list or tuple given is used as it is (commit keeps no
    reference to it). Executors return plain ints, which ``sum`` confirms in one C-level pass (it comes out a
    plain int only when every item is an int or a bool), and ``min`` / ``max`` bound in two more; only when the
    smallest is 0 or 1 can a bool hide among them, and a pass over the types looks. Anything else is converted
    item by item with ``operator.index``, which takes numpy integers and refuses floats and strs."""
    tokens = sampled if type(sampled) is tuple or type(sampled) is list else list(sampled)
    try:
        plain = type(sum(tokens)) is int
    except TypeError:
        plain = False
    if not plain:
        tokens = list(map(_token_index, enumerate(tokens)))
    if not tokens:
        return tokens
    lowest = min(tokens)
    if lowest <= 1 and bool in set(map(type, tokens)):
        position = next(i for i, t in enumerate(tokens) if type(t) is bool)
        raise PlanMismatchError(f"sampled[{position}] = {tokens[position]} is a bool, not a token id")
    if lowest < 0 or (vocab_size is not None and max(tokens) >= vocab_size):
        allowed = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        position, token = next((i, t) for i, t in enumerate(tokens) if t < 0 or (vocab_size and t >= vocab_size))
        raise PlanMismatchError(
            f"sampled[{position}] = {show(token)} is not a token id in {allowed} (vocab_size); the executor "
            "returned an invalid token"
        )
    return tokens


def _token_index(item: tuple[int, object]) -> int:
    position, token = item
    try:
        return index(token)  # type: ignore[arg-type]
    except TypeError:
        raise PlanMismatchError(f"sampled[{position}] = {show(token)} is not an int token id") from None


@cache
def compaction_period(block_size: int) -> int:
    """Output tails become chunks when a sequence's length reaches a multiple of this: the largest divisor of the
    block size up to COMPACT_EVERY. Dividing the block size makes every block fill (which reads the block's tokens
    for its hash) a compaction point too, so one boundary test per step finds both."""
    return max(d for d in range(1, min(block_size, COMPACT_EVERY) + 1) if block_size % d == 0)


@cache
def successors(max_model_len: int) -> tuple[int, ...]:
    """``successors(m)[n] == n + 1`` for every length n up to m. A decode step adds 1 to the length of every
    decoding sequence; reading the sums from this table creates no int object per sequence (lengths above 256
    are not among CPython's cached small ints), which is cheaper than ``map(add, lengths, repeat(1))`` or a list
    comprehension (BENCHMARKS.md, core microbenchmarks)."""
    return tuple(range(1, max_model_len + 2))


class _Fold:
    """Scratch of one ``commit``: the KV manager (blocks registered and freed) and the rows that finished."""

    def __init__(self, state: EngineState, plan: StepPlan) -> None:
        self.state = state
        self.plan = plan
        self.rows = state.rows
        self.bs = state.config.block_size
        self.period = compaction_period(self.bs)
        self.kv = KVManager(state.pool, state.config)
        self.finished: list[tuple[int, FinishedRequest]] = []  # (running row, record), in plan order

    def advance(self, index: int, start: int, end: int) -> tuple[Chunks, Tokens, tuple[int, ...]]:
        """Row ``index`` computed [start, end): register the blocks it filled, and when it crossed a compaction
        point move its tail into its chunks. Returns its (chunks, tail, chain hashes) before any new token."""
        rows = self.rows
        chunks, tail, chain = rows.output_chunks[index], rows.output_tails[index], rows.chain_hashes[index]
        if end // self.period != start // self.period:
            if end // self.bs != start // self.bs:
                chain = self.register_full_blocks(index, start, end, chunks, tail, chain)
            chunks, tail = compact(chunks, tail), ()
        return chunks, tail, chain

    def register_full_blocks(
        self, index: int, start: int, end: int, chunks: Chunks, tail: Tokens, chain: tuple[int, ...]
    ) -> tuple[int, ...]:
        """Register the blocks of row ``index`` that became full in [start, end); returns its extended chain."""
        if not self.kv.caching:
            return chain
        prompt, table = self.state.requests[self.rows.ids[index]].prompt, self.rows.block_tables[index]
        return self.kv.register_full_blocks(prompt, chunks, tail, table, chain, start, end)

    def check_stop(self, index: int, token: int, total: int, chunks: Chunks, tail: Tokens) -> None:
        """Record row ``index`` as finished if its new ``token`` (making ``total`` tokens) ends it."""
        rows, eos = self.rows, self.state.config.eos_token_ids
        prompt_len, params = rows.prompt_lens[index], rows.params[index]
        reason: FinishReason | None = None
        stops = (token in eos and not params.ignore_eos) or token in params.stop_token_ids
        if stops and total - prompt_len > params.min_tokens:  # the token is output token number total - prompt_len
            reason = "stop"
        elif total - prompt_len >= params.max_tokens:
            reason = "length"
        if reason is not None:
            record = FinishedRequest(rows.ids[index], prompt_len, join(chunks, tail), reason)
            self.finished.append((index, record))


def _fold_decode_prefix(fold: _Fold, tokens: Sequence[int]) -> tuple[list[Any], DecodePrefix]:
    """Column-wise commit of the leading plain decodes (each fed 1 token and sampled ``tokens[i]``). Returns their
    new [num_computed, num_tokens, output_chunks, output_tails, chain_hashes] columns and what the next step
    needs to know about them (before finished rows are removed)."""
    state, rows, bs = fold.state, fold.rows, fold.bs
    k = len(state.decode.inputs)
    whole = k == len(rows.ids)
    new = tokens if len(tokens) == k else tokens[:k]
    inputs = tuple(zip(new))  # the next step's input rows, and the one-token tuples appended to the tails
    ends = rows.num_tokens if whole else rows.num_tokens[:k]  # a decode's KV now covers every token it knew
    successor = successors(state.config.max_model_len)
    totals = tuple([successor[n] for n in ends])
    chunks: Sequence[Chunks] = rows.output_chunks if whole else rows.output_chunks[:k]
    chains: Sequence[tuple[int, ...]] = rows.chain_hashes if whole else rows.chain_hashes[:k]
    appended = map(add, rows.output_tails, inputs)  # each tail one token longer (zip stops after the k rows)
    due = byte_positions(state.decode.phases, -fold.plan.step % fold.period)  # see DecodePrefix.phases
    block_due: list[int] = []
    tails: Sequence[Tokens]
    if due:
        tails, chunks, chains = list(appended), list(chunks), list(chains)
        for i in due:  # inlined ``_Fold.advance``: about one row in ``period`` is due each step
            end, old_tail = ends[i], rows.output_tails[i]
            if end % bs == 0:
                block_due.append(i)
                chains[i] = fold.register_full_blocks(i, end - 1, end, chunks[i], old_tail, chains[i])
            chunks[i], tails[i] = compact(chunks[i], old_tail), inputs[i]
    else:
        tails = tuple(appended)
    steps_to_limit = _check_prefix_stops(fold, new, totals, chunks, tails)
    decode = DecodePrefix(inputs, tuple(block_due), steps_to_limit, state.decode.phases)
    return [ends, totals, chunks, tails, chains], decode


def _check_prefix_stops(
    fold: _Fold, new: Sequence[int], totals: tuple[int, ...], chunks: Sequence[Chunks], tails: Sequence[Tokens]
) -> int:
    """Finish the decode rows at their token limit or holding a stop-capable token; only those are visited.
    Returns the new lower bound on steps before one of them reaches its limit."""
    candidates: set[int] = set()
    bound = fold.state.decode.steps_to_limit
    if bound > 1:  # every decode row is at least two tokens from its limit: none stops for length now
        bound -= 1
    else:
        remaining = list(map(sub, fold.rows.token_limits, totals))
        candidates.update(zero_positions(remaining))
        bound = min(filter(None, remaining), default=0)
    union = fold.state.stop_token_union
    if union and not union.isdisjoint(new):  # isdisjoint would look every token up even in an empty set
        candidates.update(i for i, token in enumerate(new) if token in union)
    for i in sorted(candidates):
        fold.check_stop(i, new[i], totals[i], chunks[i], tails[i])
    return bound


def _fold_row(fold: _Fold, index: int, row: int, token: int | None) -> tuple[Any, ...]:
    """Commit plan row ``row`` (running row ``index``) alone; returns its new column values."""
    plan, rows = fold.plan, fold.rows
    start = plan.start_positions[row]
    end = start + len(plan.input_tokens[row])
    chunks, tail, chain = fold.advance(index, start, end)
    total = rows.num_tokens[index]
    if token is not None:
        total += 1
        tail += (token,)
        if token in fold.state.stop_token_union or total == rows.token_limits[index]:
            fold.check_stop(index, token, total, chunks, tail)
    return end, total, chunks, tail, chain


def _commit_running(fold: _Fold, tokens: Sequence[int]) -> tuple[RunningRows, DecodePrefix]:
    """The plan's rows are the running rows: the decode prefix column-wise, then the rest one at a time."""
    plan, rows = fold.plan, fold.rows
    k = len(fold.state.decode.inputs)
    columns, decode = _fold_decode_prefix(fold, tokens)
    if k == len(rows.ids):
        return rows.with_progress(*map(tuple, columns)), decode
    inputs, block_due, steps_to_limit = decode.inputs, list(decode.block_due), decode.steps_to_limit
    phases = bytearray(decode.phases)
    samples = iter(tokens[k:])
    extending = True  # rows right after the prefix that sampled are plain decodes now and join it
    suffix = []
    for i in range(k, len(rows.ids)):
        token = next(samples) if plan.sample[i] else None
        suffix.append(_fold_row(fold, i, i, token))
        extending = extending and token is not None
        if extending and token is not None:
            end, total = suffix[-1][0], suffix[-1][1]
            inputs += ((token,),)
            block_due += [i] if end % fold.bs == 0 else []
            steps_to_limit = min(steps_to_limit, rows.token_limits[i] - total)
            phases.append((total - fold.state.step) % fold.period)
    columns = [tuple(head) + tail for head, tail in zip(columns, zip(*suffix, strict=True), strict=True)]
    return rows.with_progress(*columns), DecodePrefix(inputs, tuple(block_due), steps_to_limit, bytes(phases))


def _commit_rows(fold: _Fold, tokens: Sequence[int]) -> tuple[RunningRows, list[str], list[int]]:
    """The general case, one plan row at a time: rows aborted since ``schedule`` are skipped, running rows that
    were not scheduled keep their values. Returns the new rows and the live sampled ids and tokens."""
    plan, rows = fold.plan, fold.rows
    index_of = {rid: i for i, rid in enumerate(rows.ids)}
    columns: list[list[Any]] = [
        list(column)
        for column in (rows.num_computed, rows.num_tokens, rows.output_chunks, rows.output_tails, rows.chain_hashes)
    ]
    sampled_ids: list[str] = []
    sampled: list[int] = []
    samples: Iterator[int] = iter(tokens)
    for row, rid in enumerate(plan.seq_ids):
        token = next(samples) if plan.sample[row] else None
        index = index_of.get(rid)
        if index is None:
            continue  # aborted since it was scheduled
        if token is not None:
            sampled_ids.append(rid)
            sampled.append(token)
        for column, value in zip(columns, _fold_row(fold, index, row, token), strict=True):
            column[index] = value
    return rows.with_progress(*map(tuple, columns)), sampled_ids, sampled


def _commit_steps(fold: _Fold, tokens: Sequence[int]) -> tuple[RunningRows, list[str], list[int]]:
    """A multi-step plan (``fnvllm.state.multistep``): sub-step by sub-step, each live row takes its token as
    ``_fold_row`` would in a one-step plan, until one stops it; its later tokens are dropped. ``tokens`` are
    sub-step-major. Returns the new rows and the kept sampled ids and tokens, in sub-step order."""
    plan, rows = fold.plan, fold.rows
    num_rows = plan.num_seqs
    index_of = {rid: i for i, rid in enumerate(rows.ids)}
    live = [(row, index_of[rid]) for row, rid in enumerate(plan.seq_ids) if rid in index_of]  # not aborted
    columns: list[list[Any]] = [
        list(column)
        for column in (rows.num_computed, rows.num_tokens, rows.output_chunks, rows.output_tails, rows.chain_hashes)
    ]
    sampled_ids: list[str] = []
    sampled: list[int] = []
    for j in range(plan.num_steps):
        going = []
        for row, at in live:
            token = tokens[j * num_rows + row]
            sampled_ids.append(plan.seq_ids[row])
            sampled.append(token)
            ended = len(fold.finished)
            current = (column[at] for column in columns[1:])
            values = _fold_token(fold, at, plan.start_positions[row] + j, token, *current)
            for column, value in zip(columns, values, strict=True):
                column[at] = value
            if len(fold.finished) == ended:
                going.append((row, at))
        live = going
    return rows.with_progress(*map(tuple, columns)), sampled_ids, sampled


def _fold_token(
    fold: _Fold, index: int, start: int, token: int, total: int, chunks: Chunks, tail: Tokens, chain: Tokens
) -> tuple[Any, ...]:
    """Running row ``index``, ``total`` tokens long, computed position ``start`` and sampled ``token`` (one
    sub-step of a multi-step plan), from its current chunks, tail and chain. Returns its new (num_computed,
    num_tokens, chunks, tail, chain), recording it as finished when the token ends it (as ``_fold_row``)."""
    end = start + 1
    if end // fold.period != start // fold.period:  # ``_Fold.advance``, from the row's current columns
        if end // fold.bs != start // fold.bs:
            chain = fold.register_full_blocks(index, start, end, chunks, tail, chain)
        chunks, tail = compact(chunks, tail), ()
    total += 1
    tail += (token,)
    if token in fold.state.stop_token_union or total == fold.rows.token_limits[index]:
        fold.check_stop(index, token, total, chunks, tail)
    return end, total, chunks, tail, chain


def _decode_prefix(state: EngineState, rows: RunningRows) -> DecodePrefix:
    """The leading plain decodes, found one row at a time (after the general path)."""
    inputs, block_due, remaining, phases = [], [], [], bytearray()
    period = compaction_period(state.config.block_size)
    for i, rid in enumerate(rows.ids):
        computed, total = rows.num_computed[i], rows.num_tokens[i]
        if total - computed != 1:
            break
        inputs.append((last_token(state.requests[rid].prompt, rows.output_chunks[i], rows.output_tails[i]),))
        block_due += [i] if computed % state.config.block_size == 0 else []
        remaining.append(rows.token_limits[i] - total)
        phases.append((total - state.step) % period)
    return DecodePrefix(tuple(inputs), tuple(block_due), min(filter(None, remaining), default=0), bytes(phases))


def commit(state: EngineState, plan: StepPlan, sampled: Sequence[int]) -> tuple[EngineState, StepOutput]:
    """Apply the executed ``plan`` with its ``sampled`` tokens (one per sequence with sample=True, in order; for a
    multi-step plan, ``plan.num_steps`` such rounds one after another, and a row's tokens after one that stops it
    are dropped: ``fnvllm.state.multistep``).

    Returns the new state and the step's output; mutates nothing. Raises PlanMismatchError for a stale plan, a
    wrong number of tokens, or a token that is not an int in [0, vocab_size), leaving the state unchanged.
    Sequences aborted since ``schedule`` are skipped.
    """
    _check_plan(state, plan, sampled)
    _check_rows(state, plan)
    tokens = _as_ints(sampled, state.config.vocab_size)
    fold = _Fold(state, plan)
    sampled_ids: Sequence[str]
    if plan.num_steps > 1:
        rows, sampled_ids, tokens = _commit_steps(fold, tokens)
        decode = _decode_prefix(state, rows)
    elif plan.seq_ids is state.running or plan.seq_ids == state.running:
        rows, decode = _commit_running(fold, tokens)
        all_sample = len(tokens) == len(plan.seq_ids)
        sampled_ids = plan.seq_ids if all_sample else tuple(compress(plan.seq_ids, plan.sample))
    else:
        rows, sampled_ids, tokens = _commit_rows(fold, tokens)
        decode = _decode_prefix(state, rows)
    output = StepOutput(plan.step, tuple(sampled_ids), tuple(tokens), tuple(record for _, record in fold.finished))
    return _without_finished(fold, rows, decode), output


def _without_finished(fold: _Fold, rows: RunningRows, decode: DecodePrefix) -> EngineState:
    """The committed state: finished rows' blocks released (in finishing order) and their requests removed."""
    state = fold.state
    if fold.finished:
        for index, _ in fold.finished:
            fold.kv.free(state.rows.block_tables[index])
        gone = sorted(index for index, _ in fold.finished)
        rows = rows.drop(gone)
        decode = decode.drop(gone)
        requests = state.requests.without([record.request_id for _, record in fold.finished])
    else:
        requests = state.requests
    return with_rows(state, rows, requests=requests, pool=fold.kv.freeze(), decode=decode, pending_step=None)


def finish(state: EngineState, request_id: str) -> EngineState:
    """End a live request early (e.g. the shell saw a stop string): same effect as ``abort``, named for intent."""
    return abort(state, request_id)
