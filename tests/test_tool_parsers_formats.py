"""The tool-call formats beyond hermes, "llama3_json" and "mistral": whole parses, streaming cut anywhere equal to
the whole parse, malformed and cut-short calls, the grammar that forces each format, the request threading the
server's parser into that grammar, and a real ``fnvllm serve`` started with each parser."""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pydantic", reason="tool parsing needs pydantic (the [serve] extra)")

from test_tools import QWEN3, TOOLS

from fnvllm.serve.formats import Choice
from fnvllm.serve.tool_parsers import (
    ChatOutputParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedChatFormat,
    ToolCallParser,
)

Parser = type[ToolCallParser]

LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_OUTPUTS = [
    "plain answer",
    LLAMA_CALL,
    "<|python_tag|>" + LLAMA_CALL,
    LLAMA_CALL + "; " + LLAMA_CALL.replace("Paris", "Oslo"),
    "<|python_tag|>" + LLAMA_CALL + ";\n<|python_tag|>" + LLAMA_CALL.replace("parameters", "arguments"),
    "\n  " + LLAMA_CALL + "\n",
    "<think>\nneed a tool\n</think>\n\n" + LLAMA_CALL,
    "Sure, " + LLAMA_CALL,  # a "{" inside prose is content
    "Sure. <|python_tag|>" + LLAMA_CALL + " done",
    '{"city": "Paris"} is not a call',  # no name: content
    '{"name": "Bob", "age": 3}',  # no parameters: content
    '{"name": "get_weather", "parameters": {"city": "Pa',  # never closed: stays content
    LLAMA_CALL + '; {"name": "get_w',  # a second call cut by max_tokens: dropped
    "{not json at all}",
    "<|python_tag|>brave_search.call(query='x')",
    "a < b and <|python but not a tag",
    "{}",
    "   ",
]
MISTRAL_CALLS = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
MISTRAL_OUTPUTS = [
    "plain answer",
    "[TOOL_CALLS]" + MISTRAL_CALLS,
    "Let me check. [TOOL_CALLS] " + MISTRAL_CALLS,
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]\n',
    '[TOOL_CALLS]{"name": "get_time", "arguments": {}} and then',  # a lone object counts as a list of one
    "<think>\nhm\n</think>\n\n[TOOL_CALLS]" + MISTRAL_CALLS,
    "[TOOL_CALLS]not json",
    '[TOOL_CALLS][{"name": 1, "arguments": {}}] tail',  # closed, not a call: content
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci',  # never closed: content
    "[TOOL_CALLS][]",
    "[TOOL without the rest and [TOOL_CALL",
    "[TOOL_CALLS]" + MISTRAL_CALLS + "[TOOL_CALLS][{",  # a second block cut short after calls: dropped
]
CASES = [(Llama3JsonToolParser, text) for text in LLAMA_OUTPUTS] + [(MistralToolParser, t) for t in MISTRAL_OUTPUTS]


def streamed(parser: ChatOutputParser, text: str, cuts: list[int]) -> dict[str, Any]:
    """The deltas of ``text`` fed to ``parser`` in pieces cut at ``cuts``, joined."""
    joined: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for delta in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        for key, value in delta.items():
            joined[key] = joined[key] + value
    return joined


def named_arguments(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(name, arguments text) of each call of a message or a joined stream."""
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_llama3_json_whole_output_is_split_into_content_and_calls() -> None:
    """A llama3_json call (with or without <|python_tag|>, "parameters" or "arguments") is one call with JSON
    arguments and a fresh id; the message has no content."""
    for text in [LLAMA_CALL, "<|python_tag|>" + LLAMA_CALL, LLAMA_CALL.replace("parameters", "arguments")]:
        message = ChatOutputParser(Llama3JsonToolParser(), None).parse(text)
        assert message["content"] is None
        [call] = message["tool_calls"]
        assert call["type"] == "function" and re.fullmatch("call_[0-9a-f]{24}", call["id"])
        assert named_arguments([call]) == [("get_weather", '{"city": "Paris"}')]


def test_llama3_json_several_calls_separated_by_semicolons() -> None:
    """Calls separated by ";" (and blanks, and repeated tags) are each a call, in order, with distinct ids."""
    text = "<|python_tag|>" + LLAMA_CALL + " ;\n" + LLAMA_CALL.replace("Paris", "Oslo") + '; {"name": "get_time", '
    text += '"parameters": {}}'
    message = ChatOutputParser(Llama3JsonToolParser(), None).parse(text)
    assert message["content"] is None
    assert named_arguments(message["tool_calls"]) == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_weather", '{"city": "Oslo"}'),
        ("get_time", "{}"),
    ]
    assert len({c["id"] for c in message["tool_calls"]}) == 3


def test_mistral_whole_output_is_split_into_content_and_calls() -> None:
    """The text before [TOOL_CALLS] is content; each list item is a call whose id is 9 letters and digits (what
    Mistral's templates require when the calls are sent back)."""
    message = ChatOutputParser(MistralToolParser(), None).parse("Let me check. [TOOL_CALLS] " + MISTRAL_CALLS)
    assert message["content"] == "Let me check. "
    calls = message["tool_calls"]
    assert named_arguments(calls) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert all(re.fullmatch("[A-Za-z0-9]{9}", c["id"]) for c in calls) and len({c["id"] for c in calls}) == 2
    only = ChatOutputParser(MistralToolParser(), None).parse("[TOOL_CALLS]" + MISTRAL_CALLS)
    assert only["content"] is None and len(only["tool_calls"]) == 2


@pytest.mark.parametrize(("parser", "text"), CASES)
@pytest.mark.parametrize("reasoning", [False, True])
def test_streamed_parse_equals_the_whole_parse(parser: Parser, text: str, reasoning: bool) -> None:
    """Cut at every character boundary (and at random cuts, and whole), the streamed deltas join to the whole
    parse: the content character for character, the same calls, the same reasoning."""
    whole = ChatOutputParser(parser(), QWEN3 if reasoning else None).parse(text)
    rng = random.Random(len(text))
    every = list(range(1, len(text)))
    for cuts in [every, sorted(rng.sample(every, min(5, len(every)))), []]:
        joined = streamed(ChatOutputParser(parser(), QWEN3 if reasoning else None), text, cuts)
        assert named_arguments(joined["tool_calls"]) == named_arguments(whole.get("tool_calls", []))
        assert joined["content"] == (whole["content"] or "")
        assert joined["reasoning_content"] == (whole.get("reasoning_content") or "")


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Pa'),
        (Llama3JsonToolParser, '{"city": "Paris"}'),
        (Llama3JsonToolParser, "{not json}"),
        (Llama3JsonToolParser, '<|python_tag|>{"name": "f", "parameters": [1]}'),
        (MistralToolParser, "[TOOL_CALLS]not json"),
        (MistralToolParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci'),
        (MistralToolParser, '[TOOL_CALLS][{"name": "get_weather"}]'),
        (MistralToolParser, "[TOOL_CALLS][]"),
    ],
)
def test_a_malformed_or_unclosed_call_stays_content(parser: Parser, text: str) -> None:
    """A call that is not well-formed, or never closes and is the only one, is content as generated (whole and
    streamed), as hermes keeps a bad <tool_call>."""
    message = ChatOutputParser(parser(), None).parse(text)
    assert message == {"content": text}
    assert streamed(ChatOutputParser(parser(), None), text, list(range(1, len(text))))["content"] == text


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        (Llama3JsonToolParser, LLAMA_CALL + '; {"name": "get_w', None),
        (MistralToolParser, "Sure. [TOOL_CALLS]" + MISTRAL_CALLS + "[TOOL_CALLS][{", "Sure. "),
    ],
)
def test_a_call_cut_short_after_calls_is_dropped(parser: Parser, text: str, content: str | None) -> None:
    """A last call that never closes after parsed calls (max_tokens) is dropped, whole and streamed, as hermes
    drops it."""
    message = ChatOutputParser(parser(), None).parse(text)
    assert message["content"] == content and message["tool_calls"]
    assert streamed(ChatOutputParser(parser(), None), text, list(range(1, len(text))))["content"] == (content or "")


def test_chat_format_reports_tool_calls_for_each_format() -> None:
    """ParsedChatFormat with either new parser: a choice that called a tool finishes with "tool_calls", whole and
    streamed; plain text keeps "stop"."""
    for parser, text in [(Llama3JsonToolParser(), LLAMA_CALL), (MistralToolParser(), "[TOOL_CALLS]" + MISTRAL_CALLS)]:
        fmt = ParsedChatFormat("id", "m", None, parser, None)
        body = fmt.final([Choice(0, text, (), None, "stop"), Choice(1, "hi", (), None, "stop")], {})
        assert [c["finish_reason"] for c in body["choices"]] == ["tool_calls", "stop"]
        chunk = fmt.chunk(0, text, (), None, "stop")["choices"][0]
        assert chunk["finish_reason"] == "tool_calls" and chunk["delta"]["tool_calls"][0]["index"] == 0


def _accepts(grammar: str, text: str) -> bool:
    """Whether EBNF ``grammar`` accepts the whole of ``text``."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    return bool(_is_grammar_accept_string(Grammar.from_ebnf(grammar), text))


def _hermes(name: str, arguments: dict[str, str]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_llama3_json_grammar_forces_its_format() -> None:
    """The llama3_json grammar accepts {"name", "parameters"} calls (joined by "; " when parallel), which parse
    back to the same calls, and rejects the hermes format, "arguments", and other tools."""
    pytest.importorskip("xgrammar", reason="forced tool calls need xgrammar (the serve extra)")
    parser = Llama3JsonToolParser()
    weather = json.dumps({"name": "get_weather", "parameters": {"city": "Oslo"}})
    time = json.dumps({"name": "get_time", "parameters": {}})
    named = parser.call_grammar(TOOLS, "get_weather", parallel=True)
    assert _accepts(named, weather)
    assert not _accepts(named, _hermes("get_weather", {"city": "Oslo"}))
    assert not _accepts(named, weather.replace("parameters", "arguments"))
    assert not _accepts(named, time) and not _accepts(named, weather.replace("Oslo", "Rome"))
    required = parser.call_grammar(TOOLS, None, parallel=True)
    assert _accepts(required, f"{time}; {weather}")
    assert not _accepts(required, _hermes("get_time", {}))
    single = parser.call_grammar(TOOLS, None, parallel=False)
    assert _accepts(single, time) and not _accepts(single, f"{time}; {weather}")
    message = ChatOutputParser(parser, None).parse(f"{time}; {weather}")
    assert named_arguments(message["tool_calls"]) == [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]


def test_mistral_grammar_forces_its_format() -> None:
    """The mistral grammar accepts [TOOL_CALLS] and a list of calls (one unless parallel), which parse back to the
    same calls, and rejects the hermes format and a list without the marker."""
    pytest.importorskip("xgrammar", reason="forced tool calls need xgrammar (the serve extra)")
    parser = MistralToolParser()
    weather = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    time = json.dumps({"name": "get_time", "arguments": {}})
    named = parser.call_grammar(TOOLS, "get_weather", parallel=True)
    assert _accepts(named, f"[TOOL_CALLS][{weather}]")
    assert not _accepts(named, _hermes("get_weather", {"city": "Paris"}))
    assert not _accepts(named, f"[{weather}]") and not _accepts(named, f"[TOOL_CALLS][{weather}, {weather}]")
    required = parser.call_grammar(TOOLS, None, parallel=True)
    assert _accepts(required, f"[TOOL_CALLS][{weather}, {time}]")
    assert not _accepts(required, _hermes("get_time", {}))
    single = parser.call_grammar(TOOLS, None, parallel=False)
    assert _accepts(single, f"[TOOL_CALLS][{time}]") and not _accepts(single, f"[TOOL_CALLS][{weather}, {time}]")
    message = ChatOutputParser(parser, None).parse(f"[TOOL_CALLS][{weather}, {time}]")
    assert named_arguments(message["tool_calls"]) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def test_the_request_forces_calls_in_the_servers_format() -> None:
    """ChatCompletionRequest.sampling_params threads the server's parser into the forced-call grammar; mistral's
    marker is a special token, so special tokens are kept (unless the body sets skip_special_tokens)."""
    pytest.importorskip("xgrammar", reason="forced tool calls need xgrammar (the serve extra)")
    from fnvllm.serve.protocol import ChatCompletionRequest

    tools = [tool.model_dump(exclude_none=True) for tool in TOOLS]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"}
    request = ChatCompletionRequest.model_validate(body)
    grammars = {}
    for parser in (HermesToolParser(), Llama3JsonToolParser(), MistralToolParser()):
        params = request.sampling_params(16, parser)
        assert params.structured is not None and params.structured.kind == "grammar"
        grammars[type(parser)] = params.structured.text
        assert params.skip_special_tokens is not parser.keeps_special_tokens
    assert grammars[HermesToolParser].startswith('root ::= "<tool_call>\\n" call')
    assert grammars[Llama3JsonToolParser].startswith('root ::= call ("; " call)*')
    assert grammars[MistralToolParser].startswith('root ::= "[TOOL_CALLS][" call (", " call)* "]"')
    kept = ChatCompletionRequest.model_validate({**body, "skip_special_tokens": True})
    assert kept.sampling_params(16, MistralToolParser()).skip_special_tokens is True


# ---- a real server started with each parser -----------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama3_json", "mistral"])
def tool_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(the --tool-call-parser name, an openai client of a tiny-model server started with it)."""
    pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
    pytest.importorskip("xgrammar", reason="forced tool calls need xgrammar (the serve extra)")
    openai = pytest.importorskip("openai")
    from tiny_models import TINY_SERVER_FLAGS, write_tool_chat_model

    from fnvllm.serve.server_process import ServerProcess

    name = request.param
    checkpoint = write_tool_chat_model(tmp_path_factory.mktemp(f"serve-{name}"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    log = tmp_path_factory.mktemp(f"serve-{name}-log") / "server.log"
    with ServerProcess([str(checkpoint), *TINY_SERVER_FLAGS, "--tool-call-parser", name], log, env=env) as proc:
        yield name, openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert proc.terminate() == 0, proc.log()[-3000:]


def test_server_forces_and_parses_calls_in_its_format(tool_server: Any) -> None:
    """A server started with --tool-call-parser llama3_json or mistral: a named tool_choice returns one valid call
    (the grammar wrote the format, the parser read it back), and "required" streamed sends it as one tool_calls
    delta; mistral's ids are 9 letters and digits."""
    from test_structured_server import MESSAGES, TIME, WEATHER, check_weather_call

    name, client = tool_server
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "temperature": 1.0, "seed": 5}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(**args, tools=[WEATHER, TIME], tool_choice=choice)
    assert out.choices[0].finish_reason == "tool_calls" and not out.choices[0].message.content
    [call] = out.choices[0].message.tool_calls
    check_weather_call(call)
    stream = client.chat.completions.create(
        **args, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, stream=True
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    calls = [c for chunk in chunks for c in chunk.delta.tool_calls or []]
    assert len(calls) == 1 and chunks[-1].finish_reason == "tool_calls"
    check_weather_call(calls[0])
    assert not "".join(chunk.delta.content or "" for chunk in chunks)
    if name == "mistral":
        assert re.fullmatch("[A-Za-z0-9]{9}", call.id) and re.fullmatch("[A-Za-z0-9]{9}", calls[0].id)
