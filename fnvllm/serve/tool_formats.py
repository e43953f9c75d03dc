"""Tool-call formats: the tool specs a chat request sends, the calls parsed from the output, and one
``ToolCallParser`` per format the model writes its calls in (a registry, ``TOOL_PARSERS``, with vLLM's names):

- "hermes": ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one call per tag (Qwen 2.5 / 3, Hermes);
- "llama3_json": ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, calls separated by
  ``;`` (Llama 3.1 / 3.2 / 3.3);
- "mistral": ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral's tokenizers before v11) and
  ``[TOOL_CALLS]name[ARGS]{...}``, one marker per call (v11 and later: Mistral Small 3.1+, Magistral, Devstral);
- "pythonic": ``[get_weather(city="Paris"), get_time()]``, a Python list of calls (Llama 3.2 / Llama 4).

A parser answers the questions that ``tool_parsers.ChatOutputParser`` asks to stream any of them (where a call block
opens, where it closes, which calls it holds) and builds the grammar that forces calls in its format. A new format
is a subclass and a registry entry.
"""

from __future__ import annotations

import abc
import json
import re
import secrets
import string
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import attrs
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr

from fnvllm.serve import tool_pythonic
from fnvllm.serve.tool_grammar import (
    Rules,
    grammar_text,
    literal,
    merge_rules,
    python_literal_rules,
    pythonic_arguments,
    schema_rules,
)


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionSpec(_Spec):
    """``tools[i].function``: name, description, JSON-schema ``parameters`` (default: any object), strict."""

    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolSpec(_Spec):
    """``tools[i]``: a function the model may call."""

    type: Literal["function"] = "function"
    function: FunctionSpec

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's shape, without unset fields)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


@attrs.frozen
class ToolCall:
    """One parsed call: its id, the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        """The call in a response message (``index`` set: in a streamed delta)."""
        call: dict[str, Any] = {"id": self.id, "type": "function"}
        call["function"] = {"name": self.name, "arguments": self.arguments}
        return call if index is None else {"index": index, **call}


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_DECODER = json.JSONDecoder()
_MISTRAL_ID_CHARS = string.ascii_letters + string.digits
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]*")  # a v11 call's function name, between [TOOL_CALLS] and [ARGS]
_MISTRAL_NAMED_CALL = re.compile(r"(?P<name>[A-Za-z0-9_.\-]+)(?:\[ARGS\])?(?P<arguments>\{.*\})", re.DOTALL)


def _json_end(text: str, start: int) -> int | None:
    """The end of the JSON object or array that opens at ``text[start]`` (after whitespace); None while it is
    incomplete, and forever when it is not JSON. A closed object or array is final: no later text changes it."""
    start = len(text) - len(text[start:].lstrip())
    if not text.startswith(("{", "["), start):
        return None
    try:
        return _DECODER.raw_decode(text, start)[1]
    except ValueError:
        return None


def _call_from(value: Any, call_id: str, require_arguments: bool) -> ToolCall | None:
    """The call a decoded JSON value spells: an object with a str ``name`` and its arguments under "arguments" or
    "parameters" (an object, or JSON text kept as sent); None when it is not one. Without ``require_arguments``,
    missing arguments are ``{}`` and any JSON value is taken (the hermes parser's leniency)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = "arguments" if "arguments" in value else "parameters"
    if require_arguments and not isinstance(value.get(key), (dict, str)):
        return None
    arguments = value.get(key, {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call_id, value["name"], text)


def _has_token(tokenizer: Any, token: str) -> bool:
    """Whether ``tokenizer`` (a transformers tokenizer, or None) has ``token`` as one vocabulary entry."""
    if tokenizer is None:
        return False
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id is not None and token_id != tokenizer.unk_token_id


def _chosen(tools: Sequence[ToolSpec], name: str | None) -> list[ToolSpec]:
    """The tools a forced call may call: the named one, or all (``name`` None)."""
    return [tool for tool in tools if name is None or tool.function.name == name]


def held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag`` (it may start the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ToolCallParser(abc.ABC):
    """A tool-call format: the three questions ``tool_parsers.ChatOutputParser`` asks to split any format's output,
    whole (``parse``, built on them here) or streamed: where a call block may open in content (``split_content``),
    where an open block ends (``block_len``), which calls a closed block holds (``parse_block``); and the grammar
    that forces calls in the format (``call_grammar``).

    A block is held from its first character until it closes; then it goes out as calls, or as content when it
    is not well-formed. ``after_call``: characters dropped right after a well-formed block (the model's separator
    between calls). ``keeps_special_tokens``: the block's marker is a special token, which
    ``skip_special_tokens`` would take out of the text. The forced-call grammar is ``grammar_open`` call
    (``grammar_separator`` call)* ``grammar_close``, each call a JSON object {"name", ``arguments_key``}.
    """

    start: ClassVar[str]
    after_call: ClassVar[str] = "\n"
    keeps_special_tokens: ClassVar[bool] = False
    grammar_open: ClassVar[str]
    grammar_separator: ClassVar[str]
    grammar_close: ClassVar[str]
    arguments_key: ClassVar[str] = "arguments"

    @abc.abstractmethod
    def block_len(self, text: str) -> int | None:
        """The length of the call block that opens ``text``; None while it has not closed."""

    @abc.abstractmethod
    def parse_block(self, block: str) -> list[ToolCall] | None:
        """The calls in a closed block (at least one), or None when it is not well-formed (it stays content)."""

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> ToolCallParser:
        """The parser for a server whose tokenizer is ``tokenizer`` (None: none). Only the forced-call grammar
        may depend on it (parsing reads every form of the format from the text); by default it does not."""
        return cls()

    def new_id(self) -> str:
        """A fresh call id."""
        return _new_id()

    def split_content(self, text: str, at_start: bool) -> tuple[int, bool]:
        """(how many leading characters of ``text`` are content for sure, whether a call block opens right after
        them). The rest is held: a block, or a marker split across two deltas. ``at_start``: no content has come
        since the output began or the last call (some formats open a block only there)."""
        found = text.find(self.start)
        if found >= 0:
            return found, True
        return len(text) - held_suffix(text, self.start), False

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the content, the calls in order) of a whole output. A well-formed block goes with the ``after_call``
        characters after it; one that is not stays in the content. A block that never closes is content when it
        is the only one, and is dropped after calls (a call cut short by max_tokens, as vLLM drops it)."""
        content: list[str] = []
        calls: list[ToolCall] = []
        rest, at_start = text, True
        while rest:
            size, opens = self.split_content(rest, at_start)
            if not opens:
                content.append(rest)
                break
            content.append(rest[:size])
            at_start, rest = at_start and size == 0, rest[size:]
            end = self.block_len(rest)
            if end is None:
                content.append("" if calls else rest)
                break
            block, rest = rest[:end], rest[end:]
            parsed = self.parse_block(block)
            if parsed is None:
                content.append(block)
                at_start = False
            else:
                calls += parsed
                at_start, rest = True, rest.lstrip(self.after_call)
        return "".join(content), calls

    def call_grammar(self, tools: Sequence[ToolSpec], name: str | None, parallel: bool) -> str:
        """EBNF text of the output that tool_choice "required" (``name`` None: any of ``tools``) or a named
        function forces, in this format: one call, or several when ``parallel`` and no name. Needs xgrammar (it
        turns the JSON schemas into grammar rules)."""
        from fnvllm.executor.structured import import_xgrammar

        xgr = import_xgrammar()
        schemas = [self._call_schema(t) for t in tools if name is None or t.function.name == name]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        rules = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)).split("\n")
        # the schema's root rule becomes "call"; the new root wraps and repeats it
        rules = [f"call ::= {r.removeprefix('root ::= ')}" if r.startswith("root ::= ") else r for r in rules]
        repeat = f"({literal(self.grammar_separator)} call)*" if name is None and parallel else ""
        parts = [literal(self.grammar_open) if self.grammar_open else "", "call", repeat]
        parts.append(literal(self.grammar_close) if self.grammar_close else "")
        return "\n".join([f"root ::= {' '.join(p for p in parts if p)}", *rules])

    def _call_schema(self, tool: ToolSpec) -> dict[str, Any]:
        """The JSON schema of one call of ``tool``: its name and its arguments under ``arguments_key``."""
        parameters = tool.function.parameters or {"type": "object"}
        return {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, self.arguments_key: parameters},
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
        }


class HermesToolParser(ToolCallParser):
    """The "hermes" format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one call per tag (Qwen
    2.5 / 3, Hermes); the newlines after a call are its separator."""

    start = "<tool_call>"
    end = "</tool_call>"
    grammar_open = "<tool_call>\n"
    grammar_separator = "\n</tool_call>\n<tool_call>\n"
    grammar_close = "\n</tool_call>"

    def block_len(self, text: str) -> int | None:
        """Up to the first ``</tool_call>``."""
        end = text.find(self.end)
        return None if end < 0 else end + len(self.end)

    def parse_block(self, block: str) -> list[ToolCall] | None:
        """The tag's body as one call: a JSON object with a str name (arguments or parameters: any JSON)."""
        call = self.parse_call(block[len(self.start) : -len(self.end)])
        return None if call is None else [call]

    def parse_call(self, body: str) -> ToolCall | None:
        """The call in one tag's body, or None when it is not a JSON object with a str name."""
        try:
            value = json.loads(body)
        except ValueError:
            return None
        return _call_from(value, self.new_id(), require_arguments=False)


class Llama3JsonToolParser(ToolCallParser):
    """The "llama3_json" format: Llama 3.1 / 3.2 / 3.3 JSON calls, ``{"name": ..., "parameters": {...}}``
    ("arguments" is read too), optionally after ``<|python_tag|>``, several separated by ``;``. A call opens at
    ``<|python_tag|>``, or at ``{`` where the output (or the text after a call) begins, leading whitespace
    included; a ``{`` inside prose is content (as in vLLM's streaming parser). The whitespace and ``;`` after a
    call are its separator. Forced calls are written ``{"name": ..., "parameters": ...}``, joined by ``; ``."""

    start = "<|python_tag|>"
    after_call = " \t\r\n;"
    grammar_open = ""
    grammar_separator = "; "
    grammar_close = ""
    arguments_key = "parameters"

    def split_content(self, text: str, at_start: bool) -> tuple[int, bool]:
        """A ``<|python_tag|>`` anywhere; a ``{`` at the start (blanks there are held: they may precede one)."""
        stripped = text.lstrip()
        if at_start and not stripped:
            return 0, False
        if at_start and stripped.startswith("{"):
            return 0, True
        return super().split_content(text, at_start)

    def block_len(self, text: str) -> int | None:
        """Through the end of the JSON object (after the tag, if any)."""
        return _json_end(text, self._body_start(text))

    def parse_block(self, block: str) -> list[ToolCall] | None:
        """The object as one call: a str name and an object under "parameters" or "arguments"."""
        value = json.loads(block[self._body_start(block) :])
        call = _call_from(value, self.new_id(), require_arguments=True)
        return None if call is None else [call]

    def _body_start(self, text: str) -> int:
        """Where the JSON may begin: after leading whitespace and the tag."""
        at = len(text) - len(text.lstrip())
        return at + len(self.start) if text.startswith(self.start, at) else at


class MistralToolParser(ToolCallParser):
    """The "mistral" format, in either of its forms after ``[TOOL_CALLS]`` (the text before the marker is
    content), told apart by the text: a JSON list ``[{"name": ..., "arguments": {...}}, ...]`` (Mistral's
    tokenizers before v11: Mistral 7B v0.3, Nemo), or ``name[ARGS]{...}`` with a marker per call (v11 and later:
    Mistral Small 3.1+, Magistral, Devstral; ``name{...}`` is read too, as when the decoder drops ``[ARGS]``).

    ``[TOOL_CALLS]`` is a special token, so the output keeps special tokens while tools are parsed. Call ids are 9
    letters and digits: Mistral's chat templates refuse any other id when the calls are sent back. Forced calls
    are written in the form of the server's tokenizer (``named_calls``: it has the ``[ARGS]`` token, which only v11
    and later tokenizers have), since the grammar must pick one."""

    start = "[TOOL_CALLS]"
    args = "[ARGS]"
    keeps_special_tokens = True
    grammar_open = "[TOOL_CALLS]["
    grammar_separator = ", "
    grammar_close = "]"

    def __init__(self, named_calls: bool = False) -> None:
        self.named_calls = named_calls

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> MistralToolParser:
        """Forced calls in the v11 form where ``tokenizer`` has the ``[ARGS]`` token, else in the list form."""
        return cls(named_calls=_has_token(tokenizer, cls.args))

    def new_id(self) -> str:
        """9 random letters and digits."""
        return "".join(secrets.choice(_MISTRAL_ID_CHARS) for _ in range(9))

    def block_len(self, text: str) -> int | None:
        """Through the end of the JSON list (or object) after the marker; in the v11 form, through the end of the
        arguments' JSON object, or up to the first character that shows the call is not well-formed."""
        at = len(text) - len(text[len(self.start) :].lstrip())
        if at == len(text):
            return None
        if text[at] in "[{":
            return _json_end(text, at)
        named = _MISTRAL_NAME.match(text, at)
        name_end = at if named is None else named.end()
        return at if name_end == at else self._named_len(text, name_end)

    def _named_len(self, text: str, at: int) -> int | None:
        """The v11 form's length, its name ending at ``at``: then ``[ARGS]`` (optional) and a JSON object."""
        rest = text[at:]
        if self.args.startswith(rest):
            return None
        if rest.startswith(self.args):
            at += len(self.args)
        if at == len(text):
            return None
        return _json_end(text, at) if text[at] == "{" else at  # neither [ARGS] nor "{" after the name: no call

    def parse_block(self, block: str) -> list[ToolCall] | None:
        """The list form: every item of the list as a call (a lone object counts as a list of one), None unless
        all are. The v11 form: one call, whose arguments must be a JSON object."""
        body = block[len(self.start) :].lstrip()
        if not body.startswith(("[", "{")):
            return self._named_call(body)
        value = json.loads(body)
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            call = _call_from(item, self.new_id(), require_arguments=True)
            if call is None:
                return None
            calls.append(call)
        return calls or None

    def _named_call(self, body: str) -> list[ToolCall] | None:
        """The v11 form's one call: ``name[ARGS]{...}`` or ``name{...}``."""
        matched = _MISTRAL_NAMED_CALL.fullmatch(body)
        if matched is None:
            return None
        arguments = json.loads(matched["arguments"])  # an object: block_len ended it where its "{" closes
        return [ToolCall(self.new_id(), matched["name"], json.dumps(arguments, ensure_ascii=False))]

    def call_grammar(self, tools: Sequence[ToolSpec], name: str | None, parallel: bool) -> str:
        """The list form's grammar (the base class's), or with ``named_calls`` the v11 form's:
        ``[TOOL_CALLS]name[ARGS]{arguments}``, once, or repeated when ``parallel`` and no name."""
        if not self.named_calls:
            return super().call_grammar(tools, name, parallel)
        rules: Rules = {}
        alternatives = []
        for index, tool in enumerate(_chosen(tools, name)):
            arguments, tool_rules = schema_rules(tool.function.parameters or {"type": "object"}, f"tool{index}_")
            rules = merge_rules(rules, tool_rules)
            alternatives.append(f"({literal(self.start + tool.function.name + self.args)} {arguments})")
        rules = merge_rules(rules, {"call": " | ".join(alternatives)})
        return grammar_text("call (call)*" if name is None and parallel else "call", rules)


class PythonicToolParser(ToolCallParser):
    """The "pythonic" format (Llama 3.2 / Llama 4): a Python list of calls with keyword arguments,
    ``[get_weather(city="Paris", unit="c"), get_time()]``, where the output (or the text after a call list)
    begins, leading blanks included; any other output is content. Arguments are Python literals (str, int,
    float, bool, None, lists, dicts), read with ``ast`` and never evaluated, and go out as JSON; a list that is
    not all such calls is content. The list's calls go out together when it closes (the machine holds a block
    until then: a call can only be told from content once the list is whole). Forced calls are written
    ``[name(arg=value, ...), ...]`` by a grammar built from each tool's JSON schema (see ``call_grammar``)."""

    start = "["
    after_call = " \t\r\n"
    grammar_open = grammar_separator = grammar_close = ""  # call_grammar builds its own

    def __init__(self) -> None:
        self._scanner = tool_pythonic.ListScanner()

    def split_content(self, text: str, at_start: bool) -> tuple[int, bool]:
        """A ``[`` where the output (or the text after a call list) begins; blanks there are held."""
        stripped = text.lstrip()
        if at_start and not stripped:
            return 0, False
        if at_start and stripped.startswith(self.start):
            return 0, True
        return len(text), False

    def block_len(self, text: str) -> int | None:
        """Through the list's closing bracket (or the first character that shows it is no call list)."""
        return self._scanner.list_len(text)

    def parse_block(self, block: str) -> list[ToolCall] | None:
        """Every item of the list as a call, arguments as JSON; None unless all are calls of literals."""
        calls = tool_pythonic.read_calls(block)
        if calls is None:
            return None
        return [ToolCall(self.new_id(), name, json.dumps(args, ensure_ascii=False)) for name, args in calls]

    def call_grammar(self, tools: Sequence[ToolSpec], name: str | None, parallel: bool) -> str:
        """``[`` one call (or several joined by ", " when ``parallel`` and no name) ``]``, each call
        ``name(key=value, ...)``: the schema's properties in their order, the required ones always, the others
        optional, each value a Python literal of its property's schema (xgrammar's JSON rules made to write
        Python); a schema without properties takes any ``identifier=value``. A ValueError naming the parser for a
        tool it cannot write so: a name or property that is not a Python identifier, parameters that are not an
        object schema of properties."""
        rules: Rules = {}
        alternatives = []
        for index, tool in enumerate(_chosen(tools, name)):
            arguments, tool_rules = pythonic_arguments(tool.function.name, tool.function.parameters, f"tool{index}_")
            rules = merge_rules(rules, tool_rules)
            alternatives.append(f"({literal(tool.function.name + '(')} {arguments} {literal(')')})")
        rules = merge_rules(python_literal_rules(rules), {"call": " | ".join(alternatives)})
        repeat = f" ({literal(', ')} call)*" if name is None and parallel else ""
        return grammar_text(f"{literal('[')} call{repeat} {literal(']')}", rules)


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}
"""Tool-call formats by name (``--tool-call-parser``; vLLM's names)."""
