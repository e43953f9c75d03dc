"""The non-streamed handlers' wait for every stream or the client's disconnect (`handlers._collect_or_abort`), on
real `RequestStream`s in one event loop: a disconnect returns None, aborts the unfinished requests and leaves
nothing for asyncio to report; finished streams return their choices."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")

from fnvllm.serve import handlers
from fnvllm.serve.stream import RequestStream, TokenEvent


class AbortLog:
    """Stands in for the engine's front door: records which request ids were aborted."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


async def _run(disconnect_first: bool) -> tuple[Any, list[str], list[dict[str, Any]]]:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    streams = [RequestStream(f"r{i}", (1, 2), loop) for i in range(2)]
    streams[0].push(TokenEvent("a", (5,), (), None))  # one token in, neither request finished
    left = asyncio.Event()

    async def receive() -> dict[str, str]:
        await left.wait()
        return {"type": "http.disconnect"}

    engine = AbortLog()
    task = asyncio.ensure_future(handlers._collect_or_abort(engine, streams, receive))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    if disconnect_first:
        left.set()
    else:
        for i, stream in enumerate(streams):
            stream.push(TokenEvent(f"b{i}", (6 + i,), (), "length"))
    result = await task
    for _ in range(5):  # let the cancelled collectors settle, then drop them
        await asyncio.sleep(0)
    gc.collect()
    return result, engine.aborted, reported


def test_a_client_that_leaves_gets_its_requests_aborted_and_nothing_is_logged() -> None:
    result, aborted, reported = asyncio.run(_run(disconnect_first=True))
    assert result is None
    assert aborted == ["r0", "r1"]
    assert reported == [], [c.get("message") for c in reported]


def test_finished_streams_return_their_choices_and_abort_nothing() -> None:
    result, aborted, reported = asyncio.run(_run(disconnect_first=False))
    assert [(c.text, c.token_ids, c.finish_reason) for c in result] == [
        ("ab0", (5, 6), "length"),
        ("b1", (7,), "length"),
    ]
    assert aborted == [] and reported == []


def test_a_stream_interval_never_holds_the_last_event() -> None:
    """``--stream-interval-ms``: after a chunk the stream pauses for the interval (an hour here), but the event that
    ends it cuts the pause short, so the end goes out at once (it waited out the interval before)."""
    from fnvllm.serve.formats import CompletionFormat
    from fnvllm.serve.sse import StreamPlan, events

    async def run() -> list[str]:
        stream = RequestStream("r", (1,), asyncio.get_running_loop())
        stream.push(TokenEvent("a", (5,), (), None))
        plan = StreamPlan(None, include_usage=False, continuous_usage=False, logprobs=False, num_prompt_tokens=1,
                          interval_s=3600.0)  # fmt: skip
        lines = events(CompletionFormat("id", "m", None), [stream], plan)
        first = await lines.__anext__()
        asyncio.get_running_loop().call_later(0.05, stream.push, TokenEvent("b", (6,), (), "length"))
        rest = await asyncio.wait_for(_all(lines), timeout=30)  # TimeoutError if the pause held the end
        return [first, *rest]

    async def _all(lines: Any) -> list[str]:
        return [line async for line in lines]

    lines = asyncio.run(run())
    assert lines[-1] == "data: [DONE]\n\n" and '"finish_reason":"length"' in lines[-2]
