"""A Hypothesis fuzz of the public boundary: every field of every public value object (SamplingParams, CoreConfig,
EngineConfig), every argument of add_request / commit, and every argument of LLM.generate / stream / chat takes
values from a deliberately wide strategy -- ints of any size, floats including NaN, infinities and subnormals,
bools, str, bytes, None, containers of those, numpy scalars and arrays. Each value either works correctly or
raises the documented error type (InvalidRequestError / InvalidConfigError / PlanMismatchError), never another
exception and never a hang, and the engine state is unchanged afterwards."""

from __future__ import annotations

import math
import pickle
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as npst
from tiny_models import write_family

from fnvllm.config import EngineConfig
from fnvllm.executor.sampler import Sampler, prepare_sampling
from fnvllm.llm import LLM
from fnvllm.state import (
    CoreConfig,
    InvalidConfigError,
    InvalidRequestError,
    PlanMismatchError,
    SamplingParams,
    add_request,
    commit,
    initial_state,
    schedule,
)
from fnvllm.state.plan import TokenHistory
from fnvllm.testing.drive import RequestSpec, drive
from fnvllm.testing.toy import CounterToyExecutor

VOCAB = 40
SMALL = dict(block_size=4, num_blocks=16, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=48)

# ----- the wide strategy ------------------------------------------------------------------------------------------

_scalars = st.one_of(
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, 10**4000, -(10**400)]),
    st.floats(),  # NaN, infinities, subnormals
    st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-6, 0.5, 1.0, 1e300, math.nan, math.inf, -math.inf]),
    st.booleans(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.none(),
)
_numpy = st.one_of(
    npst.from_dtype(np.dtype(np.int64)).map(np.int64),
    st.integers(0, 255).map(np.uint8),
    npst.from_dtype(np.dtype(np.float32)).map(np.float32),
    npst.from_dtype(np.dtype(np.float16)).map(np.float16),
    st.booleans().map(np.bool_),
    npst.arrays(st.sampled_from([np.int64, np.int32, np.float64, np.bool_]), npst.array_shapes(max_dims=2, max_side=4)),
)


# The checks of value objects are cheap, so they search five times the profile's examples; LLM calls once.
MANY = settings().max_examples * 5
LLM_EXAMPLES = settings().max_examples


def wild() -> st.SearchStrategy[Any]:
    """Any value a hostile caller might pass."""
    leaves = st.one_of(_scalars, _numpy)
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.lists(inner, max_size=4).map(tuple),
            st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 9)), inner, max_size=3),
        ),
        max_leaves=6,
    )


def wild_or(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Half wild, half plausible values (so accepted values are exercised too)."""
    return st.one_of(wild(), valid)


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """A fuzz run that hangs fails after 10 minutes instead of stalling CI."""
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the fuzz hung"))
    signal.alarm(600)
    yield
    signal.alarm(0)


# ----- SamplingParams -------------------------------------------------------------------------------------------

PARAM_FIELDS = [f.name for f in attrs.fields(SamplingParams) if f.init]
PLAUSIBLE = st.one_of(
    st.integers(-3, 50), st.floats(-3, 200), st.lists(st.integers(-1, VOCAB + 1), max_size=3), st.text(max_size=3)
)


def _assert_well_formed(params: SamplingParams) -> None:
    """Accepted params hold plain Python values inside their documented ranges."""
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        assert type(value) is float and math.isfinite(value), (name, value)
    assert 0 <= params.temperature <= 100 and 0 < params.top_p <= 1 and 0 <= params.min_p <= 1
    assert type(params.max_tokens) is int and params.max_tokens >= 1
    assert params.top_k is None or (type(params.top_k) is int and params.top_k >= 1)
    assert params.logprobs is None or (type(params.logprobs) is int and 0 <= params.logprobs <= 20)
    assert params.seed is None or type(params.seed) is int
    assert type(params.ignore_eos) is bool and type(params.include_stop_str_in_output) is bool
    assert all(type(s) is str and s for s in params.stop)
    assert all(type(i) is int and i >= 0 for i in params.stop_token_ids)


@settings(max_examples=MANY, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(PARAM_FIELDS), value=wild_or(PLAUSIBLE))
def test_sampling_params_fields(field: str, value: Any) -> None:
    """Each SamplingParams field takes any value or raises InvalidRequestError; accepted params are well formed,
    pass through the core to completion and sample valid tokens."""
    try:
        params = SamplingParams(**{field: value})
    except InvalidRequestError:
        return
    _assert_well_formed(params)
    config = CoreConfig(**SMALL, vocab_size=VOCAB, eos_token_ids=[0])
    state = initial_state(config)
    try:
        state = add_request(state, "a", [1, 2, 3], attrs.evolve(params, max_tokens=min(params.max_tokens, 8)))
    except InvalidRequestError:
        return  # e.g. stop ids or logprobs outside this vocabulary
    result = drive(state, [], CounterToyExecutor(VOCAB), max_steps=200)
    assert set(result.finish_reasons) == {"a"}
    history = TokenHistory((1, 2, 3), (4,)) if params.needs_history else None
    batch = prepare_sampling([params], [1], [history], VOCAB, "cpu")
    out = Sampler(seed=0).sample(torch.randn(1, VOCAB), batch)
    assert 0 <= int(out.token_ids[0]) < VOCAB
    if params.logprobs is not None:
        assert out.logprobs is not None and torch.isfinite(out.logprobs.sampled_logprobs).all()


# ----- CoreConfig / EngineConfig --------------------------------------------------------------------------------

CORE_FIELDS = [f.name for f in attrs.fields(CoreConfig) if f.name != "hash_block"]
ENGINE_FIELDS = [f.name for f in attrs.fields(EngineConfig)]


@settings(max_examples=MANY)
@given(field=st.sampled_from(CORE_FIELDS), value=wild_or(st.integers(-2, 64)))
def test_core_config_fields(field: str, value: Any) -> None:
    """Each CoreConfig field takes any value or raises InvalidConfigError; an accepted config runs requests."""
    settings_ = {**SMALL, "vocab_size": VOCAB, field: value}
    try:
        config = CoreConfig(**settings_)
    except InvalidConfigError:
        return
    assert all(type(getattr(config, n)) is int for n in SMALL)
    vocab = config.vocab_size or VOCAB
    specs = [RequestSpec(f"r{i}", (i % vocab,), SamplingParams(max_tokens=2)) for i in range(3)]
    if config.max_model_len < 3:
        return
    result = drive(initial_state(config), specs, CounterToyExecutor(vocab), max_steps=500)
    assert set(result.finish_reasons) == {"r0", "r1", "r2"}


@settings(max_examples=MANY)
@given(field=st.sampled_from(ENGINE_FIELDS), value=wild_or(st.sampled_from(["cpu", "auto", "torch", "bf16", 8])))
def test_engine_config_fields(field: str, value: Any) -> None:
    """Each EngineConfig field takes any value or raises InvalidConfigError (never TypeError from a comparison,
    never a value that fails later): accepted values are plain and in range."""
    try:
        config = EngineConfig(**{field: value})
    except InvalidConfigError:
        return
    stored = getattr(config, field)
    assert stored is None or type(stored) in (int, float, bool, str), (field, stored)


# ----- add_request / commit -------------------------------------------------------------------------------------


def _busy_state() -> Any:
    state = initial_state(CoreConfig(**SMALL, vocab_size=VOCAB))
    state = add_request(state, "live", [1, 2, 3], SamplingParams(max_tokens=4))
    state, plan = schedule(state)
    return state, plan


@settings(max_examples=MANY)
@given(
    request_id=wild_or(st.sampled_from(["a", "live", ""])),
    prompt=wild_or(st.lists(st.integers(-1, VOCAB), max_size=6)),
    params=st.one_of(wild(), st.just(SamplingParams(max_tokens=3))),
    priority=wild_or(st.integers(-5, 5)),
)
def test_add_request_arguments(request_id: Any, prompt: Any, params: Any, priority: Any) -> None:
    """add_request takes any arguments or raises InvalidRequestError with the state unchanged; an accepted
    prompt is stored as a tuple of plain ints equal to what was given."""
    state, _ = _busy_state()
    before = pickle.dumps(state)
    try:
        after = add_request(state, request_id, prompt, params, priority)
    except InvalidRequestError:
        assert pickle.dumps(state) == before
        return
    assert pickle.dumps(state) == before  # purity: the old state is untouched either way
    stored = after.requests[request_id].prompt
    assert all(type(t) is int and 0 <= t < VOCAB for t in stored)
    assert list(stored) == [int(t) for t in prompt]


@settings(max_examples=MANY)
@given(sampled=wild_or(st.lists(st.integers(-2, VOCAB + 2), min_size=1, max_size=1)))
def test_commit_sampled_tokens(sampled: Any) -> None:
    """commit takes any sampled list or raises PlanMismatchError with the state unchanged; accepted tokens are
    ints inside the vocabulary."""
    state, plan = _busy_state()
    before = pickle.dumps(state)
    try:
        _, out = commit(state, plan, sampled)
    except PlanMismatchError:
        assert pickle.dumps(state) == before
        return
    assert all(type(t) is int and 0 <= t < VOCAB for t in out.new_tokens)


# ----- LLM.generate / stream / chat -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path: Path = write_family(tmp_path_factory.mktemp("fuzz"), "qwen3")
    return LLM(path, dtype="float32", block_size=8, num_blocks=64, max_model_len=128, device="cpu")


_short = st.builds(SamplingParams, max_tokens=st.integers(1, 3), temperature=st.sampled_from([0.0, 1.0]))
PROMPT_LIKE = st.one_of(
    st.text(max_size=12),
    st.lists(st.integers(-1, 257), max_size=5),
    st.lists(st.one_of(st.text(max_size=6), st.lists(st.integers(0, 255), min_size=1, max_size=4)), max_size=3),
    npst.arrays(np.int64, st.integers(0, 4), elements=st.integers(0, 255)),
)


def _check_llm_call(llm: LLM, call: Any, num_prompts: int | None = None) -> None:
    """Run ``call``; it returns finished outputs or raises InvalidRequestError with the state unchanged; the LLM
    generates normally afterwards."""
    before = pickle.dumps(llm.state)
    try:
        outputs = call()
    except InvalidRequestError as error:
        note(f"rejected: {error}")
        event(f"rejected: {type(error).__name__}")
        assert pickle.dumps(llm.state) == before
    else:
        event("accepted")
        assert all(o.finished and all(0 <= t < 256 for t in o.token_ids) for o in outputs)
        assert not llm.state.has_unfinished
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(out[0].token_ids) == 1


@settings(max_examples=LLM_EXAMPLES)
@given(
    prompts=st.one_of(PROMPT_LIKE, PROMPT_LIKE, wild()),
    params=st.one_of(wild(), _short, _short, st.lists(_short, min_size=1, max_size=3)),
    use_tqdm=st.one_of(st.just(False), st.just(False), wild()),
)
def test_generate_arguments(llm: LLM, prompts: Any, params: Any, use_tqdm: Any) -> None:
    """LLM.generate with any arguments works or raises InvalidRequestError, leaving the engine as it was."""
    if isinstance(params, SamplingParams) or params is None:
        params = params or SamplingParams(max_tokens=2)
    _check_llm_call(llm, lambda: llm.generate(prompts, params, use_tqdm=use_tqdm))


@settings(max_examples=LLM_EXAMPLES)
@given(prompts=st.one_of(PROMPT_LIKE, PROMPT_LIKE, wild()), params=st.one_of(wild(), _short, _short))
def test_stream_arguments(llm: LLM, prompts: Any, params: Any) -> None:
    """LLM.stream with any arguments yields deltas until every request finished, or raises InvalidRequestError
    (when called or on the first step), leaving the engine as it was."""

    def run() -> list[Any]:
        finished: dict[int, Any] = {}
        for delta in llm.stream(prompts, params):
            if delta.finish_reason is not None:
                finished[delta.index] = delta
        return [_Done() for _ in finished]

    _check_llm_call(llm, run)


class _Done:
    """Stands in for a finished output in ``_check_llm_call``."""

    finished = True
    token_ids = ()


_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=10)})


@settings(max_examples=LLM_EXAMPLES)
@given(
    messages=st.one_of(
        wild(),
        st.lists(_message, min_size=1, max_size=2),
        st.lists(st.lists(_message, min_size=1, max_size=2), min_size=1, max_size=2),
        st.lists(st.dictionaries(st.sampled_from(["role", "content", "x"]), wild(), max_size=3), max_size=2),
    ),
    params=st.one_of(wild(), _short),
)
def test_chat_arguments(llm: LLM, messages: Any, params: Any) -> None:
    """LLM.chat with any messages works (one BOS, the template's) or raises InvalidRequestError."""
    _check_llm_call(llm, lambda: llm.chat(messages, params, use_tqdm=False))
