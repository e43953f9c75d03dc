"""Run the app with uvicorn on a socket we bind ourselves (so ``port=0`` can report the port it got).

SIGINT / SIGTERM: stop accepting connections, abort the requests in flight (their streams end with an error
event, ``code: aborted``; non-streamed ones get 503), let uvicorn close the connections, stop the engine, return
normally (exit 0). If the engine stops by itself (its process died), the server shuts down the same way and
``serve`` raises EngineStoppedError, so that a supervisor (systemd, Docker) sees a failure and restarts it.
"""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import uvicorn

from fnvllm.serve.app import DEFAULT_HEALTH_STALL_S, build_app
from fnvllm.serve.async_engine import AsyncEngine
from fnvllm.serve.limits import DEFAULT_MAX_REQUEST_BYTES

_SWITCH_INTERVAL_S = 0.0002  # 200 us: a tenth of a small decode step on an H200


class EngineStoppedError(RuntimeError):
    """The engine stopped while the server ran (not by a shutdown signal): the server shut down."""


class _Server(uvicorn.Server):
    """uvicorn's server, plus: a shutdown signal aborts the engine's requests, and is not re-raised after the
    graceful exit (uvicorn re-raises it by default, which would make SIGTERM exit non-zero); an engine that stops
    by itself shuts the server down (checked on uvicorn's tick, every 0.1 s)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine) -> None:
        super().__init__(config)
        self.engine = engine
        self.engine_stopped = False

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick; also ends the server once the engine is gone (its requests have already failed)."""
        if not self.should_exit and not self.engine.is_alive:
            self.engine_stopped = self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: graceful shutdown with every request aborted. A second SIGINT forces the exit."""
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
        self.engine.closing = True  # refuse new requests at once
        # The abort goes out from a thread: this handler runs on the main thread, which may be inside the engine's
        # send (holding its lock, blocked on a full pipe) when the signal lands; taking that lock here would hang.
        threading.Thread(target=self.engine.close, name="fnvllm-shutdown", daemon=True).start()


def bind(host: str, port: int, listen: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free port, read back with ``getsockname``), listening unless
    ``listen`` is False (then the port is only reserved: connections are refused until the server listens)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    if listen:
        sock.listen(2048)
    return sock


def serve(
    engine: AsyncEngine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    on_listening: Callable[[str, int], None] | None = None,
    stream_interval_s: float = 0.0,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    sock: socket.socket | None = None,
    reasoning_parser: str | None = None,
    tool_parser: str = "hermes",
    model_aliases: Sequence[str] = (),
    health_stall_s: float | None = DEFAULT_HEALTH_STALL_S,
    **uvicorn_options: Any,
) -> None:
    """Serve ``engine`` over HTTP until SIGINT/SIGTERM, or until the engine stops (then EngineStoppedError);
    ``on_listening(host, port)`` runs once the socket listens (before the first request can be answered).
    ``stream_interval_s``, ``max_request_bytes``, ``reasoning_parser``, ``tool_parser``, ``model_aliases``,
    ``health_stall_s``: see ``build_app``.
    ``sock``: a socket already bound to host:port (``bind(..., listen=False)``, so that a port in use is found
    before the model loads); else one is bound here."""
    app = build_app(
        engine, model_name, api_key, stream_interval_s, max_request_bytes, reasoning_parser, tool_parser, model_aliases,
        health_stall_s,
    )  # fmt: skip
    sock = sock if sock is not None else bind(host, port)
    # Listen before announcing it: a client that connects on the line then waits in the backlog, never refused.
    # (A reserved port can also be taken meanwhile by another process's reservation; listening finds that here.)
    sock.listen(2048)
    if on_listening is not None:
        on_listening(host, sock.getsockname()[1])
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=30, **uvicorn_options)
    previous = sys.getswitchinterval()
    # An engine on a thread here (--engine-thread), or the reader of an engine process, shares the GIL with the
    # web thread. When a step's report is due it must get the GIL back at once, or the engine (or the streams)
    # wait. Python's default hand-over interval (5 ms) is as long as a whole decode step.
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    server = _Server(config, engine)
    try:
        server.run(sockets=[sock])
    finally:
        sys.setswitchinterval(previous)
        sock.close()
    if server.engine_stopped:
        raise EngineStoppedError("the engine stopped while serving; the server shut down")
