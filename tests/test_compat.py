"""Real clients against a real ``fnvllm serve`` (tiny random checkpoint, CPU): the official ``openai`` client for
echo + logprobs (prompt scoring, as evaluation harnesses send it) and logit_bias; LangChain's ``ChatOpenAI``
(invoke, stream, with_structured_output by all three methods, bind_tools with a forced tool) and LiteLLM
(``completion`` with tools and response_format). LangChain and LiteLLM come from the ``compat`` extra: their tests
are skipped, saying so, when the package is missing. Whatever the random model prefers, the grammar mask makes
constrained output follow its schema."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import TINY_SERVER_FLAGS, WEATHER_TOOL, hf_model, write_tool_chat_model

from fnvllm.serve.server_process import ServerProcess

pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
openai = pytest.importorskip("openai", reason="the server tests drive it with the official openai client")
pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the serve extra)")
pydantic = pytest.importorskip("pydantic")

MODEL = "tiny"
ENGINE = TINY_SERVER_FLAGS
WEATHER = WEATHER_TOOL
PROMPT_IDS = [5, 9, 13, 200, 7, 42, 17, 99, 3, 250]


class Place(pydantic.BaseModel):  # type: ignore[misc,name-defined]
    """A place: short lowercase name, a flag and a small count (bounded, so a random model finishes quickly)."""

    city: str = pydantic.Field(pattern="^[a-z]{1,5}$")
    ok: bool
    n: int = pydantic.Field(ge=0, le=99)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tool_chat_model(tmp_path_factory.mktemp("compat"))


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    log = tmp_path_factory.mktemp("compat-log") / "server.log"
    with ServerProcess([str(checkpoint), *ENGINE], log, env=env) as proc:
        yield proc
        assert proc.terminate() == 0, proc.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


# ---- the openai client: echo + logprobs, max_tokens 0, logit_bias ------------------------------------------------


def test_echo_with_logprobs_scores_the_prompt_like_hf(client: Any, checkpoint: Path) -> None:
    """max_tokens 0 with echo and logprobs: the prompt's text, its tokens' logprobs (null first) equal to HF's
    log-softmax, top_logprobs of the asked size (plus the token itself), and no completion tokens."""
    out = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(PROMPT_IDS)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(PROMPT_IDS)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert choice.text == "".join(lp.tokens)
    with torch.no_grad():
        ref = hf_model(checkpoint)(torch.tensor([PROMPT_IDS])).logits[0].double().log_softmax(-1)
    expected = [ref[p - 1, PROMPT_IDS[p]].item() for p in range(1, len(PROMPT_IDS))]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    # the 2 most likely tokens, and the prompt's own token when it is not among them (OpenAI: up to logprobs + 1)
    assert all(len(top) <= 3 and token in top for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True))


def test_echo_with_logprobs_then_generates(client: Any) -> None:
    """echo + logprobs with max_tokens 3: prompt entries first, then the 3 generated tokens' entries."""
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT_IDS,
        max_tokens=3,
        echo=True,
        logprobs=1,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert out.usage.completion_tokens == 3
    assert len(lp.token_logprobs) == len(PROMPT_IDS) + 3
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])


def test_streamed_echo_with_logprobs_equals_the_whole_answer(client: Any) -> None:
    """Streamed echo + logprobs: the chunks' text and logprobs joined equal the non-streamed answer's."""
    args = dict(model=MODEL, prompt=PROMPT_IDS, max_tokens=3, echo=True, logprobs=1, temperature=0)
    whole = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0]
    text, tokens, values = "", [], []
    for chunk in client.completions.create(**args, stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert values[0] is None and values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-6)


def test_logit_bias_forces_a_token(client: Any, checkpoint: Path) -> None:
    """logit_bias {"33": 100} makes every greedy token id 33, in completions and in chat."""
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(checkpoint)).decode([33])
    bias = {"33": 100}
    out = client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=4, temperature=0, logit_bias=bias, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].logprobs.tokens == [text] * 4
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, logit_bias=bias,
        logprobs=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [entry.token for entry in chat.choices[0].logprobs.content] == [text] * 3


def test_min_tokens_holds_back_a_stop_id(client: Any) -> None:
    """vLLM's min_tokens (extra_body): logit_bias forces id 33 and 33 is a stop id, so a plain request stops after
    one token and a min_tokens 3 request after four (33 banned for three); min_tokens above max_tokens is a 400
    naming it."""
    import openai

    args: dict[str, Any] = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0}
    args["logit_bias"] = {"33": 100}
    for min_tokens, expected in ((0, 1), (3, 4)):
        body = {"ignore_eos": True, "stop_token_ids": [33], "min_tokens": min_tokens}
        out = client.completions.create(**args, extra_body=body)
        assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (expected, "stop")
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(**args, extra_body={"min_tokens": 9})


# ---- LangChain ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(server: ServerProcess) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai", reason="LangChain is in the compat extra")
    return langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{server.base_url}/v1", api_key="unused", temperature=0, max_tokens=24,
        max_retries=0, timeout=120,
    )  # fmt: skip


def test_langchain_invoke_and_stream_agree(chat_model: Any) -> None:
    """ChatOpenAI.invoke answers, and .stream's chunks join to the same greedy text."""
    whole = chat_model.invoke("Say something").content
    assert isinstance(whole, str) and whole
    assert "".join(chunk.content for chunk in chat_model.stream("Say something")) == whole


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output_parses(chat_model: Any, method: str) -> None:
    """with_structured_output(Place) by function calling or by json_schema returns a valid Place."""
    structured = chat_model.model_copy(update={"max_tokens": 200}).with_structured_output(Place, method=method)
    place = structured.invoke("Name a place")
    assert isinstance(place, Place)
    assert re.fullmatch("[a-z]{1,5}", place.city) and 0 <= place.n <= 99


def test_langchain_structured_output_json_mode_is_json(chat_model: Any) -> None:
    """with_structured_output(method="json_mode") gets a JSON object (json_mode promises JSON, not the schema)."""
    structured = chat_model.model_copy(update={"max_tokens": 300}).with_structured_output(
        Place, method="json_mode", include_raw=True
    )
    result = structured.invoke("Name a place, as JSON")
    assert isinstance(json.loads(result["raw"].content), dict)


def test_langchain_bind_tools_with_a_forced_tool(chat_model: Any) -> None:
    """bind_tools([get_weather], tool_choice="get_weather").invoke returns one valid call of it."""
    message = (
        chat_model.model_copy(update={"max_tokens": 200})
        .bind_tools([WEATHER], tool_choice="get_weather")
        .invoke("Weather?")
    )
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    arguments = message.tool_calls[0]["args"]
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f")


# ---- LiteLLM ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm(server: ServerProcess) -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list at import
    module = pytest.importorskip("litellm", reason="LiteLLM is in the compat extra")
    module.telemetry = False
    return module


def _litellm(litellm: Any, server: ServerProcess, **kw: Any) -> Any:
    """One litellm.completion against the server (the openai/ provider, our base URL)."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    args = {"model": f"openai/{MODEL}", "api_base": f"{server.base_url}/v1", "api_key": "unused", **kw}
    return litellm.completion(messages=messages, max_tokens=200, temperature=1.0, seed=3, **args)


def test_litellm_completion_with_tools(litellm: Any, server: ServerProcess) -> None:
    """litellm.completion with tools and tool_choice "required" returns a valid get_weather call."""
    out = _litellm(litellm, server, tools=[WEATHER], tool_choice="required")
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f")


def test_litellm_completion_with_response_format(litellm: Any, server: ServerProcess) -> None:
    """litellm.completion with response_format=Place (a json_schema) returns JSON that validates as a Place."""
    out = _litellm(litellm, server, response_format=Place)
    Place.model_validate_json(out.choices[0].message.content)


def test_skip_special_tokens_keeps_their_text_when_false(client: Any) -> None:
    """vLLM's skip_special_tokens (extra_body): a forced "<s>" (id 0, logit_bias +100) is left out of the text by
    default and kept with false, in completions and in chat."""
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "temperature": 0, "logit_bias": {"0": 100}}
    for skip, expected in ((True, ""), (False, "<s>" * 3)):
        body = {"ignore_eos": True, "skip_special_tokens": skip}
        assert client.completions.create(**args, prompt=PROMPT_IDS, extra_body=body).choices[0].text == expected
        chat = client.chat.completions.create(**args, messages=[{"role": "user", "content": "hi"}], extra_body=body)
        assert chat.choices[0].message.content == expected


def test_truncate_prompt_tokens_keeps_the_last_ids(client: Any) -> None:
    """vLLM's truncate_prompt_tokens (extra_body): usage counts the kept prompt tokens and the greedy answer is the
    cut prompt's; a shorter prompt is unchanged; in chat the prompt is cut too; 0 is a 400 naming it."""
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    cut = client.completions.create(**args, prompt=PROMPT_IDS, extra_body={"truncate_prompt_tokens": 3})
    whole = client.completions.create(**args, prompt=PROMPT_IDS[-3:])
    assert (cut.usage.prompt_tokens, cut.choices[0].text) == (3, whole.choices[0].text)
    short = client.completions.create(**args, prompt=PROMPT_IDS[:2], extra_body={"truncate_prompt_tokens": 3})
    assert short.usage.prompt_tokens == 2
    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(**args, messages=messages, extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(**args, prompt=PROMPT_IDS, extra_body={"truncate_prompt_tokens": 0})
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.chat.completions.create(**args, messages=messages, extra_body={"truncate_prompt_tokens": 0})


def test_allowed_token_ids_limits_the_output(client: Any, checkpoint: Path) -> None:
    """vLLM's allowed_token_ids (extra_body): every sampled token is an allowed one (logprobs name them); an id
    outside the vocabulary is a 400 naming allowed_token_ids."""
    from transformers import AutoTokenizer

    texts = {AutoTokenizer.from_pretrained(str(checkpoint)).decode([i]) for i in (40, 41)}
    args: dict[str, Any] = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 1.0, "seed": 1}
    body = {"ignore_eos": True, "allowed_token_ids": [40, 41]}
    out = client.completions.create(**args, logprobs=0, extra_body=body)
    assert len(out.choices[0].logprobs.tokens) == 6 and set(out.choices[0].logprobs.tokens) <= texts
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        client.completions.create(**args, extra_body={"allowed_token_ids": [3, 10**6]})


def test_bad_words_keep_a_forced_token_out(client: Any, checkpoint: Path) -> None:
    """vLLM's bad_words (extra_body): logit_bias +100 forces one token, whose text is a single token of the
    tokenizer; with that text as a bad word it never appears, in completions and in chat (the server resolves the
    word with its tokenizer, as LLM does); an empty word is a 400 naming bad_words."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    forced = next(i for i in range(40, 120) if tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i])
    text = tokenizer.decode([forced])
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 0, "logit_bias": {str(forced): 100}}
    plain = client.completions.create(**args, prompt=PROMPT_IDS, logprobs=0, extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs.tokens == [text] * 4
    body = {"ignore_eos": True, "bad_words": [text]}
    banned = client.completions.create(**args, prompt=PROMPT_IDS, logprobs=0, extra_body=body)
    assert len(banned.choices[0].logprobs.tokens) == 4 and text not in banned.choices[0].logprobs.tokens
    chat = client.chat.completions.create(
        **args, messages=[{"role": "user", "content": "hi"}], logprobs=True, extra_body=body
    )
    assert text not in [entry.token for entry in chat.choices[0].logprobs.content]
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        client.completions.create(**args, prompt=PROMPT_IDS, extra_body={"bad_words": [""]})
