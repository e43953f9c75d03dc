"""The generation endpoints: parse the body, build the prompt and SamplingParams, submit, then either stream
server-sent events (ending in ``data: [DONE]``) or collect the whole output. A client that goes away before its
request finished has the request aborted (its KV blocks are freed between steps)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import attrs
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from fnvllm.executor.base import TokenLogprobs
from fnvllm.serve.async_engine import AsyncEngine, EngineOverloaded
from fnvllm.serve.errors import (
    bad_request,
    from_invalid_request,
    from_validation_error,
    internal,
    model_not_found,
    unavailable,
)
from fnvllm.serve.formats import ChatFormat, CompletionFormat, usage
from fnvllm.serve.limits import MAX_JSON_DEPTH, check_depth
from fnvllm.serve.protocol import FIELD_NAMES, ChatCompletionRequest, CompletionRequest
from fnvllm.serve.stream import EngineFailure, RequestStream
from fnvllm.state import SamplingParams

Body = TypeVar("Body", bound=BaseModel)
Format = CompletionFormat | ChatFormat


@attrs.frozen
class Served:
    """What the handlers serve: the engine and the one model name clients must ask for."""

    engine: AsyncEngine
    model_name: str
    stream_interval_s: float = 0.0


def parse(model: type[Body], raw: bytes) -> Body:
    """The validated body, or a 400 naming the first bad field (or saying the JSON is malformed or too deep)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    except RecursionError:  # the parser recurses per level: ~1,000 levels exhaust the stack
        raise bad_request(f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    check_depth(data)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error, FIELD_NAMES) from None


@attrs.frozen
class Prepared:
    """A parsed request, ready to submit: its prompt ids and text, SamplingParams, and how to answer.

    aliases: engine field -> body field, for errors raised at submit (see ``errors.from_invalid_request``)."""

    ids: list[int]
    text: str | None
    params: SamplingParams
    is_stream: bool
    include_usage: bool
    aliases: dict[str, str]


async def completions(served: Served, raw: bytes, receive: Receive) -> Response:
    """``POST /v1/completions``. Parsing and tokenization run on a worker thread: a large prompt never holds
    the event loop (``/health`` and every stream keep answering)."""
    job = await asyncio.to_thread(_prepare_completion, served, raw)
    stream = _submit(served.engine, job, "cmpl")
    fmt = CompletionFormat(stream.request_id, served.model_name, served.engine.tokenizer)
    return await _respond(served, stream, fmt, job, receive)


async def chat_completions(served: Served, raw: bytes, receive: Receive) -> Response:
    """``POST /v1/chat/completions``: the tokenizer's chat template (on a worker thread), then generation."""
    job = await asyncio.to_thread(_prepare_chat, served, raw)
    stream = _submit(served.engine, job, "chatcmpl")
    fmt = ChatFormat(stream.request_id, served.model_name, served.engine.tokenizer)
    return await _respond(served, stream, fmt, job, receive)


def _prepare_completion(served: Served, raw: bytes) -> Prepared:
    body = parse(CompletionRequest, raw)
    _check(body.model, served, body.check_supported)
    prompt = body.single_prompt()
    text = prompt if isinstance(prompt, str) else None
    ids = _encode(served.engine, prompt) if isinstance(prompt, str) else prompt
    params = _sampling_params(body.sampling_params, body.aliases())
    return Prepared(ids, text, params, bool(body.stream), body.include_usage, body.aliases())


def _prepare_chat(served: Served, raw: bytes) -> Prepared:
    body = parse(ChatCompletionRequest, raw)
    _check(body.model, served, body.check_supported)
    ids = _render_chat(served.engine, [m.template_dict() for m in body.messages])
    room = served.engine.max_total_tokens - len(ids)
    if room < 1:
        limit = served.engine.max_total_tokens - 1
        raise bad_request(f"messages: the conversation is {len(ids)} tokens; at most {limit} fit", "messages")
    params = _sampling_params(lambda: body.sampling_params(default_max_tokens=room), body.aliases())
    return Prepared(ids, None, params, bool(body.stream), body.include_usage, body.aliases())


def _check(model: str | None, served: Served, check_supported: Callable[[], None]) -> None:
    if model is not None and model != served.model_name:
        raise model_not_found(model, served.model_name)
    check_supported()


def _encode(engine: AsyncEngine, text: str) -> list[int]:
    if engine.tokenizer is None:
        raise bad_request("prompt: this server has no tokenizer; send token ids", "prompt")
    return list(engine.tokenizer.encode(text))


def _render_chat(engine: AsyncEngine, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the conversation with the assistant's turn opened (the template adds its own BOS)."""
    tokenizer = engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("messages: this model's tokenizer has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # the template itself rejects the conversation (e.g. role order)
        raise bad_request(f"messages: the chat template rejected the conversation: {error}", "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _sampling_params(build: Callable[[], SamplingParams], aliases: dict[str, str]) -> SamplingParams:
    try:
        return build()
    except (ValueError, TypeError) as error:  # InvalidRequestError is a ValueError naming the field
        raise from_invalid_request(ValueError(str(error)), aliases) from None


def _submit(engine: AsyncEngine, job: Prepared, prefix: str) -> RequestStream:
    try:
        return engine.submit(job.ids, job.params, job.text, request_id=f"{prefix}-{uuid.uuid4().hex}")
    except EngineOverloaded as error:
        raise unavailable(str(error)) from None
    except ValueError as error:
        raise from_invalid_request(error, job.aliases) from None


async def _respond(served: Served, stream: RequestStream, fmt: Format, job: Prepared, receive: Receive) -> Response:
    engine, params = served.engine, job.params
    wants_logprobs = params.logprobs is not None
    if job.is_stream:
        events = _sse(fmt, stream, job.include_usage, wants_logprobs, served.stream_interval_s)
        return _EventStream(events, on_close=lambda: _abort_unfinished(engine, stream))
    collected = await _collect_or_abort(engine, stream, receive)
    if collected is None:
        return Response(status_code=499)  # the client closed the connection; nobody reads this
    text, token_ids, logprobs, finish_reason = collected
    if finish_reason == "abort":
        raise unavailable("the request was aborted: the server is shutting down")
    counts = usage(len(stream.prompt_ids), len(token_ids))
    return JSONResponse(fmt.final(text, token_ids, logprobs if wants_logprobs else None, finish_reason, counts))


Collected = tuple[str, list[int], list[TokenLogprobs], str | None]


async def _collect(stream: RequestStream) -> Collected:
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs] = []
    finish_reason = None
    async for event in stream:
        text.append(event.text)
        token_ids.extend(event.token_ids)
        logprobs.extend(event.logprobs)
        finish_reason = event.finish_reason
    return "".join(text), token_ids, logprobs, finish_reason


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _collect_or_abort(engine: AsyncEngine, stream: RequestStream, receive: Receive) -> Collected | None:
    """The whole output, or None if the client disconnected first (then the request is aborted)."""
    collecting = asyncio.ensure_future(_collect(stream))
    watching = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()
            engine.abort(stream.request_id)
    if collecting.cancelled():
        return None
    try:
        return collecting.result()
    except EngineFailure as error:
        raise internal(str(error)) from None


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse(
    fmt: Format, stream: RequestStream, include_usage: bool, wants_logprobs: bool, interval_s: float = 0.0
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per read of the stream with new text (and the last one), usage if asked,
    ``[DONE]``. Each read takes every event that has arrived, so a client behind by several steps gets one chunk
    for all of them. With ``interval_s`` > 0 the stream pauses that long after each chunk, so the tokens of
    several steps go out together: fewer, larger writes for the web thread, which shares the GIL with the
    engine (``fnvllm serve --stream-interval-ms``)."""
    for chunk in fmt.opening_chunks():
        yield _data(chunk)
    num_tokens, sends_ids = 0, fmt.tokenizer is None
    try:
        while not stream.finished:
            event = await stream.drain()
            num_tokens += len(event.token_ids)
            if event.text or event.finish_reason is not None or event.logprobs or (sends_ids and event.token_ids):
                logprobs = event.logprobs if wants_logprobs else None
                yield _data(fmt.chunk(event.text, event.token_ids, logprobs, event.finish_reason))
                if interval_s > 0 and event.finish_reason is None:
                    await asyncio.sleep(interval_s)
    except EngineFailure as error:
        yield _data(internal(str(error)).body())
    else:
        if include_usage:
            yield _data(fmt.usage_chunk(usage(len(stream.prompt_ids), num_tokens)))
    yield "data: [DONE]\n\n"


def _abort_unfinished(engine: AsyncEngine, stream: RequestStream) -> None:
    if not stream.finished:
        engine.abort(stream.request_id)


class _EventStream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends: done, client disconnect, or cancellation."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events, self._on_close = events, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream the events; then abort the request if it has not finished."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self._events.aclose()  # type: ignore[attr-defined]
