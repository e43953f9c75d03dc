"""The serving hot path and its load client: a stream hands a lagging consumer every arrived event as one, a
server without a tokenizer streams token ids per step, and ``fnvllm.serve.bench`` measures a real server."""

from __future__ import annotations

import asyncio
import io
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
from fnvllm.serve.bench import (
    Progress,
    RequestTiming,
    fit_lengths,
    main,
    parse_response,
    run_load,
    served_model,
    summary,
)
from fnvllm.serve.server_process import ServerProcess
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
    stop = tokenizer_less.post("/v1/completions", json={**body, "stop": ["x"]})  # no text to find it in
    assert stop.status_code == 400 and stop.json()["error"]["param"] == "stop"


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


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    log = tmp_path_factory.mktemp("serve-bench-log") / "server.log"
    with ServerProcess([str(checkpoint), *flags], log, env=server_env()) as proc:
        yield proc


def test_load_client_measures_a_real_server(server: ServerProcess) -> None:
    """run_load against ``fnvllm serve``: every request streams its max_tokens, TTFT <= e2e, a summary record."""
    prompts = [[(7 * i + j) % 256 for j in range(20 + i)] for i in range(6)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=5 + i) for i in range(6)]
    timings, seconds = asyncio.run(run_load(server.base_url, prompts, params))
    assert [t.num_tokens for t in timings] == [p.max_tokens for p in params]
    assert all(0 < t.ttft <= t.e2e <= seconds for t in timings)
    record = summary(timings, seconds)
    assert record["output_tokens"] == sum(p.max_tokens for p in params) and record["tok_per_s"] > 0
    assert set(record["ttft_ms"]) == {"p50", "p90", "p99"}


def test_load_client_reads_the_model_limits_from_the_server(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no length or vocabulary flags, the load client fits the workload to the server's max_model_len and
    vocabulary (the defaults would be refused: ids up to 10,000, 1,024 + 1,024 tokens), and reports progress."""
    card = served_model(server.base_url, None)
    assert (card.max_model_len, card.vocab_size) == (512, 256)
    main(["--url", server.base_url, "--num-requests", "2", "--warmup", "1", "--json"])
    out, err = capsys.readouterr()
    record = json.loads(out.strip().splitlines()[-1])
    assert record["requests"] == 2 and record["output_tokens"] >= 200
    assert "max_model_len is 512" in err and "bench: 2/2 requests done" in err


def test_fit_lengths_keeps_the_longest_request_within_the_model() -> None:
    """fit_lengths leaves lengths that fit alone and shrinks others to sum to max_model_len, each >= 100."""
    assert fit_lengths(1024, 1024, None) == (1024, 1024) and fit_lengths(100, 100, 512) == (100, 100)
    max_input, max_output = fit_lengths(1024, 1024, 512)
    assert max_input + max_output == 512 and min(max_input, max_output) >= 100
    with pytest.raises(ValueError, match="max_model_len"):
        fit_lengths(1024, 1024, 150)


class _Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_is_plain_lines_off_a_terminal_and_one_rewritten_line_on_one() -> None:
    """Off a terminal each report is its own line; on a terminal reports rewrite one line, ended at the end."""
    for out, expected_lines in ((io.StringIO(), 3), (_Terminal(), 1)):
        progress = Progress(4, every_s=None, out=out)
        progress.show()
        progress.finished(RequestTiming(0.1, 0.5, 10))
        progress.show()
        progress.show(final=True)
        text = out.getvalue()
        assert text.count("\n") == expected_lines and "bench: 1/4 requests done, 10 output tokens" in text
        assert ("\r" in text) == isinstance(out, _Terminal)


def test_several_served_names_are_each_accepted(llm: LLM) -> None:
    """Several served names (vLLM's ``--served-model-name a b``): a request may name any, responses carry the
    first, /v1/models lists each and retrieves each; another name is a 404. The CLI flag takes several too."""
    from fnvllm.cli import build_parser

    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    app = build_app(AsyncEngine(llm.loop, None), "main", model_aliases=["alias", "main"])
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["main", "alias"]
        assert client.get("/v1/models/alias").json()["id"] == "alias"
        for name in ("main", "alias"):
            answer = client.post("/v1/completions", json={**body, "model": name})
            assert answer.status_code == 200 and answer.json()["model"] == "main"
        assert client.post("/v1/completions", json={**body, "model": "other"}).status_code == 404
    llm.loop.on_step = None
    args = build_parser().parse_args(["serve", "MODEL", "--served-model-name", "a", "b", "--port", "0"])
    assert args.served_model_name == ["a", "b"] and args.model == "MODEL"
