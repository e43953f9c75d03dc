"""Unit tests of the pure core's specific behaviours: validation, the plan/commit protocol, abort, scheduling
order and caps, preemption, prefix-cache sharing and eviction order, pickling, and finish reasons."""

from __future__ import annotations

import copy
import math
import os
import pickle
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from fnvllm.executor.base import ExecuteResult
from fnvllm.state import (
    FCFS,
    PRIORITY,
    CoreConfig,
    EngineState,
    InvalidConfigError,
    InvalidRequestError,
    PlanMismatchError,
    Policy,
    SamplingParams,
    StepOutput,
    StepPlan,
    abort,
    add_request,
    commit,
    forget_kv,
    initial_state,
    schedule,
)
from fnvllm.testing.drive import RequestSpec, drive, run_to_completion
from fnvllm.testing.toy import KVToyExecutor

VOCAB = 100


def _config(**overrides: object) -> CoreConfig:
    settings: dict[str, object] = dict(
        block_size=4, num_blocks=64, max_num_batched_tokens=256, max_num_seqs=16, max_model_len=256, vocab_size=VOCAB
    )
    settings.update(overrides)
    return CoreConfig(**settings)  # type: ignore[arg-type]


def _state(policy: Policy = FCFS, **overrides: object) -> EngineState:
    return initial_state(_config(**overrides), policy)


def _add(state: EngineState, rid: str, prompt: Sequence[int], priority: int = 0, **params: object) -> EngineState:
    return add_request(state, rid, prompt, SamplingParams(**params), priority)  # type: ignore[arg-type]


def _step(state: EngineState, executor: KVToyExecutor) -> tuple[EngineState, StepPlan, StepOutput]:
    state, plan = schedule(state)
    state, output = commit(state, plan, executor.execute(plan).token_ids)
    return state, plan, output


def _row(plan: StepPlan, rid: str) -> tuple[tuple[int, ...], int, bool]:
    """(input tokens, start position, sample) of ``rid``'s row in ``plan``."""
    i = plan.seq_ids.index(rid)
    return plan.input_tokens[i], plan.start_positions[i], plan.sample[i]


def _busy_state() -> tuple[EngineState, KVToyExecutor]:
    """A state with a cached prefix, one request decoding, one mid-prefill and one waiting."""
    executor = KVToyExecutor(VOCAB)
    state = _add(_state(max_num_batched_tokens=12), "a", range(10), max_tokens=20)
    state, _, _ = _step(state, executor)
    state = _add(state, "b", range(40), max_tokens=5)
    state = _add(state, "c", [1, 2, 3], max_tokens=3)
    state, _, _ = _step(state, executor)
    assert state.sequence("b").status == "running" and state.sequence("b").num_computed < 40
    return state, executor


class ScriptedExecutor:
    """Returns a scripted token sequence per request: the n-th sampled token of ``rid`` is ``script[rid][n]``."""

    def __init__(self, script: dict[str, Sequence[int]]) -> None:
        self.script = script

    def execute(self, plan: StepPlan) -> ExecuteResult:
        rows = zip(plan.seq_ids, plan.num_generated, plan.sample, strict=True)
        return ExecuteResult(tuple(self.script[rid][n] for rid, n, sample in rows if sample))

    def reset(self, next_step: int) -> None:
        """Scripted tokens do not depend on KV contents: nothing to forget."""


# --- add_request validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rid", "prompt", "max_tokens", "field", "detail"),
    [
        ("new", [], 1, "prompt", "at least 1 token"),
        ("new", [1] * 250, 7, "max_tokens", "max_model_len"),
        ("new", [VOCAB], 1, "prompt", f"[0, {VOCAB})"),
        ("new", [-1], 1, "prompt", f"[0, {VOCAB})"),
        ("new", [1.5], 1, "prompt", "ints"),
        ("a", [1], 1, "request_id", "already live"),
        ("", [1], 1, "request_id", "non-empty"),
    ],
)
def test_add_request_rejects_and_leaves_state_unchanged(
    rid: str, prompt: list[int], max_tokens: int, field: str, detail: str
) -> None:
    """An invalid request raises InvalidRequestError naming the field, and the state is exactly as before."""
    state, _ = _busy_state()
    before = pickle.dumps(state)
    with pytest.raises(InvalidRequestError, match=field) as error:
        _add(state, rid, prompt, max_tokens=max_tokens)
    assert detail in str(error.value)
    assert pickle.dumps(state) == before


def test_add_request_rejects_what_the_pool_can_never_hold() -> None:
    """A request needing more KV blocks than the pool has is rejected up front; one that just fits is accepted."""
    state = _state(num_blocks=2)  # 8 slots of 4 tokens
    with pytest.raises(InvalidRequestError, match="prompt") as error:
        _add(state, "x", range(8), max_tokens=2)  # 9 positions need KV: 3 blocks
    assert "3 KV blocks" in str(error.value) and "has 2" in str(error.value)
    state = _add(state, "x", range(8), max_tokens=1)  # the last token's KV is never written: 2 blocks
    result = drive(state, [], KVToyExecutor(VOCAB))
    assert result.finish_reasons == {"x": "length"}


def test_finished_request_id_can_be_reused() -> None:
    """Duplicate ids are only rejected among live requests: once finished, the id is free again."""
    executor = KVToyExecutor(VOCAB)
    state = _add(_state(), "a", [1, 2], max_tokens=1)
    state, _, output = _step(state, executor)
    assert [f.request_id for f in output.finished] == ["a"]
    state = _add(state, "a", [3, 4], max_tokens=1)
    assert state.sequence("a").request.prompt == (3, 4)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 101.0),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("logprobs", -1),
        ("logprobs", 21),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
    ],
)
def test_sampling_params_reject_out_of_range(field: str, value: object) -> None:
    """Each out-of-range SamplingParams field raises InvalidRequestError naming that field."""
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_sampling_params_accept_boundaries() -> None:
    """The inclusive ends of each allowed range are accepted (the validators are not off by one)."""
    SamplingParams(temperature=0, top_p=1, top_k=1, min_p=1, max_tokens=1, logprobs=20, presence_penalty=-2)
    SamplingParams(temperature=100, min_p=0, logprobs=0, frequency_penalty=2, repetition_penalty=1e-3)


@pytest.mark.parametrize(
    "field", ["block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len"]
)
@pytest.mark.parametrize("value", [0, -3, 2.0])
def test_core_config_rejects_bad_sizes(field: str, value: object) -> None:
    """A size below 1 or not an int raises InvalidConfigError naming the field."""
    with pytest.raises(InvalidConfigError, match=rf"CoreConfig\.{field}\b"):
        CoreConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value"), [("vocab_size", 0), ("eos_token_ids", "2"), ("eos_token_ids", [-1])])
def test_core_config_rejects_bad_token_settings(field: str, value: object) -> None:
    """A vocab_size below 1 and EOS ids that are not non-negative ints raise InvalidConfigError naming the field."""
    with pytest.raises(InvalidConfigError, match=rf"CoreConfig\.{field}\b"):
        CoreConfig(**{field: value})  # type: ignore[arg-type]


# --- the schedule / commit protocol -----------------------------------------------------------------------------


def test_schedule_refuses_while_a_plan_is_pending() -> None:
    """A second schedule before the first plan is committed raises PlanMismatchError."""
    state = _add(_state(), "a", [1, 2, 3])
    state, _ = schedule(state)
    with pytest.raises(PlanMismatchError, match="not committed"):
        schedule(state)


def test_commit_rejects_a_stale_plan_and_leaves_state_unchanged() -> None:
    """Committing an already-committed plan, or any plan before scheduling, raises and changes nothing."""
    executor = KVToyExecutor(VOCAB)
    state = _add(_state(), "a", [1, 2, 3], max_tokens=5)
    state, old_plan = schedule(state)
    sampled = executor.execute(old_plan).token_ids
    state, _ = commit(state, old_plan, sampled)
    before = pickle.dumps(state)
    with pytest.raises(PlanMismatchError, match="schedule first"):
        commit(state, old_plan, sampled)
    assert pickle.dumps(state) == before
    state, _ = schedule(state)
    before = pickle.dumps(state)
    with pytest.raises(PlanMismatchError, match=f"plan.step is {old_plan.step}"):
        commit(state, old_plan, sampled)
    assert pickle.dumps(state) == before


@pytest.mark.parametrize("delta", [-1, 1])
def test_commit_rejects_a_wrong_number_of_sampled_tokens(delta: int) -> None:
    """One token too few or too many raises PlanMismatchError, changes nothing, and the right count then works."""
    state = _add(_add(_state(), "a", [1, 2, 3]), "b", [4, 5])
    state, plan = schedule(state)
    sampled = KVToyExecutor(VOCAB).execute(plan).token_ids
    assert len(sampled) == 2
    before = pickle.dumps(state)
    wrong = sampled[:-1] if delta < 0 else [*sampled, 0]
    with pytest.raises(PlanMismatchError, match="sampled has"):
        commit(state, plan, wrong)
    assert pickle.dumps(state) == before
    _, output = commit(state, plan, sampled)
    assert output.seq_ids == ("a", "b")


def test_inputs_are_not_mutated_by_transitions() -> None:
    """schedule, commit, add_request and abort leave the state they were given exactly as it was."""
    state, executor = _busy_state()
    before = pickle.dumps(state)
    scheduled, plan = schedule(state)
    plan_before = pickle.dumps(plan)
    mid = pickle.dumps(scheduled)
    commit(scheduled, plan, executor.execute(plan).token_ids)
    add_request(state, "z", [1], SamplingParams())
    abort(state, "a")
    assert pickle.dumps(state) == before and pickle.dumps(scheduled) == mid and pickle.dumps(plan) == plan_before


# --- abort ------------------------------------------------------------------------------------------------------


def test_abort_frees_blocks_and_forgets_the_request() -> None:
    """Aborting a running request returns its blocks to the pool and removes it; aborting an unknown id is a
    KeyError."""
    executor = KVToyExecutor(VOCAB)
    state = _add(_state(), "a", range(10), max_tokens=8)
    state, _, _ = _step(state, executor)
    assert state.pool.num_free == state.config.num_blocks - 3
    state = abort(state, "a")
    assert state.pool.num_free == state.config.num_blocks
    assert not state.has_unfinished and "a" not in state.running
    with pytest.raises(KeyError, match="not live"):
        abort(state, "a")


def test_abort_between_schedule_and_commit_is_skipped_by_commit() -> None:
    """A request aborted after its plan was made gets no token and no finish record; the others carry on."""
    executor = KVToyExecutor(VOCAB)
    state = _add(_add(_state(), "a", range(6), max_tokens=4), "b", range(20, 27), max_tokens=4)
    state, plan = schedule(state)
    state = abort(state, "a")
    state, output = commit(state, plan, executor.execute(plan).token_ids)
    assert output.seq_ids == ("b",) and not output.finished
    assert set(state.requests) == {"b"}
    assert state.pool.num_free == state.config.num_blocks - len(state.sequence("b").block_table)
    result = drive(state, [], executor)
    assert result.finish_reasons == {"b": "length"} and result.final_state.pool.num_free == 64


# --- scheduling order, chunking and caps ---------------------------------------------------------------------


def test_prefill_and_decode_are_mixed_in_one_step() -> None:
    """A decoding request and a newly arrived prompt's prefill run in the same plan."""
    executor = KVToyExecutor(VOCAB)
    state = _add(_state(), "a", [1, 2, 3], max_tokens=5)
    state, _, _ = _step(state, executor)
    state = _add(state, "b", range(10, 30), max_tokens=5)
    state, plan, _ = _step(state, executor)
    assert _row(plan, "a") == ((state.sequence("a").output[0],), 3, True)
    assert _row(plan, "b") == (tuple(range(10, 30)), 0, True)


def test_long_prompt_is_chunked_across_steps_within_the_budget() -> None:
    """A 100-token prompt under a 32-token budget runs as chunks 0-31, 32-63, 64-95, 96-99; only the last samples."""
    executor = KVToyExecutor(VOCAB)
    state = _add(_state(max_num_batched_tokens=32), "a", [i % VOCAB for i in range(100)], max_tokens=2)
    rows = []
    for _ in range(4):
        state, plan, _ = _step(state, executor)
        tokens, start, sample = _row(plan, "a")
        rows.append((start, len(tokens), sample))
        assert plan.num_tokens <= 32
    assert rows == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]


def test_decode_is_never_starved_by_a_long_waiting_prefill() -> None:
    """While a long prompt prefills under a small budget, a running request still decodes every step."""
    executor = KVToyExecutor(VOCAB)
    state = _add(_state(max_num_batched_tokens=16), "a", [1, 2, 3], max_tokens=12)
    state, _, _ = _step(state, executor)
    state = _add(state, "long", [i % VOCAB for i in range(200)], max_tokens=1)
    prefill_chunks = 0
    while "a" in state.requests:
        state, plan, _ = _step(state, executor)
        assert plan.seq_ids[0] == "a" and _row(plan, "a")[2]
        if "long" in plan.seq_ids:
            prefill_chunks += 1
            assert len(_row(plan, "long")[0]) == 15
    assert prefill_chunks == 11


def test_max_num_seqs_caps_running_not_just_one_step() -> None:
    """With max_num_seqs=2, at most two requests ever hold blocks, and the rest wait until one finishes."""
    observed = []

    def watch(state: EngineState, plan: StepPlan, output: StepOutput) -> None:
        observed.append(len(state.running) + len(output.finished))
        assert len(state.block_tables) <= 2

    specs = [RequestSpec(f"r{i}", [i + 1] * (3 + i), SamplingParams(max_tokens=3 + i)) for i in range(5)]
    result = run_to_completion(_config(max_num_seqs=2), specs, KVToyExecutor(VOCAB), on_step=watch)
    assert max(observed) == 2 and len(result.finished) == 5


# --- preemption ---------------------------------------------------------------------------------------------------


def _preemption_case(policy: Policy, priorities: dict[str, int]) -> tuple[str, EngineState, StepPlan, EngineState]:
    """Three 4-token prompts in a 4-block pool: after one step each holds a full block, so the second decode
    finds no free block and someone must be preempted. Returns (victim, state before, plan, state after)."""
    executor = KVToyExecutor(VOCAB)
    state = _state(policy, num_blocks=4)
    for rid in "ABC":
        state = _add(state, rid, [ord(rid)] * 4, priorities[rid], max_tokens=8)
    state, _, _ = _step(state, executor)
    before = state
    state, plan, _ = _step(state, executor)
    assert len(plan.preempted) == 1
    return plan.preempted[0], before, plan, state


@pytest.mark.parametrize(
    ("policy", "priorities", "victim"),
    [(FCFS, {"A": 0, "B": 0, "C": 0}, "C"), (PRIORITY, {"A": 0, "B": 2, "C": 1}, "B")],
)
def test_preemption_picks_the_policy_last_and_keeps_its_tokens(
    policy: Policy, priorities: dict[str, int], victim: str
) -> None:
    """The victim is the latest arrival (FCFS) or the lowest priority (PRIORITY); it keeps its generated tokens,
    rejoins waiting without blocks, and the run still produces the outputs of an unconstrained run."""
    preempted, before, plan, after = _preemption_case(policy, priorities)
    assert preempted == victim and victim not in plan.seq_ids
    kept = before.sequence(victim).output
    assert len(kept) == 1 and after.sequence(victim).output == kept
    assert after.sequence(victim).status == "waiting" and victim in after.waiting and victim not in after.running
    assert after.sequence(victim).block_table == ()
    specs = [RequestSpec(r, [ord(r)] * 4, SamplingParams(max_tokens=8), priorities[r]) for r in "ABC"]
    expected = run_to_completion(_config(), specs, KVToyExecutor(VOCAB), policy)
    assert expected.num_preemptions == 0
    squeezed = run_to_completion(_config(num_blocks=4), specs, KVToyExecutor(VOCAB), policy)
    assert squeezed.num_preemptions > 0 and squeezed.outputs == expected.outputs


# --- prefix cache ---------------------------------------------------------------------------------------------


def test_shared_prefix_admitted_together_is_computed_once() -> None:
    """Of two requests sharing two full blocks admitted in the same step, the second waits one step and then
    hits both blocks instead of computing them again."""
    executor = KVToyExecutor(VOCAB)
    prefix = list(range(8))
    state = _add(_add(_state(), "a", [*prefix, 50, 51], max_tokens=4), "b", [*prefix, 60, 61], max_tokens=4)
    state, first, _ = _step(state, executor)
    assert first.seq_ids == ("a",)
    state, second, _ = _step(state, executor)
    assert _row(second, "b") == ((60, 61), 8, True)
    assert state.sequence("b").block_table[:2] == state.sequence("a").block_table[:2]
    no_cache = _add(_add(_state(enable_prefix_caching=False), "a", [*prefix, 50, 51]), "b", [*prefix, 60, 61])
    assert schedule(no_cache)[1].seq_ids == ("a", "b")


def test_fully_cached_prompt_computes_only_its_last_token() -> None:
    """A prompt whose every block is cached is admitted at position len-1 with a single input token."""
    executor = KVToyExecutor(VOCAB)
    prompt = list(range(12))  # exactly 3 blocks
    first = run_to_completion(_config(), [RequestSpec("a", prompt, SamplingParams(max_tokens=3))], executor)
    state = _add(first.final_state, "b", prompt, max_tokens=3)
    state, plan, _ = _step(state, executor)
    assert _row(plan, "b") == ((11,), 11, True)
    result = drive(state, [], executor)
    assert result.outputs["b"] == first.outputs["a"]


def test_lru_keeps_a_finished_requests_prefix_longer_than_its_tail() -> None:
    """After a request finishes, later allocations evict its tail blocks first, so a repeat of its prompt still
    hits the leading blocks."""
    executor = KVToyExecutor(VOCAB)
    prompt = list(range(16))  # 4 full blocks
    state = _add(_state(num_blocks=7), "a", prompt, max_tokens=1)
    state, _, _ = _step(state, executor)
    assert not state.has_unfinished
    state = _add(state, "other", list(range(50, 66)), max_tokens=1)  # takes the 3 untouched blocks + 1 of a's
    state, _, _ = _step(state, executor)
    state = _add(state, "again", prompt, max_tokens=1)
    state, plan, _ = _step(state, executor)
    assert _row(plan, "again")[1] == 12, "a's first three blocks survived, its last one was evicted"


# --- pickling and resuming ------------------------------------------------------------------------------------------


def _finish(state: EngineState, executor: KVToyExecutor) -> dict[str, tuple[int, ...]]:
    return drive(state, [], executor).outputs


def test_state_pickles_equal_and_resumes_identically() -> None:
    """A mid-run state survives pickle equal to itself, and both copies finish with identical outputs."""
    state, executor = _busy_state()
    restored = pickle.loads(pickle.dumps(state))
    assert restored == state
    scheduled, plan = schedule(state)
    assert pickle.loads(pickle.dumps(scheduled)) == scheduled and pickle.loads(pickle.dumps(plan)) == plan
    twin = copy.deepcopy(executor)
    expected = _finish(state, executor)
    assert _finish(restored, twin) == expected and set(expected) == {"a", "b", "c"}


_RESUME = """
import pickle, sys
from fnvllm.testing.drive import drive
state, executor = pickle.load(sys.stdin.buffer)
print(repr(sorted(drive(state, [], executor).outputs.items())))
"""


def test_pickled_state_resumes_in_another_process() -> None:
    """A state pickled here and unpickled in a fresh interpreter (different hash seed) finishes identically."""
    state, executor = _busy_state()
    payload = pickle.dumps((state, copy.deepcopy(executor)))
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", _RESUME], input=payload, capture_output=True, env=env, check=True, timeout=60
    )
    assert done.stdout.decode().strip() == repr(sorted(_finish(state, executor).items()))


def test_forget_kv_restores_onto_an_empty_cache() -> None:
    """A snapshot restored with forget_kv onto an executor with an empty KV cache finishes with the same outputs."""
    state, executor = _busy_state()
    fresh = KVToyExecutor(VOCAB)
    fresh.next_step = state.step
    restored = forget_kv(pickle.loads(pickle.dumps(state)))
    assert restored.running == () and restored.pool.num_free == restored.config.num_blocks
    assert _finish(restored, fresh) == _finish(state, executor)


# --- finish reasons -------------------------------------------------------------------------------------------------


def _finish_reasons(script: dict[str, Sequence[int]], **params: dict[str, object]) -> dict[str, tuple[str, tuple]]:
    specs = [RequestSpec(rid, [1, 2, 3], SamplingParams(**params[rid])) for rid in script]  # type: ignore[arg-type]
    result = run_to_completion(_config(eos_token_ids={5}), specs, ScriptedExecutor(script))
    return {rid: (f.reason, f.output) for rid, f in result.finished.items()}


def test_eos_stops_unless_ignore_eos() -> None:
    """An EOS id ends a request with 'stop' (the EOS is kept in the output); with ignore_eos it runs to
    max_tokens and finishes with 'length'."""
    script = {"plain": [1, 5, 2, 3], "ignoring": [1, 5, 2, 3]}
    got = _finish_reasons(script, plain={"max_tokens": 4}, ignoring={"max_tokens": 4, "ignore_eos": True})
    assert got == {"plain": ("stop", (1, 5)), "ignoring": ("length", (1, 5, 2, 3))}


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    """A request's stop_token_ids end it with 'stop', also when it ignores EOS."""
    script = {"a": [1, 9, 2], "b": [1, 9, 2]}
    got = _finish_reasons(
        script,
        a={"max_tokens": 3, "stop_token_ids": [9]},
        b={"max_tokens": 3, "stop_token_ids": [9], "ignore_eos": True},
    )
    assert got == {"a": ("stop", (1, 9)), "b": ("stop", (1, 9))}


def test_max_tokens_gives_length_and_a_stop_on_the_last_token_wins() -> None:
    """Reaching max_tokens gives 'length'; an EOS sampled as the very last allowed token gives 'stop'."""
    script = {"short": [1, 2, 3, 4], "eos_last": [1, 2, 5]}
    got = _finish_reasons(script, short={"max_tokens": 3}, eos_last={"max_tokens": 3})
    assert got == {"short": ("length", (1, 2, 3)), "eos_last": ("stop", (1, 2, 5))}


def test_waiting_twin_of_a_running_chunked_prefill_waits_and_hits() -> None:
    """A waiting request whose next block a running prefill chunk computes this step waits, then hits it."""
    from fnvllm.testing.toy import KVToyExecutor

    config = CoreConfig(block_size=4, num_blocks=64, max_num_batched_tokens=6, max_num_seqs=8, max_model_len=64)
    state = initial_state(config)
    prompt = list(range(10, 26))  # 4 full blocks
    for rid in ("a", "b"):
        state = add_request(state, rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    executor, fed, outputs = KVToyExecutor(100), {"a": 0, "b": 0}, {}
    while state.has_unfinished:
        state, plan = schedule(state)
        for rid, tokens in zip(plan.seq_ids, plan.input_tokens, strict=True):
            fed[rid] += len(tokens)
        state, out = commit(state, plan, executor.execute(plan).token_ids)
        outputs.update({f.request_id: f.output for f in out.finished})
    assert fed == {"a": 17, "b": 2}  # b recomputes only its last prompt token, then decodes
    assert outputs["a"] == outputs["b"]


def test_commit_refuses_a_plan_scheduled_from_another_state() -> None:
    """``commit(state_a, plan_of_state_b, ...)`` with equal step numbers is a PlanMismatchError naming the row,
    not an IndexError from deep inside, and never folds the wrong tokens in silently."""
    from fnvllm.state import PlanMismatchError, add_request, commit, initial_state, schedule

    config = CoreConfig(block_size=4, num_blocks=64, vocab_size=200)
    short = add_request(initial_state(config), "r", (1, 2, 3), SamplingParams(max_tokens=5))
    long = add_request(initial_state(config), "r", tuple(range(1, 12)), SamplingParams(max_tokens=5))
    (short_state, short_plan), (long_state, long_plan) = schedule(short), schedule(long)
    for state, plan in ((short_state, long_plan), (long_state, short_plan)):
        with pytest.raises(PlanMismatchError, match=r"plan row 0 \('r'.*scheduled from another state"):
            commit(state, plan, [5])
    assert commit(short_state, short_plan, [5])[1].new_tokens == (5,)
