"""Overlapped stepping, the pure side: plan step N+1 while step N still runs, then keep that plan or drop it.

While the device runs step N, its sampled tokens are unknown to the host. ``speculate`` commits step N with
*placeholder* tokens (one id that stops no request) and schedules step N+1 from that guess. The guess is usable
when every row of N+1 whose sequence N sampled is a one-token decode: the executor feeds each such row the token
N sampled for it, straight from device memory, and never reads the placeholder; the other rows (prompt chunks,
sequences N did not run) feed tokens the host already knows. When N's real tokens arrive the loop commits them as
usual (stop tokens, stop strings, aborts apply now, one step late) and ``reconcile`` compares
``schedule(committed)`` with the speculative plan:

- the real plan is the speculative one minus the rows that ended at step N (same blocks, positions,
  parameters): the device already ran it. ``keep`` marks the speculative rows to keep; the tokens of the
  others are discarded, never returned, and the blocks they wrote leave the prefix cache.
- anything else (an admission, a preemption, a block handed out differently): the speculative run is
  dropped. Every free block it wrote leaves the prefix cache, and the caller schedules the returned state.

Worked example (block size 16): step 7 decodes rows ("b", "a"); ``speculate`` plans step 8 for ("b", "a"). Step 7
samples EOS for "b", so commit ends "b" and frees its blocks. ``schedule(committed)`` plans ("a",) with the same
block table and position for "a" as the speculative plan: kept, with keep = (False, True). Had both rows needed a
new block at step 8, the speculative plan would have given "b" the free queue's first block and "a" the second,
while the real plan hands "a" the first: dropped.

Either way the outputs are those of plain stepping: every committed plan is one ``schedule`` produced from the
committed state, and the KV the device wrote for it is what that plan would have written
(tests/properties/test_overlap.py checks this with a toy executor that reads each token's context back through
the block tables, so a block written by a dropped run and then reused from the cache changes an output).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import add, is_not, itemgetter

import attrs

from fnvllm.state.commit import _as_ints, commit
from fnvllm.state.errors import PlanMismatchError
from fnvllm.state.kv import KVManager
from fnvllm.state.plan import StepPlan
from fnvllm.state.request import StepOutput
from fnvllm.state.scheduler import schedule
from fnvllm.state.state import EngineState, replace, with_rows


@attrs.frozen
class Speculation:
    """Step N+1 planned before step N's tokens are known.

    state: the pending state ``schedule`` returned from the placeholder commit (only its plan is used).
    plan: the speculative plan. fed: per row, whether step N sampled its sequence; such a row's one input token
        is a placeholder the executor replaces with N's sample (the other rows' tokens are real).
    guessed: step N's output under the placeholder tokens (``fold_speculation`` substitutes the real ones).
    """

    state: EngineState
    plan: StepPlan
    fed: tuple[bool, ...]
    guessed: StepOutput | None = None


@attrs.frozen
class Reconciled:
    """What ``reconcile`` decided.

    kept: True when the speculative run stands for ``plan``.
    state: when kept, the pending state for ``plan`` (commit it with the kept tokens); otherwise the committed
        state without the registrations the dropped run overwrote, to be scheduled as usual.
    plan: when kept, the plan to commit (the speculative plan minus the rows that ended); otherwise None.
    keep: when kept, one flag per speculative row: its token belongs to ``plan``.
    """

    kept: bool
    state: EngineState
    plan: StepPlan | None = None
    keep: tuple[bool, ...] = ()


def placeholder_token(state: EngineState) -> int | None:
    """The smallest token id that ends no request (no EOS id, no request's stop id), or None when every id of
    the vocabulary does."""
    stops = state.config.eos_token_ids | state.stop_token_union
    limit = state.config.vocab_size
    return next((t for t in range(len(stops) + 1) if t not in stops and (limit is None or t < limit)), None)


def feed_sources(previous: StepPlan, plan: StepPlan) -> tuple[int | None, ...]:
    """Per row of ``plan``: the index, among the tokens ``previous`` sampled (in plan order), of the one that row
    feeds, or None when the row's tokens are the host's.

    Only rows that continue a running sequence can be fed: an admitted row (``plan.num_admitted``) is a new life
    of its id, even when ``previous`` sampled that id (the request was aborted or finished while ``previous``
    ran, and its id reused at once), and it feeds its prompt from the host. Keying by id alone would hand the new
    request the old one's token.

    Worked example: ``previous`` sampled ("a", "b", "c") and ``plan`` is ("b", "x", "a") with "a" admitted (the
    old "a" was aborted and the id reused): (1, None, None).
    """
    sampled = {rid: k for k, rid in enumerate(compress(previous.seq_ids, previous.sample))}
    continuing = plan.seq_ids[: plan.num_continuing]
    return (*map(sampled.get, continuing), *(None,) * plan.num_admitted)


def fed_rows(previous: StepPlan, plan: StepPlan) -> tuple[bool, ...]:
    """Per row of ``plan``: whether its one input token is the sample ``previous`` drew for the same sequence
    (``feed_sources``)."""
    return tuple(map(is_not, feed_sources(previous, plan), repeat(None)))  # C-level: this runs every step


def can_feed(previous: StepPlan, plan: StepPlan) -> bool:
    """True when ``plan`` can run before ``previous``'s tokens reach the host: every row whose sequence
    ``previous`` sampled feeds just that one token (the device has it), and ``plan`` preempts nothing (a
    preempted sequence would carry the placeholder into its recomputation). Token histories are no obstacle:
    only admitted rows carry one, and an admitted request's tokens are all real (it was waiting)."""
    return _feedable(plan, fed_rows(previous, plan))


def _feedable(plan: StepPlan, fed: tuple[bool, ...]) -> bool:
    """``can_feed`` given the rows the previous step sampled (``fed_rows``)."""
    if plan.is_empty or plan.preempted:
        return False
    if len(fed) != plan.num_seqs:
        raise ValueError(f"fed has {len(fed)} flags for {plan.num_seqs} rows")
    lens = list(map(len, compress(plan.input_tokens, fed)))  # the fed rows' token counts (C-level: every step)
    return lens.count(1) == len(lens)


def speculate(state: EngineState, plan: StepPlan) -> Speculation | None:
    """Plan the step after ``plan`` (pending in ``state``) before its tokens are known, or None when that plan
    could not be fed from ``plan``'s sampled ids on the device (see ``can_feed``), or when ``plan`` covers several
    decode steps (``fnvllm.state.multistep``: its sub-steps are already fed on the device)."""
    placeholder = placeholder_token(state)
    if placeholder is None or plan.num_steps > 1:
        return None
    guessed, output = commit(state, plan, (placeholder,) * plan.num_samples)
    pending, next_plan = schedule(guessed)
    fed = fed_rows(plan, next_plan)
    return Speculation(pending, next_plan, fed, output) if _feedable(next_plan, fed) else None


@attrs.frozen
class Folded:
    """Step N committed and step N+1 planned, read off a speculation (``fold_speculation``).

    state: the pending state of ``plan``, as ``schedule(commit(...))`` returns it. plan: step N+1, the speculative
    plan with step N's real samples as its fed rows' inputs. output: step N's output, as ``commit`` returns it.
    """

    state: EngineState
    plan: StepPlan
    output: StepOutput


def fold_speculation(
    state: EngineState, plan: StepPlan, speculation: Speculation, sampled: Sequence[int]
) -> Folded | None:
    """``commit(state, plan, sampled)``'s output and ``schedule`` of its state, read off ``speculation`` (which
    ``speculate(state, plan)`` returned) by putting the real tokens where the placeholders are: one commit and one
    schedule per overlapped step instead of two each. Mutates nothing.

    Exact when no sampled token can stop its row: the placeholder stops none either, so both commits end the same
    rows (for length), register the same blocks (a sampled token is not computed yet, so it is in no full block)
    and leave the same queues, and ``schedule`` reads no token that a placeholder stands for (it hashes only
    waiting requests' tokens, all real). None when that cannot be read off: a sampled token among the EOS or stop
    ids, a row of ``plan`` aborted since it was scheduled, tokens ``commit`` would refuse (it raises them for the
    caller); the caller then commits and reconciles (tests/properties/test_overlap.py checks both agree).

    Worked example: step 7 decodes ("a", "b") and the placeholder is 0; the speculation's state ends "a" and "b"
    with token 0 and its plan feeds ((0,), (0,)). Step 7 samples (41, 17): the folded state ends them with 41 and
    17, the plan feeds ((41,), (17,)), and the output's tokens are (41, 17).
    """
    guessed = speculation.guessed
    if guessed is None or state.pending_step != plan.step or len(sampled) != len(guessed.new_tokens):
        return None
    try:
        tokens = tuple(_as_ints(sampled, state.config.vocab_size))
    except PlanMismatchError:
        return None  # commit raises it
    if not (state.config.eos_token_ids | state.stop_token_union).isdisjoint(tokens):
        return None
    ids = guessed.seq_ids
    pending, spec_plan, fed = speculation.state, speculation.plan, speculation.fed
    rows, decode = pending.rows, pending.decode
    ones = tuple(zip(tokens))  # each sampled token as a one-token row, shared by the three columns
    tails = _with_last_tokens(rows.ids, rows.output_tails, ids, ones)
    inputs = _with_last_tokens(rows.ids[: len(decode.inputs)], decode.inputs, ids, ones, single=True)
    feeds = _with_last_tokens(spec_plan.seq_ids, spec_plan.input_tokens, ids, ones, fed, single=True)
    progressed = rows.with_progress(rows.num_computed, rows.num_tokens, rows.output_chunks, tails, rows.chain_hashes)
    folded = with_rows(
        pending, progressed, pending_step=pending.pending_step, decode=attrs.evolve(decode, inputs=inputs)
    )
    finished = guessed.finished
    if finished:
        token_of = dict(zip(ids, tokens, strict=True))
        finished = tuple(attrs.evolve(f, output=(*f.output[:-1], token_of[f.request_id])) for f in finished)
    output = StepOutput(guessed.step, ids, tokens, finished)
    return Folded(folded, attrs.evolve(spec_plan, input_tokens=feeds), output)


_ALL_BUT_LAST = itemgetter(slice(None, -1))


def _with_last_tokens(
    ids: tuple[str, ...],
    values: tuple[tuple[int, ...], ...],
    sampled_ids: tuple[str, ...],
    ones: tuple[tuple[int], ...],
    flags: tuple[bool, ...] | None = None,
    single: bool = False,
) -> tuple[tuple[int, ...], ...]:
    """``values`` (token tuples aligned with ``ids``) with the last token of each row whose id is in
    ``sampled_ids`` (and whose flag is set, when ``flags`` are given) replaced by that id's token (``ones``: each
    token as a one-token tuple, aligned with ``sampled_ids``). ``single``: every such row is that one token. The
    usual decode batch, where the sampled rows lead in order, takes C-level passes; otherwise a dict lookup a row."""
    n = min(len(ids), len(sampled_ids))
    if ids[:n] == sampled_ids[:n] and (flags is None or all(flags[:n])):
        if single:
            return (ones if n == len(ones) else ones[:n]) + values[n:]
        head = values[:n] if n < len(values) else values
        return tuple(map(add, map(_ALL_BUT_LAST, head), ones)) + values[n:]
    one_of = dict(zip(sampled_ids, ones, strict=True))
    marks = flags if flags is not None else (True,) * len(ids)
    return tuple(
        value[:-1] + one_of[rid] if mark and rid in one_of else value
        for rid, value, mark in zip(ids, values, marks, strict=True)
    )


def forget_written_blocks(state: EngineState, plan: StepPlan, rows: tuple[bool, ...] | None = None) -> EngineState:
    """``state`` without the prefix-cache registrations of free blocks that ``plan`` wrote (all its rows, or those
    flagged in ``rows``): after a run that will not be committed, their contents are not what was registered.
    Returns ``state`` itself when no such block is registered."""
    if not state.config.enable_prefix_caching or not state.pool.cached:
        return state
    written = plan.write_blocks()
    kv = KVManager(state.pool, state.config)
    kv.forget_free_blocks(b for blocks in (written if rows is None else compress(written, rows)) for b in blocks)
    pool = kv.freeze()
    return state if pool is state.pool else replace(state, pool=pool)


def reconcile(committed: EngineState, speculation: Speculation) -> Reconciled:
    """Decide whether the device's run of ``speculation.plan`` stands, given the state after step N's real commit
    (stop strings and aborts applied). See the module docstring."""
    speculative = speculation.plan
    live = committed.requests  # a row admitted by the speculative plan is live here, though not yet running
    keep = tuple(map(live.__contains__, speculative.seq_ids))
    ended = tuple(not k for k in keep)
    state = forget_written_blocks(committed, speculative, ended) if any(ended) else committed
    pending, plan = schedule(state)
    if not plan.is_empty and _same_run(plan, speculation, keep):
        return Reconciled(True, pending, plan, keep)
    return Reconciled(False, forget_written_blocks(state, speculative))


def _admitted_flags(plan: StepPlan) -> tuple[bool, ...]:
    """Per row: admitted by ``plan`` (a new request life; see ``StepPlan.num_admitted``)."""
    return (False,) * plan.num_continuing + (True,) * plan.num_admitted


def _same_run(plan: StepPlan, speculation: Speculation, keep: tuple[bool, ...]) -> bool:
    """True when ``plan`` is the speculative plan's kept rows with the same blocks, positions, parameters and
    host-fed tokens (a row the device fed has the real token in ``plan`` and a placeholder in the speculative
    plan: only its length is compared)."""
    speculative = speculation.plan
    if plan.preempted or plan.step != speculative.step:
        return False
    all_kept = all(keep)

    def kept(values: tuple[object, ...]) -> tuple[object, ...]:
        return values if all_kept else tuple(compress(values, keep))

    fields = ("seq_ids", "start_positions", "block_tables", "sample", "params", "num_generated", "histories", "slots")
    if not all(getattr(plan, name) == kept(getattr(speculative, name)) for name in fields):
        return False
    if _admitted_flags(plan) != kept(_admitted_flags(speculative)):
        return False
    fed = kept(speculation.fed)
    expected = kept(speculative.input_tokens)
    return all(
        len(real) == 1 if was_fed else real == guessed
        for real, guessed, was_fed in zip(plan.input_tokens, expected, fed, strict=True)
    )
