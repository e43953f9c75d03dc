"""Tool calls and reasoning in chat output: the tool specs a request sends, the grammar that forces a call, and
parsers that split generated text into content, ``reasoning_content`` and ``tool_calls`` (whole or streamed).

Tool-call formats are a registry (``TOOL_PARSERS``): "hermes" is the ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` format Qwen (2.5, 3) and Hermes models emit, one call per tag. Reasoning formats are a
registry too (``REASONING_PARSERS``): "qwen3" splits ``<think>...</think>`` off the start of the output.

Streaming: text outside a tool call goes out as content deltas as it comes; once ``<tool_call>`` opens, text is
held until ``</tool_call>`` closes it, then the whole call goes out as one ``tool_calls`` delta (id, name and the
complete arguments). A tag split across two deltas is held until it can be told apart from text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import attrs
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr

from fnvllm.executor.base import TokenLogprobs
from fnvllm.serve.formats import ChatFormat, Choice


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


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    """The JSON schema of one call of ``tool`` in the hermes format's JSON."""
    parameters = tool.function.parameters or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_grammar(tools: Sequence[ToolSpec], name: str | None, parallel: bool) -> str:
    """EBNF text of the output that tool_choice "required" (``name`` None: any of ``tools``) or a named function
    forces: ``<tool_call>\\n{json}\\n</tool_call>``, repeated (newline-separated) when ``parallel`` and no name.
    Needs xgrammar (it turns the JSON schemas into grammar rules)."""
    from fnvllm.executor.structured import import_xgrammar

    xgr = import_xgrammar()
    chosen = [t for t in tools if name is None or t.function.name == name]
    schema = _call_schema(chosen[0]) if len(chosen) == 1 else {"anyOf": [_call_schema(t) for t in chosen]}
    call = xgr.Grammar.concat(
        xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'),
        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
        xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'),
    )
    text = str(call)
    if name is not None or not parallel:
        return text
    head, rest = text.split("\n", 1)  # "root ::= ..." defines one call; root repeats it
    return f'root ::= call ("\\n" call)*\ncall ::= {head.removeprefix("root ::= ")}\n{rest}'


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` calls (Qwen, Hermes)."""

    start = "<tool_call>"
    end = "</tool_call>"
    # A call with the newlines after it (the model's separator between calls, dropped with a well-formed call).
    _pattern = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>\n*", re.DOTALL)

    def parse_call(self, body: str) -> ToolCall | None:
        """The call in one tag's body, or None when it is not a JSON object with a str name."""
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ToolCall(_new_id(), value["name"], text)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text outside well-formed calls, the calls in order). A well-formed call goes with the newlines right
        after it; a tag whose body does not parse stays in the text, newlines included."""
        calls: list[ToolCall] = []

        def take(match: re.Match[str]) -> str:
            call = self.parse_call(match.group(1))
            if call is None:
                return match.group(0)
            calls.append(call)
            return ""

        return self._pattern.sub(take, text), calls


TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}
"""Tool-call formats by name."""


@attrs.frozen
class ReasoningFormat:
    """A reasoning block at the start of the output: ``start`` ... ``end``."""

    start: str
    end: str

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole output. An output that opens the block and never closes it is
        all reasoning (cut by max_tokens)."""
        stripped = text.lstrip()
        if not stripped.startswith(self.start):
            return None, text
        body = stripped[len(self.start) :]
        reasoning, closed, content = body.partition(self.end)
        return reasoning.strip("\n"), content.lstrip("\n") if closed else ""


REASONING_PARSERS: dict[str, ReasoningFormat] = {"qwen3": ReasoningFormat("<think>", "</think>")}
"""Reasoning formats by name (``--reasoning-parser``)."""


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag`` (it may start the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ChatOutputParser:
    """Splits one choice's output into content, reasoning and tool calls, whole (``parse``) or as deltas
    (``feed`` then ``finish``). tools: the tool-call parser (None: no tools); reasoning: the reasoning format
    (None: none)."""

    def __init__(self, tools: HermesToolParser | None, reasoning: ReasoningFormat | None) -> None:
        self.tools, self.reasoning = tools, reasoning
        self._pending = ""  # text not yet sent (a possible tag, a call being held)
        self._mode = "start" if reasoning is not None else "content"  # start | reasoning | content | call
        self._strip_lead = False  # newlines right after a reasoning tag are dropped (as by ``ReasoningFormat.split``)
        self.calls: list[ToolCall] = []

    def parse(self, text: str) -> dict[str, Any]:
        """The message fields of a whole output: content (None when only calls), reasoning_content when a
        reasoning format is set, tool_calls when any. The content is exactly what ``feed`` and ``finish`` send
        as content deltas, joined (text around the calls as generated, the newlines after each call dropped)."""
        reasoning, content = self.reasoning.split(text) if self.reasoning is not None else (None, text)
        message: dict[str, Any] = {}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        message["content"] = content
        if self.tools is not None:
            rest, self.calls = self.tools.parse(content)
            message["content"] = rest
            if self.calls:
                message["tool_calls"] = [c.to_json() for c in self.calls]
                message["content"] = _without_unclosed_call(rest, self.tools) or None
        return message

    def feed(self, text: str) -> dict[str, Any]:
        """The delta fields for newly generated ``text`` (content, reasoning_content, tool_calls)."""
        self._pending += text
        delta: dict[str, Any] = {}
        while self._pending and self._step(delta):
            pass
        return delta

    def finish(self) -> dict[str, Any]:
        """The delta fields of whatever is still held when the output ends. An unclosed call is content, unless
        calls came before it: then it is a call cut short (max_tokens) and is dropped, as vLLM drops it."""
        delta: dict[str, Any] = {}
        held, self._pending = self._pending, ""
        if self._mode == "call" and self.calls:
            return delta
        _add(delta, "reasoning_content" if self._mode == "reasoning" else "content", held)
        return delta

    def _step(self, delta: dict[str, Any]) -> bool:
        """Consume what it can of the pending text into ``delta``; False when the rest must wait for more."""
        assert self._mode in ("start", "reasoning", "content", "call")
        if self._mode == "start":
            return self._step_start()
        if self._strip_lead:
            self._pending = self._pending.lstrip("\n")
            if not self._pending:
                return False
            self._strip_lead = False
        if self._mode == "reasoning":
            return self._until(self.reasoning.end if self.reasoning else "", "reasoning_content", "content", delta)
        if self._mode == "content":
            if self.tools is None:
                _add(delta, "content", self._pending)
                self._pending = ""
                return False
            return self._until(self.tools.start, "content", "call", delta)
        return self._step_call(delta)

    def _step_start(self) -> bool:
        assert self.reasoning is not None
        stripped = self._pending.lstrip()
        if len(stripped) < len(self.reasoning.start) and self.reasoning.start.startswith(stripped):
            return False  # could still open the block
        if stripped.startswith(self.reasoning.start):
            self._pending = stripped[len(self.reasoning.start) :]
            self._mode, self._strip_lead = "reasoning", True
        else:
            self._mode = "content"
        return True

    def _until(self, tag: str, key: str, then: str, delta: dict[str, Any]) -> bool:
        """Send pending text as ``key`` up to ``tag`` (then switch to mode ``then``), holding a possible partial
        tag at the end (and, in reasoning, the newlines that may precede the closing tag)."""
        before, found, after = self._pending.partition(tag)
        closes_reasoning = key == "reasoning_content"
        if found:
            _add(delta, key, before.rstrip("\n") if closes_reasoning else before)
            self._pending = after if closes_reasoning else found + after
            self._mode, self._strip_lead = then, closes_reasoning
            return True
        held = _held_suffix(self._pending, tag)
        rest = self._pending[: len(self._pending) - held]
        if closes_reasoning:
            held += len(rest) - len(rest.rstrip("\n"))
        _add(delta, key, self._pending[: len(self._pending) - held])
        self._pending = self._pending[len(self._pending) - held :]
        return False

    def _step_call(self, delta: dict[str, Any]) -> bool:
        assert self.tools is not None
        end = self._pending.find(self.tools.end)
        if end < 0:
            return False
        whole = self._pending[: end + len(self.tools.end)]
        self._pending = self._pending[len(whole) :]
        _, calls = self.tools.parse(whole)
        # the newlines after a well-formed call go with it, also those that arrive later (as ``parse`` drops them)
        self._mode, self._strip_lead = "content", bool(calls)
        if not calls:
            _add(delta, "content", whole)
            return True
        for call in calls:
            delta.setdefault("tool_calls", []).append(call.to_json(len(self.calls)))
            self.calls.append(call)
        return True


def _without_unclosed_call(text: str, tools: HermesToolParser) -> str:
    """``text`` (the content outside well-formed calls) without a last call that opens and never closes."""
    start = text.rfind(tools.start)
    return text[:start] if start >= 0 and text.find(tools.end, start) < 0 else text


def _add(delta: dict[str, Any], key: str, text: str) -> None:
    if text:
        delta[key] = delta.get(key, "") + text


class ParsedChatFormat(ChatFormat):
    """Chat bodies whose messages and deltas go through a ``ChatOutputParser`` per choice: content,
    ``reasoning_content`` and ``tool_calls``; a choice that called tools finishes with "tool_calls".
    drop_reasoning: the reasoning is split off and not sent (vLLM's ``include_reasoning: false``)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        tokenizer: Any,
        tools: HermesToolParser | None,
        reasoning: ReasoningFormat | None,
        drop_reasoning: bool = False,
    ) -> None:
        super().__init__(request_id, model, tokenizer)
        self.tool_parser, self.reasoning, self.drop_reasoning = tools, reasoning, drop_reasoning
        self._parsers: dict[int, ChatOutputParser] = {}

    def parser(self) -> ChatOutputParser:
        """A fresh parser for one choice."""
        return ChatOutputParser(self.tool_parser, self.reasoning)

    def chunk(
        self,
        index: int,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None,
        finish_reason: str | None,
        counts: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk of choice ``index``: the parsed delta of ``text`` (a held tool call goes out whole
        once it closes)."""
        parser = self._parsers.setdefault(index, self.parser())
        delta = parser.feed(text)
        if finish_reason is not None:
            for key, value in parser.finish().items():
                _add(delta, key, value)
            if parser.calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        if self.drop_reasoning:
            delta.pop("reasoning_content", None)
        choice = {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        return self._chunk(choice, counts)

    def final(self, choices: Sequence[Choice], counts: dict[str, int]) -> dict[str, Any]:
        """The non-streamed body, each message parsed."""
        body = super().final(choices, counts)
        for rendered, choice in zip(body["choices"], choices, strict=True):
            parser = self.parser()
            rendered["message"] = {"role": "assistant", **parser.parse(choice.text)}
            if self.drop_reasoning:
                rendered["message"].pop("reasoning_content", None)
            if parser.calls and choice.finish_reason == "stop":
                rendered["finish_reason"] = "tool_calls"
        return body
