"""Overlapped stepping, the pure side: plan step N+1 while step N still runs, then keep that plan or drop it.

While the device runs step N, its sampled tokens are unknown to the host. ``speculate`` commits step N with
*placeholder* tokens (one id that stops no request) and schedules step N+1 from that guess. The guess is usable
only when every row of N+1 is a one-token decode of a sequence that N sampled: the executor then feeds each row
the token N sampled for it, straight from device memory, and never reads the placeholder. When N's real tokens
arrive the loop commits them as usual (stop tokens, stop strings, aborts apply now, one step late) and
``reconcile`` compares ``schedule(committed)`` with the speculative plan:

- the real plan is the speculative one minus the rows that ended at step N (same blocks, positions,
  parameters): the device already ran it. ``keep`` marks the speculative rows to keep; the tokens of the
  others are discarded, never returned, and the blocks they wrote leave the prefix cache.
- anything else (an admission, a preemption, a block handed out differently): the speculative run is
  dropped. Every free block it wrote leaves the prefix cache, and the caller schedules the returned state.

Worked example (block size 16): step 7 decodes rows ("a", "b"); ``speculate`` plans step 8 for ("a", "b"). Step 7
samples EOS for "b", so commit ends "b" and frees its blocks. ``schedule(committed)`` plans ("a",) with the same
block table and position for "a" as the speculative plan: kept, with keep = (True, False). Had "b" needed a new
block at step 8, the speculative plan would have taken it from the free queue before "a"'s new block and the
real plan would hand "a" a different one: dropped.

Either way the outputs are those of plain stepping: every committed plan is one ``schedule`` produced from the
committed state, and the KV the device wrote for it is what that plan would have written
(tests/properties/test_overlap.py checks both against the shadow KV cache).
"""

from __future__ import annotations

from itertools import compress

import attrs

from fnvllm.state.commit import commit
from fnvllm.state.kv import KVManager
from fnvllm.state.plan import StepPlan
from fnvllm.state.scheduler import schedule
from fnvllm.state.state import EngineState, replace


@attrs.frozen
class Speculation:
    """Step N+1 planned before step N's tokens are known.

    state: the pending state ``schedule`` returned from the placeholder commit (only its plan is used).
    plan: the speculative plan; its input tokens are placeholders the executor replaces with step N's samples.
    """

    state: EngineState
    plan: StepPlan


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


def can_feed(previous: StepPlan, plan: StepPlan) -> bool:
    """True when every row of ``plan`` is a one-token decode that samples, of a sequence ``previous`` sampled,
    with no token history to send (penalties read it on the host), and ``plan`` preempts nothing: then the
    device can feed ``plan`` from ``previous``'s sampled ids alone."""
    if plan.is_empty or plan.preempted or not all(plan.sample) or plan.histories.count(None) != plan.num_seqs:
        return False
    if any(len(tokens) != 1 for tokens in plan.input_tokens):
        return False
    sampled = set(compress(previous.seq_ids, previous.sample))
    return all(map(sampled.__contains__, plan.seq_ids))


def speculate(state: EngineState, plan: StepPlan) -> Speculation | None:
    """Plan the step after ``plan`` (pending in ``state``) before its tokens are known, or None when that plan
    could not be fed from ``plan``'s sampled ids on the device (see ``can_feed``)."""
    placeholder = placeholder_token(state)
    if placeholder is None or not plan.num_samples:
        return None
    guessed, _ = commit(state, plan, (placeholder,) * plan.num_samples)
    pending, next_plan = schedule(guessed)
    return Speculation(pending, next_plan) if can_feed(plan, next_plan) else None


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


def reconcile(committed: EngineState, speculative: StepPlan) -> Reconciled:
    """Decide whether the device's run of ``speculative`` stands, given the state after step N's real commit
    (stop strings and aborts applied). See the module docstring."""
    running = set(committed.running)
    keep = tuple(map(running.__contains__, speculative.seq_ids))
    ended = tuple(not k for k in keep)
    state = forget_written_blocks(committed, speculative, ended) if any(ended) else committed
    pending, plan = schedule(state)
    if not plan.is_empty and _same_run(plan, speculative, keep):
        return Reconciled(True, pending, plan, keep)
    return Reconciled(False, forget_written_blocks(state, speculative))


def _same_run(plan: StepPlan, speculative: StepPlan, keep: tuple[bool, ...]) -> bool:
    """True when ``plan`` is ``speculative``'s kept rows with the same blocks, positions and parameters (its
    input tokens are the real ones the device fed; the speculative plan's are placeholders)."""
    if plan.preempted or plan.step != speculative.step or any(len(t) != 1 for t in plan.input_tokens):
        return False
    fields = ("seq_ids", "start_positions", "block_tables", "sample", "params", "num_generated", "histories")
    all_kept = all(keep)
    return all(
        getattr(plan, name)
        == (getattr(speculative, name) if all_kept else tuple(compress(getattr(speculative, name), keep)))
        for name in fields
    )
