"""vLLM's ``use_beam_search`` on a real in-process server, driven by the official openai client: each prompt's ``n``
choices are ``LLM.beam_search``'s sequences on the same checkpoint and engine options, best first (texts, finish
reasons, usage; exact token ids from a front without a tokenizer), for completions (text, token-id and batched
prompts) and chat; width 1 with length_penalty 0 is greedy; logprobs (and echo's prompt logprobs) are
transformers' log_softmax of the beams' own tokens; streamed, the chunks add up to the plain answer (usage chunk,
continuous usage, ``[DONE]``); fields the search cannot honour are 400s naming them; no request is left in the
engine after a search."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("uvicorn", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
openai = pytest.importorskip("openai", reason="the server tests drive it with the official openai client")
httpx = pytest.importorskip("httpx", reason="installed with openai")

from test_beam_search import _set_eos  # noqa: E402
from test_serve_health_metrics import ENGINE, serving  # noqa: E402
from tiny_models import WEATHER_TOOL, hf_model, write_tool_chat_model  # noqa: E402

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


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> Any:
    """The independent reference for logprobs: the checkpoint loaded by transformers (fp32)."""
    return hf_model(checkpoint)


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


def transformers_entries(hf: Any, prompt: list[int], output: list[int], k: int) -> list[tuple[int, float, list]]:
    """Each of ``output``'s tokens after ``prompt`` as (id, logprob, top k [(id, logprob)] best first), from
    transformers' log_softmax over prompt + output in one forward (row j scores the token at j + 1)."""
    ids = [*prompt, *output]
    with torch.no_grad():
        rows = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    entries = []
    for position in range(len(prompt), len(ids)):
        row = rows[position - 1]
        top = row.topk(k)
        scored = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        entries.append((ids[position], row[ids[position]].item(), scored))
    return entries


def assert_legacy_logprobs(logprobs: dict[str, Any], entries: list[tuple[int, float, list]], first: int = 0) -> None:
    """Completions' logprobs (a front without a tokenizer: a token's text is its id) from index ``first`` on are
    ``entries``: the tokens, their logprobs, and the top k with the token itself last when it is not among them."""
    tokens = logprobs["tokens"][first:]
    assert tokens == [str(token) for token, _, _ in entries]
    assert logprobs["token_logprobs"][first:] == pytest.approx([lp for _, lp, _ in entries], abs=1e-4)
    for got, (token, lp, top) in zip(logprobs["top_logprobs"][first:], entries, strict=True):
        want = {str(t): v for t, v in top} | ({} if token in dict(top) else {str(token): lp})
        assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)


LOGPROB_CASES = [  # (n, k, echo): k below 2n (the top cut to k), above it (the steps ask for k), with the echo
    (3, 2, False),
    (2, 5, True),
]


@pytest.mark.parametrize(("width", "k", "echo"), LOGPROB_CASES)
def test_completion_logprobs_are_the_models(served: LLM, offline: LLM, hf: Any, width: int, k: int, echo: bool) -> None:
    """``logprobs: k`` with beam search: each choice (batched token-id prompts, no tokenizer: ids as tokens) carries
    one entry per generated token, the token's logprob and the top k by transformers' forward over the prompt and
    the beam's tokens; with echo the prompt's entries (the first unscored) come first; the beams are the offline
    ones (more logprobs asked of each step do not widen the search)."""
    want = offline.beam_search(IDS, BeamSearchParams(width, MAX_TOKENS), use_tqdm=False)
    with server(served, with_tokenizer=False) as (url, engine):
        body = {"model": MODEL, "prompt": IDS, "n": width, "max_tokens": MAX_TOKENS, "logprobs": k, "echo": echo}
        response = httpx.post(f"{url}/v1/completions", json={**body, **BEAM}, timeout=120)
        assert_left_nothing(served, engine)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["token_ids"] for c in choices] == [list(s.output_token_ids) for out in want for s in out.sequences]
    for i, choice in enumerate(choices):
        prompt, tokens, logprobs = IDS[i // width], choice["token_ids"], choice["logprobs"]
        if echo:  # the first prompt token has nothing before it: no score
            assert logprobs["tokens"][0] == str(prompt[0]) and logprobs["token_logprobs"][0] is None
            assert logprobs["top_logprobs"][0] is None
            assert_legacy_logprobs(logprobs, transformers_entries(hf, prompt[:1], [*prompt[1:], *tokens], k), 1)
        else:
            assert_legacy_logprobs(logprobs, transformers_entries(hf, prompt, tokens, k))


def test_chat_logprobs_are_the_models(served: LLM, offline: LLM, hf: Any) -> None:
    """Chat ``logprobs: true`` with ``top_logprobs``: each choice's content entries are its beam's tokens (as the
    offline search finds them) with transformers' logprob and top k, an ending EOS id's entry included."""
    with server(served) as (url, _):
        ids = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
        answer = client(url).chat.completions.create(
            model=MODEL, messages=MESSAGES, n=2, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3, extra_body=BEAM
        )
    (want,) = offline.beam_search([ids], BeamSearchParams(2, MAX_TOKENS), use_tqdm=False)
    text = offline.tokenizer.decode
    for choice, seq in zip(answer.choices, want.sequences, strict=True):
        entries = transformers_entries(hf, ids, list(seq.output_token_ids), 3)
        content = choice.logprobs.content
        assert [e.token for e in content] == [text([token]) for token, _, _ in entries]
        assert [e.logprob for e in content] == pytest.approx([lp for _, lp, _ in entries], abs=1e-4)
        for got, (_, _, top) in zip(content, entries, strict=True):
            assert [t.token for t in got.top_logprobs] == [text([t]) for t, _ in top]
            assert [t.logprob for t in got.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-4)


def test_streamed_completions_add_up_to_the_answer(served: LLM) -> None:
    """stream: true with beam search (openai client, echo and logprobs): per choice the chunks' texts, logprobs and
    finish reason add up to the plain answer's; the last chunk has no choices and the plain answer's usage."""
    body: dict[str, Any] = {"model": MODEL, "prompt": TEXT, "n": 3, "max_tokens": MAX_TOKENS, "logprobs": 2}
    with server(served) as (url, engine):
        openai_client = client(url)
        plain = openai_client.completions.create(**body, echo=True, extra_body=BEAM)
        chunks = list(
            openai_client.completions.create(
                **body, echo=True, stream=True, stream_options={"include_usage": True}, extra_body=BEAM
            )
        )
        assert_left_nothing(served, engine)
    texts, lists, reasons = {}, {}, {}
    for chunk in chunks[:-1]:
        (c,) = chunk.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        lists.setdefault(c.index, []).append(c.logprobs)
        reasons[c.index] = c.finish_reason or reasons.get(c.index)
        assert chunk.usage is None
    assert texts == {c.index: c.text for c in plain.choices} and all(t.startswith(TEXT) for t in texts.values())
    assert reasons == {c.index: c.finish_reason for c in plain.choices}
    for c in plain.choices:
        streamed = lists[c.index]
        assert [t for lp in streamed for t in lp.tokens] == c.logprobs.tokens
        assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(c.logprobs.token_logprobs, abs=1e-5)
        keys = [top and list(top) for lp in streamed for top in lp.top_logprobs]  # the echo's first entry: None
        assert keys == [top and list(top) for top in c.logprobs.top_logprobs]
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert {chunk.id for chunk in chunks} == {chunks[0].id} and chunks[0].object == "text_completion"


@pytest.mark.parametrize("tools", [False, True])
def test_streamed_chat_adds_up_to_the_answer(served: LLM, tools: bool) -> None:
    """Chat stream: true with beam search (with tools: through the tool-call parser's format): each choice opens
    with the assistant role, its deltas add up to the plain answer's content, logprobs and finish reason, and the
    usage chunk closes the stream."""
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "n": 2, "max_tokens": MAX_TOKENS, "extra_body": BEAM}
    if tools:
        body["tools"] = [WEATHER_TOOL]
    with server(served) as (url, engine):
        openai_client = client(url)
        plain = openai_client.chat.completions.create(**body, logprobs=True, top_logprobs=2)
        stream = openai_client.chat.completions.create(
            **body, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert_left_nothing(served, engine)
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [(0, "assistant"), (1, "assistant")]
    contents: dict[int, str] = {}
    entries: dict[int, list[Any]] = {}
    reasons: dict[int, str | None] = {}
    for chunk in chunks[:-1]:
        (c,) = chunk.choices
        contents[c.index] = contents.get(c.index, "") + (c.delta.content or "")
        entries.setdefault(c.index, []).extend(c.logprobs.content if c.logprobs else [])
        reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert contents == {c.index: c.message.content for c in plain.choices}
    assert reasons == {c.index: c.finish_reason for c in plain.choices}
    for c in plain.choices:
        assert [(e.token, [t.token for t in e.top_logprobs]) for e in entries[c.index]] == [
            (e.token, [t.token for t in e.top_logprobs]) for e in c.logprobs.content
        ]
        assert [e.logprob for e in entries[c.index]] == pytest.approx([e.logprob for e in c.logprobs.content], abs=1e-5)
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage


def test_stream_events_and_continuous_usage(served: LLM, offline: LLM) -> None:
    """The raw event stream (token-id prompts, no tokenizer, continuous_usage_stats and include_usage): ``data:``
    events ending with ``[DONE]``; each choice's one chunk holds its offline beam's ids and finish reason and the
    counts so far; the usage chunk holds the totals."""
    want = offline.beam_search(IDS, BeamSearchParams(2, MAX_TOKENS), use_tqdm=False)
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": MODEL, "prompt": IDS, "n": 2, "max_tokens": MAX_TOKENS, "stream": True, "stream_options": options}
    with server(served, with_tokenizer=False) as (url, engine):
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, **BEAM}, timeout=120) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            events = [line for line in response.iter_lines() if line]
        assert_left_nothing(served, engine)
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    sequences = [s for out in want for s in out.sequences]
    num_prompt = sum(len(ids) for ids in IDS)
    generated = 0
    for chunk, seq, index in zip(chunks[:-1], sequences, range(4), strict=True):
        (choice,) = chunk["choices"]
        generated += len(seq.output_token_ids)
        assert choice["index"] == index and choice["token_ids"] == list(seq.output_token_ids)
        assert choice["finish_reason"] == seq.finish_reason and choice["logprobs"] is None
        assert chunk["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": generated,
                                  "total_tokens": num_prompt + generated}  # fmt: skip
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == generated


def test_a_client_that_leaves_a_streamed_search_stops_it(served: LLM) -> None:
    """Closing a streamed beam search after its opening chunk (sent before the search) aborts the step in flight:
    no later step is submitted and nothing is left in the engine."""
    steps: list[int] = []
    body = {"model": MODEL, "messages": MESSAGES, "n": 4, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with server(served) as (url, engine):
        submit_many = engine.submit_many

        def counting(submissions: Any, *args: Any) -> Any:
            steps.append(len(submissions))
            return submit_many(submissions, *args)

        engine.submit_many = counting  # type: ignore[method-assign]
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, **BEAM}, timeout=60) as response:
            first = next(response.iter_lines())
            while not steps:  # the search has started
                time.sleep(0.01)
        assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
        deadline, seen = time.monotonic() + 30, -1
        while seen != len(steps) or served.loop.has_unfinished:  # settled: no new step for a while
            assert time.monotonic() < deadline, f"the search went on: {len(steps)} steps"
            seen = len(steps)
            time.sleep(0.3)
        assert_left_nothing(served, engine)
    assert 1 <= len(steps) < 100, steps


REFUSED: list[tuple[str, dict[str, Any], str]] = [  # (route, body fields, the field the 400 names)
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"stream": True, "stop": ["x"]}, "stop"),
    ("completions", {"stop": ["x"]}, "stop"),
    ("completions", {"top_p": 0.5}, "top_p"),
    ("completions", {"seed": 3}, "seed"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"max_tokens": 0, "echo": True}, "max_tokens"),
    ("completions", {"n": 11}, "n"),
    ("completions", {"length_penalty": 11}, "length_penalty"),
    ("completions", {"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
    ("completions", {"max_tokens": 4000}, "max_tokens"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"stream": True, "frequency_penalty": 0.5}, "frequency_penalty"),
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
