"""The consumer side of one request: a ``RequestStream`` of ``TokenEvent``s, fed from the engine thread.

The engine thread calls ``put`` (never blocks: ``call_soon_threadsafe`` onto the consumer's event loop); the
consumer iterates it with ``async for``. A stream ends after the event with a finish reason, or raises
``EngineFailure`` if the engine failed the request.
"""

from __future__ import annotations

import asyncio

import attrs

from fnvllm.executor.base import TokenLogprobs
from fnvllm.state import FinishReason


class EngineFailure(Exception):
    """The engine failed while running this request (raised by its stream); the server keeps running."""


@attrs.frozen
class TokenEvent:
    """What one step added to a request: new text and ids, their logprobs (if asked), and the finish reason."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: FinishReason | None


class RequestStream:
    """The consumer side of one request: ``async for event in stream`` yields ``TokenEvent``s until the one with
    a finish reason; raises ``EngineFailure`` if the engine failed it. Fed from the engine thread."""

    def __init__(self, request_id: str, prompt_ids: tuple[int, ...], aloop: asyncio.AbstractEventLoop) -> None:
        self.request_id, self.prompt_ids = request_id, prompt_ids
        self.finished = False  # consumer side: the last event was read
        self._queue: asyncio.Queue[TokenEvent | EngineFailure] = asyncio.Queue()
        self._aloop = aloop
        self._closed = False  # engine side: the last event was sent

    def put(self, item: TokenEvent | EngineFailure) -> None:
        """Hand one event to the consumer's event loop (engine thread; never blocks)."""
        if self._closed:
            return
        self._closed = isinstance(item, EngineFailure) or item.finish_reason is not None
        try:
            self._aloop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self._closed = True

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, EngineFailure):
            self.finished = True
            raise item
        self.finished = item.finish_reason is not None
        return item
