"""The output items of a ``/v1/responses`` answer, and its server-sent events.

``OutputWriter`` turns the chat parser's deltas (``ChatOutputParser.feed``: content, reasoning_content,
tool_calls) into Responses items, in the order they were generated:

- reasoning text opens a ``reasoning`` item with one ``reasoning_text`` part;
- content opens a ``message`` item (role assistant) with one ``output_text`` part;
- each tool call is one ``function_call`` item (its arguments arrive whole: the parser holds a call until it
  closes, so there is one arguments delta per call).

An item closes when an item of another kind follows or the output ends. Every step is also an event, as OpenAI
streams them::

    response.output_item.added      {"item": {..., "status": "in_progress"}}
    response.content_part.added     {"part": {"type": "output_text", "text": ""}}
    response.output_text.delta      {"delta": "Hel"}   (reasoning: response.reasoning_text.delta)
    response.output_text.done       {"text": "Hello"}
    response.content_part.done      {"part": {... the whole text}}
    response.output_item.done       {"item": {... "status": "completed"}}

and for a call: ``output_item.added``, ``function_call_arguments.delta``, ``function_call_arguments.done``,
``output_item.done``. ``stream_events`` wraps them in ``response.created`` / ``response.in_progress`` and a last
``response.completed`` (``response.incomplete`` when max_output_tokens cut the output, ``response.failed`` when the
engine failed or shut down), numbering every event (``sequence_number``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Literal

from fnvllm.serve.stream import EngineFailure, RequestStream
from fnvllm.serve.tool_parsers import ChatOutputParser

if TYPE_CHECKING:
    from fnvllm.serve.responses import ResponseShell

Status = Literal["completed", "incomplete"]
Event = dict[str, Any]

# Per text item kind: the id prefix, the part's type, and the delta / done event names.
_TEXT_KINDS = {
    "message": ("msg", "output_text", "response.output_text"),
    "reasoning": ("rs", "reasoning_text", "response.reasoning_text"),
}


def status_of(finish_reason: str | None) -> Status:
    """A finished generation's status: cut by the token limit is "incomplete", anything else "completed"."""
    return "incomplete" if finish_reason == "length" else "completed"


class OutputWriter:
    """Builds one response's output items from its generated text, recording each step as an event.

    items: the output items so far (the open one still "in_progress"). events: the events not yet taken
    (None: not recorded, for an answer that is not streamed)."""

    def __init__(self, parser: ChatOutputParser, new_id: Callable[[str], str], record_events: bool) -> None:
        self.parser, self._new_id = parser, new_id
        self.items: list[dict[str, Any]] = []
        self.events: list[Event] | None = [] if record_events else None
        self._open: dict[str, Any] | None = None  # the text item receiving deltas (message or reasoning)

    def add(self, text: str) -> None:
        """Write newly generated ``text``."""
        self._write(self.parser.feed(text))

    def finish(self, status: Status) -> None:
        """Write what the parser still holds, and close the last item with ``status``."""
        self._write(self.parser.finish())
        self._close(status)

    def take_events(self) -> list[Event]:
        """The events recorded since the last call."""
        taken, self.events = self.events or [], [] if self.events is not None else None
        return taken

    def _write(self, delta: dict[str, Any]) -> None:
        if delta.get("reasoning_content"):
            self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            self._text("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            self._call(call["id"], call["function"]["name"], call["function"]["arguments"])

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.events is not None:  # a copy: the items change after the event is recorded
            self.events.append({"type": kind, **copy.deepcopy(fields)})

    def _text(self, kind: str, text: str) -> None:
        """Append ``text`` to the open item of ``kind``, opening one (and closing another kind) first."""
        if self._open is None or self._open["type"] != kind:
            self._close("completed")
            self._open = self._open_text(kind)
        part = self._open["content"][0]
        part["text"] += text
        where = {"item_id": self._open["id"], "output_index": len(self.items) - 1, "content_index": 0}
        self._emit(_TEXT_KINDS[kind][2] + ".delta", **where, delta=text, **_logprobs(kind))

    def _open_text(self, kind: str) -> dict[str, Any]:
        prefix, part_type, _ = _TEXT_KINDS[kind]
        item: dict[str, Any] = {"id": self._new_id(prefix), "type": kind, "status": "in_progress"}
        item |= {"role": "assistant", "content": []} if kind == "message" else {"summary": [], "content": []}
        self.items.append(item)
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=item)
        part: dict[str, Any] = {"type": part_type, "text": ""} | ({"annotations": []} if kind == "message" else {})
        item["content"].append(part)
        self._emit("response.content_part.added", **self._where(item), part=part)
        return item

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}

    def _close(self, status: Status) -> None:
        """Close the open text item (if any) with ``status``."""
        item, self._open = self._open, None
        if item is None:
            return
        part = item["content"][0]
        self._emit(
            _TEXT_KINDS[item["type"]][2] + ".done", **self._where(item), text=part["text"], **_logprobs(item["type"])
        )
        self._emit("response.content_part.done", **self._where(item), part=part)
        item["status"] = status
        self._emit("response.output_item.done", output_index=self.items.index(item), item=item)

    def _call(self, call_id: str, name: str, arguments: str) -> None:
        """One whole function call: its item, opened and closed."""
        self._close("completed")
        item = {"id": self._new_id("fc"), "type": "function_call", "call_id": call_id, "name": name}
        item |= {"arguments": "", "status": "in_progress"}
        self.items.append(item)
        index = len(self.items) - 1
        self._emit("response.output_item.added", output_index=index, item=item)
        self._emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=arguments)
        item |= {"arguments": arguments, "status": "completed"}
        self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=arguments)
        self._emit("response.output_item.done", output_index=index, item=item)


def _logprobs(kind: str) -> dict[str, Any]:
    """Text events of a message carry (empty) logprobs, as the API's schema requires; reasoning's do not."""
    return {"logprobs": []} if kind == "message" else {}


class _Numbered:
    """Server-sent events numbered from 0 (``sequence_number``), each named by its type."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event: Event) -> str:
        event = {**event, "sequence_number": self.count}
        self.count += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


async def stream_events(
    shell: ResponseShell, writer: OutputWriter, stream: RequestStream, interval_s: float
) -> AsyncIterator[str]:
    """The events of one streamed response: created and in_progress, the writer's events as tokens arrive, then
    completed / incomplete with the whole response (usage included), or failed when the engine failed or aborted
    the request. ``interval_s``: least time between two reads of the stream (``--stream-interval-ms``)."""
    numbered = _Numbered()
    for kind in ("response.created", "response.in_progress"):
        yield numbered({"type": kind, "response": shell.body("in_progress", [], None)})
    num_tokens, failure, finish_reason = 0, None, None
    try:
        while not stream.finished:
            event = await stream.drain()
            num_tokens, finish_reason = num_tokens + len(event.token_ids), event.finish_reason
            writer.add(event.text)
            if finish_reason == "abort":
                failure = "the request was aborted: the server is shutting down"
                break
            if finish_reason is not None:
                writer.finish(status_of(finish_reason))
            for step in writer.take_events():
                yield numbered(step)
            if interval_s > 0 and finish_reason is None:
                await stream.pause(interval_s)  # ends early when the last event comes: it goes out at once
    except EngineFailure as error:
        failure = str(error)
    if failure is not None:  # the items so far end "incomplete", then the response fails
        writer.finish("incomplete")
        for step in writer.take_events():
            yield numbered(step)
        error_body = {"code": "server_error", "message": failure}
        yield numbered(
            {"type": "response.failed", "response": shell.body("failed", writer.items, num_tokens, error_body)}
        )
        return
    status = status_of(finish_reason)
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield numbered({"type": kind, "response": shell.body(status, writer.items, num_tokens)})
