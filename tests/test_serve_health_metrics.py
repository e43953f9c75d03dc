"""The server's monitoring endpoints as a vLLM user expects them: ``/metrics`` needs no API key (the /v1 routes
still do), the per-request token and decode-time histograms agree with the responses' ``usage``, and ``/health``
answers 503 naming the reason when requests are pending and the engine has made no progress for longer than the
stall limit (200 when idle, and again after progress). Time is a fake clock: nothing waits for a stall."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
uvicorn = pytest.importorskip(
    "uvicorn", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)"
)
pytest.importorskip("prometheus_client", reason="the server needs the [serve] extra")
openai = pytest.importorskip("openai", reason="the server tests drive it with the official openai client")
httpx = pytest.importorskip("httpx", reason="installed with openai")

from fastapi import FastAPI  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tiny_models import write_family  # noqa: E402

from fnvllm.cli import build_parser, main  # noqa: E402
from fnvllm.cli.serve import DEFAULT_HEALTH_STALL_S as CLI_DEFAULT_HEALTH_STALL_S  # noqa: E402
from fnvllm.engine import EngineStats, RequestMetrics, RequestOutput  # noqa: E402
from fnvllm.llm import LLM  # noqa: E402
from fnvllm.serve import AsyncEngine, EngineSnapshot, build_app  # noqa: E402
from fnvllm.serve.app import DEFAULT_HEALTH_STALL_S, health_problem  # noqa: E402
from fnvllm.serve.metrics import ServerMetrics  # noqa: E402
from fnvllm.serve.server import bind  # noqa: E402

MODEL = "tiny"
API_KEY = "sk-monitoring"
STALL_S = 5.0  # fake seconds
# Plain steps (no overlap), so each step is one ``executor.execute`` call the test can hold.
ENGINE = {"dtype": "float32", "device": "cpu", "block_size": 8, "num_blocks": 256, "attention_backend": "torch"}
ENGINE["overlap_steps"] = False


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``."""
        self.now += seconds


class HeldSteps:
    """Wraps ``executor.execute``: while held, each step waits (at most 60 s) for a permit; ``entered`` counts the
    steps that reached it."""

    def __init__(self, execute: Any) -> None:
        self._execute = execute
        self.held = threading.Event()
        self.entered = threading.Semaphore(0)
        self._permits = threading.Semaphore(0)

    def __call__(self, plan: Any) -> Any:
        if self.held.is_set():
            self.entered.release()
            assert self._permits.acquire(timeout=60), "a held step was never let go"
        return self._execute(plan)

    def let_one_go(self) -> None:
        """Let the held step finish (the next one is held again)."""
        self._permits.release()

    def release(self) -> None:
        """Stop holding steps and let the held one go."""
        self.held.clear()
        self._permits.release()


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM(write_family(tmp_path_factory.mktemp("serve-monitoring"), "qwen3"), **ENGINE)


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """A real uvicorn server for ``app`` on a free loopback port, in a thread of this process; yields its URL."""
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(600):
            if server.started:
                break
            time.sleep(0.05)
        assert server.started, "the in-process server did not start within 30 s"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture
def engine(llm: LLM) -> Iterator[AsyncEngine]:
    """A fresh engine front on the shared model (its own metrics registry), with a fake clock."""
    yield AsyncEngine(llm.loop, llm.tokenizer, clock=FakeClock())
    llm.loop.on_step = None


def histograms(url: str) -> dict[str, float]:
    """Every histogram's _count and _sum from /metrics, scraped without an API key."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200, response.text
    out = {}
    for family in text_string_to_metric_families(response.text):
        if family.type == "histogram":
            out |= {s.name: s.value for s in family.samples if s.name.endswith(("_count", "_sum"))}
    return out


def test_metrics_needs_no_api_key_but_v1_routes_do(engine: AsyncEngine) -> None:
    """With an API key, GET /metrics and /health without a header are 200; /v1/models without one is 401."""
    with serving(build_app(engine, MODEL, api_key=API_KEY)) as url:
        metrics = httpx.get(f"{url}/metrics", timeout=30)
        assert metrics.status_code == 200 and "fnvllm_request_prompt_tokens_bucket" in metrics.text
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        refused = httpx.get(f"{url}/v1/models", timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        keyed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        assert keyed.status_code == 200


def test_token_histograms_match_the_responses_usage(engine: AsyncEngine) -> None:
    """Over non-streamed and streamed completions and chats, the prompt / generation token histograms' _count is
    the number of requests and their _sum the responses' summed usage; the decode-time histogram counts each."""
    with serving(build_app(engine, MODEL, api_key=API_KEY)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        usages = [
            client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=5, temperature=0).usage,
            client.completions.create(
                model=MODEL, prompt="jumps over the lazy dog " * 3, max_tokens=9, temperature=0,
                extra_body={"ignore_eos": True},
            ).usage,
        ]  # fmt: skip
        streamed = client.completions.create(
            model=MODEL, prompt="a b c", max_tokens=7, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        usages.append([c for c in streamed if c.usage is not None][-1].usage)
        messages = [{"role": "user", "content": "Name a colour."}]
        usages.append(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6).usage)
        chat = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
        usages.append([c for c in chat if c.usage is not None][-1].usage)
        m = histograms(url)
    assert m["fnvllm_request_prompt_tokens_count"] == len(usages)
    assert m["fnvllm_request_prompt_tokens_sum"] == sum(u.prompt_tokens for u in usages)
    assert m["fnvllm_request_generation_tokens_count"] == len(usages)
    assert m["fnvllm_request_generation_tokens_sum"] == sum(u.completion_tokens for u in usages)
    assert m["fnvllm_request_decode_time_seconds_count"] == m["fnvllm_e2e_request_latency_seconds_count"] == 5
    assert 0 <= m["fnvllm_request_decode_time_seconds_sum"] <= m["fnvllm_e2e_request_latency_seconds_sum"]
    assert m["fnvllm_request_queue_time_seconds_count"] == m["fnvllm_request_prefill_time_seconds_count"] == 5
    queue_and_prefill = m["fnvllm_request_queue_time_seconds_sum"] + m["fnvllm_request_prefill_time_seconds_sum"]
    assert queue_and_prefill == pytest.approx(m["fnvllm_time_to_first_token_seconds_sum"])


def test_an_aborted_request_is_counted_but_observed_in_no_histogram() -> None:
    """An abort adds to requests_finished{abort} only; a finished request lands in every per-request histogram,
    its decode time being first token to finish."""
    snapshot = EngineSnapshot(0, 0, 0, 8, 0, 0, EngineStats())
    metrics = ServerMetrics(lambda: snapshot)
    timing = RequestMetrics(arrival_time=1.0, first_token_time=1.5, finish_time=4.0, num_cached_tokens=0)
    timing = attrs.evolve(timing, scheduled_time=1.25)
    for reason in ("abort", "length"):
        metrics.on_finish(RequestOutput(reason, None, (1, 2, 3), "", (7, 8), reason, metrics=timing))
    value = metrics.registry.get_sample_value
    assert value("fnvllm_requests_finished_total", {"finish_reason": "abort"}) == 1
    assert value("fnvllm_requests_finished_total", {"finish_reason": "length"}) == 1
    assert value("fnvllm_request_prompt_tokens_count") == 1 and value("fnvllm_request_prompt_tokens_sum") == 3
    assert value("fnvllm_request_generation_tokens_count") == 1 and value("fnvllm_request_generation_tokens_sum") == 2
    assert value("fnvllm_request_decode_time_seconds_count") == 1
    assert value("fnvllm_request_decode_time_seconds_sum") == 2.5
    assert value("fnvllm_request_queue_time_seconds_sum") == 0.25
    assert value("fnvllm_request_prefill_time_seconds_sum") == 0.25
    assert value("fnvllm_request_inference_time_seconds_sum") == 2.75
    assert value("fnvllm_time_to_first_token_seconds_count") == value("fnvllm_e2e_request_latency_seconds_count") == 1


def test_health_is_503_while_pending_work_makes_no_progress(
    engine: AsyncEngine, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle for an hour: 200. A request whose step is held: 200 until the stall limit passes, then 503 naming the
    reason; a completed step makes it 200 again (while the next step is held); idle after the request: 200."""
    clock = engine.clock
    assert isinstance(clock, FakeClock)
    steps = HeldSteps(llm.executor.execute)
    monkeypatch.setattr(llm.executor, "execute", steps)
    body = {"model": MODEL, "prompt": "hold this request", "max_tokens": 3, "ignore_eos": True}
    app = build_app(engine, MODEL, health_stall_s=STALL_S)
    with serving(app) as url, ThreadPoolExecutor(1) as pool:

        def health() -> tuple[int, dict[str, str]]:
            response = httpx.get(f"{url}/health", timeout=30)
            return response.status_code, response.json()

        try:
            clock.advance(3600)
            assert health() == (200, {"status": "ok"})  # idle however long: healthy
            steps.held.set()
            pending = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            assert steps.entered.acquire(timeout=30), "the request's first step never started"
            assert health() == (200, {"status": "ok"})  # the stall clock starts with the work, not an hour ago
            clock.advance(STALL_S + 1)
            status, stalled = health()
            assert status == 503 and stalled["status"] == "stalled", stalled
            assert "--health-stall-s" in stalled["reason"] and "0 running and 1 waiting" in stalled["reason"]
            assert health_problem(engine, None) is None  # no limit: never stalled
            steps.let_one_go()
            assert steps.entered.acquire(timeout=30), "the request's second step never started"
            assert health() == (200, {"status": "ok"})  # the first step's report is progress
            clock.advance(STALL_S + 1)
            status, stalled = health()
            assert status == 503 and "1 running and 0 waiting" in stalled["reason"], stalled
        finally:
            steps.release()
        assert pending.result().status_code == 200
        clock.advance(3600)
        assert health() == (200, {"status": "ok"})  # idle again


def test_health_reports_a_stopped_engine(engine: AsyncEngine) -> None:
    """An engine that is not running is a 503 naming it (and build_app refuses a stall limit that is not > 0)."""
    assert health_problem(engine, STALL_S) == (
        "engine stopped",
        "the engine (its thread, or its process) is not running",
    )
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="health_stall_s must be a number of seconds > 0"):
            build_app(engine, MODEL, health_stall_s=bad)


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_the_health_stall_flag_is_checked_before_the_model(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--health-stall-s`` not > 0 exits 2 with one line naming the flag, before the (missing) model is read."""
    code = main(["serve", str(tmp_path / "no-such-model"), "--health-stall-s", value])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--health-stall-s" in err, err


def test_the_health_stall_flag_defaults_to_the_apps_and_takes_none() -> None:
    """The flag's default is build_app's (the CLI spells it out so --help needs no [serve] extra); ``none`` turns
    the check off."""
    parse = build_parser().parse_args
    assert parse(["serve"]).health_stall_s == DEFAULT_HEALTH_STALL_S == CLI_DEFAULT_HEALTH_STALL_S
    assert parse(["serve", "--health-stall-s", "None"]).health_stall_s is None
    assert parse(["serve", "--health-stall-s", "0.5"]).health_stall_s == 0.5
