"""The serving hot path and its load client: a stream hands a lagging consumer every arrived event as one, a
server without a tokenizer streams token ids per step, and ``fnvllm.serve.bench`` measures a real server."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="fnvllm.serve needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("uvicorn", reason="fnvllm.serve needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("prometheus_client", reason="fnvllm.serve needs the [serve] extra")
pytest.importorskip("httpx", reason="the in-process client needs httpx")

from starlette.testclient import TestClient
from tiny_models import write_family

from fnvllm.llm import LLM
from fnvllm.serve import AsyncEngine, EngineFailure, RequestStream, TokenEvent, build_app
from fnvllm.serve.bench import parse_response, run_load, summary
from fnvllm.serve.process import ServerProcess
from fnvllm.state import SamplingParams

PROMPT = [5, 9, 13, 200, 7, 42, 42, 11]
# torch attention: conftest turns Triton's interpreter on for CPU runs, and "auto" would then pick it (slow).
ENGINE = {"dtype": "float32", "device": "cpu", "block_size": 8, "num_blocks": 512, "max_model_len": 512}
ENGINE["attention_backend"] = "torch"


def server_env() -> dict[str, str]:
    """The server's environment: one thread per op, no Triton interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(tmp_path_factory.mktemp("serve-bench"), "qwen3")


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLM:
    return LLM(checkpoint, **ENGINE)


def test_drain_merges_every_arrived_event_and_raises_a_failure_after_them() -> None:
    """drain() returns the events queued so far as one (texts and ids joined); a failure comes after them."""

    async def scenario() -> tuple[TokenEvent, TokenEvent, bool]:
        stream = RequestStream("r", (1, 2), asyncio.get_running_loop())
        for i in range(3):
            stream.push(TokenEvent(f"t{i}", (i,), (), None))
        first = await stream.drain()
        stream.push(TokenEvent("t3", (3,), (), None))
        stream.push(EngineFailure("boom"))
        second = await stream.drain()
        with pytest.raises(EngineFailure, match="boom"):
            await stream.drain()
        return first, second, stream.finished

    first, second, finished = asyncio.run(scenario())
    assert first == TokenEvent("t0t1t2", (0, 1, 2), (), None)
    assert second == TokenEvent("t3", (3,), (), None)
    assert finished


@pytest.fixture
def tokenizer_less(llm: LLM) -> Iterator[TestClient]:
    engine = AsyncEngine(llm.loop, None)
    with TestClient(build_app(engine, "ids-only")) as client:
        yield client
    llm.loop.on_step = None


def test_a_server_without_tokenizer_streams_token_ids(tokenizer_less: TestClient, llm: LLM) -> None:
    """Without a tokenizer, completion choices carry ``token_ids`` (text stays empty), streamed as they come; both
    equal offline greedy generation, and a text prompt is a 400 naming the prompt."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = list(llm.generate([PROMPT], greedy, use_tqdm=False)[0].token_ids)
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = tokenizer_less.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["token_ids"] == expected and whole["text"] == ""
    with tokenizer_less.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line[6:])["choices"][0] for line in lines]
    assert [t for c in chunks for t in c["token_ids"]] == expected
    assert len(chunks) > 1 and chunks[-1]["finish_reason"] == "length"
    error = tokenizer_less.post("/v1/completions", json={**body, "prompt": "text"})
    assert error.status_code == 400 and error.json()["error"]["param"] == "prompt"


def test_a_stream_interval_batches_tokens_into_fewer_chunks(llm: LLM) -> None:
    """With a stream interval, the streamed ids still equal offline greedy generation, in fewer chunks than
    tokens (several steps' tokens go out together)."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = list(llm.generate([PROMPT], greedy, use_tqdm=False)[0].token_ids)
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    app = build_app(AsyncEngine(llm.loop, None), "ids-only", stream_interval_s=0.25)
    with TestClient(app) as client, client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    llm.loop.on_step = None
    chunks = [json.loads(line[6:])["choices"][0] for line in lines]
    assert [t for c in chunks for t in c["token_ids"]] == expected
    assert len(chunks) < len(expected) and chunks[-1]["finish_reason"] == "length"


def test_parse_response_reads_a_chunked_event_stream() -> None:
    """The load client's parser undoes chunked transfer encoding and returns the JSON events (not [DONE])."""
    payload = b'data: {"a":1}\n\ndata: {"usage":{"completion_tokens":3}}\n\ndata: [DONE]\n\n'
    body = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (payload[:10], payload[10:])) + b"0\r\n\r\n"
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    assert parse_response(raw) == (200, [{"a": 1}, {"usage": {"completion_tokens": 3}}])
    with pytest.raises(RuntimeError, match="HTTP 400"):
        parse_response(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 5\r\n\r\noops!")


def test_load_client_measures_a_real_server(checkpoint: Path, tmp_path: Path) -> None:
    """run_load against ``fnvllm serve``: every request streams its max_tokens, TTFT <= e2e, a summary record."""
    prompts = [[(7 * i + j) % 256 for j in range(20 + i)] for i in range(6)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=5 + i) for i in range(6)]
    flags = [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    with ServerProcess([str(checkpoint), *flags], tmp_path / "server.log", env=server_env()) as server:
        timings, seconds = asyncio.run(run_load(server.base_url, prompts, params))
    assert [t.num_tokens for t in timings] == [p.max_tokens for p in params]
    assert all(0 < t.ttft <= t.e2e <= seconds for t in timings)
    record = summary(timings, seconds)
    assert record["output_tokens"] == sum(p.max_tokens for p in params) and record["tok_per_s"] > 0
    assert set(record["ttft_ms"]) == {"p50", "p90", "p99"}
