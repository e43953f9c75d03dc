"""The engine in a process of its own (``ProcessEngine``, what ``fnvllm serve`` runs by default): same tokens as
offline generation, start-up errors carry the child's message, a dead engine process fails the open streams and
refuses new requests instead of hanging; and ``fnvllm serve --engine-thread`` still serves."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="fnvllm.serve needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("uvicorn", reason="fnvllm.serve needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("prometheus_client", reason="fnvllm.serve needs the [serve] extra")
httpx = pytest.importorskip("httpx", reason="installed with the [test] extra")

from tiny_models import write_family  # noqa: E402

from fnvllm.engine.text import load_local_tokenizer  # noqa: E402
from fnvllm.llm import LLM  # noqa: E402
from fnvllm.serve import EngineFailure, EngineOverloaded, EngineStartupError, ProcessEngine, RequestStream  # noqa: E402
from fnvllm.serve.server_process import ServerProcess  # noqa: E402
from fnvllm.state import SamplingParams  # noqa: E402

OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "device": "cpu",
    "block_size": 8,
    "num_blocks": 256,
    "attention_backend": "torch",  # "auto" would pick Triton's interpreter, which conftest turns on for CPU runs
}
PROMPTS = [[5, 9, 13, 200, 7], [42] * 12, list(range(3, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(tmp_path_factory.mktemp("engine-process"), "qwen3")


@pytest.fixture
def engine(checkpoint: Path) -> Iterator[ProcessEngine]:
    engine = ProcessEngine(checkpoint, OPTIONS, load_local_tokenizer(checkpoint), max_waiting=64)
    engine.start()
    yield engine
    engine.stop(timeout=30)


async def _ids(stream: RequestStream) -> list[int]:
    return [t async for event in stream for t in event.token_ids]


def _run(coro: Any, timeout: float = 120.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_tokens_equal_offline_generate(engine: ProcessEngine, checkpoint: Path) -> None:
    expected = [o.token_ids for o in LLM(checkpoint, **OPTIONS).generate(PROMPTS, GREEDY, use_tqdm=False)]

    async def scenario() -> list[list[int]]:
        return list(await asyncio.gather(*(_ids(engine.submit(p, GREEDY)) for p in PROMPTS)))

    assert [tuple(ids) for ids in _run(scenario())] == expected
    assert engine.is_alive
    assert engine.ready.config.num_blocks == OPTIONS["num_blocks"] and engine.ready.has_tokenizer
    assert engine.snapshot.stats.num_generated_tokens >= 3 * GREEDY.max_tokens


def test_a_dead_engine_process_fails_open_streams_and_refuses_new_requests(engine: ProcessEngine) -> None:
    async def scenario() -> None:
        stream = engine.submit(PROMPTS[2], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        await stream.__anext__()  # it is running
        pid = engine._process.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineFailure, match="engine process exited"):
            async for _ in stream:
                pass
        for _ in range(500):
            if not engine.is_alive:
                break
            await asyncio.sleep(0.01)
        assert not engine.is_alive
        with pytest.raises(EngineOverloaded):
            engine.submit(PROMPTS[0], GREEDY)

    _run(scenario())


def test_startup_error_carries_the_childs_message(checkpoint: Path) -> None:
    with pytest.raises(EngineStartupError, match="block_size"):
        ProcessEngine(checkpoint, {**OPTIONS, "block_size": 0}, None)


def test_serve_with_the_engine_on_a_thread(checkpoint: Path, tmp_path: Path) -> None:
    flags = [x for k, v in OPTIONS.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with ServerProcess([str(checkpoint), "--engine-thread", *flags], tmp_path / "log", env=env) as server:
        body = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 5
        assert "engine in its own process" not in server.log()
        assert server.terminate() == 0
