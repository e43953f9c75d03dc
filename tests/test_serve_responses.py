"""``POST /v1/responses`` on a real in-process server, driven by the official openai client: the text of a string
input, a message list and instructions is /v1/chat/completions' for the same messages (greedy), usage included;
max_output_tokens cuts it to an "incomplete" response; streamed, the events come in the documented order, numbered,
and their deltas add up to the plain answer (``client.responses.stream`` too); a forced function tool yields a
function_call item whose arguments parse, and the conversation sent back with its output renders as chat's; a
json_schema format parses; the API key, body limit, metrics, unknown and unsupported fields, and what the chat
path refuses are as on the other routes, the errors naming the Responses field; the output items and events of a
reasoning, tool-calling output, and a stream the engine fails or aborts; a client leaving a stream aborts it."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("uvicorn", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
openai = pytest.importorskip("openai", reason="the server tests drive it with the official openai client")
httpx = pytest.importorskip("httpx", reason="installed with openai")
pytest.importorskip("xgrammar", reason="forced tool calls and json_schema need xgrammar")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_serve_health_metrics import ENGINE, serving  # noqa: E402
from tiny_models import WEATHER_TOOL, write_tool_chat_model  # noqa: E402

from fnvllm.llm import LLM  # noqa: E402
from fnvllm.serve import AsyncEngine, build_app  # noqa: E402
from fnvllm.serve.limits import DEFAULT_MAX_REQUEST_BYTES  # noqa: E402
from fnvllm.serve.response_items import OutputWriter, stream_events  # noqa: E402
from fnvllm.serve.responses import ResponseShell, ResponsesRequest  # noqa: E402
from fnvllm.serve.stream import EngineFailure, RequestStream, TokenEvent  # noqa: E402
from fnvllm.serve.tool_parsers import REASONING_PARSERS, ChatOutputParser, HermesToolParser  # noqa: E402

MODEL = "tiny"
KEY = "sk-test"
QUESTION = "What is the weather in Paris?"
WEATHER = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses shape: name etc. at the top level
FORCED = {"type": "function", "name": "get_weather"}
SCHEMA = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"}},
    "required": ["unit", "ok"],
    "additionalProperties": False,
}
TEXT_EVENTS = re.compile(
    r"response\.created response\.in_progress response\.output_item\.added response\.content_part\.added"
    r"( response\.output_text\.delta)+ response\.output_text\.done response\.content_part\.done"
    r" response\.output_item\.done response\.(completed|incomplete)"
)
CALL_EVENTS = (
    "response.created response.in_progress response.output_item.added response.function_call_arguments.delta"
    " response.function_call_arguments.done response.output_item.done response.completed"
)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real server of the tiny tool-calling chat model, with an API key."""
    llm = LLM(write_tool_chat_model(tmp_path_factory.mktemp("serve-responses")), **ENGINE)
    try:
        with serving(build_app(AsyncEngine(llm.loop, llm.tokenizer), MODEL, api_key=KEY)) as address:
            yield address
    finally:
        llm.loop.on_step = None


@pytest.fixture(scope="module")
def client(url: str) -> Any:
    """The openai client of the server."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(client: Any, messages: list[dict[str, Any]], max_tokens: int, **kw: Any) -> Any:
    """The independent path: /v1/chat/completions, greedy."""
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def respond(client: Any, input: Any, max_output_tokens: int, **kw: Any) -> Any:
    """/v1/responses, greedy."""
    return client.responses.create(model=MODEL, input=input, max_output_tokens=max_output_tokens, temperature=0, **kw)


def assert_same_as_chat(response: Any, answer: Any) -> None:
    """A response holds a chat answer's text as one message, its usage, and the status of its finish reason."""
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.output_text == answer.choices[0].message.content
    (item,) = response.output
    assert (item.type, item.role, [c.type for c in item.content]) == ("message", "assistant", ["output_text"])
    assert response.usage.input_tokens == answer.usage.prompt_tokens
    assert response.usage.output_tokens == answer.usage.completion_tokens
    assert response.usage.total_tokens == answer.usage.total_tokens
    cut = answer.choices[0].finish_reason == "length"
    assert response.status == item.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details.reason if cut else response.incomplete_details) == (
        "max_output_tokens" if cut else None
    )


def test_a_string_input_is_one_user_message(client: Any) -> None:
    """A string input answers chat's greedy text for one user message, with its usage."""
    response = respond(client, QUESTION, 12)
    assert_same_as_chat(response, chat(client, [{"role": "user", "content": QUESTION}], 12))


def test_a_message_list_with_instructions_is_the_chat_conversation(client: Any) -> None:
    """Message items (text parts, an assistant turn sent back) and instructions (a system message first) answer
    chat's text for the same conversation; without instructions the prompt is shorter."""
    conversation = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": " there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {"role": "user", "content": QUESTION},
    ]  # fmt: skip
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": QUESTION},
    ]
    response = respond(client, conversation, 10, instructions="Answer briefly.")
    assert_same_as_chat(response, chat(client, messages, 10))
    assert respond(client, conversation, 1).usage.input_tokens < response.usage.input_tokens


def test_max_output_tokens_cuts_an_incomplete_response(client: Any) -> None:
    """max_output_tokens stops the output there: status incomplete, reason max_output_tokens, that many tokens."""
    answer = chat(client, [{"role": "user", "content": QUESTION}], 3)
    assert answer.choices[0].finish_reason == "length"  # the tiny model does not stop by itself within 3 tokens
    response = respond(client, QUESTION, 3)
    assert_same_as_chat(response, answer)
    assert response.usage.output_tokens == 3


def test_streamed_text_events_are_ordered_and_add_up(client: Any) -> None:
    """Streamed: created, in_progress, the message's added events, its deltas, its done events, then incomplete
    (the limit cut it), numbered 0, 1, ...; the deltas join to the plain answer's text, the last event holds the
    plain answer's items and usage."""
    plain = respond(client, QUESTION, 12)
    events = list(respond(client, QUESTION, 12, stream=True))
    types = " ".join(e.type for e in events)
    assert TEXT_EVENTS.fullmatch(types), types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == plain.output_text and all(deltas)
    done = {e.type: e for e in events}
    assert done["response.output_text.done"].text == plain.output_text
    item = done["response.output_item.done"].item
    assert item.id == done["response.output_item.added"].item.id == events[3].item_id
    final = events[-1].response
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"
    assert (final.status, final.output_text, final.usage.output_tokens) == (
        plain.status, plain.output_text, plain.usage.output_tokens
    )  # fmt: skip
    assert events[-1].type == f"response.{plain.status}"


def test_json_schema_format_parses_whole_and_streamed(client: Any) -> None:
    """text.format json_schema: the text is JSON of the schema and the response completes; the client's
    ``responses.stream`` helper gets the same final response; json_object constrains the text to an object."""
    text = {"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}}
    response = respond(client, QUESTION, 60, text=text)
    value = json.loads(response.output_text)
    assert response.status == "completed" and value["unit"] in ("c", "f") and isinstance(value["ok"], bool)
    assert set(value) == {"unit", "ok"}
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=60, temperature=0, text=text) as s:
        final = s.get_final_response()
    assert (final.status, final.output_text) == ("completed", response.output_text)
    json_object = respond(client, QUESTION, 8, text={"format": {"type": "json_object"}}).output_text
    assert json_object.startswith("{")  # constrained to an object (8 tokens of a random model do not close it)


def check_weather_call(item: Any) -> dict[str, Any]:
    """A completed get_weather call whose arguments parse and satisfy the tool's schema; returns them."""
    assert (item.type, item.name, item.status) == ("function_call", "get_weather", "completed")
    assert item.call_id and item.id and item.id != item.call_id
    arguments = json.loads(item.arguments)
    assert re.fullmatch("[A-Za-z]{1,6}", arguments["city"]) and arguments["unit"] in ("c", "f")
    return arguments


def test_a_forced_function_tool_call_and_its_round_trip(client: Any) -> None:
    """tool_choice naming a function: one function_call item whose arguments parse; the conversation sent back
    with it and a function_call_output renders as chat's (same prompt tokens, same greedy text)."""
    response = respond(client, QUESTION, 160, tools=[WEATHER], tool_choice=FORCED, parallel_tool_calls=False)
    (item,) = response.output
    check_weather_call(item)
    assert response.status == "completed" and response.output_text == ""
    follow_up = [
        {"role": "user", "content": QUESTION},
        *[o.model_dump(exclude_none=True) for o in response.output],
        {"type": "function_call_output", "call_id": item.call_id, "output": '{"temp": 21}'},
    ]
    again = respond(client, follow_up, 6, tools=[WEATHER])
    call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": item.call_id, "content": '{"temp": 21}'},
    ]
    answer = chat(client, messages, 6, tools=[WEATHER_TOOL])
    assert again.usage.input_tokens == answer.usage.prompt_tokens
    assert again.output_text == (answer.choices[0].message.content or "")


def test_a_streamed_call_has_its_argument_events(client: Any) -> None:
    """Streamed, a forced call is an added item, its arguments delta and done, the item done, then completed; the
    arguments delta is the whole, parsing arguments."""
    kw = {"tools": [WEATHER], "tool_choice": FORCED, "parallel_tool_calls": False, "stream": True}
    events = list(respond(client, QUESTION, 160, **kw))
    assert " ".join(e.type for e in events) == CALL_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    arguments = check_weather_call(events[5].item)
    assert json.loads(events[3].delta) == json.loads(events[4].arguments) == arguments
    assert events[-1].response.output[0].call_id == events[5].item.call_id


def post(url: str, body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
    """A raw POST /v1/responses."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/responses", json=body, headers=headers, timeout=60)


BAD = [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"seed": 1}, "seed"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": "hi", "color": 1}]}, "input.0.color"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input.0.call_id"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 7}}}}, "text.format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"temperature": -1}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x " * 3000}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"max_output_tokens": 2.5}, "max_output_tokens"),
    ({"instructions": 3}, "instructions"),
    ({"tools": [{"type": "function", "description": "no name"}]}, "tools.0.name"),
]


@pytest.mark.parametrize(("extra", "field"), BAD)
def test_unsupported_and_bad_fields_are_400s_naming_them(url: str, extra: dict[str, Any], field: str) -> None:
    """Stored-response fields, unknown fields, unsupported item, part and tool types, and what the chat path
    refuses (a bad schema, an unknown forced tool, a range, a conversation too long): 400 naming the field."""
    answer = post(url, {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, **extra})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert error["message"].startswith(field), error


def test_store_false_metadata_and_user_are_accepted_and_echoed(url: str) -> None:
    """store false, metadata and user change nothing: accepted, and echoed in the response."""
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 2, "store": False, "metadata": {"k": "v"}}
    answer = post(url, {**body, "user": "u1"})
    assert answer.status_code == 200, answer.text
    assert (answer.json()["metadata"], answer.json()["user"], answer.json()["store"]) == ({"k": "v"}, "u1", False)


def test_the_api_key_and_the_model_name_are_checked(url: str) -> None:
    """Without the key: 401; an unknown model: 404 model_not_found, as on the other /v1 routes."""
    assert post(url, {"input": QUESTION}, key=None).status_code == 401
    assert post(url, {"input": QUESTION}, key="wrong").status_code == 401
    missing = post(url, {"model": "other", "input": QUESTION})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


# ---- the output items and events without a server: hand-written outputs of a reasoning, tool-calling model ----

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OUTPUT = "<think>\nweigh it\n</think>\n\nLet me check.\n" + CALL + " Done."


def writer(record_events: bool) -> OutputWriter:
    """An output writer parsing hermes calls and qwen3 reasoning, with numbered ids."""
    ids = iter(range(100))
    parser = ChatOutputParser(HermesToolParser(), REASONING_PARSERS["qwen3"])
    return OutputWriter(parser, lambda prefix: f"{prefix}_{next(ids)}", record_events)


def summary(items: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(type, text or name + arguments, status) of each item."""
    return [
        (i["type"], i["content"][0]["text"] if "content" in i else f"{i['name']} {i['arguments']}", i["status"])
        for i in items
    ]


def test_the_whole_output_is_grouped_as_chat_groups_it() -> None:
    """Unstreamed: the reasoning, then the text (around the call, as chat's message content), then the call."""
    out = writer(record_events=False)
    out.add(OUTPUT)
    out.finish("completed")
    assert summary(out.items) == [
        ("reasoning", "weigh it", "completed"),
        ("message", "Let me check.\n Done.", "completed"),
        ("function_call", 'get_weather {"city": "Paris"}', "completed"),
    ]
    assert out.take_events() == [] and out.items[0]["id"] == "rs_0" and out.items[2]["call_id"].startswith("call_")


def test_streamed_items_come_in_generation_order_with_paired_events() -> None:
    """Fed a character at a time: items in generation order (the text after the call is a message of its own),
    each opened by output_item.added and closed by output_item.done holding its final state; the text deltas of
    each item join to its text."""
    out = writer(record_events=True)
    events = []
    for character in OUTPUT:
        out.add(character)
        events += out.take_events()
    out.finish("incomplete")
    events += out.take_events()
    assert summary(out.items) == [
        ("reasoning", "weigh it", "completed"),
        ("message", "Let me check.\n", "completed"),
        ("function_call", 'get_weather {"city": "Paris"}', "completed"),
        ("message", " Done.", "incomplete"),
    ]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert added == [e["output_index"] for e in done] == [0, 1, 2, 3]
    assert [e["item"] for e in done] == out.items
    for index, kind in [(0, "response.reasoning_text.delta"), (1, "response.output_text.delta")]:
        deltas = [e["delta"] for e in events if e["type"] == kind and e["output_index"] == index]
        assert "".join(deltas) == out.items[index]["content"][0]["text"]
    opened = [e["type"] for e in events if e.get("output_index") == 2]
    assert opened == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]  # fmt: skip


def streamed(items: list[TokenEvent | EngineFailure]) -> list[dict[str, Any]]:
    """The events ``stream_events`` sends for a request whose engine stream delivers ``items``."""

    async def run() -> list[str]:
        stream = RequestStream("resp_1", (1, 2), asyncio.get_running_loop())
        for item in items:
            stream.push(item)
        shell = ResponseShell("resp_1", MODEL, ResponsesRequest(input="hi"), 2)
        return [e async for e in stream_events(shell, writer(record_events=True), stream, 0.0)]

    return [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(run())]


def test_an_engine_failure_or_an_abort_ends_the_stream_failed() -> None:
    """An engine failure or an abort (shutdown) mid-stream: the open item ends "incomplete" (its done events are
    sent), then response.failed with a server_error and the items so far; an ending by the limit is
    response.incomplete with the usage."""
    first = TokenEvent("Hi", (5, 6), (), None)
    for last in [EngineFailure("the engine died"), TokenEvent("", (), (), "abort")]:
        events = streamed([first, last])
        final = events[-1]
        assert final["type"] == "response.failed" and final["response"]["status"] == "failed"
        assert final["response"]["error"]["code"] == "server_error"
        assert final["response"]["output"][0]["content"][0]["text"] == "Hi"
        assert final["response"]["output"][0]["status"] == events[-2]["item"]["status"] == "incomplete"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = streamed([first, TokenEvent("!", (7,), (), "length")])[-1]
    assert final["type"] == "response.incomplete" and final["response"]["output"][0]["content"][0]["text"] == "Hi!"
    assert final["response"]["usage"]["output_tokens"] == 3 and final["response"]["usage"]["total_tokens"] == 5


def counters(url: str) -> dict[str, float]:
    """The /metrics counters and histogram sums and counts, by sample name (and finish reason)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[s.name + (f"[{s.labels['finish_reason']}]" if "finish_reason" in s.labels else "")] = s.value
    return found


def test_metrics_count_it_and_large_bodies_are_refused(url: str) -> None:
    """A response is counted in /metrics as any request (one finished by length, its tokens); a body over
    --max-request-bytes is a 413 before it is read."""
    before = counters(url)
    assert post(url, {"model": MODEL, "input": QUESTION, "max_output_tokens": 3}).status_code == 200
    after = counters(url)
    assert (
        after["fnvllm_requests_finished_total[length]"] == before.get("fnvllm_requests_finished_total[length]", 0) + 1
    )
    assert after["fnvllm_request_generation_tokens_sum"] == before["fnvllm_request_generation_tokens_sum"] + 3
    big = post(url, {"model": MODEL, "input": "x" * (DEFAULT_MAX_REQUEST_BYTES + 1)})
    assert big.status_code == 413, big.text


def test_a_client_that_leaves_the_stream_aborts_the_request(client: Any, url: str) -> None:
    """Closing a stream after its first delta aborts the engine request (counted as finished by "abort")."""
    aborted = "fnvllm_requests_finished_total[abort]"
    before = counters(url).get(aborted, 0)
    stream = respond(client, QUESTION, 1000, stream=True)
    next(e for e in stream if e.type == "response.output_text.delta")
    stream.close()
    for _ in range(300):
        if counters(url).get(aborted, 0) == before + 1:
            break
        time.sleep(0.1)
    assert counters(url).get(aborted, 0) == before + 1
