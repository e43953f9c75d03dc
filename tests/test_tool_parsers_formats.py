"""The tool-call formats beyond hermes, "llama3_json", "mistral" (both of its forms) and "pythonic": whole parses,
streaming cut anywhere equal to the whole parse, malformed and cut-short calls, the grammar that forces each format,
the request threading the server's parser into that grammar, and a real ``fnvllm serve`` started with each
parser."""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path
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
    PythonicToolParser,
    ToolCallParser,
    ToolSpec,
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
# the v11 form: [TOOL_CALLS]name[ARGS]{arguments}, one marker per call ([ARGS] may be missing)
MISTRAL_V11_CALLS = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time{}'
MISTRAL_V11_OUTPUTS = [
    MISTRAL_V11_CALLS,
    "Let me check. " + MISTRAL_V11_CALLS + "\nDone.",
    '[TOOL_CALLS] get_weather[ARGS]{"city": "Oslo"}\n\n[TOOL_CALLS]get_time[ARGS]{}',
    "<think>\nhm\n</think>\n\n" + MISTRAL_V11_CALLS,
    "[TOOL_CALLS]get_weather[ARGS][1, 2]",  # arguments not an object: content
    "[TOOL_CALLS]get weather[ARGS]{}",  # a blank in the name: content
    "[TOOL_CALLS]get_weather[ARG]{}",
    "[TOOL_CALLS]get_weather[ARGS]oops",
    "[TOOL_CALLS](x)",
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',  # never closed: content
    MISTRAL_V11_CALLS + '[TOOL_CALLS]get_weather[ARGS]{"ci',  # a third call cut short: dropped
    MISTRAL_V11_CALLS + "[TOOL_CALLS][" + MISTRAL_CALLS[1:],  # both forms in one output
]
PYTHONIC_CALLS = '[get_weather(city="Paris", unit=\'c\'), get_time(zone=None, n=-2, ok=True, tags=["a", 1.5], '
PYTHONIC_CALLS += 'm={"k": [False]})]'
PYTHONIC_MALFORMED = [  # each stays content, whole and streamed
    "[1, 2, 3] are numbers",
    "[Note: calls follow]",
    "[]",
    "[get_time(1)]",  # a positional argument: content
    "[get_time(zone=utc)]",  # a name, not a literal
    "[get_time(zone=__import__('os').getcwd())]",
    "[os.getcwd()]",
    "[get_time(zone='utc', zone='cet')]",
    "[get_time(**{'zone': 'utc'})]",
    "[get_time(at=(1, 2))]",  # a tuple: not JSON
    "[get_time(at={1: 2})]",  # a dict key that is not a str
    "[get_time(at=1e999)]",  # not finite
    "[get_time(at='\\ud83d')]",  # a lone surrogate
    "[get_time(zone='utc')",  # never closed: content
    "[get_time(zone='utc'))",  # mismatched brackets
    "[get_time(zone='ut\nc')]",  # a string running past the line
]
PYTHONIC_OUTPUTS = [
    "plain answer",
    PYTHONIC_CALLS,
    "  \n" + PYTHONIC_CALLS + "\n",
    '[get_time()]\n[get_weather(city="a)]\\"(")]',  # brackets and quotes inside strings
    "[get_time()]\n[get_time()] [get_time(), get_time()]",  # each list read afresh, though it repeats the last
    "<think>\nneed a tool\n</think>\n\n" + PYTHONIC_CALLS,
    "Sure: " + PYTHONIC_CALLS,  # a list inside prose is content
    PYTHONIC_CALLS + " and some words after",
    *PYTHONIC_MALFORMED,
    PYTHONIC_CALLS + "\n[get_weather(city='Pa",  # a second list cut short after calls: dropped
]
CASES = [(Llama3JsonToolParser, text) for text in LLAMA_OUTPUTS] + [(MistralToolParser, t) for t in MISTRAL_OUTPUTS]
CASES += [(MistralToolParser, text) for text in MISTRAL_V11_OUTPUTS]
CASES += [(PythonicToolParser, text) for text in PYTHONIC_OUTPUTS]


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


def test_mistral_v11_calls_each_follow_their_marker() -> None:
    """Mistral's v11 form: each [TOOL_CALLS]name[ARGS]{...} (or name{...}) is a call, in order, with its own
    9-character id; the text before the first marker is content, the text after the last is too."""
    message = ChatOutputParser(MistralToolParser(), None).parse("Let me check. " + MISTRAL_V11_CALLS + "\nDone.")
    assert message["content"] == "Let me check. Done."
    calls = message["tool_calls"]
    assert named_arguments(calls) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert all(re.fullmatch("[A-Za-z0-9]{9}", c["id"]) for c in calls) and len({c["id"] for c in calls}) == 2
    both = ChatOutputParser(MistralToolParser(), None).parse(MISTRAL_V11_CALLS + "[TOOL_CALLS]" + MISTRAL_CALLS)
    assert both["content"] is None and [c["function"]["name"] for c in both["tool_calls"]] == [
        "get_weather", "get_time", "get_weather", "get_time"
    ]  # fmt: skip


def test_pythonic_calls_have_their_literal_arguments_as_json() -> None:
    """A pythonic call list is its calls in order, each with a fresh id and its keyword arguments as a JSON
    object (None, True, False as null, true, false; single or double quotes alike); text after the list is
    content."""
    message = ChatOutputParser(PythonicToolParser(), None).parse(PYTHONIC_CALLS)
    assert message["content"] is None
    calls = message["tool_calls"]
    assert named_arguments(calls) == [
        ("get_weather", '{"city": "Paris", "unit": "c"}'),
        ("get_time", '{"zone": null, "n": -2, "ok": true, "tags": ["a", 1.5], "m": {"k": [false]}}'),
    ]
    assert all(re.fullmatch("call_[0-9a-f]{24}", c["id"]) for c in calls) and len({c["id"] for c in calls}) == 2
    after = ChatOutputParser(PythonicToolParser(), None).parse("[get_time()]\n and then words")
    assert after["content"] == "and then words" and named_arguments(after["tool_calls"]) == [("get_time", "{}")]
    quoted = ChatOutputParser(PythonicToolParser(), None).parse('[get_weather(city="a)]\\"(")]')
    assert named_arguments(quoted["tool_calls"]) == [("get_weather", '{"city": "a)]\\"("}')]
    prose = "Sure: " + PYTHONIC_CALLS
    assert ChatOutputParser(PythonicToolParser(), None).parse(prose) == {"content": prose}


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
        (MistralToolParser, "[TOOL_CALLS]get_weather[ARGS][1, 2]"),
        (MistralToolParser, "[TOOL_CALLS]get weather[ARGS]{}"),
        (MistralToolParser, "[TOOL_CALLS]get_weather[ARGS]oops"),
        (MistralToolParser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa'),
        *[(PythonicToolParser, text) for text in PYTHONIC_MALFORMED],
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
        (MistralToolParser, MISTRAL_V11_CALLS + '[TOOL_CALLS]get_weather[ARGS]{"ci', None),
        (PythonicToolParser, PYTHONIC_CALLS + "\n[get_weather(city='Pa", None),
    ],
)
def test_a_call_cut_short_after_calls_is_dropped(parser: Parser, text: str, content: str | None) -> None:
    """A last call that never closes after parsed calls (max_tokens) is dropped, whole and streamed, as hermes
    drops it."""
    message = ChatOutputParser(parser(), None).parse(text)
    assert message["content"] == content and message["tool_calls"]
    assert streamed(ChatOutputParser(parser(), None), text, list(range(1, len(text))))["content"] == (content or "")


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (PythonicToolParser, "[Note: calls follow"),
        (PythonicToolParser, "[1, 2"),
        (PythonicToolParser, "[get_time(zone='utc'))"),
        (MistralToolParser, "[TOOL_CALLS]get weather"),
        (MistralToolParser, "[TOOL_CALLS]get_weather[ARGS]oops"),
    ],
)
def test_text_that_cannot_be_a_call_goes_out_before_the_output_ends(parser: Parser, text: str) -> None:
    """Streamed a character at a time, text that shows it is no call (a list that does not open with name(, a
    closing bracket that does not match, a blank in a v11 name, no JSON object after [ARGS]) goes out as content
    as it comes, not held until the output ends."""
    chat = ChatOutputParser(parser(), None)
    assert "".join(chat.feed(char).get("content", "") for char in text) == text


def test_the_list_scanner_reads_on_only_where_the_text_grows() -> None:
    """ListScanner (the pythonic parser's, kept across a stream's deltas) answers every text as a fresh scan
    would: a text that extends the last one is read on from where the scan stopped (brackets and quotes already
    seen still count), any other text, or one after a list closed, is scanned afresh."""
    from fnvllm.serve.tool_pythonic import ListScanner

    scanner = ListScanner()
    closed = "[f(x='a)]', y=[1])]"
    texts = ["[f(x='a", "[f(x='a)]', y=[1", closed, closed, closed + " more", "[g('", "[h(y=1)]", "[g(1)]"]
    texts.append("[f(x='a)]', y=[1]]")  # a mismatch
    assert [scanner.list_len(text) for text in texts] == [None, None, 19, 19, 19, None, 8, 6, 18]


def test_chat_format_reports_tool_calls_for_each_format() -> None:
    """ParsedChatFormat with each new parser (and form): a choice that called a tool finishes with "tool_calls",
    whole and streamed; plain text keeps "stop"."""
    for parser, text in [
        (Llama3JsonToolParser(), LLAMA_CALL),
        (MistralToolParser(), "[TOOL_CALLS]" + MISTRAL_CALLS),
        (MistralToolParser(), MISTRAL_V11_CALLS),
        (PythonicToolParser(), PYTHONIC_CALLS),
    ]:
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


def test_mistral_v11_grammar_forces_the_named_form() -> None:
    """With ``named_calls`` the mistral grammar accepts [TOOL_CALLS]name[ARGS]{arguments} (repeated when
    parallel), which parses back to the same calls, and rejects the list form, other tools and bad arguments."""
    pytest.importorskip("xgrammar", reason="forced tool calls need xgrammar (the serve extra)")
    parser = MistralToolParser(named_calls=True)
    weather, time = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "[TOOL_CALLS]get_time[ARGS]{}"
    named = parser.call_grammar(TOOLS, "get_weather", parallel=True)
    assert _accepts(named, weather) and not _accepts(named, weather + weather)
    assert not _accepts(named, weather.replace("Paris", "Rome")) and not _accepts(named, time)
    assert not _accepts(named, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert not _accepts(named, weather.replace("[ARGS]", ""))
    required = parser.call_grammar(TOOLS, None, parallel=True)
    assert _accepts(required, time + weather) and not _accepts(required, time + " " + weather)
    single = parser.call_grammar(TOOLS, None, parallel=False)
    assert _accepts(single, time) and not _accepts(single, time + weather)
    message = ChatOutputParser(parser, None).parse(time + weather)
    assert named_arguments(message["tool_calls"]) == [("get_time", "{}"), ("get_weather", '{"city": "Paris"}')]


def test_mistral_forces_the_v11_form_only_with_a_v11_tokenizer() -> None:
    """The server's tokenizer picks the forced form: one with the [ARGS] token (v11) gets the named form, one
    without it (or no tokenizer) the list form; other parsers ignore the tokenizer."""
    pytest.importorskip("transformers")
    from fnvllm.testing.tokenizer import build_test_tokenizer

    v11 = build_test_tokenizer()
    v11.add_special_tokens({"additional_special_tokens": ["[ARGS]"]})
    assert MistralToolParser.for_tokenizer(v11).named_calls
    assert not MistralToolParser.for_tokenizer(build_test_tokenizer()).named_calls
    assert not MistralToolParser.for_tokenizer(None).named_calls
    assert type(PythonicToolParser.for_tokenizer(v11)) is PythonicToolParser


PYTHONIC_TOOLS = [
    ToolSpec.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "unit": {"enum": ["c", "f"]},
                        "days": {"type": "integer"},
                        "detailed": {"type": ["boolean", "null"]},
                        "flags": {"enum": [[True, None], {"k": False}]},
                    },
                    "required": ["city"],
                },
            },
        }
    ),
    ToolSpec.model_validate({"type": "function", "function": {"name": "get_time"}}),
]


def test_pythonic_grammar_forces_python_calls_of_the_schema() -> None:
    """The pythonic grammar accepts a list of calls whose keyword arguments follow the schema's properties in
    order (required ones always, optional ones or not) as Python literals (enum lists and objects too), which
    parse back to the same calls; it rejects JSON's true/null, escapes whose Python reading differs, a missing
    required or unknown argument, another tool, and the other formats."""
    pytest.importorskip("xgrammar", reason="forced tool calls need xgrammar (the serve extra)")
    parser = PythonicToolParser()
    named = parser.call_grammar(PYTHONIC_TOOLS, "get_weather", parallel=True)
    full = '[get_weather(city="Paris", unit="c", days=-3, detailed=None)]'
    accepted = ['[get_weather(city="Paris")]', full, '[get_weather(city="Oslo", detailed=True)]']
    accepted += ['[get_weather(city="Oslo", flags=[True, None])]', '[get_weather(city="Oslo", flags={"k": False})]']
    for text in [*accepted, r'[get_weather(city="\u00e9\n")]']:
        assert _accepts(named, text), text
    for text in [
        '[get_weather(city="Paris", detailed=true)]',
        '[get_weather(city="Paris", detailed=null)]',
        '[get_weather(city="Paris", flags=[true,null])]',
        '[get_weather(city="Paris", flags=[True, False])]',
        r'[get_weather(city="a\/b")]',  # JSON's "\/" is "/"; Python keeps the backslash
        r'[get_weather(city="\ud83d\ude00")]',  # JSON pairs the surrogates; Python does not
        '[get_weather(unit="c")]',
        '[get_weather(city="Paris", wind=1)]',
        '[get_weather(unit="c", city="Paris")]',  # the schema's order
        '[get_weather(city="Paris"), get_weather(city="Oslo")]',  # named: one call
        "[get_time()]",
        'get_weather(city="Paris")',
        _hermes("get_weather", {"city": "Paris"}),
    ]:
        assert not _accepts(named, text), text
    required = parser.call_grammar(PYTHONIC_TOOLS, None, parallel=True)
    two = '[get_time(), get_time(zone="utc", at=[1, 2.5, None, {"k": False}]), get_weather(city="Oslo")]'
    assert _accepts(required, two) and _accepts(required, full)
    single = parser.call_grammar(PYTHONIC_TOOLS, None, parallel=False)
    assert _accepts(single, "[get_time()]") and not _accepts(single, two)
    defs = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": {"enum": ["c"]}}}
    referring = ToolSpec.model_validate({"type": "function", "function": {"name": "f", "parameters": defs}})
    by_ref = parser.call_grammar([referring], "f", parallel=False)  # a property's $ref reads the schema's $defs
    assert _accepts(by_ref, '[f(unit="c")]') and not _accepts(by_ref, '[f(unit="f")]')
    flags = ChatOutputParser(parser, None).parse(accepted[-2])["tool_calls"]
    assert named_arguments(flags) == [("get_weather", '{"city": "Oslo", "flags": [true, null]}')]
    message = ChatOutputParser(parser, None).parse(two)
    assert named_arguments(message["tool_calls"]) == [
        ("get_time", "{}"),
        ("get_time", '{"zone": "utc", "at": [1, 2.5, null, {"k": false}]}'),
        ("get_weather", '{"city": "Oslo"}'),
    ]


@pytest.mark.parametrize(
    ("function", "named"),
    [
        ({"name": "get-weather"}, "'get-weather'"),
        ({"name": "f", "parameters": {"type": "object", "properties": {"my-key": {"type": "string"}}}}, "'my-key'"),
        ({"name": "f", "parameters": {"type": "object", "properties": {"class": {"type": "string"}}}}, "'class'"),
        ({"name": "f", "parameters": {"type": "object", "properties": {"a": {}}, "required": ["b"]}}, "'b'"),
        ({"name": "f", "parameters": {"anyOf": [{"type": "object"}]}}, "anyOf"),
        ({"name": "f", "parameters": {"type": "array"}}, "'array'"),
    ],
)
def test_pythonic_grammar_refuses_what_keyword_arguments_cannot_write(function: dict[str, Any], named: str) -> None:
    """A tool the pythonic grammar cannot force (a name or property that is no Python identifier, a required
    property not among the properties, parameters that are not an object of properties) is a 400 on
    tool_choice naming the parser and the culprit."""
    pytest.importorskip("xgrammar", reason="forced tool calls need xgrammar (the serve extra)")
    from fnvllm.serve.errors import APIError
    from fnvllm.serve.protocol import ChatCompletionRequest

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": function}]}
    request = ChatCompletionRequest.model_validate({**body, "tool_choice": "required"})
    with pytest.raises(APIError) as raised:
        request.sampling_params(16, PythonicToolParser())
    assert raised.value.status == 400 and raised.value.param == "tool_choice"
    assert "pythonic tool-call parser" in raised.value.message and named in raised.value.message
    auto = ChatCompletionRequest.model_validate({**body, "tool_choice": "auto"})
    assert auto.sampling_params(16, PythonicToolParser()).structured is None  # only forcing needs the grammar


def test_the_request_forces_calls_in_the_servers_format() -> None:
    """ChatCompletionRequest.sampling_params threads the server's parser (and mistral's form) into the forced-call
    grammar; mistral's marker is a special token, so special tokens are kept (unless the body sets
    skip_special_tokens)."""
    pytest.importorskip("xgrammar", reason="forced tool calls need xgrammar (the serve extra)")
    from fnvllm.serve.protocol import ChatCompletionRequest

    tools = [tool.model_dump(exclude_none=True) for tool in TOOLS]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"}
    request = ChatCompletionRequest.model_validate(body)
    grammars = {}
    parsers = [HermesToolParser(), Llama3JsonToolParser(), MistralToolParser(), MistralToolParser(True)]
    for parser in [*parsers, PythonicToolParser()]:
        params = request.sampling_params(16, parser)
        assert params.structured is not None and params.structured.kind == "grammar"
        grammars[parser] = params.structured.text
        assert params.skip_special_tokens is not parser.keeps_special_tokens
    hermes, llama, mistral, mistral_v11, pythonic = grammars.values()
    assert hermes.startswith('root ::= "<tool_call>\\n" call')
    assert llama.startswith('root ::= call ("; " call)*')
    assert mistral.startswith('root ::= "[TOOL_CALLS][" call (", " call)* "]"')
    assert mistral_v11.startswith("root ::= call (call)*") and '"[TOOL_CALLS]get_weather[ARGS]"' in mistral_v11
    assert pythonic.startswith('root ::= "[" call (", " call)* "]"') and '"get_weather("' in pythonic
    kept = ChatCompletionRequest.model_validate({**body, "skip_special_tokens": True})
    assert kept.sampling_params(16, MistralToolParser()).skip_special_tokens is True


# ---- a real server started with each parser -----------------------------------------------------------------

# each server's --tool-call-parser; "mistral_v11" is mistral with a tokenizer that has v11's [ARGS] token
SERVED_PARSERS = {"llama3_json": "llama3_json", "mistral": "mistral", "mistral_v11": "mistral", "pythonic": "pythonic"}
# the first characters of a forced get_weather call in each server's format (the form the grammar chose)
FORCED_STARTS = {
    "llama3_json": '{"name": "get_weather", "parameters": {',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {',
    "mistral_v11": '[TOOL_CALLS]get_weather[ARGS]{"',
    "pythonic": "[get_weather(city=",
}


def write_v11_tokenizer(checkpoint: Path) -> None:
    """Give ``checkpoint`` a tokenizer with Mistral v11's ``[ARGS]`` token (one merge fewer, so every id stays in
    the model's 256), keeping its tool chat template."""
    from tiny_models import TOOL_TEMPLATE

    from fnvllm.testing.tokenizer import build_test_tokenizer

    tokenizer = build_test_tokenizer(vocab_size=255)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ARGS]"]})
    tokenizer.save_pretrained(str(checkpoint))
    (checkpoint / "chat_template.jinja").write_text(TOOL_TEMPLATE)


@pytest.fixture(scope="module", params=list(SERVED_PARSERS))
def tool_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(the server's name in SERVED_PARSERS, an openai client of a tiny-model server started with its parser)."""
    pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
    pytest.importorskip("xgrammar", reason="forced tool calls need xgrammar (the serve extra)")
    openai = pytest.importorskip("openai")
    from tiny_models import TINY_SERVER_FLAGS, write_tool_chat_model

    from fnvllm.serve.server_process import ServerProcess

    name = request.param
    checkpoint = write_tool_chat_model(tmp_path_factory.mktemp(f"serve-{name}"))
    if name == "mistral_v11":
        write_v11_tokenizer(checkpoint)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    log = tmp_path_factory.mktemp(f"serve-{name}-log") / "server.log"
    flags = [str(checkpoint), *TINY_SERVER_FLAGS, "--tool-call-parser", SERVED_PARSERS[name]]
    with ServerProcess(flags, log, env=env) as proc:
        yield name, openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert proc.terminate() == 0, proc.log()[-3000:]


def test_server_forces_and_parses_calls_in_its_format(tool_server: Any) -> None:
    """A server started with each parser: a named tool_choice returns one valid call (the grammar wrote the
    format, in mistral's form of the server's tokenizer, and the parser read it back), and "required" streamed
    sends it as one tool_calls delta; mistral's ids are 9 letters and digits."""
    from test_structured_server import MESSAGES, TIME, WEATHER, check_weather_call

    name, client = tool_server
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "temperature": 1.0, "seed": 5}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(**args, tools=[WEATHER, TIME], tool_choice=choice, logprobs=True)
    assert out.choices[0].finish_reason == "tool_calls" and not out.choices[0].message.content
    [call] = out.choices[0].message.tool_calls
    check_weather_call(call)
    generated = "".join(token.token for token in out.choices[0].logprobs.content)
    assert generated.startswith(FORCED_STARTS[name]), generated
    stream = client.chat.completions.create(
        **args, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, stream=True
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    calls = [c for chunk in chunks for c in chunk.delta.tool_calls or []]
    assert len(calls) == 1 and chunks[-1].finish_reason == "tool_calls"
    check_weather_call(calls[0])
    assert not "".join(chunk.delta.content or "" for chunk in chunks)
    if name.startswith("mistral"):
        assert re.fullmatch("[A-Za-z0-9]{9}", call.id) and re.fullmatch("[A-Za-z0-9]{9}", calls[0].id)


# two calls in each server's format (mistral_v11: the v11 form, which any mistral server reads), pinned by
# guided_choice under tool_choice "auto"; pythonic's arguments are Python literals of every kind
PINNED_OUTPUTS = {
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
    '{"name": "get_time", "parameters": {"zone": "utc", "days": [1, -2.5], "exact": true, "tz": null}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
    '{"name": "get_time", "arguments": {"zone": "utc", "days": [1, -2.5], "exact": true, "tz": null}}]',
    "mistral_v11": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}'
    '[TOOL_CALLS]get_time[ARGS]{"zone": "utc", "days": [1, -2.5], "exact": true, "tz": null}',
    "pythonic": '[get_weather(city=\'Paris\', unit="c"), get_time(zone="utc", days=[1, -2.5], exact=True, tz=None)]',
}
PINNED_CALLS = [
    ("get_weather", '{"city": "Paris", "unit": "c"}'),
    ("get_time", '{"zone": "utc", "days": [1, -2.5], "exact": true, "tz": null}'),
]


def test_server_parses_two_calls_in_its_format(tool_server: Any) -> None:
    """Output pinned to two calls in the server's format (tool_choice "auto"): the message holds both calls with
    their arguments as JSON and no content, whole and streamed over real token boundaries."""
    from test_structured_server import MESSAGES, TIME, WEATHER

    name, client = tool_server
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 300, "tools": [WEATHER, TIME]}
    args["extra_body"] = {"guided_choice": [PINNED_OUTPUTS[name]]}
    out = client.chat.completions.create(**args)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and not message.content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == PINNED_CALLS
    chunks = [chunk.choices[0] for chunk in client.chat.completions.create(**args, stream=True) if chunk.choices]
    calls = [c for chunk in chunks for c in chunk.delta.tool_calls or []]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (index, *call) for index, call in enumerate(PINNED_CALLS)
    ]
    assert chunks[-1].finish_reason == "tool_calls" and not "".join(c.delta.content or "" for c in chunks)
