"""The consumer side of one request: a ``RequestStream`` of ``TokenEvent``s, fed from the engine's step reports.

The engine's front hands over one step's events for every stream at once (``deliver``: one
``call_soon_threadsafe`` per step, not one per request — at 256 streams the per-call self-pipe write and
callback were most of the event loop's work). The consumer reads with ``async for`` (one event at a time) or
``drain`` (every event that has arrived, merged into one): a consumer that fell behind by several steps sends
one chunk for all of them, so the event loop's work per step shrinks exactly when it is the bottleneck. A stream
ends after the event with a finish reason, or raises ``EngineFailure`` if the engine failed the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterable

import attrs

from fnvllm.executor.base import TokenLogprobs
from fnvllm.state import FinishReason


class EngineFailure(Exception):
    """The engine failed while running this request (raised by its stream); the server keeps running."""


@attrs.frozen
class TokenEvent:
    """What one step added to a request: new text and ids, their logprobs (if asked), and the finish reason.
    prompt_logprobs: on a request's first event, its prompt logprobs when it asked (``RequestOutput``'s shape)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: FinishReason | None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


Item = TokenEvent | EngineFailure


def merge(events: list[TokenEvent]) -> TokenEvent:
    """Consecutive events of one request as one (texts, ids and logprobs joined; the last finish reason)."""
    if len(events) == 1:
        return events[0]
    text = "".join(e.text for e in events)
    ids = tuple(t for e in events for t in e.token_ids)
    logprobs = tuple(lp for e in events for lp in e.logprobs)
    prompt = next((e.prompt_logprobs for e in events if e.prompt_logprobs is not None), None)
    return TokenEvent(text, ids, logprobs, events[-1].finish_reason, prompt)


class RequestStream:
    """The consumer side of one request: ``async for event in stream`` yields ``TokenEvent``s until the one with
    a finish reason; raises ``EngineFailure`` if the engine failed it. Fed from the engine thread."""

    def __init__(self, request_id: str, prompt_ids: tuple[int, ...], aloop: asyncio.AbstractEventLoop) -> None:
        self.request_id, self.prompt_ids = request_id, prompt_ids
        self.finished = False  # consumer side: the last event was read
        self.aloop = aloop
        self._items: deque[Item] = deque()  # event loop thread only
        self._waiter: asyncio.Future[None] | None = None
        self._pause: asyncio.Future[None] | None = None  # ``pause``'s wait, ended early by the last event
        self._closed = False  # engine side: the last event was sent

    def put(self, item: Item) -> None:
        """Hand one event to the consumer's event loop (engine thread; never blocks)."""
        deliver([(self, item)])

    def accepts(self, item: Item) -> bool:
        """Engine side: False once the last event was sent (later ones are dropped); marks the stream closed
        when ``item`` is its last."""
        if self._closed:
            return False
        self._closed = isinstance(item, EngineFailure) or item.finish_reason is not None
        return True

    def push(self, item: Item) -> None:
        """Event loop side: queue ``item`` and wake the consumer (and end a ``pause`` when it is the last)."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._pause is not None and not self._pause.done() and _is_last(item):
            self._pause.set_result(None)

    async def pause(self, seconds: float) -> None:
        """Wait ``seconds`` (``--stream-interval-ms``: let several steps' tokens gather into one chunk), or until the
        last event arrives: the end of a stream is sent at once, never held for the interval."""
        if any(map(_is_last, self._items)):
            return
        self._pause = pause = self.aloop.create_future()
        timer = self.aloop.call_later(seconds, _settle, pause)
        try:
            await pause
        finally:
            timer.cancel()
            self._pause = None

    async def drain(self) -> TokenEvent:
        """Every event that has arrived (waiting for one), merged; raises ``EngineFailure`` if one is a failure
        (after the events before it were read) and ``StopAsyncIteration`` after the last event."""
        if self.finished:
            raise StopAsyncIteration
        await self._arrival()
        events: list[TokenEvent] = []
        while self._items and isinstance(self._items[0], TokenEvent):
            events.append(self._items.popleft())  # type: ignore[arg-type]
        if not events:
            self.finished = True
            raise self._items.popleft()  # type: ignore[misc]
        event = merge(events)
        self.finished = event.finish_reason is not None
        return event

    async def _arrival(self) -> None:
        while not self._items:
            self._waiter = self.aloop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        await self._arrival()
        item = self._items.popleft()
        if isinstance(item, EngineFailure):
            self.finished = True
            raise item
        self.finished = item.finish_reason is not None
        return item


def _is_last(item: Item) -> bool:
    return isinstance(item, EngineFailure) or item.finish_reason is not None


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def deliver(items: Iterable[tuple[RequestStream, Item]]) -> None:
    """Hand events to their streams' event loops, one thread-safe call per loop (engine thread; never blocks)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Item]]] = {}
    for stream, item in items:
        if stream.accepts(item):
            by_loop.setdefault(stream.aloop, []).append((stream, item))
    for aloop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            aloop.call_soon_threadsafe(_push_all, batch)


def _push_all(batch: list[tuple[RequestStream, Item]]) -> None:
    for stream, item in batch:
        stream.push(item)
