"""Invariants of the pure core as plain functions, usable from any test (Hypothesis or not).

Each ``check_*`` raises ``InvariantViolation`` (an AssertionError) whose message names the broken rule and the
offending block or request; it returns None when the rule holds. ``CoreStateMachine`` calls them after every
transition; call them from your own tests to vet a custom policy or scheduler wrapper.

A shadow KV cache (``ShadowKV``: slot -> (position, the context its K/V was computed from)) stands in for the
device: ``write_plan`` applies a plan's writes the way an executor would, and ``check_kv`` verifies that every
computed position of every running sequence reads back, through its block table, K/V computed from that
sequence's own tokens. A scheduler that hands out a wrong block, or a prefix-cache hit whose tokens match but
whose earlier context differs, fails this check at once.
"""

from __future__ import annotations

import io
import operator
import pickle
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import attrs

from fnvllm.state._pmap import PMap
from fnvllm.state.commit import compaction_period
from fnvllm.state.config import CoreConfig
from fnvllm.state.hashing import chain_hashes
from fnvllm.state.multistep import substep, substep_inputs
from fnvllm.state.params import SamplingParams
from fnvllm.state.plan import StepPlan, TokenHistory
from fnvllm.state.policy import Policy
from fnvllm.state.pool import BlockPool
from fnvllm.state.request import FinishReason, Request, StepOutput
from fnvllm.state.state import EngineState

R = TypeVar("R")
ShadowKV = dict[tuple[int, int], tuple[int, tuple[int, ...]]]  # (block, offset) -> (position, context tokens)


class InvariantViolation(AssertionError):
    """A core invariant does not hold; the message names the rule and where it broke."""


def _uses_penalty(params: SamplingParams) -> bool:
    """Whether the sampler needs the request's history: any penalty on, or a bad word of several ids. Derived here
    from those fields, not read from ``params.needs_history`` (the field under test)."""
    if any(len(word) >= 2 for word in params.bad_words_token_ids):
        return True
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def fail(message: str) -> NoReturn:
    """Raise InvariantViolation with ``message``."""
    raise InvariantViolation(message)


def _field_reducer(cls: type) -> Callable[[object], tuple[object, ...]]:
    values = operator.attrgetter(*(f.name for f in attrs.fields(cls)))
    return lambda obj: (cls, values(obj))


def _pmap_reducer(mapping: PMap[object, object]) -> tuple[object, ...]:
    shards = getattr(mapping, "_shards", None)  # its shard dicts pickle in C; fall back to the public items
    return (PMap, (shards if shards is not None else dict(mapping.items()),))


# attrs' and PMap's own pickling run Python code per object; these reducers do the same job mostly in C.
_FAST_REDUCERS: dict[type, Callable[[Any], tuple[object, ...]]] = {
    cls: _field_reducer(cls)
    for cls in (SamplingParams, Request, CoreConfig, Policy, EngineState, BlockPool, StepPlan, StepOutput)
}
_FAST_REDUCERS[PMap] = _pmap_reducer


def snapshot(value: object) -> bytes:
    """A pickle of ``value`` for before/after comparison (purity checks); equal bytes mean nothing changed."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _FAST_REDUCERS  # type: ignore[assignment]
    pickler.dump(value)
    return buffer.getvalue()


def run_pure(function: Callable[..., R], *inputs: object) -> R:
    """Call ``function(*inputs)`` and check that it left every input unchanged (compared as pickles)."""
    before = [snapshot(x) for x in inputs]
    result = function(*inputs)
    for i, (x, old) in enumerate(zip(inputs, before, strict=True)):
        if snapshot(x) != old:
            fail(f"purity: {getattr(function, '__name__', function)} mutated its input #{i} ({type(x).__name__})")
    return result


def seq_tokens(state: EngineState, rid: str) -> tuple[int, ...]:
    """Prompt plus generated tokens of a live request, read through the public snapshot."""
    view = state.sequence(rid)
    return view.request.prompt + view.output


def check_blocks_conserved(state: EngineState) -> None:
    """Every block is either free (once, in the free queue) or referenced, never both, never neither."""
    pool = state.pool
    free, held = pool.free_queue, set(pool.ref_counts)
    if len(set(free)) != len(free):
        fail(f"conservation: free queue holds a block twice: {sorted(b for b, n in Counter(free).items() if n > 1)}")
    if set(free) & held:
        fail(f"conservation: blocks both free and referenced: {sorted(set(free) & held)}")
    everything = set(range(pool.num_blocks))
    if set(free) | held != everything:
        lost, alien = everything - set(free) - held, (set(free) | held) - everything
        fail(f"conservation: blocks neither free nor referenced: {sorted(lost)}; unknown ids: {sorted(alien)}")
    if pool.num_blocks != state.config.num_blocks:
        fail(f"conservation: pool has {pool.num_blocks} blocks, config says {state.config.num_blocks}")


def check_ref_counts(state: EngineState) -> None:
    """Each ref count equals the number of running sequences whose block table holds the block (once each)."""
    holders: Counter[int] = Counter()
    for rid, table in state.block_tables.items():
        if len(set(table)) != len(table):
            fail(f"ref count: {rid!r} holds a block twice: {table}")
        holders.update(table)
    counts = dict(state.pool.ref_counts.items())
    if counts != dict(holders):
        wrong = {b: (counts.get(b, 0), holders.get(b, 0)) for b in set(counts) | set(holders)}
        wrong = {b: v for b, v in wrong.items() if v[0] != v[1]}
        fail(f"ref count != holders, block: (ref count, holders): {dict(sorted(wrong.items()))}")


def check_queues(state: EngineState) -> None:
    """Waiting and running partition the live requests, each sorted by the policy; only running ones hold KV."""
    waiting, running = state.waiting, state.running
    if len(set(waiting)) != len(waiting) or len(set(running)) != len(running) or set(waiting) & set(running):
        fail(f"queues: duplicated ids; waiting={waiting} running={running}")
    if set(waiting) | set(running) != set(state.requests):
        fail(f"queues: waiting+running {sorted(set(waiting) | set(running))} != live {sorted(state.requests)}")
    if set(state.block_tables) != set(running) or set(state.num_computed) != set(running):
        fail(
            f"queues: block tables {sorted(state.block_tables)} / num_computed {sorted(state.num_computed)} "
            f"must be exactly the running ids {sorted(running)}"
        )
    key = state.policy.key
    for name, queue in (("waiting", waiting), ("running", running)):
        keys = [key(state.requests[r]) for r in queue]
        if keys != sorted(keys):
            fail(f"queues: {name} is not in policy order: {list(zip(queue, keys, strict=True))}")
    if len(running) > state.config.max_num_seqs:
        fail(f"max_num_seqs: {len(running)} running > {state.config.max_num_seqs}")


def check_lengths(state: EngineState) -> None:
    """num_tokens matches prompt + output; computed KV fits the table; no table holds more than it can use (a
    pending plan of K decode steps holds blocks for K - 1 tokens more: ``fnvllm.state.multistep``)."""
    bs = state.config.block_size
    ahead = 0 if state.pending_step is None else state.step - state.pending_step - 1
    for rid in state.requests:
        n = len(seq_tokens(state, rid))
        if state.num_tokens[rid] != n:
            fail(f"lengths: num_tokens[{rid!r}] = {state.num_tokens[rid]} but prompt + output = {n}")
        table, computed = state.block_tables.get(rid, ()), state.num_computed.get(rid, 0)
        if not computed <= len(table) * bs or computed > n:
            fail(f"lengths: {rid!r} computed {computed} of {n} tokens with {len(table)} blocks of {bs}")
        if len(table) > -(-(n + ahead) // bs):
            fail(f"lengths: {rid!r} holds {len(table)} blocks for {n} tokens (block size {bs})")


def check_prefix_cache(state: EngineState) -> None:
    """cached and hash_to_block are inverse; each entry's hash is the chain hash of its parent and tokens; serials
    are unique, below next_serial and above their parent's; a held entry's tokens and parent are the holder's own
    block and chain hash, and its parent serial is that of the holder's previous block (None for the first block);
    each request's chain is its tokens'."""
    pool, cfg = state.pool, state.config
    if not cfg.enable_prefix_caching and len(pool.cached):
        fail(f"prefix cache: {len(pool.cached)} blocks registered with caching off")
    if len(pool.cached) != len(pool.hash_to_block):
        fail(f"prefix cache: {len(pool.cached)} cached blocks but {len(pool.hash_to_block)} hashes")
    for block, entry in pool.cached.items():
        if pool.hash_to_block.get(entry.hash) != block:
            fail(
                f"prefix cache: block {block} has hash {entry.hash} which maps to {pool.hash_to_block.get(entry.hash)}"
            )
        if len(entry.tokens) != cfg.block_size or cfg.hash_block(entry.parent, entry.tokens) != entry.hash:
            fail(f"prefix cache: block {block}'s hash is not hash(parent, tokens): {entry}")
        if not (entry.parent_serial is None or entry.parent_serial < entry.serial) or entry.serial >= pool.next_serial:
            fail(f"prefix cache: block {block}'s serials are out of order (next serial {pool.next_serial}): {entry}")
    if len({entry.serial for entry in pool.cached.values()}) != len(pool.cached):
        fail("prefix cache: two registrations share a serial")
    for rid in state.requests:
        _check_chain(state, rid, seq_tokens(state, rid))


def _check_chain(state: EngineState, rid: str, tokens: tuple[int, ...]) -> None:
    cfg, cached = state.config, state.pool.cached
    bs, known = cfg.block_size, state.chain_hashes.get(rid, ())
    table = state.block_tables.get(rid, ())
    depth = max([len(known)] + [i + 1 for i, b in enumerate(table) if b in cached])
    if depth > len(tokens) // bs:
        fail(f"prefix cache: {rid!r} has {depth} hashed/cached blocks but only {len(tokens)} tokens")
    chain = chain_hashes(cfg.hash_block, tokens, bs, depth)
    if tuple(chain[: len(known)]) != tuple(known):
        fail(f"prefix cache: chain_hashes[{rid!r}] = {known} but its tokens hash to {chain[: len(known)]}")
    for i, block in enumerate(table):
        entry = cached.get(block)
        if entry is None:
            continue
        parent = chain[i - 1] if i else None
        if entry.tokens != tokens[i * bs : (i + 1) * bs] or entry.parent != parent:
            fail(
                f"prefix cache: {rid!r} holds block {block} at index {i} registered as {entry}, but its own "
                f"tokens there are {tokens[i * bs : (i + 1) * bs]} with parent hash {parent}"
            )
        parent_entry = cached.get(table[i - 1]) if i else None
        parent_serial = None if parent_entry is None else parent_entry.serial
        if entry.parent_serial != parent_serial or (i and parent_entry is None):
            fail(
                f"prefix cache: {rid!r} holds block {block} at index {i} registered as {entry}, but its previous "
                f"block's registration is {parent_entry}"
            )


def check_derived(state: EngineState) -> None:
    """Every derived or cached field of the state equals its recomputation from the primary fields.

    The primary fields are the value (``==`` compares them): requests, queues, the per-request mappings, the
    pool's free queue, ref counts and registrations. Derived, kept so a step can work column-wise (see
    docs/design.md): the running columns ``state.rows``, the decode prefix ``state.decode``, the two-part layout
    of each per-request mapping and its merged-dict cache, each request's ``token_limit``, the stop-token union
    and the persistent maps' shard bookkeeping. (The pool's own derived parts, the free queue as the complement
    of the held blocks and ``hash_to_block`` as the inverse of ``cached``, are checked by
    ``check_blocks_conserved`` and ``check_prefix_cache``.)"""
    _check_persistent_maps(state)
    _check_rows(state)
    _check_row_maps(state)
    _check_decode_prefix(state)
    union = state.config.eos_token_ids.union(*(r.params.stop_token_ids for r in state.requests.values()))
    if not union <= state.stop_token_union:
        fail(f"derived: stop_token_union lacks {sorted(union - state.stop_token_union)}")


def _flat(chunks: Sequence[Sequence[int]], tail: Sequence[int]) -> tuple[int, ...]:
    return tuple(token for chunk in (*chunks, tail) for token in chunk)


def _check_rows(state: EngineState) -> None:
    """``state.rows``: one row per running request, in order, each column its fresh value."""
    rows, running = state.rows, state.running
    columns = {f.name: getattr(rows, f.name) for f in attrs.fields(type(rows)) if f.name != "num_needing_history"}
    if any(len(column) != len(running) for column in columns.values()) or rows.ids != running:
        fail(f"derived: running columns { ({k: len(v) for k, v in columns.items()}) } do not align with {running}")
    for i, rid in enumerate(running):
        request = state.requests[rid]
        expected = {
            "num_computed": state.num_computed[rid],
            "num_tokens": len(request.prompt) + len(state.outputs[rid]),
            "block_tables": state.block_tables[rid],
            "chain_hashes": state.chain_hashes[rid],
            "params": request.params,
            "prompt_lens": len(request.prompt),
            "token_limits": len(request.prompt) + request.params.max_tokens,
        }
        actual = {name: columns[name][i] for name in expected}
        if actual != expected or request.token_limit != expected["token_limits"]:
            wrong = {k: (actual[k], v) for k, v in expected.items() if actual[k] != v}
            fail(f"derived: running row {i} ({rid!r}), column: (cached, fresh): {wrong}, limit {request.token_limit}")
        chunks, tail = rows.output_chunks[i], rows.output_tails[i]
        if not all(chunks) or _flat(chunks, tail) != state.outputs[rid]:
            fail(f"derived: {rid!r} output chunks {chunks} + tail {tail} != its output {state.outputs[rid]}")
    needing = sum(1 for params in rows.params if _uses_penalty(params))
    if rows.num_needing_history != needing:
        fail(f"derived: num_needing_history is {rows.num_needing_history}, {needing} rows need their history")


def _check_row_maps(state: EngineState) -> None:
    """Each per-request mapping: its rows are the running column of its name, its rest the waiting entries (or
    nothing, for fields only running requests have), and its merged-dict cache, if built, the two merged."""
    rows, waiting = state.rows, set(state.waiting)
    parts = {
        "num_tokens": (state.num_tokens, rows.num_tokens, waiting),
        "outputs": (state.outputs, tuple(map(_flat, rows.output_chunks, rows.output_tails)), waiting),
        "num_computed": (state.num_computed, rows.num_computed, set()),
        "block_tables": (state.block_tables, rows.block_tables, set()),
        "chain_hashes": (state.chain_hashes, rows.chain_hashes, waiting),
        "slots": (state.slots, rows.slots, set()),
    }
    for name, (mapping, column, rest_ids) in parts.items():
        if mapping.row_ids != state.running or tuple(mapping.row_values) != tuple(column):
            fail(f"derived: {name}'s rows {mapping.row_ids} -> {mapping.row_values} != the running column {column}")
        if set(mapping.rest) != rest_ids:
            fail(f"derived: {name}'s rest holds {sorted(mapping.rest)}, expected {sorted(rest_ids)}")
        merged = getattr(mapping, "_merged", None)
        if merged is not None and merged != {**mapping.rest.as_dict(), **dict(zip(state.running, column, strict=True))}:
            fail(f"derived: {name}'s cached merged dict is stale: {merged}")


def _check_decode_prefix(state: EngineState) -> None:
    """``state.decode`` describes some leading run of ``running`` (any length up to all of its plain decodes):
    their last tokens, which of them have a full table, their compaction phases, and a lower bound on their
    steps to the token limit (0: unknown; any value when the prefix is empty)."""
    decode, rows, bs = state.decode, state.rows, state.config.block_size
    k = len(decode.inputs)
    plain = 0
    while plain < len(rows.ids) and rows.num_tokens[plain] - rows.num_computed[plain] == 1:
        plain += 1
    if k > plain:
        fail(f"derived: decode prefix covers {k} rows, but only the first {plain} running rows are plain decodes")
    period = compaction_period(bs)
    next_commit = state.step if state.pending_step is None else state.pending_step
    ids = state.running[:k]
    inputs = tuple((seq_tokens(state, rid)[-1],) for rid in ids)
    due = tuple(i for i in range(k) if rows.num_computed[i] == len(rows.block_tables[i]) * bs)
    phases = bytes((rows.num_tokens[i] - next_commit) % period for i in range(k))
    if (decode.inputs, decode.block_due, decode.phases) != (inputs, due, phases):
        fail(
            f"derived: decode prefix of {ids}: (inputs, block_due, phases) = "
            f"{(decode.inputs, decode.block_due, tuple(decode.phases))}, fresh {(inputs, due, tuple(phases))}"
        )
    limit = min((rows.token_limits[i] - rows.num_tokens[i] for i in range(k)), default=None)
    if limit is not None and decode.steps_to_limit > limit:
        fail(f"derived: decode steps_to_limit {decode.steps_to_limit} exceeds the fewest steps to a limit, {limit}")


def _check_persistent_maps(state: EngineState) -> None:
    """Each PMap's length counter and shard placement (a key lives in the shard its hash names)."""
    maps: dict[str, PMap[Any, Any]] = {
        "requests": state.requests,
        "pool.ref_counts": state.pool.ref_counts,
        "pool.cached": state.pool.cached,
        "pool.hash_to_block": state.pool.hash_to_block,
    }
    for name in ("num_tokens", "outputs", "num_computed", "block_tables", "chain_hashes", "slots"):
        maps[f"{name}.rest"] = getattr(state, name).rest
    for name, mapping in maps.items():
        shards = mapping._shards
        misplaced = [key for index, shard in enumerate(shards) for key in shard if hash(key) % len(shards) != index]
        if misplaced or len(mapping) != sum(map(len, shards)):
            fail(f"derived: {name} counts {len(mapping)} of {sum(map(len, shards))} entries; misplaced {misplaced}")


def write_plan(kv: ShadowKV, plan: StepPlan, sampled: Sequence[int] = ()) -> None:
    """Apply the plan's KV writes to the shadow cache, as an executor does (every row, aborted or not); a
    multi-step plan's sub-steps feed the tokens of ``sampled`` (what the executor returned for it).

    Like a transformer's K/V, what is written at position p depends on the whole context: it is the token
    sequence read back through the block table at p - 1, plus the token fed at p. A prefix-cache hit on a block
    computed under another context therefore carries that other context forward, where ``check_kv`` sees it.
    """
    if plan.num_steps > 1:  # sub-step by sub-step, each fed what the one before sampled
        for index in range(plan.num_steps):
            inputs = substep_inputs(sampled, index - 1, plan.num_seqs) if index else None
            write_plan(kv, substep(plan, index, inputs))
        return
    bs = plan.block_size
    for tokens, start, table in zip(plan.input_tokens, plan.start_positions, plan.block_tables, strict=True):
        for offset, token in enumerate(tokens):
            position = start + offset
            previous = kv.get((table[(position - 1) // bs], (position - 1) % bs)) if position else (-1, ())
            context = previous[1] if previous is not None and previous[0] == position - 1 else (UNREADABLE,)
            kv[(table[position // bs], position % bs)] = (position, (*context, token))


UNREADABLE = -1  # a context token that could not be read back (the slot held another position or nothing)


def check_kv(state: EngineState, kv: ShadowKV) -> None:
    """Every computed position of a running sequence reads back, through its block table, K/V computed from its
    own tokens up to there; every cached block holds K/V of its registered tokens under its chain hash."""
    bs = state.config.block_size
    for rid in state.running:
        tokens, table = seq_tokens(state, rid), state.block_tables[rid]
        for position in range(state.num_computed[rid]):
            slot = (table[position // bs], position % bs)
            found = kv.get(slot)
            if found is None or found[0] != position or found[1] != tokens[: position + 1]:
                fail(
                    f"KV: {rid!r} position {position} reads block {slot[0]} offset {slot[1]} = {found}, "
                    f"expected K/V of {tokens[: position + 1]}"
                )
    for block, entry in state.pool.cached.items():
        _check_cached_kv(state.config, kv, block, entry.hash, entry.tokens)


def _check_cached_kv(config: CoreConfig, kv: ShadowKV, block: int, block_hash: int, tokens: tuple[int, ...]) -> None:
    bs = config.block_size
    last = kv.get((block, bs - 1))
    context = last[1] if last is not None else ()
    first = len(context) - bs
    slots = [kv.get((block, o)) for o in range(bs)]
    if first < 0 or first % bs or slots != [(first + o, context[: first + o + 1]) for o in range(bs)]:
        fail(f"KV: cached block {block} ({tokens}) holds {slots}")
    elif context[first:] != tokens or chain_hashes(config.hash_block, context, bs, first // bs + 1)[-1] != block_hash:
        fail(
            f"KV: cached block {block} is registered as {tokens} with hash {block_hash}, but its K/V was "
            f"computed for context {context}"
        )


def check_plan(config: CoreConfig, before: EngineState, after: EngineState, plan: StepPlan) -> None:
    """A plan respects the budget and caps, feeds each sequence its own next tokens with a table that covers
    them, keeps running sequences' progress, and preempts only the lowest-priority running sequences."""
    if plan.step != before.step or plan.block_size != config.block_size:
        fail(f"plan: step {plan.step} / block size {plan.block_size}, expected {before.step} / {config.block_size}")
    if plan.num_tokens > config.max_num_batched_tokens:
        fail(f"budget: plan feeds {plan.num_tokens} tokens > max_num_batched_tokens {config.max_num_batched_tokens}")
    if plan.num_seqs > config.max_num_seqs or len(after.running) > config.max_num_seqs:
        fail(f"max_num_seqs: plan has {plan.num_seqs}, running {len(after.running)} > {config.max_num_seqs}")
    if len(set(plan.seq_ids)) != plan.num_seqs:
        fail(f"plan: a sequence is scheduled twice: {plan.seq_ids}")
    columns = (plan.input_tokens, plan.start_positions, plan.block_tables, plan.sample, plan.params, plan.slots)
    if any(len(c) != plan.num_seqs for c in (*columns, plan.num_generated, plan.histories)):
        fail(f"plan: columns of different lengths for {plan.num_seqs} sequences")
    admitted = tuple(rid not in before.num_computed for rid in plan.seq_ids)
    if admitted != (False,) * plan.num_continuing + (True,) * plan.num_admitted:
        fail(f"plan: num_admitted={plan.num_admitted}, but the rows admitted from waiting are {admitted}")
    _check_admitted_slots(config, before, plan)
    for i, rid in enumerate(plan.seq_ids):
        _check_row(config, before, after, plan, i, rid)
    _check_preempted(before, after, plan)
    if config.enable_prefix_caching:
        _check_no_duplicate_prefill(config, before, plan)
    skipped = set(before.running) - set(plan.seq_ids) - set(plan.preempted)
    if skipped and plan.num_tokens < config.max_num_batched_tokens:
        fail(
            f"plan: running {sorted(skipped)} left out with {config.max_num_batched_tokens - plan.num_tokens} "
            "tokens of budget unused"
        )


def _check_row(config: CoreConfig, before: EngineState, after: EngineState, plan: StepPlan, i: int, rid: str) -> None:
    tokens, start, table = plan.input_tokens[i], plan.start_positions[i], plan.block_tables[i]
    full = seq_tokens(before, rid)
    request = before.requests[rid]
    if not tokens or tuple(tokens) != full[start : start + len(tokens)]:
        fail(f"plan: {rid!r} fed {tokens} at {start}, but its tokens there are {full[start : start + len(tokens)]}")
    if plan.sample[i] != (start + len(tokens) == len(full)):
        fail(f"plan: {rid!r} sample={plan.sample[i]} after feeding up to {start + len(tokens)} of {len(full)}")
    if len(table) * config.block_size < start + len(tokens) or table != after.block_tables.get(rid):
        fail(f"plan: {rid!r} table {table} does not cover {start + len(tokens)} tokens or is not its state table")
    if rid in before.num_computed and start != before.num_computed[rid]:
        fail(f"plan: running {rid!r} restarts at {start}, but {before.num_computed[rid]} tokens were computed")
    if after.num_computed.get(rid) != start:
        fail(f"plan: {rid!r} num_computed {after.num_computed.get(rid)} != plan start {start} before commit")
    admitted = rid not in before.num_computed  # only an admitted row carries its history (the executor keeps it)
    history = TokenHistory(request.prompt, full[len(request.prompt) :]) if _uses_penalty(request.params) else None
    history = history if admitted else None
    num_generated = len(full) - len(request.prompt)
    if plan.slots[i] != after.slots.get(rid):
        fail(f"plan: {rid!r} slot {plan.slots[i]} is not its state slot {after.slots.get(rid)}")
    if plan.params[i] != request.params or plan.num_generated[i] != num_generated or plan.histories[i] != history:
        fail(f"plan: {rid!r} params / num_generated / history do not match the request")


def _check_admitted_slots(config: CoreConfig, before: EngineState, plan: StepPlan) -> None:
    """Admitted rows take the lowest slots that the running rows (all kept: admissions happen only in steps
    that preempt nothing) do not hold, in admission order."""
    if not plan.num_admitted:
        return
    used = set(before.slots.values())
    free = [slot for slot in range(config.max_num_seqs) if slot not in used]
    if plan.slots[plan.num_continuing :] != tuple(free[: plan.num_admitted]):
        fail(f"slots: admitted rows took {plan.slots[plan.num_continuing :]}, the lowest free are {free}")


def check_slots(state: EngineState) -> None:
    """Every running request holds a slot in [0, max_num_seqs) that no other running request holds; waiting
    requests hold none."""
    slots = [state.slots.get(rid) for rid in state.running]
    if set(state.slots) != set(state.running):
        fail(f"slots: held by {sorted(state.slots)}, but running are {sorted(state.running)}")
    if len(set(slots)) != len(slots) or any(s is None or not 0 <= s < state.config.max_num_seqs for s in slots):
        fail(f"slots: running {state.running} hold {slots} (distinct, in [0, {state.config.max_num_seqs}))")


def _check_no_duplicate_prefill(config: CoreConfig, before: EngineState, plan: StepPlan) -> None:
    """A request admitted in a step must not compute into a block of its own a full block (same token prefix) that
    another row of the step completes: an earlier admission, or a running request finishing a block it began in an
    earlier step. It waits a step and hits it instead (the scheduler's hold-back). (Rewriting the last token of a
    fully cached prompt into the shared hit block is fine; two running requests may both complete one: the second
    had started its copy before the first's was known. A block completed by a running row's one token past its
    prompt does not count: a decode's token is the sample of the step before, which the scheduler may not read —
    under overlapped steps it is still a placeholder — and a recomputed request's last token is treated alike.)"""
    bs, completing = config.block_size, dict[tuple[int, ...], tuple[str, int]]()
    rows = list(zip(plan.seq_ids, plan.input_tokens, plan.start_positions, plan.block_tables, strict=True))
    running_first = sorted(rows, key=lambda row: row[0] not in before.num_computed)  # stable: plan order within
    for rid, tokens, start, table in running_first:
        full, end = seq_tokens(before, rid), start + len(tokens)
        if rid not in before.num_computed:  # admitted: every full-prefix block it writes into, completed or not
            for index in range(start // bs, min(-(-end // bs), len(full) // bs)):
                other, block = completing.get(full[: (index + 1) * bs], (rid, table[index]))
                if block != table[index]:
                    fail(
                        f"prefix cache: {rid!r}, admitted in step {plan.step}, computes block {index} of prefix "
                        f"{full[: (index + 1) * bs]} that {other!r} completes in that step, into another block "
                        f"({table[index]}, not {block})"
                    )
        if rid in before.num_computed and len(tokens) == 1 and end == len(full) > len(before.requests[rid].prompt):
            continue  # a decode (or a recomputation's last token): see the docstring
        for index in range(start // bs, end // bs):
            completing.setdefault(full[: (index + 1) * bs], (rid, table[index]))


def _check_preempted(before: EngineState, after: EngineState, plan: StepPlan) -> None:
    key = before.policy.key
    for victim in plan.preempted:
        if victim not in before.running or victim in after.running or victim in plan.seq_ids:
            fail(f"preemption: {victim!r} was not running, is still running, or is also scheduled")
        if victim not in after.waiting or victim in after.block_tables:
            fail(f"preemption: {victim!r} must be waiting without blocks")
        if victim in after.requests and seq_tokens(after, victim) != seq_tokens(before, victim):
            fail(f"preemption: {victim!r} lost tokens: {seq_tokens(before, victim)} -> {seq_tokens(after, victim)}")
        victim_key = key(before.requests[victim])
        kept = [r for r in after.running if key(after.requests[r]) > victim_key]
        if kept:
            fail(f"preemption: {victim!r} was preempted while lower-priority {kept} kept running")


def stop_reason(request: Request, output: Sequence[int], eos_token_ids: frozenset[int]) -> FinishReason | None:
    """The naive stop rule: the last token is EOS (unless ignore_eos) or a stop id, and more than min_tokens
    were generated -> "stop"; max_tokens reached -> "length"; else None. Used by the reference model and
    ``check_finished``."""
    if not output:
        return None
    params, token = request.params, output[-1]
    stops = (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
    if stops and len(output) > params.min_tokens:
        return "stop"
    return "length" if len(output) >= params.max_tokens else None


def check_finished(request: Request, output: Sequence[int], reason: FinishReason, eos: frozenset[int]) -> None:
    """A finished output is at most max_tokens long, did not run past an earlier stop, and its reason is right."""
    if len(output) > request.params.max_tokens:
        fail(f"finish: {request.request_id!r} has {len(output)} tokens > max_tokens {request.params.max_tokens}")
    early = [i for i in range(1, len(output)) if stop_reason(request, output[:i], eos) is not None]
    if early:
        fail(f"finish: {request.request_id!r} should have stopped after {early[0]} tokens: {tuple(output)}")
    if reason != "abort" and stop_reason(request, output, eos) != reason:
        fail(
            f"finish: {request.request_id!r} finished with {reason!r} but its tokens {tuple(output)} say "
            f"{stop_reason(request, output, eos)!r}"
        )
