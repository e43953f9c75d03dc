"""The server's AsyncEngine in-process (no HTTP): its engine thread survives a failing step, never waits for a slow
consumer, frees KV blocks on abort, and enforces the waiting cap."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="fnvllm.serve needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("uvicorn", reason="fnvllm.serve needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("prometheus_client", reason="fnvllm.serve needs the [serve] extra")

from tiny_models import write_family

from fnvllm.llm import LLM
from fnvllm.serve import AsyncEngine, EngineFailure, EngineOverloaded, RequestStream
from fnvllm.serve.async_engine import Submission
from fnvllm.state import InvalidRequestError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = [5, 9, 13, 200, 7, 42, 42, 11]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path: Path = write_family(tmp_path_factory.mktemp("async-engine"), "qwen3")
    return LLM(path, dtype="float32", device="cpu", block_size=8, num_blocks=128, attention_backend="torch")


@pytest.fixture
def engine(llm: LLM) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(llm.loop, llm.tokenizer, max_waiting=4)
    engine.start()
    yield engine
    engine.stop()
    llm.loop.on_step = None


async def _ids(stream: RequestStream) -> list[int]:
    return [t async for event in stream for t in event.token_ids]


async def _eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until ``condition()`` holds (the engine thread publishes its snapshot after each step)."""
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition did not hold in time")


def _run(coro: Any, timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(
    engine: AsyncEngine, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception in a step raises EngineFailure in the streams in flight; the next request runs normally."""
    expected = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].token_ids
    real_execute, calls = llm.executor.execute, []

    def execute_failing_once(plan: Any) -> Any:
        calls.append(plan.step)
        if len(calls) == 2:
            raise RuntimeError("injected device fault")
        return real_execute(plan)

    monkeypatch.setattr(llm.executor, "execute", execute_failing_once)

    async def scenario() -> list[int]:
        with pytest.raises(EngineFailure, match="injected device fault"):
            await _ids(engine.submit(PROMPT, GREEDY))
        return await _ids(engine.submit(PROMPT, GREEDY))

    assert tuple(_run(scenario())) == expected
    assert engine.snapshot.num_failed_steps == 1 and engine.is_alive


def test_a_slow_consumer_does_not_block_others(engine: AsyncEngine) -> None:
    """A stream nobody reads does not hold the engine back: another request finishes, and the unread one's
    events wait in its queue."""

    async def scenario() -> tuple[list[int], list[int]]:
        unread = engine.submit(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        read = await _ids(engine.submit(PROMPT[:4], GREEDY))
        return read, await _ids(unread)

    read, unread = _run(scenario())
    assert len(read) == 12 and len(unread) == 40


def test_abort_frees_the_kv_blocks(engine: AsyncEngine) -> None:
    """Aborting a running request ends its stream with "abort" and returns every KV block to the pool."""

    async def scenario() -> str | None:
        stream = engine.submit(PROMPT * 4, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
        await stream.__anext__()
        await _eventually(lambda: engine.snapshot.num_used_blocks > 0)  # published after the step
        engine.abort(stream.request_id)
        reason = [event async for event in stream][-1].finish_reason
        await _eventually(lambda: engine.snapshot.num_used_blocks == 0 and engine.snapshot.num_running == 0)
        return reason

    assert _run(scenario()) == "abort"


def test_submit_validates_and_refuses_when_closing(engine: AsyncEngine) -> None:
    """An impossible request raises InvalidRequestError at submit; after close(), EngineOverloaded."""

    async def scenario() -> None:
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            engine.submit(PROMPT, SamplingParams(max_tokens=10**6))
        engine.close()  # refuse new work, abort the live requests
        with pytest.raises(EngineOverloaded, match="shutting down"):
            engine.submit(PROMPT, GREEDY)

    _run(scenario())


def test_the_waiting_cap_counts_requests_not_yet_admitted(llm: LLM) -> None:
    """With max_waiting=3 and the engine thread not started, the fourth submission raises EngineOverloaded."""
    engine = AsyncEngine(llm.loop, llm.tokenizer, max_waiting=3)

    async def scenario() -> int:
        streams = [engine.submit(PROMPT, GREEDY) for _ in range(3)]
        with pytest.raises(EngineOverloaded, match="3 requests are waiting"):
            engine.submit(PROMPT, GREEDY)
        return len(streams)

    assert _run(scenario()) == 3
    llm.loop.on_step = None


def test_submit_many_queues_all_or_none(engine: AsyncEngine, llm: LLM) -> None:
    """A group holding one invalid request queues none of it; a valid group runs every request (seeded copies
    of one prompt list each get their own stream and tokens)."""
    expected = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].token_ids

    async def scenario() -> list[list[int]]:
        with pytest.raises(InvalidRequestError):
            engine.submit_many([Submission(PROMPT, GREEDY), Submission([10**6], GREEDY)])
        streams = engine.submit_many([Submission(PROMPT, GREEDY), Submission(PROMPT, GREEDY)])
        return [await _ids(s) for s in streams]

    assert [tuple(ids) for ids in _run(scenario())] == [expected, expected]
    assert engine.snapshot.num_prompt_tokens == 2 * len(PROMPT)  # the refused group's valid request never ran
