"""`fnvllm serve` under bad input and overload: OpenAI-shaped 400/404/503 errors (never a 500), the server keeps
serving afterwards, and SIGTERM aborts in-flight requests and exits 0."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("uvicorn", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("prometheus_client", reason="the server needs the [serve] extra")
openai = pytest.importorskip("openai", reason="the server tests drive it with the official openai client")
httpx = pytest.importorskip("httpx", reason="installed with openai")

from tiny_models import write_family  # noqa: E402

from fnvllm.serve.server_process import ServerProcess  # noqa: E402

MODEL = "tiny"
# One running sequence at a time and one waiting slot, so a third concurrent request finds the queue full.
FLAGS = ["--dtype", "float32", "--device", "cpu", "--block-size", "8", "--num-blocks", "256", "--max-model-len", "512"]
FLAGS += ["--attention-backend", "torch", "--max-num-seqs", "1", "--max-waiting", "1", "--served-model-name", MODEL]
GOOD = {"model": MODEL, "prompt": "The engine is pure", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    checkpoint = write_family(tmp_path_factory.mktemp("serve-errors"), "qwen3")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    log = tmp_path_factory.mktemp("serve-errors-log") / "server.log"
    with ServerProcess([str(checkpoint), *FLAGS], log, env=env) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def post(server: ServerProcess, path: str, body: Any) -> Any:
    """POST a JSON body (or raw bytes) and return the response."""
    if isinstance(body, bytes):
        return httpx.post(f"{server.base_url}{path}", content=body, headers={"Content-Type": "application/json"})
    return httpx.post(f"{server.base_url}{path}", json=body)


BAD_COMPLETIONS = [
    ("malformed JSON", b'{"prompt": "x",', None),
    ("not an object", b"[1, 2]", None),
    ("wrong type", {**GOOD, "temperature": "hot"}, "temperature"),
    ("bool as number", {**GOOD, "top_p": True}, "top_p"),
    ("out of range", {**GOOD, "top_p": 2.0}, "top_p"),
    ("negative max_tokens", {**GOOD, "max_tokens": -1}, "max_tokens"),
    ("max_completion_tokens too large", {**GOOD, "max_completion_tokens": 10**9}, "max_completion_tokens"),
    ("unknown field", {**GOOD, "frequency": 1}, "frequency"),
    ("n of 0", {**GOOD, "n": 0}, "n"),
    ("n over the cap", {**GOOD, "n": 129}, "n"),
    ("best_of under n", {**GOOD, "n": 3, "best_of": 2}, "best_of"),
    ("best_of > n streamed", {**GOOD, "best_of": 2, "stream": True}, "best_of"),
    ("max_tokens 0 streamed", {**GOOD, "max_tokens": 0, "echo": True, "stream": True}, "stream"),
    ("max_tokens 0 without echo", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("suffix", {**GOOD, "suffix": "return x"}, "suffix"),
    ("logit_bias key not an id", {**GOOD, "logit_bias": {"five": 10}}, "logit_bias"),
    ("logit_bias out of range", {**GOOD, "logit_bias": {"5": 101}}, "logit_bias"),
    ("logit_bias id out of vocab", {**GOOD, "logit_bias": {"99999": 1}}, "logit_bias"),
    ("too many sequences", {**GOOD, "prompt": ["a"] * 9, "n": 128}, "prompt"),
    ("unknown response_format type", {**GOOD, "response_format": {"type": "xml"}}, "response_format.type"),
    ("tools in completions", {**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("bad guided_regex", {**GOOD, "guided_regex": "(unclosed"}, "guided_regex"),
    ("ignored field of the wrong type", {**GOOD, "store": "yes"}, "store"),
    ("functions (unknown)", {**GOOD, "functions": [{"name": "f"}]}, "functions"),
    ("empty token prompt", {**GOOD, "prompt": []}, "prompt"),
    ("token id out of vocab", {**GOOD, "prompt": [1, 99999]}, "prompt"),
    ("negative token id with echo", {**GOOD, "prompt": [1, -5], "echo": True}, "prompt"),
    ("too long for the model", {**GOOD, "max_tokens": 600}, "max_tokens"),
    ("empty stop string", {**GOOD, "stop": [""]}, "stop"),
    ("missing prompt", {"model": MODEL}, "prompt"),
    ("lone surrogate in prompt", b'{"prompt": "abc\\ud800def", "max_tokens": 2}', "prompt"),
    ("lone surrogate in stop", b'{"prompt": "abc", "stop": ["\\udc00"], "max_tokens": 2}', "stop"),
    ("nested 100,000 deep", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("nested 40 deep", b'{"prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}", None),
]
BAD_CHATS = [
    ("no messages", {"model": MODEL, "messages": []}, "messages"),
    ("bad role", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ("image part", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
    ("tool without a name", {**CHAT, "tools": [{"type": "function", "function": {}}]}, None),
    ("tool_choice required", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    (
        "json_schema without a schema",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format",
    ),
    ("top_logprobs alone", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None),
    ("message without content", {"model": MODEL, "messages": [{"role": "user"}]}, "messages.0.content"),
    ("null content", {"model": MODEL, "messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ("lone surrogate in content", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
    (
        "lone surrogate in a text part",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        "messages.0.content",
    ),
    ("max_completion_tokens too large", {**CHAT, "max_completion_tokens": 10**9}, "max_completion_tokens"),
    ("max_completion_tokens as a float", {**CHAT, "max_completion_tokens": 1e9}, "max_completion_tokens"),
    ("top_logprobs over 20", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
]


@pytest.mark.parametrize(
    ("path", "case"),
    [("/v1/completions", c) for c in BAD_COMPLETIONS] + [("/v1/chat/completions", c) for c in BAD_CHATS],
    ids=[c[0] for c in BAD_COMPLETIONS + BAD_CHATS],
)
def test_bad_input_is_a_400_with_openai_error_json(server: ServerProcess, path: str, case: tuple) -> None:
    """Malformed, mistyped, out-of-range, unknown or unsupported input is a 400 naming the field; then a good
    request still succeeds."""
    _, body, param = case
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    assert post(server, "/v1/completions", GOOD).status_code == 200


def test_a_body_over_the_default_limit_is_a_413(server: ServerProcess) -> None:
    """A 9 MiB body (the default limit is 8 MiB) is answered 413 with OpenAI error JSON; /health still answers."""
    prompt = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    response = post(server, "/v1/completions", prompt)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_models_retrieve_unknown_id_is_an_openai_404(server: ServerProcess) -> None:
    """GET /v1/models/{id} for an id this server does not serve is a 404 with code model_not_found."""
    response = httpx.get(f"{server.base_url}/v1/models/org/other-model")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server.base_url}/v1/models/{MODEL}").json()["id"] == MODEL


def test_unknown_model_and_route_are_404(server: ServerProcess, client: Any) -> None:
    """An unknown model name is a 404 model_not_found (the client raises NotFoundError); so is an unknown route."""
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    response = httpx.get(f"{server.base_url}/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()


def test_full_waiting_queue_is_a_503_and_recovers(server: ServerProcess, client: Any) -> None:
    """With one running and one waiting request, a third gets 503; once they are gone the server serves again."""
    long = dict(model=MODEL, prompt="A long one", max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
    running = client.completions.create(**long, stream=True)
    next(iter(running))  # its first token is out: it holds the one running slot
    waiting = client.completions.create(**{**long, "max_tokens": 3}, stream=True)
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(**GOOD)
    assert info.value.status_code == 503 and info.value.body["code"] == "overloaded"
    running.close()  # aborts it, so the waiting one runs
    chunks = list(waiting)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert client.completions.create(**GOOD).choices[0].finish_reason in ("length", "stop")


def test_sigterm_aborts_in_flight_requests_and_exits_zero(server: ServerProcess, client: Any) -> None:
    """SIGTERM ends a running stream with an error event (no "abort" finish reason, which OpenAI does not have)
    and the server exits with code 0 (runs last)."""
    kw = dict(model=MODEL, prompt="Keep going", max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
    stream = client.completions.create(**kw, stream=True)
    next(iter(stream))
    assert server.proc is not None
    server.proc.terminate()
    reasons = []
    with pytest.raises(openai.APIError, match="aborted"):
        reasons.extend(c.choices[0].finish_reason for c in stream if c.choices)
    assert "abort" not in reasons and len(reasons) < 400
    assert server.terminate(timeout=60) == 0, server.log()[-3000:]


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()  # noqa: SIM115
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_a_dead_engine_process_shuts_the_server_down_with_exit_1(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The engine process killed (-9) under a running server: the server shuts down by itself and exits 1 with one
    line saying why, so that a supervisor restarts it (it served 503s forever and exited 0 on SIGTERM)."""
    import signal
    import time

    checkpoint = write_family(tmp_path_factory.mktemp("serve-dies"), "qwen3")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    log = tmp_path_factory.mktemp("serve-dies-log") / "server.log"
    with ServerProcess([str(checkpoint), *FLAGS], log, env=env) as proc:
        assert proc.proc is not None
        # the engine process (``fnvllm serve`` runs one by default), not multiprocessing's resource tracker
        [engine] = [c for c in _children(proc.proc.pid) if b"resource_tracker" not in _cmdline(c)]
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while proc.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.proc.returncode == 1, proc.log()[-3000:]
        assert "the engine stopped while serving; the server shut down" in proc.log()
        assert "Traceback" not in proc.log()
