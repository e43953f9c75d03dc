"""``SamplingParams.n``: its validation, the core's refusal, the shared fan-out rule (``copies``), and the offline
API's grouped outputs (``RequestOutput.outputs``), streams and CLI."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tiny_models import write_family

from fnvllm.cli import main
from fnvllm.engine import CompletionOutput, RequestOutput
from fnvllm.llm import LLM
from fnvllm.state import CoreConfig, InvalidRequestError, SamplingParams, add_request, copies, initial_state
from fnvllm.state.errors import RequestTypeError
from fnvllm.state.params import MAX_N, SEED_RANGE

PROMPT = [5, 9, 13, 200, 7, 42, 17, 99, 3]
SAMPLED = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(tmp_path_factory.mktemp("offline_n"), "qwen3")


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    return LLM(ckpt, dtype="float32", block_size=8, num_blocks=64)


def _with(params: SamplingParams, **changes: Any) -> SamplingParams:
    """``params`` with some fields changed (a new, validated SamplingParams)."""
    fields = {name: getattr(params, name) for name in ("temperature", "seed", "max_tokens", "ignore_eos", "logprobs")}
    return SamplingParams(**{**fields, **changes})


# ----- validation and the core ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, InvalidRequestError), (129, InvalidRequestError), (-1, InvalidRequestError), (True, RequestTypeError),
     ("2", RequestTypeError), (2.0, RequestTypeError), (None, RequestTypeError)],
)  # fmt: skip
def test_n_out_of_range_or_of_the_wrong_type_names_the_field(value: object, error: type[Exception]) -> None:
    """n outside [1, 128], a bool, a str, a float or None is refused, naming SamplingParams.n and its range."""
    with pytest.raises(error, match=r"SamplingParams\.n ") as raised:
        SamplingParams(n=value)  # type: ignore[arg-type]
    assert "[1, 128]" in str(raised.value)


def test_n_in_range_is_kept_as_a_plain_int() -> None:
    """n defaults to 1, takes the range's ends, and a numpy integer is stored as an int; the server's bound is it."""
    assert SamplingParams().n == 1 and SamplingParams(n=MAX_N).n == 128
    n = SamplingParams(n=np.int64(3)).n
    assert n == 3 and type(n) is int
    protocol = pytest.importorskip("fnvllm.serve.protocol", reason="the server needs the [serve] extra")
    assert protocol.MAX_N is MAX_N


def test_core_refuses_n_above_one() -> None:
    """The pure core runs one sequence per request: add_request refuses n != 1, saying who runs n copies."""
    state = initial_state(CoreConfig(block_size=4, num_blocks=16, max_model_len=64, vocab_size=256))
    with pytest.raises(InvalidRequestError, match=r"SamplingParams\.n must be 1") as raised:
        add_request(state, "a", [1, 2, 3], SamplingParams(n=2))
    assert "LLM.generate" in str(raised.value) and "LLM.stream" in str(raised.value) and "server" in str(raised.value)
    assert not state.requests  # the state is a value: nothing was queued
    assert "a" in add_request(state, "a", [1, 2, 3], SamplingParams(n=1)).requests


# ----- copies ---------------------------------------------------------------------------------------------------


def test_copies_draw_from_seed_plus_j() -> None:
    """Copy j of a seeded request has seed + j and n = 1; everything else is the request's."""
    params = SamplingParams(n=3, seed=7, temperature=0.5, max_tokens=4)
    made = copies(params, 3)
    assert [p.seed for p in made] == [7, 8, 9]
    assert all(p.n == 1 and p.temperature == 0.5 and p.max_tokens == 4 for p in made)
    assert params.n == 3 and params.seed == 7  # unchanged


def test_copies_step_down_at_the_top_of_the_seed_range() -> None:
    """Where seed + num - 1 would pass the top of the seed range, the copies' seeds step down from the seed."""
    top = SEED_RANGE[1]
    assert [p.seed for p in copies(SamplingParams(seed=top - 1), 3)] == [top - 1, top - 2, top - 3]
    assert [p.seed for p in copies(SamplingParams(seed=top - 2), 3)] == [top - 2, top - 1, top]


def test_unseeded_copies_are_one_object() -> None:
    """Without a seed every copy is the same n = 1 object (the request itself when its n is 1)."""
    single = SamplingParams(temperature=0.7)
    assert all(p is single for p in copies(single, 4))
    many = copies(SamplingParams(n=4, temperature=0.7), 4)
    assert all(p is many[0] for p in many) and many[0] == single
    assert copies(SamplingParams(seed=3), 1)[0].seed == 3


@pytest.mark.parametrize("num", [0, 129, True])
def test_copies_checks_num(num: object) -> None:
    """``num`` must be an int in [1, 128]."""
    with pytest.raises((InvalidRequestError, RequestTypeError), match="num"):
        copies(SamplingParams(), num)  # type: ignore[arg-type]


def test_server_uses_the_shared_fan_out() -> None:
    """The server's handlers fan n / best_of out with ``fnvllm.state.copies`` (no private copy of the rule)."""
    handlers = pytest.importorskip("fnvllm.serve.handlers", reason="the server needs the [serve] extra")
    assert handlers.copies is copies and not hasattr(handlers, "_copies")


# ----- outputs --------------------------------------------------------------------------------------------------


def _completion_fields(c: CompletionOutput | RequestOutput) -> tuple[Any, ...]:
    return c.text, c.token_ids, c.finish_reason, c.logprobs


def test_hand_built_output_has_one_completion_of_its_fields() -> None:
    """A RequestOutput built without ``outputs`` holds one completion equal to its flat fields."""
    out = RequestOutput("r", None, (1, 2), "ab", (3, 4), "length")
    assert out.outputs == (CompletionOutput(0, "ab", (3, 4), "length", None),)
    assert out.outputs[0].cumulative_logprob is None and out.finished


def test_generate_n_is_n_seeded_requests(llm: LLM) -> None:
    """n = 3 gives one output whose completions 0..2 equal separate n = 1 requests seeded seed + j; completion 0
    is the flat fields."""
    [out] = llm.generate([PROMPT], _with(SAMPLED, n=3), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    separate = [llm.generate([PROMPT], _with(SAMPLED, seed=5 + j), use_tqdm=False)[0] for j in range(3)]
    assert [_completion_fields(c) for c in out.outputs] == [_completion_fields(s) for s in separate]
    assert len({c.token_ids for c in out.outputs}) > 1  # the seeds differ, so the samples do
    assert _completion_fields(out) == _completion_fields(out.outputs[0])
    assert out.prompt_token_ids == tuple(PROMPT) and out.finished


def test_copies_share_the_prompt_kv(llm: LLM) -> None:
    """Only the first copy computes the prompt's full blocks: the group's cached-token count is (n - 1) of them."""
    prompt = [77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93]  # 2 full blocks of 8, unseen
    [out] = llm.generate([prompt], _with(SAMPLED, n=3), use_tqdm=False)
    assert out.metrics is not None and out.metrics.num_cached_tokens == 2 * 16


def test_greedy_n_gives_identical_completions(llm: LLM) -> None:
    """With temperature 0 every completion is the greedy one."""
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=2), use_tqdm=False)
    [alone] = llm.generate([PROMPT], greedy, use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [alone.token_ids] * 2


def test_per_prompt_params_with_different_n(llm: LLM) -> None:
    """A list of params with n 1, 3 and 2 gives one output per prompt, in input order, with that many
    completions; the group's metrics span its copies."""
    prompts = [PROMPT, [42] * 10, [250, 3, 8]]
    params = [_with(SAMPLED, n=n, seed=s) for n, s in ((1, 1), (3, 2), (2, 3))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [1, 3, 2]
    assert [o.prompt_token_ids for o in outs] == [tuple(p) for p in prompts]
    assert all([c.index for c in o.outputs] == list(range(len(o.outputs))) for o in outs)
    assert all(len(c.token_ids) == 6 for o in outs for c in o.outputs)
    assert outs[0].outputs == (CompletionOutput(0, *_completion_fields(outs[0])),)
    m = outs[1].metrics
    assert m is not None and m.first_token_time is not None and m.finish_time is not None
    assert m.arrival_time <= m.first_token_time <= m.finish_time


def test_cumulative_logprob_is_the_sum_of_sampled_logprobs(llm: LLM) -> None:
    """With logprobs, each completion's cumulative_logprob is the sum of its sampled tokens' logprobs; without
    them it is None."""
    [out] = llm.generate([PROMPT], _with(SAMPLED, n=2, logprobs=1), use_tqdm=False)
    for c in out.outputs:
        assert c.logprobs is not None and [e.token_id for e in c.logprobs] == list(c.token_ids)
        assert c.cumulative_logprob == sum(e.logprob for e in c.logprobs)
        assert c.cumulative_logprob is not None and c.cumulative_logprob < 0
    [plain] = llm.generate([PROMPT], _with(SAMPLED, n=2), use_tqdm=False)
    assert [c.cumulative_logprob for c in plain.outputs] == [None, None]


def test_stream_delivers_every_completion(llm: LLM) -> None:
    """A stream with n = 2 labels each delta with its completion; per (prompt, completion) the deltas add up to
    generate's completion, and each ends once."""
    prompts = [PROMPT, [42] * 10]
    params = _with(SAMPLED, n=2, seed=11)
    texts: dict[tuple[int, int], str] = defaultdict(str)
    ids: dict[tuple[int, int], tuple[int, ...]] = defaultdict(tuple)
    ends: dict[tuple[int, int], int] = defaultdict(int)
    for delta in llm.stream(prompts, params):
        key = (delta.index, delta.completion)
        texts[key] += delta.new_text
        ids[key] += delta.new_token_ids
        ends[key] += delta.finish_reason is not None
    outs = llm.generate(prompts, params, use_tqdm=False)
    expected = {(i, c.index): c for i, o in enumerate(outs) for c in o.outputs}
    assert set(ids) == set(expected) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert all(ids[k] == c.token_ids and texts[k] == c.text for k, c in expected.items())
    assert set(ends.values()) == {1}


def test_chat_takes_n(llm: LLM) -> None:
    """LLM.chat returns one output per conversation with n completions."""
    [out] = llm.chat([{"role": "user", "content": "hi"}], _with(SAMPLED, n=2), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1] and all(len(c.token_ids) == 6 for c in out.outputs)


# ----- CLI ------------------------------------------------------------------------------------------------------


def test_cli_prints_every_completion(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``fnvllm generate --n 2`` prints both completions of each prompt under labelled headers; --json lists them
    under "completions"; --stream labels them the same way."""
    base = ["generate", str(ckpt), "ab", "--n", "2", "--temperature", "1", "--seed", "4", "--max-tokens", "4"]
    base += ["--ignore-eos", "--num-blocks", "64", "--dtype", "float32"]
    assert main(base) == 0
    text = capsys.readouterr().out
    assert "===== request 0 (completion 0, 4 tokens, length) =====" in text
    assert "===== request 0 (completion 1, 4 tokens, length) =====" in text
    assert main([*base, "--json"]) == 0
    [record] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [c["index"] for c in record["completions"]] == [0, 1]
    assert record["completions"][0]["token_ids"] == record["token_ids"]
    assert main([*base, "--stream"]) == 0
    streamed = capsys.readouterr().out
    assert streamed.count("===== request 0 (completion") == 2
    blocks = [b for b in text.split("=====") if b.startswith("\n")]
    assert [b.strip() for b in streamed.split("=====") if b.startswith("\n")] == [b.strip() for b in blocks]
