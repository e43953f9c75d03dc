"""Structured outputs, tools and reasoning through the official ``openai`` client against a real ``fnvllm serve``
(tiny random checkpoint: whatever the model prefers, the grammar mask makes the output follow the constraint)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
from tiny_models import TINY_SERVER_FLAGS, WEATHER_TOOL, write_tool_chat_model

from fnvllm.serve.server_process import ServerProcess

pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the serve extra)")

MODEL = "tiny"
ENGINE = [*TINY_SERVER_FLAGS, "--reasoning-parser", "qwen3"]

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "ok", "n"],
    "additionalProperties": False,
}
WEATHER = WEATHER_TOOL
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]},
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    checkpoint = write_tool_chat_model(tmp_path_factory.mktemp("serve-structured"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    log = tmp_path_factory.mktemp("serve-structured-log") / "server.log"
    with ServerProcess([str(checkpoint), *ENGINE], log, env=env) as proc:
        yield proc
        assert proc.terminate() == 0, proc.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def check_schema(value: Any) -> None:
    """Assert that ``value`` satisfies SCHEMA."""
    assert isinstance(value, dict) and set(value) == {"city", "ok", "n"}, value
    assert re.fullmatch("[a-z]{1,5}", value["city"]), value
    assert isinstance(value["ok"], bool) and isinstance(value["n"], int) and 0 <= value["n"] <= 99


def check_weather_call(call: Any) -> None:
    """Assert that ``call`` is a valid get_weather call."""
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f"), arguments
    assert re.fullmatch("[A-Za-z]{1,6}", arguments["city"]), arguments


def chat(client: Any, **kw: Any) -> Any:
    """A chat completion of MESSAGES (sampled at temperature 1, 200 tokens at most)."""
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 1.0, "seed": 5, **kw}
    return client.chat.completions.create(**args)


def test_json_schema_response_parses_and_validates(client: Any) -> None:
    """response_format json_schema (strict): every choice is JSON that satisfies the schema, finished by EOS."""
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    out = chat(client, response_format=fmt, n=3)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        check_schema(json.loads(choice.message.content))


def test_json_object_and_completions_guided_json(client: Any) -> None:
    """response_format json_object gives a JSON object; completions take guided_json in extra_body."""
    out = chat(client, response_format={"type": "json_object"}, max_tokens=300)
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    done = client.completions.create(model=MODEL, prompt="Data:", max_tokens=200, extra_body={"guided_json": SCHEMA})
    check_schema(json.loads(done.choices[0].text))


def test_guided_choice_and_regex(client: Any) -> None:
    """guided_choice returns one of the choices; guided_regex output fullmatches the pattern (chat and stream)."""
    out = chat(client, extra_body={"guided_choice": ["sunny", "rainy", "foggy"]})
    assert out.choices[0].message.content in {"sunny", "rainy", "foggy"}
    pattern = r"[A-Z][a-z]{2,5} [0-9]{2}"
    out = chat(client, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, out.choices[0].message.content)
    stream = chat(client, extra_body={"guided_regex": pattern}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(pattern, text)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
         "response_format"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= "}}, "guided_grammar"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        ({"extra_body": {"guided_regex": "a+", "guided_choice": ["a"]}}, "guided_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(client: Any, extra: dict[str, Any], field: str) -> None:
    """A bad schema, regex, grammar, choice list, two constraints or a bad tool_choice: 400 naming the field."""
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, **extra)
    assert caught.value.body["param"] == field, caught.value.body


def test_named_tool_choice_returns_a_valid_call(client: Any) -> None:
    """tool_choice naming a function: the message holds one valid call of it and finishes with "tool_calls"."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(client, tools=[WEATHER, TIME], tool_choice=choice)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert len(message.tool_calls) == 1 and not message.content
    check_weather_call(message.tool_calls[0])


def test_tools_are_rendered_by_the_template(client: Any) -> None:
    """The chat template sees the tools (the prompt grows by them); tool_choice "none" leaves them out."""
    plain = chat(client, max_tokens=1).usage.prompt_tokens
    with_tools = chat(client, max_tokens=1, tools=[WEATHER]).usage.prompt_tokens
    none = chat(client, max_tokens=1, tools=[WEATHER], tool_choice="none").usage.prompt_tokens
    assert with_tools > plain == none


def test_required_tool_call_streams_and_round_trips(client: Any) -> None:
    """tool_choice "required" streamed: the call arrives as a tool_calls delta; sending it back with a tool message
    is accepted."""
    stream = chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, stream=True)
    calls, reasons = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        calls.extend(delta.tool_calls or [])
        reasons.append(chunk.choices[0].finish_reason)
    assert len(calls) == 1 and reasons[-1] == "tool_calls"
    check_weather_call(calls[0])
    call = {"id": calls[0].id, "type": "function", "function": calls[0].function.model_dump()}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]
    history.append({"role": "tool", "tool_call_id": calls[0].id, "content": '{"temp": 21}'})
    out = chat(client, messages=history, tools=[WEATHER], max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_reasoning_is_split_whole_and_streamed(client: Any) -> None:
    """With --reasoning-parser qwen3, <think>...</think> goes to reasoning_content, the rest to content."""
    pattern = "<think>\nabc\n</think>\n\nxyz"
    out = chat(client, extra_body={"guided_regex": re.escape(pattern)})
    message = out.choices[0].message
    assert (message.reasoning_content, message.content) == ("abc", "xyz")
    reasoning, content = "", ""
    for chunk in chat(client, extra_body={"guided_regex": re.escape(pattern)}, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == ("abc", "xyz")
    off = chat(client, extra_body={"guided_regex": re.escape(pattern), "include_reasoning": False})
    assert (
        off.choices[0].message.content == "xyz" and getattr(off.choices[0].message, "reasoning_content", None) is None
    )


def test_openai_parse_with_a_pydantic_model(client: Any) -> None:
    """The client's ``chat.completions.parse(response_format=Model)`` (a strict json_schema) returns a parsed
    instance."""
    from typing import Literal

    from pydantic import BaseModel

    class Place(BaseModel):
        city: Literal["Paris", "Oslo", "Rome"]
        sunny: bool

    out = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Place, max_tokens=200)
    assert isinstance(out.choices[0].message.parsed, Place)
