"""Tool calls and reasoning in chat output: the hermes parser, the streaming splitter (any cut of the text gives
the whole parse), the grammar that forces a call, and the chat format's finish reason."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("pydantic", reason="tool parsing needs pydantic (the [serve] extra)")

from fnvllm.serve.formats import Choice
from fnvllm.serve.tool_parsers import (
    REASONING_PARSERS,
    ChatOutputParser,
    HermesToolParser,
    ParsedChatFormat,
    ToolSpec,
)

QWEN3 = REASONING_PARSERS["qwen3"]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OUTPUTS = [
    "plain answer",
    CALL,
    "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"),
    "<think>\nweigh it\n</think>\n\nIt is sunny.",
    "<think>\nneed a tool\n</think>\n\n" + CALL,
    "<tool_call>not json</tool_call> tail",
    '<tool_call>\n{"name": "f", "arguments": {}}',  # never closed: stays content
    "<think>unfinished thought",
    "a < b and <tool but not a tag",
    "Sure. " + CALL + " after",
    CALL + "\n\n" + CALL + "\n",
    "<tool_call>bad</tool_call>\n\nthen " + CALL,
    "Sure. " + CALL + '\n<tool_call>\n{"name": "get_w',  # a second call cut by max_tokens: dropped
    "x <tool_call>bad</tool_call> " + CALL + " <tool_call>{",  # a bad closed call stays, the cut one goes
]
TOOLS = [
    ToolSpec.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                               "required": ["city"], "additionalProperties": False},
            },
        }
    ),
    ToolSpec.model_validate({"type": "function", "function": {"name": "get_time"}}),
]  # fmt: skip


def _streamed(text: str, cuts: list[int], tools: bool, reasoning: bool) -> dict[str, object]:
    """The deltas of ``text`` fed in pieces cut at ``cuts``, joined."""
    parser = ChatOutputParser(HermesToolParser() if tools else None, QWEN3 if reasoning else None)
    joined: dict[str, object] = {"content": "", "reasoning_content": "", "tool_calls": []}
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    for delta in deltas:
        for key, value in delta.items():
            joined[key] = joined[key] + value  # type: ignore[operator]
    return joined


@pytest.mark.parametrize("text", OUTPUTS)
@pytest.mark.parametrize(("tools", "reasoning"), [(True, True), (True, False), (False, True)])
def test_streamed_parse_equals_the_whole_parse(text: str, tools: bool, reasoning: bool) -> None:
    """Cut anywhere (random cuts, one character at a time), the streamed deltas join to the whole parse, the
    content character for character."""
    whole = ChatOutputParser(HermesToolParser() if tools else None, QWEN3 if reasoning else None).parse(text)
    rng = random.Random(len(text))
    for cuts in [list(range(1, len(text))), sorted(rng.sample(range(1, len(text)), min(4, len(text) - 1))), []]:
        joined = _streamed(text, cuts, tools, reasoning)
        calls = whole.get("tool_calls", [])
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"])
            for c in joined["tool_calls"]  # type: ignore[attr-defined]
        ]
        assert joined["content"] == (whole["content"] or "")
        assert joined["reasoning_content"] == (whole.get("reasoning_content") or "")


def test_hermes_calls_and_reasoning_are_split_out() -> None:
    """A reasoning block and two calls: reasoning_content, no content, two calls with JSON arguments."""
    parser = ChatOutputParser(HermesToolParser(), QWEN3)
    message = parser.parse("<think>\nhm\n</think>\n\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    assert message["reasoning_content"] == "hm" and message["content"] is None
    calls = message["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert len({c["id"] for c in calls}) == 2


def test_forced_call_grammar_accepts_calls_and_nothing_else() -> None:
    """The grammar of a named function accepts its valid call only; "required" accepts any tool, parallel
    repeats."""
    pytest.importorskip("xgrammar")
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    def call(name: str, arguments: dict[str, str]) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    named = Grammar.from_ebnf(HermesToolParser().call_grammar(TOOLS, "get_weather", parallel=True))
    assert accepts(named, call("get_weather", {"city": "Oslo"}))
    assert not accepts(named, call("get_weather", {"city": "Rome"}))
    assert not accepts(named, call("get_time", {}))
    required = Grammar.from_ebnf(HermesToolParser().call_grammar(TOOLS, None, parallel=True))
    two = call("get_time", {}) + "\n" + call("get_weather", {"city": "Paris"})
    assert accepts(required, two)
    single = Grammar.from_ebnf(HermesToolParser().call_grammar(TOOLS, None, parallel=False))
    assert not accepts(single, two) and accepts(single, two.split("\n<tool_call>")[0])


def test_chat_format_reports_tool_calls_as_the_finish_reason() -> None:
    """A choice that called a tool and stopped finishes with "tool_calls"; plain text keeps "stop"."""
    fmt = ParsedChatFormat("id", "m", None, HermesToolParser(), None)
    body = fmt.final([Choice(0, CALL, (), None, "stop"), Choice(1, "hi", (), None, "stop")], {})
    assert [c["finish_reason"] for c in body["choices"]] == ["tool_calls", "stop"]
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    chunk = fmt.chunk(0, CALL, (), None, "stop")
    assert chunk["choices"][0]["finish_reason"] == "tool_calls" and chunk["choices"][0]["delta"]["tool_calls"]


@pytest.mark.parametrize("reasoning", [False, True])
def test_streamed_chat_sends_no_chunk_for_held_tokens(reasoning: bool) -> None:
    """Tokens a parser holds back (a tool call until it closes, the reasoning markers) send no chunk: every chunk
    of the event stream carries a delta field, a finish reason or logprobs, and they join to the whole parse."""
    pytest.importorskip("starlette", reason="the event stream needs the [serve] extra")
    import asyncio

    from fnvllm.serve.sse import StreamPlan, events
    from fnvllm.serve.stream import RequestStream, TokenEvent

    text = ("<think>\nhm\n</think>\n\n" if reasoning else "") + "Sure. " + CALL + "\n" + CALL + " done"
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]

    async def stream_all() -> list[dict[str, object]]:
        stream = RequestStream("r", (1,), asyncio.get_running_loop())

        async def generate() -> None:  # one piece per read: the consumer drains each on its own
            for i, piece in enumerate(pieces):
                stream.push(TokenEvent(piece, (i,), (), "stop" if i == len(pieces) - 1 else None))
                for _ in range(3):
                    await asyncio.sleep(0)

        generating = asyncio.ensure_future(generate())
        fmt = ParsedChatFormat("id", "m", None, HermesToolParser(), QWEN3 if reasoning else None)
        plan = StreamPlan(None, include_usage=False, continuous_usage=False, logprobs=False, num_prompt_tokens=1)
        lines = [line async for line in events(fmt, [stream], plan)]
        await generating
        return [json.loads(line[len("data: ") :]) for line in lines if line != "data: [DONE]\n\n"]

    chunks = asyncio.run(stream_all())[1:]  # after the opening role chunk
    choices = [c["choices"][0] for c in chunks]  # type: ignore[index]
    assert all(ch["delta"] or ch["finish_reason"] is not None for ch in choices)
    assert len(choices) < len(pieces) - 20  # the held pieces (each call's ~24) made none
    content = "".join(ch["delta"].get("content", "") for ch in choices)
    calls = [c for ch in choices for c in ch["delta"].get("tool_calls", [])]
    whole = ChatOutputParser(HermesToolParser(), QWEN3 if reasoning else None).parse(text)
    assert content == whole["content"] == "Sure.  done"
    assert [c["function"]["arguments"] for c in calls] == [c["function"]["arguments"] for c in whole["tool_calls"]]
    assert choices[-1]["finish_reason"] == "tool_calls"


def test_a_call_cut_short_after_calls_is_dropped_not_content() -> None:
    """A last call that never closes (max_tokens) after parsed calls is dropped, streamed or whole, as vLLM does;
    alone, an unclosed call stays content (there is nothing else to show)."""
    cut = "Sure. " + CALL + '\n<tool_call>\n{"name": "get_w'
    whole = ChatOutputParser(HermesToolParser(), None).parse(cut)
    assert whole["content"] == "Sure. " and len(whole["tool_calls"]) == 1
    assert _streamed(cut, list(range(1, len(cut))), tools=True, reasoning=False)["content"] == "Sure. "
    alone = '<tool_call>\n{"name": "f"'
    assert ChatOutputParser(HermesToolParser(), None).parse(alone)["content"] == alone
