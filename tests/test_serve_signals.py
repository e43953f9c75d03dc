"""The server's shutdown-signal handler (``server._Server.handle_exit``) on the main thread: it must not take the
engine's send lock itself, because the signal can land while the main thread is inside the engine's send holding
that lock (blocked on a full pipe to a busy engine process); the abort goes out from another thread."""

from __future__ import annotations

import signal
import threading

import pytest

pytest.importorskip("uvicorn", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")

import uvicorn

from fnvllm.serve.server import _Server


class LockedEngine:
    """An engine whose ``close`` takes a send lock, as ``ProcessEngine``'s does."""

    def __init__(self) -> None:
        self.send_lock = threading.Lock()
        self.closing = False
        self.closed = threading.Event()
        self.waited_out = False  # close gave up on the lock

    @property
    def is_alive(self) -> bool:
        return True

    def close(self) -> None:
        # a bounded wait, so that the handler's old form (taking the lock on the signalled thread) fails, not hangs
        if self.send_lock.acquire(timeout=2):
            self.closed.set()
            self.send_lock.release()
        else:
            self.waited_out = True


def test_the_signal_handler_returns_while_the_send_lock_is_held() -> None:
    engine = LockedEngine()
    server = _Server(uvicorn.Config(app=lambda scope, receive, send: None), engine)  # type: ignore[arg-type]
    with engine.send_lock:  # the main thread is "inside a send" when SIGTERM lands
        server.handle_exit(signal.SIGTERM, None)  # returns (it would wait on the lock for ever before)
        assert server.should_exit and engine.closing and not engine.closed.is_set() and not engine.waited_out
    assert engine.closed.wait(5) and not engine.waited_out  # the abort went out once the send finished
