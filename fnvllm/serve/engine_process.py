"""ProcessEngine: the server's engine core in a process of its own, behind the same front as ``AsyncEngine``.

    server process                                         engine process (spawned; owns the GPU)
    handlers -> submit / abort -- AddCommand, AbortCommand -->  EngineWorker.serve_forever: LLM + EngineLoop
    reader thread <-------------- StepReport (pickled) -------  after each round of commands + one step
      -> each event to its RequestStream (one call per event loop), metrics observer, snapshot

Why a process: in one process the engine thread and the asyncio thread share the GIL. At 256 streams the web
side's work (HTTP, server-sent events) delayed the engine's step launches so much that the GPU waited (on the
H200, decode steps stretched from 5.5 to 8-10 ms). In its own process the engine keeps a whole interpreter.

Start-up: the child loads the model and sends ``Ready`` (the core config the front validates requests against,
device, attention backend) or ``StartupFailed`` (the error, raised here as ``EngineStartupError``). Shutdown:
STOP over the pipe (the core aborts what is live and reports it), then join; terminate after a timeout. If the
child dies, every open stream fails with ``EngineFailure`` and new requests are refused (``is_alive`` turns
False, so ``/health`` reports it). If this process dies, the child reads end-of-file on the pipe and exits. A
child that is alive but stuck (a hung step) sends no report: with work pending, ``/health`` turns 503 once none
has arrived for ``--health-stall-s`` (the reader stamps each report's arrival with this process's clock).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import attrs

from fnvllm.engine import EngineStats
from fnvllm.serve.async_engine import (
    STOP,
    AddCommand,
    AsyncEngine,
    Command,
    EngineObserver,
    EngineOverloaded,
    EngineSnapshot,
    EngineWorker,
    StepReport,
)
from fnvllm.state import CoreConfig, initial_state

logger = logging.getLogger(__name__)


class EngineStartupError(RuntimeError):
    """The engine process could not load the model (the message is the child's error) or did not start."""


@attrs.frozen
class Ready:
    """The child loaded the model: its core config, device and attention backend, and whether it detokenizes."""

    config: CoreConfig
    device: str
    backend: str
    has_tokenizer: bool


@attrs.frozen
class StartupFailed:
    """The child could not build the engine: the error, as text."""

    message: str


def _die_with_parent() -> None:
    """On Linux, have the kernel SIGTERM this process when the server dies (``prctl(PR_SET_PDEATHSIG)``): a server
    killed while the model loads (before it can stop us by the pipe) must not leave the engine loading, holding
    the GPU, as an orphan. Elsewhere a no-op: the pipe's EOF stops the engine once it serves. The kernel ties the
    signal to the thread that started this process, so a ProcessEngine must be made on a thread that outlives it
    (the main thread, as ``fnvllm serve`` does)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _child_main(conn: Connection, model: str, options: dict[str, Any], load_tokenizer: bool) -> None:
    """The engine process: build the engine, report Ready, serve commands until STOP or until the server is
    gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server stops us by pipe
    _die_with_parent()
    try:
        from fnvllm.config import EngineConfig
        from fnvllm.engine.build import build_engine

        parts = build_engine(model, EngineConfig.from_options(options), load_tokenizer=load_tokenizer)
    except Exception as error:
        with contextlib.suppress(OSError):  # the server is gone: nobody to tell
            conn.send(StartupFailed(f"{type(error).__name__}: {error}"))
        return
    backend = parts.executor.backend
    ready = Ready(
        parts.engine.config, str(parts.executor.device), getattr(backend, "name", str(backend)),
        parts.tokenizer is not None,
    )  # fmt: skip
    try:
        conn.send(ready)
    except OSError:  # the server went away while the model loaded (a signal): nothing to serve
        parts.close()
        return
    core = EngineWorker(parts.loop, conn.send, parts.detokenizer)

    def take_commands(block: bool) -> list[Command]:
        commands: list[Command] = [conn.recv()] if block else []
        while conn.poll():
            commands.append(conn.recv())
        return commands

    try:
        core.serve_forever(take_commands)
    except (EOFError, OSError):  # the server closed the pipe (it exited or was killed): nothing to report to
        pass
    except BaseException as error:
        logger.exception("the engine process failed")
        core.fail_all(error)
        raise
    finally:
        parts.close()


class ProcessEngine(AsyncEngine):
    """An ``AsyncEngine`` front whose ``EngineWorker`` runs in a spawned process (``fnvllm serve``'s default).

    model / options / load_tokenizer: what the child builds (``LLM(model, load_tokenizer=..., **options)``).
    tokenizer: this process's own copy, for text prompts and chat templates (the child detokenizes with its own).
    The constructor returns once the model is loaded; raises ``EngineStartupError`` if it could not be, or if the
    child did not answer within ``startup_timeout_s``. On Linux the child is stopped when the thread that made it
    ends (``_die_with_parent``): make it on a thread that outlives it, such as the main thread.
    clock: as ``AsyncEngine``'s; the reader thread stamps each report's arrival with it (this process's clock,
    never the child's, so ``/health``'s stall check has no clock skew).
    """

    def __init__(
        self,
        model: str | Path,
        options: dict[str, Any],
        tokenizer: Any,
        load_tokenizer: bool = True,
        max_waiting: int | None = None,
        observer: EngineObserver | None = None,
        startup_timeout_s: float = 1800.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._conn, child_end = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(child_end, str(model), options, load_tokenizer), name="fnvllm-engine"
        )
        # Not a daemon: a daemonic process may not start children, and the engine starts its tensor-parallel
        # workers (--tensor-parallel-size). It still ends with this process: it exits when the pipe closes, which
        # the OS does if we die and ``_close_at_exit`` does at a normal exit (before multiprocessing's own exit
        # hook would wait for it).
        self._process.start()
        atexit.register(self._close_at_exit)
        child_end.close()
        self.ready = self._wait_for_ready(startup_timeout_s)
        self._init_front(initial_state(self.ready.config), tokenizer, max_waiting, observer, clock)
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._stopping = False
        config = self.ready.config
        self.snapshot = EngineSnapshot(0, 0, 0, config.num_blocks, 0, 0, EngineStats())

    def _close_at_exit(self) -> None:
        """This interpreter is exiting without ``stop()``: close the pipe (the engine process reads end-of-file
        and exits), then wait for it briefly, terminating it if it lingers."""
        self._conn.close()
        self._process.join(30)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)

    def _wait_for_ready(self, timeout_s: float) -> Ready:
        waited = 0.0
        while not self._conn.poll(1.0):
            waited += 1.0
            if not self._process.is_alive():
                raise EngineStartupError(f"the engine process exited with code {self._process.exitcode} at start-up")
            if waited >= timeout_s:
                atexit.unregister(self._close_at_exit)
                self._process.kill()
                raise EngineStartupError(f"the engine process did not load the model within {timeout_s:.0f} s")
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            message = StartupFailed(f"the engine process exited with code {self._process.exitcode} at start-up")
        if isinstance(message, StartupFailed):
            atexit.unregister(self._close_at_exit)
            self._process.join(10)
            raise EngineStartupError(message.message)
        assert isinstance(message, Ready)
        return message

    @property
    def is_alive(self) -> bool:
        """True while the engine process runs and its reports are being read."""
        return self._process.is_alive() and self._reader is not None and self._reader.is_alive()

    def start(self) -> None:
        """Start reading the engine process's reports (idempotent)."""
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_reports, name="fnvllm-engine-reader", daemon=True)
            self._reader.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything, stop the engine process (terminated if it does not exit in ``timeout``)."""
        self.closing = self._stopping = True
        self._send(STOP)
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine process did not stop in %.0f s; terminating it", timeout)
            self._process.terminate()
            self._process.join(5)
        if self._reader is not None:
            self._reader.join(timeout)
        self._conn.close()
        atexit.unregister(self._close_at_exit)

    def _send(self, command: Command) -> None:
        try:
            with self._send_lock:
                self._conn.send(command)
        except (OSError, ValueError) as error:  # the pipe is closed: the engine process is gone
            self.closing = True
            if isinstance(command, AddCommand):
                raise EngineOverloaded(f"the engine process is not running ({error})") from None

    def _read_reports(self) -> None:
        while True:
            try:
                report = self._conn.recv()
            except (EOFError, OSError):
                break
            assert isinstance(report, StepReport)
            self._on_report(report)
        self._process.join(5)
        if not self._stopping:
            logger.error("the engine process exited (code %s)", self._process.exitcode)
        self._fail_streams(f"the engine process exited (code {self._process.exitcode})")
