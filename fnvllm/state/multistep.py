"""Multi-step decoding, the pure side: plan K decode steps at once, so the host schedules and commits once per K.

At small batches a decode step's host work (schedule, commit, routing the tokens, preparing the device inputs)
is close to its device time; a plan that covers K steps runs them back to back on the device, each sub-step fed
the tokens the one before sampled there, and the host pays its per-step work once per K tokens.

``schedule_steps(state, max_steps)`` plans K = ``decode_steps(state, max_steps)`` steps when every running
sequence is a plain decode and nothing waits (a waiting request is admitted by a one-step plan, so multi-step
decoding never delays a first token), no row needs the host between two of its tokens (a grammar mask, logprobs)
and the blocks for K more tokens per row are free; K is capped so that no row passes its token limit inside the
plan. Otherwise it returns ``schedule(state)``: a one-step plan. ``commit`` folds the K tokens per row
(``StepPlan.num_steps``): each row takes its tokens in order until one stops it (EOS, a stop id, max_tokens);
the tokens after that stop are dropped, as K single steps would never have sampled them.

Equivalence (tests/properties/test_multistep.py): the tokens, outputs and finished requests are those of K
single steps, and when no row ends before the last sub-step the committed state is the same value, blocks
included: the plan takes each sub-step's new blocks in the order one-step plans would, sub-step by sub-step and
row by row. A row that ends early keeps the blocks taken for its later sub-steps until the commit frees them all,
so later block ids can differ from single steps' (outputs do not: tests/test_invariance.py style, by a toy
executor that reads the KV cache back through the block tables).

Worked example (block size 4, K = 3): "a" has 6 tokens, 5 computed (its table (7, 2): 8 slots), feeding its
last token 44 at position 5. Sub-steps compute positions 5, 6, 7, all inside block 2: no new block. "b" has 8
tokens, 7 computed (table (3, 9)), feeding at 7, 8, 9: position 8 opens a block at sub-step 1, so the plan
takes one free block for it, and its table becomes (3, 9, 5). The executor returns 6 tokens: sub-step 0's
("a", "b"), then sub-step 1's, then sub-step 2's.
"""

from __future__ import annotations

from operator import sub

import attrs

from fnvllm.state.errors import PlanMismatchError
from fnvllm.state.kv import KVManager
from fnvllm.state.params import SamplingParams
from fnvllm.state.plan import StepPlan
from fnvllm.state.scheduler import schedule
from fnvllm.state.state import EngineState, with_rows

Tables = list[tuple[int, ...]]


def check_max_steps(max_steps: object) -> int:
    """``max_steps`` as an int >= 1; ValueError naming it otherwise."""
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps (decode steps a plan may cover) must be an int >= 1, got {max_steps!r}")
    return max_steps


def decode_steps(state: EngineState, max_steps: int) -> int:
    """How many decode steps one plan may cover in ``state`` (at most ``max_steps``), before counting blocks: 1
    unless every running sequence is a plain decode, nothing waits, the rows fit the token budget and none needs
    the host between tokens (a grammar, logprobs); else ``max_steps`` capped at the fewest tokens any row may still
    generate (its token limit minus its length)."""
    check_max_steps(max_steps)
    rows = state.rows
    num_rows = len(rows.ids)
    if max_steps == 1 or num_rows == 0 or state.waiting or len(state.decode.inputs) != num_rows:
        return 1
    if num_rows > state.config.max_num_batched_tokens or any(map(_needs_host, rows.params)):
        return 1
    fewest_left: int = min(map(sub, rows.token_limits, rows.num_tokens))
    return max(1, min(max_steps, fewest_left))


def _needs_host(params: SamplingParams) -> bool:
    """Whether a row's sampling needs the host between two of its tokens (a grammar mask, logprobs)."""
    return params.structured is not None or params.logprobs is not None


def grow_tables(state: EngineState, kv: KVManager, num_steps: int) -> tuple[int, Tables]:
    """Blocks for ``num_steps`` sub-steps of the running decodes, taken from ``kv`` sub-step by sub-step and row
    by row (the order of one-step plans). Returns (sub-steps covered, the tables): fewer than asked when the free
    blocks run out (the blocks of the covered sub-steps stay taken in ``kv``)."""
    rows, bs = state.rows, state.config.block_size
    tables = list(rows.block_tables)
    for j in range(num_steps):
        needy = [i for i, start in enumerate(rows.num_computed) if (start + j) // bs >= len(tables[i])]
        if len(needy) > kv.num_free:
            return j, tables
        for i, block in zip(needy, kv.allocate(len(needy)), strict=True):
            tables[i] += (block,)
    return num_steps, tables


def schedule_steps(state: EngineState, max_steps: int) -> tuple[EngineState, StepPlan]:
    """Plan up to ``max_steps`` decode steps at once (see the module docstring); a one-step plan
    (``schedule(state)``) where that cannot be done. Returns the new state and the plan; mutates nothing.

    Raises PlanMismatchError when the previous plan has not been committed yet, ValueError for a bad max_steps.
    """
    if state.pending_step is not None:
        raise PlanMismatchError(f"step {state.pending_step} is planned but not committed; commit it first")
    num_steps = decode_steps(state, max_steps)
    if num_steps > 1:
        kv = KVManager(state.pool, state.config)
        num_steps, tables = grow_tables(state, kv, num_steps)
        if num_steps > 1:
            return _plan_steps(state, kv, tables, num_steps)
    return schedule(state)


def _plan_steps(state: EngineState, kv: KVManager, tables: Tables, num_steps: int) -> tuple[EngineState, StepPlan]:
    """The pending state and the plan of ``num_steps`` sub-steps over every running row, with ``tables``."""
    rows = state.rows.with_tables(tuple(tables))
    num_rows = len(rows.ids)
    pending = with_rows(
        state,
        rows,
        pending_step=state.step,
        pool=kv.freeze(),
        step=state.step + num_steps,
        decode=state.decode.take(num_rows, ()),
    )
    plan = StepPlan(
        state.step,
        state.config.block_size,
        rows.ids,
        state.decode.inputs,
        rows.num_computed,
        rows.block_tables,
        (True,) * num_rows,
        rows.params,
        tuple(map(sub, rows.num_tokens, rows.prompt_lens)),
        (None,) * num_rows,
        num_steps=num_steps,
        slots=rows.slots,
    )
    return pending, plan


def substep(plan: StepPlan, index: int, inputs: tuple[tuple[int, ...], ...] | None = None) -> StepPlan:
    """Sub-step ``index`` of a multi-step ``plan`` as a one-step plan (step ``plan.step + index``, positions and
    generated counts ``index`` further), feeding ``inputs`` (default: the plan's own, which from sub-step 1 on are
    placeholders for the tokens sub-step ``index - 1`` sampled). What an executor runs for each sub-step."""
    if not 0 <= index < plan.num_steps:
        raise ValueError(f"index must be in [0, {plan.num_steps}) (the plan's sub-steps), got {index}")
    if plan.num_steps == 1 and inputs is None:
        return plan
    return attrs.evolve(
        plan,
        step=plan.step + index,
        input_tokens=plan.input_tokens if inputs is None else inputs,
        start_positions=tuple(start + index for start in plan.start_positions),
        num_generated=tuple(generated + index for generated in plan.num_generated),
        num_steps=1,
    )


def substep_inputs(tokens: list[int] | tuple[int, ...], index: int, num_rows: int) -> tuple[tuple[int, ...], ...]:
    """The inputs of sub-step ``index + 1``: the tokens sub-step ``index`` sampled, out of a multi-step plan's
    sub-step-major token list."""
    return tuple((token,) for token in tokens[index * num_rows : (index + 1) * num_rows])
