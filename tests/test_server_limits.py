"""What one request may make the server do: a body over the size limit is a 413 before it is read, tokenization
runs off the event loop (``/health`` answers while a prompt is being tokenized), and ``fnvllm serve`` checks its
flags (exit 2, one line naming the flag) before it looks at the model."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
uvicorn = pytest.importorskip(
    "uvicorn", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)"
)
pytest.importorskip("prometheus_client", reason="the server needs the [serve] extra")
httpx = pytest.importorskip("httpx", reason="installed with openai")

from tiny_models import write_family  # noqa: E402

from fnvllm.cli import main  # noqa: E402
from fnvllm.llm import LLM  # noqa: E402
from fnvllm.serve import AsyncEngine, build_app  # noqa: E402
from fnvllm.serve.server import bind  # noqa: E402

MODEL = "tiny"
LIMIT = 64 * 1024  # the test server's --max-request-bytes
MARKER = "HOLD-THE-TOKENIZER"  # a prompt holding it waits in encode() until the test opens the gate
HEAD = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
ENGINE = {"dtype": "float32", "device": "cpu", "block_size": 8, "num_blocks": 256, "attention_backend": "torch"}


class GatedTokenizer:
    """The real tokenizer, except that encoding a text that holds MARKER waits until ``gate`` is set (at most
    ``wait_s``); ``opened_in_time`` records whether the gate opened before that wait ran out."""

    def __init__(self, tokenizer: Any, wait_s: float = 5.0) -> None:
        self._tokenizer, self.wait_s = tokenizer, wait_s
        self.entered, self.gate = threading.Event(), threading.Event()
        self.opened_in_time: bool | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        """The real encode, held at the gate for MARKER texts."""
        if MARKER in text:
            self.entered.set()
            self.opened_in_time = self.gate.wait(self.wait_s)
        return self._tokenizer.encode(text, *args, **kwargs)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM(write_family(tmp_path_factory.mktemp("serve-limits"), "qwen3"), **ENGINE)


@pytest.fixture(scope="module")
def live(llm: LLM) -> Iterator[tuple[str, GatedTokenizer]]:
    """A real uvicorn server on a loopback port, in a thread of this process, with a gated tokenizer."""
    tokenizer = GatedTokenizer(llm.tokenizer)
    app = build_app(AsyncEngine(llm.loop, tokenizer), MODEL, max_request_bytes=LIMIT)
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started, "the in-process server did not start within 30 s"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", tokenizer
    server.should_exit = True
    thread.join(30)
    sock.close()
    llm.loop.on_step = None


def _raw_exchange(url: str, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send a hand-written HTTP request; return the response's status and body (the server closes or answers)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(head.encode() + body)
        received = b""
        while b"\r\n\r\n" not in received or not _complete(received):
            data = conn.recv(65536)
            if not data:
                break
            received += data
    status_line, _, rest = received.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _complete(received: bytes) -> bool:
    head, _, body = received.partition(b"\r\n\r\n")
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def test_a_declared_oversized_body_is_a_413_before_it_is_sent(live: tuple[str, GatedTokenizer]) -> None:
    """A Content-Length over the limit is answered 413 (OpenAI error JSON) without waiting for the body."""
    url, _ = live
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {10**9}\r\n\r\n"
    )
    status, body = _raw_exchange(url, head)
    assert status == 413 and b'"request_too_large"' in body and b"--max-request-bytes" in body


def test_a_chunked_body_is_refused_once_it_passes_the_limit(live: tuple[str, GatedTokenizer]) -> None:
    """A chunked upload without Content-Length is counted as it streams and refused with 413 past the limit."""
    url, _ = live
    head = f"{HEAD}Transfer-Encoding: chunked\r\n\r\n"
    piece = b'{"prompt": "' + b"a" * 8000
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(LIMIT // len(piece) + 2))
    status, body = _raw_exchange(url, head, chunks + b"0\r\n\r\n")
    assert status == 413 and b'"request_too_large"' in body


def test_a_body_under_the_limit_is_served(live: tuple[str, GatedTokenizer]) -> None:
    """A request just under the limit still gets its completion."""
    url, _ = live
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "user": "x" * (LIMIT - 200)}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_health_answers_while_a_prompt_is_being_tokenized(live: tuple[str, GatedTokenizer]) -> None:
    """While one request's prompt is held in the tokenizer, /health (and so the event loop) still answers."""
    url, tokenizer = live
    body = {"model": MODEL, "prompt": f"{MARKER} " + "word " * 200, "max_tokens": 2}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
        assert tokenizer.entered.wait(30), "the request never reached the tokenizer"
        health = httpx.get(f"{url}/health", timeout=30)
        still_pending = not pending.done()
        tokenizer.gate.set()
        response = pending.result()
    assert health.status_code == 200 and still_pending
    assert tokenizer.opened_in_time, "/health was answered only after the tokenizer gave up waiting"
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--max-waiting", "-1"], "--max-waiting"),
        (["--max-waiting", "0"], "--max-waiting"),
        (["--stream-interval-ms", "nan"], "--stream-interval-ms"),
        (["--max-request-bytes", "0"], "--max-request-bytes"),
        (["--served-model-name", " "], "--served-model-name"),
        (["--api-key", ""], "--api-key"),  # would turn authentication off
        (["--block-size", "0"], "block_size"),
    ],
)
def test_serve_checks_its_flags_before_the_model(
    flags: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad serve flag exits 2 with one line naming it, before the (here missing) model is even looked at."""
    code = main(["serve", str(tmp_path / "no-such-model"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and named in err, err


def test_serve_flag_of_the_wrong_type_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A flag value argparse cannot convert exits 2 with one line naming the flag (no usage dump)."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "--port", "eighty"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "--port" in err


def test_a_port_in_use_fails_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    """A port another socket listens on exits 1 with one line, before any model is loaded."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--host", "127.0.0.1", "--port", str(port)])
    out, err = capsys.readouterr()
    assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1
    assert "fnvllm serve: model" not in out


def test_the_tool_call_parser_flag_lists_the_parsers() -> None:
    """``--tool-call-parser``'s choices are the server's parsers (spelled out in the CLI, so --help needs no extra),
    and vLLM's ``--enable-auto-tool-choice`` is accepted."""
    from fnvllm.cli import build_parser
    from fnvllm.cli.serve import TOOL_PARSER_NAMES
    from fnvllm.serve.tool_parsers import TOOL_PARSERS

    assert set(TOOL_PARSER_NAMES) == set(TOOL_PARSERS)
    args = build_parser().parse_args(["serve", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"])
    assert args.tool_call_parser == "hermes" and args.enable_auto_tool_choice
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "not_a_parser"])
