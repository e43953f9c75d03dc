"""vLLM's ``use_beam_search`` on a real in-process server, driven by the official openai client: each prompt's ``n``
choices are ``LLM.beam_search``'s sequences on the same checkpoint and engine options, best first (texts, finish
reasons, usage; exact token ids from a front without a tokenizer), for completions (text, token-id and batched
prompts) and chat; width 1 with length_penalty 0 is greedy; fields the search cannot honour are 400s naming them;
no request is left in the engine after a search."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("uvicorn", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
openai = pytest.importorskip("openai", reason="the server tests drive it with the official openai client")
httpx = pytest.importorskip("httpx", reason="installed with openai")

from test_beam_search import _set_eos  # noqa: E402
from test_serve_health_metrics import ENGINE, serving  # noqa: E402
from tiny_models import WEATHER_TOOL, write_tool_chat_model  # noqa: E402

from fnvllm import BeamSearchOutput, BeamSearchParams  # noqa: E402
from fnvllm.llm import LLM  # noqa: E402
from fnvllm.serve import AsyncEngine, build_app  # noqa: E402
from fnvllm.state import SamplingParams  # noqa: E402

MODEL = "tiny"
TEXT = "The quick brown fox"
IDS = [[17, 40, 93, 5, 61, 28], [201, 7, 150, 33]]  # two token-id prompts
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 5
BEAM = {"use_beam_search": True, "temperature": 0}  # deterministic: the search of LLM.beam_search's default


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model whose EOS id is the second token of its greedy answer to TEXT, so beams of TEXT meet it
    in their first steps and the EOS rules run in the server's search too."""
    path = write_tool_chat_model(tmp_path_factory.mktemp("serve-beam"))
    probe = LLM(path, **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    _set_eos(path, probe.generate(TEXT, greedy, use_tqdm=False)[0].token_ids[1])
    return path


@pytest.fixture(scope="module")
def offline(checkpoint: Path) -> LLM:
    """The reference: ``LLM.beam_search`` on the checkpoint, with the server's engine options."""
    return LLM(checkpoint, **ENGINE)


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> LLM:
    """The model the servers run (its own LLM: the reference's engine state stays apart)."""
    return LLM(checkpoint, **ENGINE)


@contextmanager
def server(llm: LLM, with_tokenizer: bool = True) -> Iterator[tuple[str, AsyncEngine]]:
    """A real server of ``llm``'s loop as MODEL (without a tokenizer: completions answer token ids); yields its URL
    and engine."""
    engine = AsyncEngine(llm.loop, llm.tokenizer if with_tokenizer else None)
    try:
        with serving(build_app(engine, MODEL)) as url:
            yield url, engine
    finally:
        llm.loop.on_step = None


def client(url: str) -> Any:
    """The openai client of a server."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def expected_texts(llm: LLM, out: BeamSearchOutput) -> list[str]:
    """The text each sequence's choice carries: its generated ids less an EOS id that ended it, without special
    tokens (the server's default skip_special_tokens)."""
    return [llm.tokenizer.decode(list(s.answer_token_ids), skip_special_tokens=True) for s in out.sequences]


def assert_left_nothing(llm: LLM, engine: AsyncEngine) -> None:
    """No request waits, runs or is tracked in the served engine, and the gauges its front publishes count none."""
    assert not llm.state.requests and not llm.state.waiting and not llm.state.running
    assert not llm.loop.processor.trackers and not llm.loop.has_unfinished
    assert engine.snapshot.num_running == engine.snapshot.num_waiting == 0  # published before the last events


CASES = [  # (n, length_penalty, ignore_eos)
    (3, 1.0, False),
    (2, 0.0, False),
    (4, 2.0, True),
]


@pytest.mark.parametrize(("width", "penalty", "ignore_eos"), CASES)
def test_text_prompt_choices_are_the_offline_beams(
    served: LLM, offline: LLM, width: int, penalty: float, ignore_eos: bool
) -> None:
    """A text prompt's n choices are LLM.beam_search's sequences, best first: text, finish_reason, and usage (the
    prompt once, every returned beam's generated tokens, an ending EOS id included); echo prepends the prompt."""
    params = BeamSearchParams(width, MAX_TOKENS, ignore_eos=ignore_eos, length_penalty=penalty)
    (want,) = offline.beam_search(TEXT, params, use_tqdm=False)
    with server(served) as (url, engine):
        extra = {**BEAM, "length_penalty": penalty, "ignore_eos": ignore_eos}
        answer = client(url).completions.create(
            model=MODEL, prompt=TEXT, n=width, max_tokens=MAX_TOKENS, echo=True, extra_body=extra
        )
        assert_left_nothing(served, engine)
    assert [c.index for c in answer.choices] == list(range(width))
    assert [c.text for c in answer.choices] == [TEXT + t for t in expected_texts(offline, want)]
    assert [c.finish_reason for c in answer.choices] == [s.finish_reason for s in want.sequences]
    assert answer.usage.prompt_tokens == len(want.prompt_token_ids)
    assert answer.usage.completion_tokens == sum(len(s.output_token_ids) for s in want.sequences)
    if not ignore_eos and penalty == 1.0:
        assert "stop" in {c.finish_reason for c in answer.choices}, "no beam met the EOS id: the case is vacuous"


def test_token_id_prompts_give_the_offline_token_ids(served: LLM, offline: LLM) -> None:
    """A batch of token-id prompts on a front without a tokenizer: each prompt's choices (prompt-major, index
    p * n + i) hold exactly the offline sequences' generated ids, in order."""
    params = BeamSearchParams(3, MAX_TOKENS, length_penalty=0.5)
    want = offline.beam_search(IDS, params, use_tqdm=False)
    with server(served, with_tokenizer=False) as (url, engine):
        body = {"model": MODEL, "prompt": IDS, "n": 3, "max_tokens": MAX_TOKENS, **BEAM, "length_penalty": 0.5}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert_left_nothing(served, engine)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    assert [c["token_ids"] for c in choices] == [list(s.output_token_ids) for out in want for s in out.sequences]
    assert [c["finish_reason"] for c in choices] == [s.finish_reason for out in want for s in out.sequences]


def test_token_id_prompt_text(served: LLM, offline: LLM) -> None:
    """One token-id prompt through the openai client: its choices' texts are the offline sequences'."""
    (want,) = offline.beam_search([IDS[0]], BeamSearchParams(2, MAX_TOKENS), use_tqdm=False)
    with server(served) as (url, _):
        answer = client(url).completions.create(model=MODEL, prompt=IDS[0], n=2, max_tokens=MAX_TOKENS, extra_body=BEAM)
    assert [c.text for c in answer.choices] == expected_texts(offline, want)


def test_chat_choices_are_the_offline_beams(served: LLM, offline: LLM) -> None:
    """Chat: the conversation's ids (as /tokenize renders them for chat) beam-searched offline give the choices'
    contents and finish reasons, best first."""
    with server(served) as (url, engine):
        ids = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
        answer = client(url).chat.completions.create(
            model=MODEL, messages=MESSAGES, n=3, max_tokens=MAX_TOKENS, extra_body={**BEAM, "length_penalty": 0.0}
        )
        assert_left_nothing(served, engine)
    (want,) = offline.beam_search([ids], BeamSearchParams(3, MAX_TOKENS, length_penalty=0.0), use_tqdm=False)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.message.content for c in answer.choices] == expected_texts(offline, want)
    assert [c.finish_reason for c in answer.choices] == [s.finish_reason for s in want.sequences]
    assert answer.usage.completion_tokens == sum(len(s.output_token_ids) for s in want.sequences)


def test_width_one_is_greedy(served: LLM) -> None:
    """n=1 with length_penalty 0 and ignore_eos is greedy decoding: the plain greedy request's text and length."""
    with server(served) as (url, _):
        openai_client = client(url)
        common: dict[str, Any] = {"model": MODEL, "prompt": TEXT, "max_tokens": MAX_TOKENS}
        extra = {**BEAM, "length_penalty": 0.0, "ignore_eos": True}
        beam = openai_client.completions.create(**common, n=1, extra_body=extra)
        greedy = openai_client.completions.create(**common, temperature=0, extra_body={"ignore_eos": True})
    assert beam.choices[0].text == greedy.choices[0].text
    assert beam.usage.completion_tokens == greedy.usage.completion_tokens == MAX_TOKENS


REFUSED: list[tuple[str, dict[str, Any], str]] = [  # (route, body fields, the field the 400 names)
    ("completions", {"stream": True}, "stream"),
    ("completions", {"logprobs": 0}, "logprobs"),
    ("completions", {"stop": ["x"]}, "stop"),
    ("completions", {"top_p": 0.5}, "top_p"),
    ("completions", {"seed": 3}, "seed"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"max_tokens": 0, "echo": True}, "max_tokens"),
    ("completions", {"n": 11}, "n"),
    ("completions", {"length_penalty": 11}, "length_penalty"),
    ("completions", {"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
    ("completions", {"max_tokens": 4000}, "max_tokens"),
    ("chat", {"stream": True}, "stream"),
    ("chat", {"logprobs": True}, "logprobs"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"tools": [WEATHER_TOOL], "tool_choice": "required"}, "tool_choice"),
]


@pytest.fixture(scope="module")
def refusing(served: LLM) -> Iterator[tuple[str, AsyncEngine]]:
    """One server for the refusal cases."""
    with server(served) as running:
        yield running


@pytest.mark.parametrize(("route", "fields", "param"), REFUSED)
def test_refused_fields_are_400s_naming_them(
    refusing: tuple[str, AsyncEngine], served: LLM, route: str, fields: dict[str, Any], param: str
) -> None:
    """A field beam search cannot honour (or a value out of its range) is a 400 whose message and param name it,
    and nothing reaches the engine."""
    url, engine = refusing
    base: dict[str, Any] = {"model": MODEL, "n": 2, "max_tokens": 3, **BEAM}
    if route == "chat":
        path, body = "/v1/chat/completions", {**base, "messages": MESSAGES, **fields}
    else:
        path, body = "/v1/completions", {**base, "prompt": TEXT, **fields}
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert_left_nothing(served, engine)
