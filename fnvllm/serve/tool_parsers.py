"""Tool calls and reasoning in chat output: ``ChatOutputParser`` splits generated text into content,
``reasoning_content`` and ``tool_calls``, whole or streamed, for any tool-call format of ``tool_formats`` (whose
public names are re-exported here: the specs a request sends, the parsers, ``TOOL_PARSERS``) and any reasoning
format of ``REASONING_PARSERS`` ("qwen3" splits ``<think>...</think>`` off the start of the output).

Streaming: text outside a tool call goes out as content deltas as it comes; once a call block opens, text is held
until the block closes (at ``</tool_call>`` in the hermes format, at the end of the JSON in the JSON formats, at the
list's closing bracket in the pythonic format), then its calls go out as one ``tool_calls`` delta (id, name and the
complete arguments). A marker split across two deltas is held until it can be told apart from text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from fnvllm.executor.base import TokenLogprobs
from fnvllm.serve.formats import ChatFormat, Choice
from fnvllm.serve.tool_formats import (
    TOOL_PARSERS,
    FunctionSpec,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    ToolCall,
    ToolCallParser,
    ToolSpec,
    held_suffix,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChatOutputParser",
    "FunctionSpec",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedChatFormat",
    "PythonicToolParser",
    "ReasoningFormat",
    "ToolCall",
    "ToolCallParser",
    "ToolSpec",
]


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


class ChatOutputParser:
    """Splits one choice's output into content, reasoning and tool calls, whole (``parse``) or as deltas
    (``feed`` then ``finish``). tools: the tool-call format (None: no tools); reasoning: the reasoning format
    (None: none)."""

    def __init__(self, tools: ToolCallParser | None, reasoning: ReasoningFormat | None) -> None:
        self.tools, self.reasoning = tools, reasoning
        self._pending = ""  # text not yet sent (a possible marker, a call being held)
        self._mode = "start" if reasoning is not None else "content"  # start | reasoning | content | call
        # characters dropped from the front of what comes next: newlines after a reasoning tag (as
        # ``ReasoningFormat.split`` drops them), the tool format's separator after a call (as its ``parse`` does)
        self._strip_lead = ""
        self._at_start = True  # no content sent since the content began or the last call
        self.calls: list[ToolCall] = []

    def parse(self, text: str) -> dict[str, Any]:
        """The message fields of a whole output: content (None when only calls), reasoning_content when a
        reasoning format is set, tool_calls when any. The content is exactly what ``feed`` and ``finish`` send
        as content deltas, joined (text around the calls as generated, each call's separator dropped)."""
        reasoning, content = self.reasoning.split(text) if self.reasoning is not None else (None, text)
        message: dict[str, Any] = {}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        message["content"] = content
        if self.tools is not None:
            rest, self.calls = self.tools.parse(content)
            message["content"] = (rest or None) if self.calls else rest
            if self.calls:
                message["tool_calls"] = [c.to_json() for c in self.calls]
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
            self._pending = self._pending.lstrip(self._strip_lead)
            if not self._pending:
                return False
            self._strip_lead = ""
        if self._mode == "reasoning":
            return self._step_reasoning(delta)
        if self._mode == "content":
            return self._step_content(delta)
        return self._step_call(delta)

    def _step_start(self) -> bool:
        assert self.reasoning is not None
        stripped = self._pending.lstrip()
        if len(stripped) < len(self.reasoning.start) and self.reasoning.start.startswith(stripped):
            return False  # could still open the block
        if stripped.startswith(self.reasoning.start):
            self._pending = stripped[len(self.reasoning.start) :]
            self._mode, self._strip_lead = "reasoning", "\n"
        else:
            self._mode = "content"
        return True

    def _step_reasoning(self, delta: dict[str, Any]) -> bool:
        """Send pending text as reasoning up to the closing tag (then switch to content), holding a possible
        partial tag at the end and the newlines that may precede it."""
        assert self.reasoning is not None
        before, found, after = self._pending.partition(self.reasoning.end)
        if found:
            _add(delta, "reasoning_content", before.rstrip("\n"))
            self._pending, self._mode, self._strip_lead = after, "content", "\n"
            return True
        held = held_suffix(self._pending, self.reasoning.end)
        rest = self._pending[: len(self._pending) - held]
        held += len(rest) - len(rest.rstrip("\n"))
        _add(delta, "reasoning_content", self._pending[: len(self._pending) - held])
        self._pending = self._pending[len(self._pending) - held :]
        return False

    def _step_content(self, delta: dict[str, Any]) -> bool:
        """Send the pending text that is surely content; switch to holding a call when one opens."""
        if self.tools is None:
            _add(delta, "content", self._pending)
            self._pending = ""
            return False
        size, opens = self.tools.split_content(self._pending, self._at_start)
        if size:
            _add(delta, "content", self._pending[:size])
            self._pending, self._at_start = self._pending[size:], False
        if opens:
            self._mode = "call"
        return opens

    def _step_call(self, delta: dict[str, Any]) -> bool:
        """Hold the call block until it closes; then send its calls, or the block as content when malformed."""
        assert self.tools is not None
        end = self.tools.block_len(self._pending)
        if end is None:
            return False
        block, self._pending = self._pending[:end], self._pending[end:]
        self._mode = "content"
        calls = self.tools.parse_block(block)
        if calls is None:
            _add(delta, "content", block)
            self._at_start = False
            return True
        # the separator after a well-formed call goes with it, also what arrives later (as ``parse`` drops it)
        self._strip_lead, self._at_start = self.tools.after_call, True
        for call in calls:
            delta.setdefault("tool_calls", []).append(call.to_json(len(self.calls)))
            self.calls.append(call)
        return True


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
        tools: ToolCallParser | None,
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
