"""vLLM's utility routes on a real in-process HTTP server: ``/tokenize`` gives the tokenizer's own ids for a prompt
and, for a conversation, exactly the ids /v1/chat/completions sends to the engine (recorded at ``submit_many``);
``/detokenize`` inverts it and refuses ids outside the vocabulary; unknown models, fields and values are OpenAI
errors naming them; ``/ping`` and ``/version`` need no API key, and ``/ping`` is 503 once the engine stopped."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from importlib import metadata
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("uvicorn", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
openai = pytest.importorskip("openai", reason="the server tests drive it with the official openai client")
httpx = pytest.importorskip("httpx", reason="installed with openai")

from test_serve_health_metrics import ENGINE, serving  # noqa: E402
from tiny_models import WEATHER_TOOL, write_tool_chat_model  # noqa: E402

from fnvllm.llm import LLM  # noqa: E402
from fnvllm.serve import AsyncEngine, build_app  # noqa: E402
from fnvllm.serve.async_engine import Submission  # noqa: E402
from fnvllm.serve.stream import RequestStream  # noqa: E402

MODEL = "tiny"
ALIAS = "tiny-alias"
API_KEY = "sk-tokenize"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXT = "The quick brown fox: 12345 words, words!"
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """The tiny model with the Hermes-style template (it renders tools)."""
    return LLM(write_tool_chat_model(tmp_path_factory.mktemp("serve-tokenize")), **ENGINE)


@pytest.fixture
def engine(llm: LLM) -> Iterator[AsyncEngine]:
    """A fresh engine front on the shared model."""
    yield AsyncEngine(llm.loop, llm.tokenizer)
    llm.loop.on_step = None


@pytest.fixture
def url(engine: AsyncEngine) -> Iterator[str]:
    """A server of ``engine`` as MODEL (and ALIAS) that needs API_KEY."""
    with serving(build_app(engine, MODEL, api_key=API_KEY, model_aliases=[ALIAS])) as address:
        yield address


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    """POST ``body`` with the key; returns the response."""
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60)


def tokens(url: str, body: dict[str, Any]) -> list[int]:
    """The ids /tokenize answers for ``body`` (checking the response's other fields)."""
    response = post(url, "/tokenize", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["count"] == len(answer["tokens"]) and answer["token_strs"] is None
    return list(answer["tokens"])


def record_submissions(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> list[Submission]:
    """Every Submission the handlers hand the engine from now on (they still run)."""
    sent: list[Submission] = []
    submit_many = engine.submit_many

    def recording(
        submissions: Sequence[Submission], aloop: asyncio.AbstractEventLoop | None = None
    ) -> list[RequestStream]:
        sent.extend(submissions)
        return submit_many(submissions, aloop)

    monkeypatch.setattr(engine, "submit_many", recording)
    return sent


def error(response: Any, status: int) -> dict[str, Any]:
    """The OpenAI error body of ``response``, which must have ``status``."""
    assert response.status_code == status, response.text
    return dict(response.json()["error"])


def test_prompt_tokenize_is_the_tokenizers_encode(url: str, llm: LLM) -> None:
    """A prompt's ids are the tokenizer's encode with special tokens (the default) or without; token_strs are its
    pieces; count and max_model_len come with them."""
    tokenizer = llm.tokenizer
    with_specials = tokens(url, {"prompt": TEXT})
    assert with_specials == tokenizer.encode(TEXT) and with_specials[0] == tokenizer.bos_token_id
    plain = tokens(url, {"model": MODEL, "prompt": TEXT, "add_special_tokens": False})
    assert plain == tokenizer.encode(TEXT, add_special_tokens=False) != with_specials
    answer = post(url, "/tokenize", {"model": ALIAS, "prompt": TEXT, "return_token_strs": True}).json()
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(with_specials)
    models = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=30).json()
    assert answer["max_model_len"] == models["data"][0]["max_model_len"] and answer["count"] == len(with_specials)


def test_prompt_tokenize_equals_what_completions_submit(
    url: str, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ids /v1/completions hands the engine for a text prompt are /tokenize's (special tokens on)."""
    sent = record_submissions(engine, monkeypatch)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    usage = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1).usage
    assert [list(s.prompt_ids) for s in sent] == [tokens(url, {"prompt": TEXT})]
    assert usage.prompt_tokens == len(sent[0].prompt_ids)


CONTINUED = [*MESSAGES, {"role": "assistant", "content": "It is"}]
CLOSED = {"chat_template_kwargs": {"add_generation_prompt": False}}
CHAT_CASES = [  # /tokenize's fields, /v1/chat/completions' fields, the conversation
    ({}, {}, MESSAGES),
    ({"tools": [WEATHER_TOOL]}, {"tools": [WEATHER_TOOL]}, MESSAGES),
    ({"add_generation_prompt": False}, CLOSED, MESSAGES),
    ({"continue_final_message": True}, {"chat_template_kwargs": {"continue_final_message": True}}, CONTINUED),
    (CLOSED, CLOSED, MESSAGES),
]  # fmt: skip


@pytest.mark.parametrize(("tokenize_fields", "chat_fields", "messages"), CHAT_CASES)
def test_chat_tokenize_equals_the_ids_chat_completions_submit(
    url: str,
    engine: AsyncEngine,
    monkeypatch: pytest.MonkeyPatch,
    tokenize_fields: dict[str, Any],
    chat_fields: dict[str, Any],
    messages: list[dict[str, str]],
) -> None:
    """For the same conversation (with tools, a closed or continued last turn), /tokenize's ids are the prompt ids
    /v1/chat/completions hands the engine, and its usage.prompt_tokens is their count."""
    sent = record_submissions(engine, monkeypatch)
    chat = post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1, **chat_fields})
    assert chat.status_code == 200, chat.text
    ids = tokens(url, {"model": MODEL, "messages": messages, **tokenize_fields})
    assert [list(s.prompt_ids) for s in sent] == [ids]
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)


def test_chat_tokenize_renders_the_template(url: str, llm: LLM) -> None:
    """The conversation's ids decode to the template's text: the assistant's turn opened by default, not with
    add_generation_prompt false, the last one left open with continue_final_message; tools add their system turn."""
    text = "<s>system\nAnswer briefly.</s><s>user\nWhat is the weather in Paris?</s>"
    closed = tokens(url, {"messages": MESSAGES, "add_generation_prompt": False})
    assert llm.tokenizer.decode(closed) == text
    assert llm.tokenizer.decode(tokens(url, {"messages": MESSAGES})) == text + "<s>assistant\n"
    continued = tokens(url, {"messages": CONTINUED, "continue_final_message": True})
    assert llm.tokenizer.decode(continued) == text + "<s>assistant\nIt is"
    with_tools = llm.tokenizer.decode(tokens(url, {"messages": MESSAGES, "tools": [WEATHER_TOOL]}))
    assert with_tools.startswith("<s>system\n# Tools") and with_tools.endswith(text + "<s>assistant\n")
    assert '"name": "get_weather"' in with_tools


def test_chat_tokenize_with_special_tokens_adds_the_tokenizers_own(url: str, llm: LLM) -> None:
    """add_special_tokens true with messages: the rendered text encoded with the tokenizer's own special tokens
    (what the prompt form gives for that text), unlike the default."""
    plain = tokens(url, {"messages": MESSAGES})
    with_specials = tokens(url, {"messages": MESSAGES, "add_special_tokens": True})
    text = llm.tokenizer.decode(plain)
    assert with_specials == tokens(url, {"prompt": text}) == llm.tokenizer.encode(text, add_special_tokens=True)
    assert with_specials != plain


@pytest.mark.parametrize("text", [TEXT, "", "héllo wörld ✓ 🙂", "  two  spaces\nand a line"])
def test_detokenize_inverts_tokenize(url: str, llm: LLM, text: str) -> None:
    """detokenize(tokenize(text)) is the text without special tokens, and the tokenizer's decode with them."""
    plain = tokens(url, {"prompt": text, "add_special_tokens": False})
    assert post(url, "/detokenize", {"tokens": plain}).json() == {"prompt": text}
    with_specials = tokens(url, {"prompt": text})
    answer = post(url, "/detokenize", {"model": ALIAS, "tokens": with_specials}).json()
    assert answer == {"prompt": llm.tokenizer.decode(with_specials)} and answer["prompt"].startswith("<s>")


@pytest.mark.parametrize("bad", [-1, 256, 2**70])
def test_detokenize_refuses_ids_outside_the_vocabulary(url: str, bad: int) -> None:
    """An id outside [0, vocab_size) is a 400 naming its position."""
    refused = error(post(url, "/detokenize", {"tokens": [5, 6, bad]}), 400)
    assert refused["param"] == "tokens.2" and "[0, 256)" in refused["message"], refused


BAD_BODIES = [
    ("/tokenize", {"prompt": TEXT, "temperature": 0.5}, "temperature"),
    ("/tokenize", {"messages": MESSAGES, "max_tokens": 3}, "max_tokens"),
    ("/tokenize", {"prompt": TEXT, "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens.1"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
    ("/detokenize", {"prompt": TEXT}, "tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "field"), BAD_BODIES)
def test_bad_bodies_are_400s_naming_the_field(url: str, path: str, body: dict[str, Any], field: str) -> None:
    """An unknown field, a wrong type or a refused value is a 400 whose param and message name the field."""
    refused = error(post(url, path, body), 400)
    assert refused["param"] == field and field in refused["message"], refused
    assert refused["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body"), [("/tokenize", {"prompt": TEXT}), ("/tokenize", {"messages": MESSAGES}),
                                            ("/detokenize", {"tokens": [1, 2]})])  # fmt: skip
def test_an_unknown_model_is_a_404(url: str, path: str, body: dict[str, Any]) -> None:
    """A model name the server does not serve is /v1/models/{id}'s 404 model_not_found."""
    missing = error(post(url, path, {"model": "gpt-4", **body}), 404)
    assert missing["code"] == "model_not_found" and missing["param"] == "model" and "gpt-4" in missing["message"]


def test_tokenize_needs_the_key_but_ping_and_version_do_not(url: str) -> None:
    """Without the key /tokenize and /detokenize are 401s; GET and POST /ping and GET /version are 200s."""
    for path, body in (("/tokenize", {"prompt": TEXT}), ("/detokenize", {"tokens": [1]})):
        refused = error(httpx.post(f"{url}{path}", json=body, timeout=30), 401)
        assert refused["type"] == "authentication_error"
    assert httpx.get(f"{url}/ping", timeout=30).json() == {"status": "ok"}
    assert httpx.post(f"{url}/ping", timeout=30).json() == {"status": "ok"}
    version = httpx.get(f"{url}/version", timeout=30)
    assert version.status_code == 200 and version.json() == {"version": metadata.version("fnvllm")}


def test_ping_is_503_once_the_engine_stopped(url: str, engine: AsyncEngine) -> None:
    """/ping answers as /health: 200 while the engine runs, 503 naming the reason once it stopped."""
    assert httpx.get(f"{url}/ping", timeout=30).status_code == 200
    engine.stop()
    for method in ("GET", "POST"):
        stopped = httpx.request(method, f"{url}/ping", timeout=30)
        assert stopped.status_code == 503 and stopped.json()["status"] == "engine stopped", stopped.text


def test_without_a_tokenizer_both_are_400s(llm: LLM) -> None:
    """A server without a tokenizer refuses /tokenize and /detokenize with a 400 naming the field."""
    with serving(build_app(AsyncEngine(llm.loop, None), MODEL)) as address:
        for path, body, field in (("/tokenize", {"prompt": TEXT}, "prompt"), ("/detokenize", {"tokens": [1]}, "tokens"),
                                  ("/tokenize", {"messages": MESSAGES}, "messages")):  # fmt: skip
            refused = error(httpx.post(f"{address}{path}", json=body, timeout=30), 400)
            assert refused["param"] == field and "tokenizer" in refused["message"], refused
