"""Strict validation at every boundary: types are never coerced, errors name the field, the range and the value,
nothing changes on error; the step protocol checks a plan before the executor runs it; sampler numerics."""

from __future__ import annotations

import math
import pickle
from typing import Any

import numpy as np
import pytest
import torch

from fnvllm.config import EngineConfig
from fnvllm.engine import Engine
from fnvllm.executor.sampler import Sampler, prepare_sampling
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
from fnvllm.state.errors import ConfigTypeError, RequestTypeError
from fnvllm.testing.toy import KVToyExecutor

VOCAB = 50


def _state() -> Any:
    config = CoreConfig(block_size=4, num_blocks=32, max_num_batched_tokens=64, max_model_len=64, vocab_size=VOCAB)
    return initial_state(config)


# --- SamplingParams ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", True),
        ("max_tokens", 5.0),
        ("max_tokens", "5"),
        ("top_k", False),
        ("top_k", np.float64(3)),
        ("temperature", "0.5"),
        ("temperature", True),
        ("temperature", b"1"),
        ("top_p", None),
        ("seed", 1.5),
        ("seed", True),
        ("logprobs", True),
        ("ignore_eos", 1),
        ("ignore_eos", "false"),
        ("include_stop_str_in_output", None),
        ("stop", b"end"),
        ("stop", {"end": 1}),
        ("stop", ["ok", 3]),
        ("stop_token_ids", "12"),
        ("stop_token_ids", b"\x01\x02"),
        ("stop_token_ids", [True]),
        ("stop_token_ids", [2.0]),
        ("stop_token_ids", {3: "x"}),
        ("repetition_penalty", "1.1"),
    ],
)
def test_sampling_params_refuse_wrong_types(field: str, value: object) -> None:
    """A value of the wrong type is refused (not converted) with RequestTypeError naming the field and value."""
    with pytest.raises(RequestTypeError, match=rf"SamplingParams\.{field}\b") as error:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert isinstance(error.value, InvalidRequestError) and isinstance(error.value, TypeError)
    assert "got" in str(error.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.inf),
        ("temperature", 10**400),
        ("top_p", math.nan),
        ("min_p", -math.inf),
        ("presence_penalty", math.nan),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1e300),
        ("max_tokens", 2**70),
        ("top_k", 2**64),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
    ],
)
def test_sampling_params_refuse_non_finite_and_absurd(field: str, value: object) -> None:
    """NaN, infinities and sizes beyond 64 bits are out of range, with a message that can be printed."""
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{field} must be") as error:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert len(str(error.value)) < 300


def test_a_huge_int_is_reported_without_printing_it() -> None:
    """An int too long for repr (over 4300 digits) still gives a readable error, not a ValueError from repr."""
    with pytest.raises(InvalidRequestError, match="cannot be shown"):
        SamplingParams(max_tokens=10**5000)


def test_sampling_params_normalise_numpy_scalars() -> None:
    """numpy scalars are accepted and stored as plain Python ints and floats; a str stop becomes a 1-tuple."""
    params = SamplingParams(
        temperature=np.float32(0.5),
        top_k=np.int64(5),
        max_tokens=np.uint8(7),
        seed=np.int32(-3),
        stop="END",
        stop_token_ids=np.array([3, 4]),
    )
    assert type(params.temperature) is float and params.temperature == 0.5
    assert type(params.top_k) is int and type(params.max_tokens) is int and type(params.seed) is int
    assert params.stop == ("END",) and params.stop_token_ids == (3, 4)
    assert all(type(i) is int for i in params.stop_token_ids)
    assert pickle.loads(pickle.dumps(params)) == params


def test_tiny_temperature_is_greedy() -> None:
    """Temperatures below 1e-5 count as greedy (dividing by them overflows float32); 1e-5 itself samples."""
    assert SamplingParams(temperature=5e-324).is_greedy
    assert SamplingParams(temperature=9.9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy


# --- CoreConfig / EngineConfig ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("block_size", True, ConfigTypeError),
        ("num_blocks", np.float64(8), ConfigTypeError),
        ("max_model_len", "64", ConfigTypeError),
        ("num_blocks", 2**40, InvalidConfigError),
        ("max_model_len", 2**40, InvalidConfigError),
        ("vocab_size", False, ConfigTypeError),
        ("eos_token_ids", [True], ConfigTypeError),
        ("eos_token_ids", 2.0, ConfigTypeError),
        ("eos_token_ids", b"\x02", ConfigTypeError),
        ("enable_prefix_caching", 1, ConfigTypeError),
        ("hash_block", "xxh3", ConfigTypeError),
    ],
)
def test_core_config_is_strict(field: str, value: object, error: type) -> None:
    """CoreConfig refuses bools as sizes, floats as ints, absurd sizes and non-bool switches, naming the field."""
    with pytest.raises(error, match=rf"CoreConfig\.{field}\b"):
        CoreConfig(**{field: value})  # type: ignore[arg-type]


def test_core_config_eos_ids_must_be_in_the_vocabulary() -> None:
    """A cross-field check: EOS ids at or above vocab_size could never be sampled."""
    with pytest.raises(InvalidConfigError, match=r"eos_token_ids.*\[0, 10\)"):
        CoreConfig(vocab_size=10, eos_token_ids=[3, 10])
    assert CoreConfig(vocab_size=10, eos_token_ids=np.array([3, 9])).eos_token_ids == {3, 9}


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("seed", "0", ConfigTypeError),
        ("seed", -1, InvalidConfigError),
        ("seed", 1.0, ConfigTypeError),
        ("block_size", 10**6, InvalidConfigError),
        ("block_size", True, ConfigTypeError),
        ("num_blocks", 2**30, InvalidConfigError),
        ("cpu_kv_cache_gib", "1", ConfigTypeError),
        ("cpu_kv_cache_gib", math.inf, InvalidConfigError),
        ("cpu_kv_cache_gib", 0, InvalidConfigError),
        ("gpu_memory_utilization", "0.5", ConfigTypeError),
        ("gpu_memory_utilization", math.nan, InvalidConfigError),
        ("distributed_timeout_s", math.inf, InvalidConfigError),
        ("max_num_seqs", 10**9, InvalidConfigError),
        ("enforce_eager", "no", ConfigTypeError),
        ("enable_prefix_caching", 0, ConfigTypeError),
        ("device", np.array(["cpu", "cuda"]), ConfigTypeError),
        ("attention_backend", None, ConfigTypeError),
        ("dtype", "int8", InvalidConfigError),
        ("dtype", 16, ConfigTypeError),
        ("model_ops", ["torch"], ConfigTypeError),
    ],
)
def test_engine_config_is_strict(field: str, value: object, error: type) -> None:
    """Every EngineConfig option is checked when constructed, naming the field (no failure at the first step)."""
    with pytest.raises(error, match=rf"EngineConfig\.{field}\b"):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_engine_config_accepts_numpy_and_torch_values() -> None:
    """Integer and float scalars of numpy, and torch dtypes, are accepted and stored as plain values."""
    config = EngineConfig(block_size=np.int64(8), cpu_kv_cache_gib=np.float32(0.5), dtype=torch.bfloat16, seed=2**63)
    assert (config.block_size, config.cpu_kv_cache_gib, config.dtype) == (8, 0.5, "bfloat16")
    assert EngineConfig(dtype="auto").dtype is None  # vLLM's spelling of the checkpoint's dtype
    assert type(config.block_size) is int and type(config.cpu_kv_cache_gib) is float


# --- requests ---------------------------------------------------------------------------------------------------


_OK = SamplingParams()


@pytest.mark.parametrize(
    ("rid", "prompt", "params", "priority", "field", "error"),
    [
        ("a", {1: 2, 3: 4}, _OK, 0, "prompt", RequestTypeError),
        ("a", b"\x01\x02", _OK, 0, "prompt", RequestTypeError),
        ("a", "12", _OK, 0, "prompt", RequestTypeError),
        ("a", [True, False], _OK, 0, "prompt", RequestTypeError),
        ("a", [1, 2.0], _OK, 0, "prompt", RequestTypeError),
        ("a", np.array([[1, 2]]), _OK, 0, "prompt", RequestTypeError),
        ("a", np.array([1.0, 2.0]), _OK, 0, "prompt", RequestTypeError),
        ("a", {1, 2}, _OK, 0, "prompt", RequestTypeError),
        ("a", iter([1, 2]), _OK, 0, "prompt", RequestTypeError),
        ("a", [1, VOCAB], _OK, 0, "prompt", InvalidRequestError),
        (7, [1], _OK, 0, "request_id", RequestTypeError),
        ("live", [1], _OK, 0, "request_id", InvalidRequestError),
        ("a", [1], "params", 0, "params", RequestTypeError),
        ("a", [1], _OK, True, "priority", RequestTypeError),
        ("a", [1], _OK, 1.5, "priority", RequestTypeError),
        ("a", [1], SamplingParams(stop_token_ids=[VOCAB]), 0, "stop_token_ids", InvalidRequestError),
    ],
)
def test_add_request_is_strict_and_atomic(
    rid: Any, prompt: Any, params: Any, priority: Any, field: str, error: type
) -> None:
    """A prompt that is not a sequence of int ids (a dict, bytes, a str, bools, floats, a 2-D array, an
    iterator) or any other bad argument raises naming the field; the state is unchanged."""
    state = add_request(_state(), "live", [1, 2], SamplingParams())
    before = pickle.dumps(state)
    with pytest.raises(error, match=field):
        add_request(state, rid, prompt, params, priority)
    assert pickle.dumps(state) == before


def test_logprobs_above_the_vocabulary_are_refused() -> None:
    """Asking for more logprobs than the vocabulary has is an error at add_request, not in torch.topk later."""
    config = CoreConfig(vocab_size=5, num_blocks=8)
    with pytest.raises(InvalidRequestError, match=r"SamplingParams\.logprobs.*vocabulary size \(5\)"):
        add_request(initial_state(config), "a", [1], SamplingParams(logprobs=6))


def test_numpy_prompts_are_stored_as_plain_ints() -> None:
    """A 1-D integer array, or a list of numpy integers, is a prompt; the stored prompt is a tuple of ints."""
    state = add_request(_state(), "a", np.array([3, 4, 5], dtype=np.int32), SamplingParams())
    state = add_request(state, "b", [np.int64(6), np.uint16(7)], SamplingParams(), priority=np.int8(2))
    assert state.requests["a"].prompt == (3, 4, 5) and state.requests["b"].prompt == (6, 7)
    assert all(type(t) is int for rid in "ab" for t in state.requests[rid].prompt)
    assert type(state.requests["b"].priority) is int


# --- the step protocol ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [[VOCAB], [-1], [2.0], ["3"], [None]])
def test_commit_rejects_tokens_outside_the_vocabulary(bad: list[object]) -> None:
    """A sampled token that is not an int in [0, vocab_size) raises PlanMismatchError and changes nothing; the
    right tokens then commit."""
    state, plan = schedule(add_request(_state(), "a", [1, 2, 3], SamplingParams(max_tokens=2)))
    before = pickle.dumps(state)
    with pytest.raises(PlanMismatchError, match=r"sampled\[0\]"):
        commit(state, plan, bad)  # type: ignore[arg-type]
    assert pickle.dumps(state) == before
    state, out = commit(state, plan, [np.int64(VOCAB - 1)])
    assert out.new_tokens == (VOCAB - 1,) and type(out.new_tokens[0]) is int


def test_engine_step_checks_the_plan_before_executing() -> None:
    """A stale plan is refused before the executor runs it, so the executor is not a step ahead and the correct
    plan still runs (formerly: the executor ran, commit refused, and every retry was stale)."""
    config = _state().config
    executor = KVToyExecutor(VOCAB)
    engine = Engine(executor, config)
    state = add_request(engine.initial_state(), "a", [1, 2, 3], SamplingParams(max_tokens=3))
    planned, plan = schedule(state)
    with pytest.raises(PlanMismatchError, match="schedule first"):
        engine.step(state, plan)  # the state before schedule: no plan pending
    assert executor.next_step == 0
    state, out = engine.step(planned, plan)
    assert out.output.seq_ids == ("a",)
    with pytest.raises(PlanMismatchError, match="schedule first"):
        engine.step(state, plan)  # the same plan again
    assert executor.next_step == 1


# --- sampler numerics -------------------------------------------------------------------------------------------


def _sample(params: list[SamplingParams], logits: torch.Tensor) -> Any:
    batch = prepare_sampling(params, [0] * len(params), [None] * len(params), logits.shape[1], "cpu")
    return Sampler(seed=0).sample(logits, batch)


def test_the_smallest_temperatures_give_the_greedy_token() -> None:
    """Temperatures down to the smallest positive float give valid tokens (the argmax), never garbage."""
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(0)) * 30
    temperatures = [5e-324, 1e-300, 1e-40, 1e-5]
    out = _sample([SamplingParams(temperature=t) for t in temperatures], logits)
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert not out.non_finite.any()


def test_non_finite_logits_are_reported_not_turned_into_token_0() -> None:
    """Rows whose logits hold a NaN or an infinity (greedy or sampled, with logprobs) are flagged (the executor
    then raises NonFiniteLogitsError); finite rows are untouched; commit rejects a token outside the vocabulary."""
    logits = torch.randn(4, 10)
    logits[0, 3] = math.nan
    logits[2, 5] = math.inf
    params = [SamplingParams(temperature=t, logprobs=2) for t in (0.0, 0.0, 1.0, 1.0)]
    out = _sample(params, logits)
    assert out.non_finite.tolist() == [True, False, True, False]
    assert 0 <= out.token_ids[1] < 10 and 0 <= out.token_ids[3] < 10
    all_nan = _sample([SamplingParams(temperature=0.7, top_p=0.9, top_k=3)], torch.full((1, 10), math.nan))
    assert all_nan.non_finite.tolist() == [True]
    state, plan = schedule(add_request(_state(), "a", [1], SamplingParams()))
    with pytest.raises(PlanMismatchError, match="not a token id"):
        commit(state, plan, [-1])


def test_every_engine_option_has_a_check() -> None:
    """A new EngineConfig field cannot skip validation: each one has an entry in the table of checks."""
    import attrs

    from fnvllm.config import _CHECKS

    assert {field.name for field in attrs.fields(EngineConfig)} == set(_CHECKS)
