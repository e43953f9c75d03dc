"""``commit(state, plan, sampled) -> (state, output)``: fold one executed step back into the state.

For each planned sequence: its fed tokens are now computed; blocks that became full are registered in the
prefix cache; a sampled token is appended and the stop conditions are applied (EOS ids unless ignore_eos,
stop_token_ids, max_tokens). Finished requests release their blocks and leave the state. Stop *strings* need
the detokenizer, so the shell applies them by calling ``finish``.

The per-sequence work is done column-wise (``map``/``zip`` over the batch, ``dict.update``) because a Python
loop over hundreds of decoding sequences per step would cost more than the rest of the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import add, attrgetter, floordiv, ne, sub

import attrs

from fnvllm.state.errors import PlanMismatchError
from fnvllm.state.plan import StepPlan
from fnvllm.state.pool import CachedBlock, PoolTxn
from fnvllm.state.request import FinishedRequest, FinishReason, Request, StepOutput
from fnvllm.state.state import EngineState, abort, drop_requests
from fnvllm.state.tokens import COMPACT_EVERY, TokenLog, flatten, token_slice

_prompt = attrgetter("prompt")
_token_limit = attrgetter("token_limit")


def _check_plan(state: EngineState, plan: StepPlan, sampled: Sequence[int]) -> None:
    if state.pending_step != plan.step:
        expected = "no plan (schedule first)" if state.pending_step is None else f"step {state.pending_step}"
        raise PlanMismatchError(f"plan.step is {plan.step} but the state expects {expected}")
    if len(sampled) != plan.num_samples:
        raise PlanMismatchError(
            f"sampled has {len(sampled)} tokens; plan {plan.step} samples {plan.num_samples} sequences"
        )


@attrs.frozen
class _Rows:
    """The plan's rows that are still live, with the sampled tokens of those that sample."""

    ids: Sequence[str]
    tokens: Sequence[tuple[int, ...]]
    starts: Sequence[int]
    sampled_ids: Sequence[str]
    sampled: Sequence[int]


def _live_rows(state: EngineState, plan: StepPlan, sampled: Sequence[int]) -> _Rows:
    """Rows of the plan minus requests aborted since it was scheduled."""
    computed = state.num_computed
    sampled = list(map(int, sampled))
    sampled_ids = list(compress(plan.seq_ids, plan.sample))
    if all(map(computed.__contains__, plan.seq_ids)):
        return _Rows(plan.seq_ids, plan.input_tokens, plan.start_positions, sampled_ids, sampled)
    keep = list(map(computed.__contains__, plan.seq_ids))
    keep_sampled = list(map(computed.__contains__, sampled_ids))
    return _Rows(
        list(compress(plan.seq_ids, keep)),
        list(compress(plan.input_tokens, keep)),
        list(compress(plan.start_positions, keep)),
        list(compress(sampled_ids, keep_sampled)),
        list(compress(sampled, keep_sampled)),
    )


def _register_full_blocks(state: EngineState, txn: PoolTxn, rid: str, start: int, end: int) -> tuple[int, ...]:
    """Register the blocks that became full in [start, end); returns the request's extended chain hashes."""
    bs, hasher = state.config.block_size, state.config.hash_block
    request, table = state.requests[rid], state.block_tables[rid]
    known = list(state.chain_hashes[rid])
    for index in range(start // bs, end // bs):
        tokens = token_slice(request.prompt, state.outputs[rid], index * bs, (index + 1) * bs)
        parent = known[index - 1] if index else None
        if index == len(known):
            known.append(hasher(parent, tokens))
        txn.register(table[index], CachedBlock(known[index], parent, tokens))
    return tuple(known)


def _register_blocks(
    state: EngineState, rows: _Rows, ends: list[int]
) -> tuple[PoolTxn | None, dict[str, tuple[int, ...]] | None]:
    """Register every block that became full this step (only rows whose end crossed a block boundary).
    Returns (None, None) when no block filled, so a plain decode step opens no pool transaction."""
    bs = state.config.block_size
    crossed = list(map(ne, map(floordiv, ends, repeat(bs)), map(floordiv, rows.starts, repeat(bs))))
    if not any(crossed):
        return None, None
    txn = state.pool.txn()
    chains = dict(state.chain_hashes)
    for rid, start, end in compress(zip(rows.ids, rows.starts, ends, strict=False), crossed):
        chains[rid] = _register_full_blocks(state, txn, rid, start, end)
    return txn, chains


def _stop_reason(request: Request, token: int, num_generated: int, eos: frozenset[int]) -> FinishReason | None:
    params = request.params
    if (token in eos and not params.ignore_eos) or token in params.stop_token_ids:
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None


def _finished(
    state: EngineState, rows: _Rows, totals: list[int], outputs: dict[str, TokenLog]
) -> list[FinishedRequest]:
    """Requests whose new token ends them. Only rows at their length limit or holding a stop-capable token are
    examined one by one."""
    requests = list(map(state.requests.__getitem__, rows.sampled_ids))
    remaining = list(map(sub, map(_token_limit, requests), totals))
    candidates = {i for i, left in enumerate(remaining) if left == 0} if 0 in remaining else set()
    union = state.stop_token_union
    if not union.isdisjoint(rows.sampled):
        candidates.update(i for i, token in enumerate(rows.sampled) if token in union)
    eos = state.config.eos_token_ids
    finished = []
    for i in sorted(candidates):
        request, rid = requests[i], rows.sampled_ids[i]
        reason = _stop_reason(request, rows.sampled[i], totals[i] - len(request.prompt), eos)
        if reason is not None:
            finished.append(FinishedRequest(rid, len(request.prompt), flatten(outputs[rid]), reason))
    return finished


def commit(state: EngineState, plan: StepPlan, sampled: Sequence[int]) -> tuple[EngineState, StepOutput]:
    """Apply the executed ``plan`` with its ``sampled`` tokens (one per sequence with sample=True, in order).

    Returns the new state and the step's output; mutates nothing. Raises PlanMismatchError for a stale plan or
    a wrong number of tokens, leaving the state unchanged. Sequences aborted since ``schedule`` are skipped.
    """
    _check_plan(state, plan, sampled)
    rows = _live_rows(state, plan, sampled)
    ends = list(map(add, rows.starts, map(len, rows.tokens)))
    computed = dict(state.num_computed)
    computed.update(zip(rows.ids, ends, strict=False))
    txn, chains = _register_blocks(state, rows, ends) if state.config.enable_prefix_caching else (None, None)
    num_tokens = dict(state.num_tokens)
    totals = list(map(add, map(num_tokens.__getitem__, rows.sampled_ids), repeat(1)))
    num_tokens.update(zip(rows.sampled_ids, totals, strict=False))
    outputs = dict(state.outputs)
    cells = list(zip(map(outputs.__getitem__, rows.sampled_ids), rows.sampled, strict=False))
    outputs.update(zip(rows.sampled_ids, cells, strict=False))
    if (plan.step + 1) % COMPACT_EVERY == 0:
        outputs = {rid: flatten(log) for rid, log in outputs.items()}
    finished = _finished(state, rows, totals, outputs)
    output = StepOutput(plan.step, tuple(rows.sampled_ids), tuple(rows.sampled), tuple(finished))
    pool = state.pool
    if finished:
        txn = txn or state.pool.txn()
        for record in finished:
            txn.release(state.block_tables[record.request_id])
    if txn is not None:
        pool = txn.freeze()
    columns = dict(
        num_tokens=num_tokens,
        outputs=outputs,
        num_computed=computed,
        chain_hashes=state.chain_hashes if chains is None else chains,
    )
    if finished:
        state = drop_requests(state, {f.request_id for f in finished}, pool, **columns)
        return attrs.evolve(state, pending_step=None), output
    return attrs.evolve(state, pool=pool, pending_step=None, **columns), output


def finish(state: EngineState, request_id: str) -> EngineState:
    """End a live request early (e.g. the shell saw a stop string): same effect as ``abort``, named for intent."""
    return abort(state, request_id)
