"""``commit(state, plan, sampled) -> (state, output)``: fold one executed step back into the state.

For each planned sequence: its fed tokens are now computed; blocks that became full are registered in the
prefix cache; a sampled token is appended and the stop conditions are applied (EOS ids unless ignore_eos,
stop_token_ids, max_tokens). Finished requests release their blocks and leave the state. Stop *strings* need
the detokenizer, so the shell applies them by calling ``finish``/``abort``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from fnvllm.state.errors import PlanMismatchError
from fnvllm.state.plan import StepPlan
from fnvllm.state.pool import CachedBlock, PoolTxn
from fnvllm.state.request import FinishedRequest, FinishReason, Request, StepOutput
from fnvllm.state.state import EngineState, drop_requests
from fnvllm.state.tokens import Chunks, append_token, flatten, token_slice


def _check_plan(state: EngineState, plan: StepPlan, sampled: Sequence[int]) -> None:
    if state.pending_step != plan.step:
        expected = "no plan (schedule first)" if state.pending_step is None else f"step {state.pending_step}"
        raise PlanMismatchError(f"plan.step is {plan.step} but the state expects {expected}")
    if len(sampled) != plan.num_samples:
        raise PlanMismatchError(
            f"sampled has {len(sampled)} tokens; plan {plan.step} samples {plan.num_samples} sequences"
        )


def _stop_reason(request: Request, token: int, num_generated: int, eos: frozenset[int]) -> FinishReason | None:
    params = request.params
    if (token in eos and not params.ignore_eos) or token in params.stop_token_ids:
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None


def _register_full_blocks(
    state: EngineState, txn: PoolTxn, rid: str, start: int, end: int, chain: tuple[int, ...]
) -> tuple[int, ...]:
    """Register blocks that became full in [start, end); returns the (possibly extended) chain hashes."""
    bs, hasher = state.config.block_size, state.config.hash_block
    request, table = state.requests[rid], state.block_tables[rid]
    known = list(chain)
    for index in range(start // bs, end // bs):
        tokens = token_slice(request.prompt, state.outputs[rid], index * bs, (index + 1) * bs)
        parent = known[index - 1] if index else None
        if index == len(known):
            known.append(hasher(parent, tokens))
        txn.register(table[index], CachedBlock(known[index], parent, tokens))
    return tuple(known)


def commit(state: EngineState, plan: StepPlan, sampled: Sequence[int]) -> tuple[EngineState, StepOutput]:
    """Apply the executed ``plan`` with its ``sampled`` tokens (one per sequence with sample=True, in order).

    Returns the new state and the step's output; mutates nothing. Raises PlanMismatchError for a stale plan or
    a wrong number of tokens, leaving the state unchanged. Sequences aborted since ``schedule`` are skipped.
    """
    _check_plan(state, plan, sampled)
    bs, caching = state.config.block_size, state.config.enable_prefix_caching
    eos = state.config.eos_token_ids
    requests = state.requests
    computed = dict(state.num_computed)
    num_tokens = dict(state.num_tokens)
    outputs: dict[str, Chunks] = dict(state.outputs)
    chains = dict(state.chain_hashes) if caching else state.chain_hashes
    txn = state.pool.txn()
    out_ids: list[str] = []
    out_tokens: list[int] = []
    finished: list[FinishedRequest] = []
    j = 0
    for rid, tokens, start, sample in zip(
        plan.seq_ids, plan.input_tokens, plan.start_positions, plan.sample, strict=True
    ):
        token = sampled[j] if sample else None
        j += sample
        if rid not in computed:
            continue  # aborted after it was planned
        end = start + len(tokens)
        computed[rid] = end
        if caching and end // bs > start // bs:
            chains[rid] = _register_full_blocks(state, txn, rid, start, end, chains[rid])  # type: ignore[index]
        if token is None:
            continue
        token = int(token)
        outputs[rid] = append_token(outputs[rid], token)
        total = num_tokens[rid] + 1
        num_tokens[rid] = total
        out_ids.append(rid)
        out_tokens.append(token)
        request = requests[rid]
        reason = _stop_reason(request, token, total - len(request.prompt), eos)
        if reason is not None:
            finished.append(FinishedRequest(rid, len(request.prompt), flatten(outputs[rid]), reason))
    return _finish_step(state, plan, txn, computed, num_tokens, outputs, chains, out_ids, out_tokens, finished)


def _finish_step(
    state: EngineState,
    plan: StepPlan,
    txn: PoolTxn,
    computed: dict[str, int],
    num_tokens: dict[str, int],
    outputs: dict[str, Chunks],
    chains: object,
    out_ids: list[str],
    out_tokens: list[int],
    finished: list[FinishedRequest],
) -> tuple[EngineState, StepOutput]:
    output = StepOutput(plan.step, tuple(out_ids), tuple(out_tokens), tuple(finished))
    changes = dict(
        num_computed=computed, num_tokens=num_tokens, outputs=outputs, chain_hashes=chains, pending_step=None
    )
    if not finished:
        return attrs.evolve(state, pool=txn.freeze(), **changes), output  # type: ignore[arg-type]
    gone = {f.request_id for f in finished}
    for rid in gone:
        txn.release(state.block_tables[rid])
    return drop_requests(state, gone, txn.freeze(), **changes), output


def finish(state: EngineState, request_id: str) -> EngineState:
    """End a live request early (e.g. the shell saw a stop string). Same as ``abort``; kept as its own verb."""
    from fnvllm.state.state import abort

    return abort(state, request_id)
