"""Server-sent events of one HTTP request: every choice's chunks as its engine request produces them, then the
usage (if asked) and ``data: [DONE]``. Choices known only at the end (beam search) go out one chunk each, in the
same shapes (``final_events``).

One choice reads its ``RequestStream`` directly; several (``n`` > 1, a batch of prompts) each get a small task
that drains its stream into one queue, so the chunks of all choices interleave as they are generated. A stream
the engine aborted (the server is shutting down) ends with an error event, never with a finish reason outside
OpenAI's ("stop", "length"); so does an engine failure.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import attrs
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from fnvllm.serve.errors import APIError, internal
from fnvllm.serve.formats import ChatFormat, Choice, CompletionFormat, echoed_logprobs, usage
from fnvllm.serve.stream import EngineFailure, RequestStream, TokenEvent

Format = CompletionFormat | ChatFormat


def aborted() -> APIError:
    """The error event that ends a stream the engine aborted (shutdown)."""
    return APIError(503, "the request was aborted: the server is shutting down", "server_error", None, "aborted")


@attrs.frozen
class StreamPlan:
    """How to stream one HTTP request's choices (stream k is choice k).

    echo_texts: per choice, text sent before its first token (the prompt, for ``echo``), or None.
    include_usage: a last chunk with the totals. continuous_usage: the counts so far in every chunk.
    logprobs: send each token's logprobs. num_prompt_tokens: the usage's prompt_tokens.
    interval_s: pause after each chunk of a choice (``--stream-interval-ms``).
    echo_ids: with echo and logprobs, per choice its prompt's ids: the echoed prompt is then sent with its
        logprobs, once they arrive (with the choice's first tokens), instead of first.
    """

    echo_texts: Sequence[str] | None
    include_usage: bool
    continuous_usage: bool
    logprobs: bool
    num_prompt_tokens: int
    interval_s: float = 0.0
    echo_ids: Sequence[Sequence[int]] | None = None


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def events(fmt: Format, streams: Sequence[RequestStream], plan: StreamPlan) -> AsyncIterator[str]:
    """The whole event stream of one request. Each read of a stream takes every event that has arrived (a
    consumer behind by several steps sends one chunk for them all); with ``interval_s`` > 0 a choice waits that
    long after each chunk, so several steps' tokens go out together: fewer, larger writes for the web thread."""
    for chunk in fmt.opening_chunks(len(streams)):
        yield _data(chunk)
    pending_echo = set(range(len(streams))) if plan.echo_ids is not None else set()
    for index, text in enumerate(() if pending_echo else plan.echo_texts or ()):
        yield _data(fmt.chunk(index, text, (), None, None))
    num_tokens, sends_ids = 0, fmt.tokenizer is None
    reads = _one(streams[0], plan.interval_s) if len(streams) == 1 else _merged(streams, plan.interval_s)
    error: APIError | None = None
    try:
        async for index, item in reads:
            if isinstance(item, EngineFailure) or item.finish_reason == "abort":
                error = internal(str(item)) if isinstance(item, EngineFailure) else aborted()
                break
            if index in pending_echo and isinstance(fmt, CompletionFormat) and plan.echo_texts and plan.echo_ids:
                pending_echo.discard(index)
                scored = echoed_logprobs(plan.echo_ids[index], item.prompt_logprobs)
                yield _data(fmt.chunk(index, plan.echo_texts[index], (), scored, None))
            num_tokens += len(item.token_ids)
            if item.text or item.finish_reason is not None or item.logprobs or (sends_ids and item.token_ids):
                counts = usage(plan.num_prompt_tokens, num_tokens) if plan.continuous_usage else None
                logprobs = item.logprobs if plan.logprobs else None
                chunk = fmt.chunk(index, item.text, item.token_ids, logprobs, item.finish_reason, counts)
                if not _says_nothing(chunk):
                    yield _data(chunk)
    finally:
        await reads.aclose()  # type: ignore[attr-defined]
    if error is not None:
        yield _data(error.body())
    elif plan.include_usage:
        yield _data(fmt.usage_chunk(usage(plan.num_prompt_tokens, num_tokens)))
    yield "data: [DONE]\n\n"


def _says_nothing(chunk: dict[str, Any]) -> bool:
    """A chat chunk with an empty delta, no finish reason and no logprobs: tokens a parser holds back (a tool
    call until it closes, the reasoning markers) leave nothing to send, and vLLM sends nothing for them."""
    choice = chunk["choices"][0]
    logprobs = choice.get("logprobs")
    return choice.get("delta") == {} and choice["finish_reason"] is None and not (logprobs and logprobs["content"])


Read = tuple[int, TokenEvent | EngineFailure]


async def _one(stream: RequestStream, interval_s: float) -> AsyncIterator[Read]:
    """The reads of a single stream, as (0, event), ending with its last event or its failure."""
    try:
        while not stream.finished:
            event = await stream.drain()
            yield 0, event
            if interval_s > 0 and event.finish_reason is None:
                await stream.pause(interval_s)  # ends early when the last event comes: it goes out at once
    except EngineFailure as failure:
        yield 0, failure


async def _merged(streams: Sequence[RequestStream], interval_s: float) -> AsyncIterator[Read]:
    """The reads of several streams as they arrive, as (stream index, event), until every stream has ended."""
    queue: asyncio.Queue[Read] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        async for read in _one(stream, interval_s):
            await queue.put((index, read[1]))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            yield index, item
            if isinstance(item, EngineFailure) or item.finish_reason is not None:
                remaining -= 1
    finally:
        for task in tasks:
            task.cancel()


async def final_events(
    fmt: Format, num_choices: int, answer: Callable[[], Awaitable[Sequence[Choice] | None]], plan: StreamPlan
) -> AsyncIterator[str]:
    """The event stream of choices known only once they are all done (beam search ranks whole beams at the end):
    the opening chunks at once, then each of ``answer()``'s choices as one chunk (its whole text, ids, logprobs
    and finish reason; an echo is already in its text), then the usage (if asked) and ``data: [DONE]``. An
    APIError raised by ``answer`` ends the stream with its error event; None (the client left) ends it at once."""
    for chunk in fmt.opening_chunks(num_choices):
        yield _data(chunk)
    try:
        choices = await answer()
    except APIError as error:
        yield _data(error.body())
        yield "data: [DONE]\n\n"
        return
    if choices is None:
        return
    num_tokens = 0
    for c in choices:
        num_tokens += len(c.token_ids)
        counts = usage(plan.num_prompt_tokens, num_tokens) if plan.continuous_usage else None
        yield _data(fmt.chunk(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, counts))
    if plan.include_usage:
        yield _data(fmt.usage_chunk(usage(plan.num_prompt_tokens, num_tokens)))
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends: done, client disconnect, or cancellation."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events, self._on_close = body, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream the events; then abort the requests that have not finished."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self._events.aclose()  # type: ignore[attr-defined]
