"""``POST /v1/responses``: OpenAI's Responses API over the chat path.

A request is translated into a chat completions body (``to_chat``): ``instructions`` becomes a system message
first, each ``input`` item a chat message (``function_call`` items an assistant message's ``tool_calls``,
``function_call_output`` items ``tool`` messages), ``max_output_tokens`` max_tokens, ``text.format``
response_format, function tools the chat shape. That body then takes the chat endpoint's own road
(``handlers.prepare_chat``: the chat template, the same sampling fields, forced tool calls, structured output),
and the output goes through the chat endpoint's parser (``ChatOutputParser``: tool calls, reasoning).

The parsed output becomes the response's items (``response_items.OutputWriter``): a ``reasoning`` item (with a
reasoning parser), a ``message`` holding one ``output_text`` part, and a ``function_call`` item per call.
Streamed, they come in the order they were generated, each step an event (``response.output_item.added``, ...,
``response.output_text.delta``, ...) numbered by ``sequence_number``. Unstreamed, the same writer reads the whole
output at once, so the items are grouped as chat's message is: the reasoning, the text (all of it, also text
after a call), then the calls. The two differ only for an output with text after a call (streamed, that text is a
second message).

Nothing is stored: ``store`` is accepted only as false (or left out), and ``previous_response_id`` and
``background`` are refused by name. ``metadata`` and ``user`` are echoed, and change nothing.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from fnvllm.serve import handlers, protocol, sse
from fnvllm.serve.errors import APIError, bad_request, from_validation_error
from fnvllm.serve.protocol import ChatCompletionRequest, Number, Text
from fnvllm.serve.response_items import OutputWriter, status_of, stream_events
from fnvllm.serve.tool_parsers import REASONING_PARSERS, TOOL_PARSERS, ChatOutputParser


class _Strict(BaseModel):
    """A body part that rejects fields it does not declare."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ContentPart(_Strict):
    """A text part of an input message: ``input_text``, or ``output_text`` in an assistant message sent back
    (its annotations and logprobs are not rendered). Images, files and audio are not supported."""

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


Content = Text | list[ContentPart]


def _text_of(content: Content) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class _InputItem(_Strict):
    """What every input item may carry when it is an output sent back: its id and status (not rendered)."""

    id: StrictStr | None = None
    status: StrictStr | None = None


class MessageItem(_InputItem):
    """An input message (``type`` may be left out); an assistant message sent back carries its id and status."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(_InputItem):
    """A call the model made, sent back with the conversation (an assistant message's tool call)."""

    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr


class FunctionCallOutputItem(_InputItem):
    """The result of a call (a ``tool`` message answering ``call_id``)."""

    type: Literal["function_call_output"]
    call_id: StrictStr
    output: Content


class ReasoningItem(_InputItem):
    """A reasoning item sent back with the conversation: accepted and not rendered (as chat's
    ``reasoning_content``)."""

    type: Literal["reasoning"]
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: StrictStr | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
"""The input item types served, by their ``type`` (a message may leave it out)."""


class FunctionTool(_Strict):
    """A function the model may call, in the Responses shape (name and parameters at the top level)."""

    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def chat_dict(self) -> dict[str, Any]:
        """The tool in the chat shape (``{"type": "function", "function": {...}}``)."""
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(_Strict):
    """``tool_choice`` naming one function."""

    type: Literal["function"]
    name: StrictStr


class TextFormat(_Strict):
    """``text.format``: ``text`` (the default), ``json_object``, or ``json_schema`` with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(_Strict):
    """``text``: the output's format."""

    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses``'s body (the fields this server serves; any other is a 400 naming it)."""

    model: StrictStr | None = None
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    stream: StrictBool | None = None
    text: TextConfig | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    background: StrictBool | None = None

    def check_supported(self) -> None:
        """A 400 naming ``store``, ``previous_response_id`` or ``background`` when set: nothing is stored."""
        if self.store:
            raise bad_request("store: this server stores no responses; send false or leave it out", "store")
        if self.previous_response_id is not None:
            message = "previous_response_id: this server stores no responses; send the whole conversation as input"
            raise bad_request(message, "previous_response_id")
        if self.background:
            raise bad_request("background: not supported (send false or leave it out)", "background")

    def items(self) -> list[InputItem]:
        """The input as items (a string is one user message), each validated; a 400 names ``input.<i>...``."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return [_item(i, raw) for i, raw in enumerate(self.input)]

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completions body that generates this response."""
        body: dict[str, Any] = {"model": self.model, "messages": chat_messages(self.instructions, self.items())}
        sent = {"max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p}
        sent |= {"parallel_tool_calls": self.parallel_tool_calls, "stream": self.stream}
        body |= {key: value for key, value in sent.items() if value is not None}
        if self.tools:
            body["tools"] = [tool.chat_dict() for tool in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            body["response_format"] = _response_format(self.text.format)
        return ChatCompletionRequest.model_validate(body)


def _item(index: int, raw: dict[str, Any]) -> InputItem:
    """Input item ``index``, validated as its ``type`` says; a 400 names the item's field."""
    kind = raw.get("type", "message")
    model = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        message = f"input.{index}.type: must be one of {sorted(ITEM_TYPES)} (nothing is stored to refer to), got"
        raise bad_request(f"{message} {kind!r}", f"input.{index}.type")
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        found = from_validation_error(error, FIELD_NAMES)
        raise bad_request(f"input.{index}.{found.message}", f"input.{index}.{found.param or ''}".rstrip(".")) from None


def chat_messages(instructions: str | None, items: list[InputItem]) -> list[dict[str, Any]]:
    """The chat messages of a conversation: the instructions as a system message first, then one message per
    item; consecutive function calls join the assistant message before them (as a chat client sends them)."""
    messages: list[dict[str, Any]] = [] if instructions is None else [{"role": "system", "content": instructions}]
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function"}
            call["function"] = {"name": item.name, "arguments": item.arguments}  # type: ignore[assignment]
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text_of(item.output)})
    return messages


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    """``text.format`` as chat's ``response_format``."""
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = fmt.model_dump(include={"name", "description", "schema_", "strict"}, by_alias=True, exclude_none=True)
    return {"type": "json_schema", "json_schema": schema}


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for model in models for name in model.model_fields) | {"schema"}


FIELD_NAMES = _field_names(ResponsesRequest, *ITEM_TYPES.values(), ContentPart, FunctionTool, TextConfig, TextFormat)
"""Every field name of the body (error locations are cut at the first part that is not one)."""

RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
"""Chat fields the chat path's errors name -> the Responses field the client sent."""


def _renamed(error: APIError) -> APIError:
    """A 400 of the chat path, naming the Responses field instead of the chat field it became."""
    head, sep, rest = (error.param or "").partition(".")
    if error.status != 400 or head not in RENAMED:
        return error
    message = error.message
    if message.startswith(head):
        message = RENAMED[head] + message[len(head) :]
    return bad_request(message, RENAMED[head] + sep + rest)


def prepare(served: handlers.Served, raw: bytes) -> tuple[handlers.Prepared, ResponsesRequest]:
    """The chat job of a Responses body and the body itself (on a worker thread); 400s name the body's fields."""
    body = handlers.parse(ResponsesRequest, raw, FIELD_NAMES)
    body.check_supported()
    try:
        return handlers.prepare_chat(served, body.to_chat(), {"max_tokens": "max_output_tokens"}), body
    except ValidationError as error:  # the chat body refuses what the items left (no message at all)
        raise _renamed(from_validation_error(error, protocol.FIELD_NAMES)) from None
    except APIError as error:
        raise _renamed(error) from None


async def create(served: handlers.Served, raw: bytes, receive: Receive) -> Response:
    """``POST /v1/responses``: the response object, or its events with ``stream: true``."""
    response_id = f"resp_{uuid.uuid4().hex}"
    bodies: list[ResponsesRequest] = []

    def prepare_job(served: handlers.Served, raw: bytes) -> handlers.Prepared:
        job, body = prepare(served, raw)
        bodies.append(body)
        return job

    job, streams = await handlers.start(prepare_job, served, raw, response_id)
    shell = ResponseShell(response_id, served.model_name, bodies[0], job.num_prompt_tokens)
    writer = OutputWriter(_parser(served, job.parse_tools), shell.output_id, record_events=job.is_stream)
    if job.is_stream:
        interval_s = served.stream_interval_s
        events = stream_events(shell, writer, streams[0], interval_s)
        return sse.EventStream(events, on_close=lambda: handlers.abort_unfinished(served.engine, streams))
    collected = await handlers.collect_all(served.engine, streams, receive)
    if collected is None:
        return Response(status_code=499)  # the client closed the connection; nobody reads this
    (choice,) = collected
    writer.add(choice.text)
    status = status_of(choice.finish_reason)
    writer.finish(status)
    return JSONResponse(shell.body(status, writer.items, len(choice.token_ids)))


def _parser(served: handlers.Served, parse_tools: bool) -> ChatOutputParser:
    """The chat endpoint's output parser: tool calls when the request uses tools, the server's reasoning format."""
    tools = TOOL_PARSERS[served.tool_parser]() if parse_tools else None
    reasoning = REASONING_PARSERS[served.reasoning_parser] if served.reasoning_parser is not None else None
    return ChatOutputParser(tools, reasoning)


class ResponseShell:
    """The response object's fields that do not depend on the output: its id, creation time, the model, and the
    request's settings echoed (instructions, limits, sampling, tools, text format, metadata, user)."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest, num_input_tokens: int) -> None:
        self.id, self.model, self.request, self.num_input_tokens = response_id, model, body, num_input_tokens
        self.created_at = int(time.time())

    def output_id(self, prefix: str) -> str:
        """A new output item id (``msg_...``, ``fc_...``, ``rs_...``)."""
        return f"{prefix}_{uuid.uuid4().hex}"

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        num_output_tokens: int | None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """The response object: ``status``, its ``output`` items, the usage (None: not known yet) and error."""
        body = self.request
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionChoice) else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "tool_choice": tool_choice or body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "metadata": body.metadata or {}, "user": body.user, "store": False, "background": False,
            "previous_response_id": None, "truncation": "disabled",
            "usage": None if num_output_tokens is None else self.usage(num_output_tokens),
        }  # fmt: skip

    def usage(self, num_output_tokens: int) -> dict[str, Any]:
        """The usage object (cache and reasoning token details are not counted: 0)."""
        return {
            "input_tokens": self.num_input_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.num_input_tokens + num_output_tokens,
        }
