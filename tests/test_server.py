"""`fnvllm serve` as a real subprocess on a loopback port, driven by the official `openai` client: completions and
chat (streamed and not) equal offline `LLM.generate`, usage, stop strings, seeds, logprobs, 32 concurrent requests
batched together, client disconnects abort, the API key is enforced."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("uvicorn", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("prometheus_client", reason="the server needs the [serve] extra")
openai = pytest.importorskip("openai", reason="the server tests drive it with the official openai client")
httpx = pytest.importorskip("httpx", reason="installed with openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tiny_models import write_family  # noqa: E402

from fnvllm.llm import LLM  # noqa: E402
from fnvllm.serve.server_process import ServerProcess  # noqa: E402
from fnvllm.state import SamplingParams  # noqa: E402

API_KEY = "sk-test-key"
MODEL = "tiny"
# torch attention: conftest turns Triton's interpreter on for CPU runs, and "auto" would then pick it (slow).
ENGINE = {"dtype": "float32", "device": "cpu", "block_size": 8, "num_blocks": 512, "max_model_len": 512}
ENGINE["attention_backend"] = "torch"
PROMPTS = [f"Request {i}: the quick brown fox jumps over {'the lazy dog ' * (i % 3)}" for i in range(32)]


def _flags(options: dict[str, Any]) -> list[str]:
    return [x for k, v in options.items() for x in (f"--{k.replace('_', '-')}", str(v))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(tmp_path_factory.mktemp("serve"), "qwen3")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = [str(checkpoint), "--served-model-name", MODEL, "--api-key", API_KEY, *_flags(ENGINE)]
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with ServerProcess(args, log, env=server_env()) as proc:
        yield proc
        assert proc.terminate() == 0, proc.log()[-3000:]


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLM:
    return LLM(checkpoint, **ENGINE)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def server_env() -> dict[str, str]:
    """The test's environment for the server, on one thread per op and without Triton's interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "OMP_NUM_THREADS": "1"}


def greedy(max_tokens: int = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def metrics(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics by name (labels folded into the name as name{k=v})."""
    text = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(server: ServerProcess, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits; returns the last sample."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["fnvllm_num_requests_running"] == 0 and m["fnvllm_num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"still busy: {m}"
        time.sleep(0.05)


def test_completion_matches_offline_generate(client: Any, llm: LLM) -> None:
    """A greedy completion's text, finish reason and usage equal offline LLM.generate on the same model."""
    expected = llm.generate([PROMPTS[0]], greedy(), use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert got.object == "text_completion" and got.model == MODEL
    assert got.choices[0].text == expected.text
    assert got.choices[0].finish_reason == expected.finish_reason
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == len(expected.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_streamed_completion_equals_non_streamed(client: Any, server: ServerProcess) -> None:
    """Streamed deltas concatenate to the non-streamed text; include_usage adds a usage chunk; SSE ends in [DONE]."""
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "stream": True}
    raw = httpx.post(f"{server.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().splitlines()[-1] == "data: [DONE]"


def test_chat_applies_template_and_streams(client: Any, llm: LLM) -> None:
    """Chat renders the tokenizer's chat template; its greedy reply equals LLM.generate on those ids, streamed too."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    expected = llm.generate([ids], greedy(20), use_tqdm=False)[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.text
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(expected.token_ids)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == got.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_stop_string_ends_the_completion(client: Any) -> None:
    """A stop string found in the greedy text cuts the text before it, with finish_reason "stop"."""
    full = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=32, temperature=0).choices[0].text
    assert len(full) >= 6, full
    stop = full[3:5]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=32, temperature=0, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client: Any) -> None:
    """The same seed gives the same sampled text; another seed gives another."""

    def sample(seed: int) -> str:
        kw = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=1.0, seed=seed)
        return client.completions.create(**kw, extra_body={"ignore_eos": True, "top_k": 50}).choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_logprobs_match_offline(client: Any, llm: LLM) -> None:
    """Completion logprobs (legacy shape) and chat logprobs equal the offline engine's for the same greedy tokens."""
    expected = llm.generate([PROMPTS[4]], greedy(8, logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    got = client.completions.create(
        model=MODEL, prompt=PROMPTS[4], max_tokens=8, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert [len(top) for top in lp.top_logprobs] == [2] * 8
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # the sampled token's logprob is always in top_logprobs (OpenAI: up to logprobs + 1 entries): alone at 0
    zero = (
        client.completions.create(
            model=MODEL, prompt=PROMPTS[4], max_tokens=8, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .logprobs
    )
    assert zero.top_logprobs == [{t: v} for t, v in zip(zero.tokens, zero.token_logprobs, strict=True)]
    drawn = client.completions.create(
        model=MODEL, prompt=PROMPTS[4], max_tokens=16, temperature=5.0, seed=3, logprobs=1,
        extra_body={"ignore_eos": True},
    ).choices[0].logprobs  # fmt: skip
    for t, v, top in zip(drawn.tokens, drawn.token_logprobs, drawn.top_logprobs, strict=True):
        best, best_logprob = next(iter(top.items()))
        assert t in top and len(top) <= 2 and best_logprob >= v - 1e-6
        assert top[t] == v or t == best  # keyed by text: a sampled byte token can share the top-1's text ("\ufffd")
    assert any(len(top) == 2 for top in drawn.top_logprobs)  # at temperature 5 some draw is not the top-1
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)


def test_concurrent_requests_match_offline_and_are_batched(client: Any, llm: LLM, server: ServerProcess) -> None:
    """32 concurrent greedy requests each get their own text (equal to offline generate), run in shared steps."""
    expected = [o.text for o in llm.generate(PROMPTS, greedy(32, ignore_eos=True), use_tqdm=False)]
    before = metrics(server)

    def one(prompt: str) -> str:
        kw = dict(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
        return client.completions.create(**kw).choices[0].text

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, PROMPTS))
    assert got == expected
    after = wait_idle(server)

    def big_steps(m: dict[str, float]) -> float:  # steps that ran more than 8 sequences
        return m["fnvllm_step_num_sequences_count"] - m["fnvllm_step_num_sequences_bucket{le=8.0}"]

    assert big_steps(after) > big_steps(before)
    assert after["fnvllm_generation_tokens_total"] - before["fnvllm_generation_tokens_total"] == 32 * 32


def test_client_disconnect_aborts_the_request(client: Any, server: ServerProcess) -> None:
    """Closing a stream mid-way aborts its request: it stops generating and its KV blocks are freed."""
    before = wait_idle(server)
    kw = dict(model=MODEL, prompt=PROMPTS[5], max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
    stream = client.completions.create(**kw, stream=True)
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    assert metrics(server)["fnvllm_kv_cache_used_blocks"] > 0
    stream.close()
    after = wait_idle(server)
    assert after["fnvllm_kv_cache_used_blocks"] == 0 and after["fnvllm_kv_cache_usage_ratio"] == 0
    aborted = "fnvllm_requests_finished_total{finish_reason=abort}"
    assert after[aborted] - before.get(aborted, 0) == 1
    assert after["fnvllm_generation_tokens_total"] - before["fnvllm_generation_tokens_total"] < 200


def test_non_streaming_client_that_gives_up_aborts_the_request(server: ServerProcess) -> None:
    """A non-streamed request whose client closes the connection (read timeout) is aborted mid-way, quietly: the
    server logs no traceback for it."""
    before = wait_idle(server)
    log_start = len(server.log())
    body = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 450, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=httpx.Timeout(60, read=0.2),
        )  # fmt: skip
    after = wait_idle(server)
    aborted = "fnvllm_requests_finished_total{finish_reason=abort}"
    assert after[aborted] - before.get(aborted, 0) == 1 and after["fnvllm_kv_cache_used_blocks"] == 0
    assert after["fnvllm_generation_tokens_total"] - before["fnvllm_generation_tokens_total"] < 450
    assert "Traceback" not in server.log()[log_start:], server.log()[log_start:][-3000:]


def test_api_key_is_enforced(server: ServerProcess) -> None:
    """Every /v1 route needs the Bearer key: 401 with OpenAI error JSON otherwise; /health and /metrics are open
    (as in vLLM: scrapers carry no token)."""
    url = server.base_url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    refused = ["Bearer wrong", API_KEY, f"Basic {API_KEY}", f"Bearer {API_KEY}x", f"Bearer  {API_KEY}", ""]
    for path in ("/v1/models", "/v1/models/tiny"):
        for value in refused:
            response = httpx.get(f"{url}{path}", headers={"Authorization": value})
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        for scheme in ("bearer", "BEARER"):  # the scheme's name is case-insensitive (RFC 7235)
            assert httpx.get(f"{url}{path}", headers={"Authorization": f"{scheme} {API_KEY}"}).status_code == 200
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    models = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_metrics_parse_and_report_the_engine(server: ServerProcess, client: Any) -> None:
    """/metrics is valid Prometheus text with the engine's gauges, counters and latency histograms. The test makes
    its own traffic (one prompt twice: the second hits the prefix cache), so it holds whichever tests ran before."""
    prompt = PROMPTS[2] * 2  # several 8-token blocks
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    m = wait_idle(server)
    assert m["fnvllm_kv_cache_num_blocks"] == ENGINE["num_blocks"]
    assert m["fnvllm_kv_cache_usage_ratio"] == 0
    assert 0 <= m["fnvllm_prefix_cache_hit_rate"] <= 1 and m["fnvllm_prefix_cache_hit_tokens_total"] > 0
    assert m["fnvllm_num_preemptions_total"] >= 0
    assert m["fnvllm_time_to_first_token_seconds_count"] == m["fnvllm_e2e_request_latency_seconds_count"] > 0
    assert m["fnvllm_time_per_output_token_seconds_count"] > 0
