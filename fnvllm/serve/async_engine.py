"""AsyncEngine: the one engine loop on its own thread, and an asyncio stream per request.

    HTTP handlers (asyncio thread)                    engine thread (sole owner of the EngineLoop)
    submit(): validate, check the waiting cap  --->   inbox: drain add/abort between steps
    stream.drain() / async for event in stream <---   tracker.on_delta -> outbox; after each step, one
                                                      loop.call_soon_threadsafe hands the whole outbox over

The engine thread steps while any request is live and sleeps on the inbox when idle. GPU steps block, so they
never run on the event loop; a slow consumer never blocks the engine (its queue just grows). An exception in a
step fails the requests in flight (each stream raises ``EngineFailure``) and the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from fnvllm.detokenizer import IncrementalDetokenizer
from fnvllm.engine import EngineLoop, EngineOutput, EngineStats, RequestOutput, RequestTracker, StreamDelta
from fnvllm.serve.stream import EngineFailure, Item, RequestStream, TokenEvent, deliver
from fnvllm.state import EngineState, SamplingParams, StepPlan, validate_request

logger = logging.getLogger(__name__)


class EngineOverloaded(Exception):
    """The waiting queue is full, or the engine is shutting down: retry later."""


@attrs.frozen
class EngineSnapshot:
    """The engine's gauges and totals, published by the engine thread after each step (read from any thread).

    num_used_blocks: KV blocks referenced by live requests (cached-but-free blocks count as free).
    num_prompt_tokens: prompt tokens of every request admitted so far (the prefix-cache hit rate's denominator).
    num_failed_steps: steps that raised (their requests were failed).
    """

    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_blocks: int
    num_prompt_tokens: int
    num_failed_steps: int
    stats: EngineStats


class EngineObserver(Protocol):
    """Receives engine-thread events (the server's Prometheus metrics implement it)."""

    def on_step(self, num_seqs: int) -> None:
        """A step ran ``num_seqs`` sequences."""
        ...

    def on_finish(self, output: RequestOutput) -> None:
        """A request finished (stop, length or abort)."""
        ...


@attrs.frozen
class _Add:
    tracker: RequestTracker
    stream: RequestStream


@attrs.frozen
class _Abort:
    request_id: str | None  # None: every live request


_STOP = "stop"


class AsyncEngine:
    """An ``EngineLoop`` driven by one dedicated thread; any asyncio task may ``submit`` and ``abort``.

    max_waiting: submissions beyond this many waiting (not yet running) requests raise ``EngineOverloaded``.
    observer: sees each step and each finished request, on the engine thread.
    """

    def __init__(
        self,
        loop: EngineLoop,
        tokenizer: Any,
        max_waiting: int | None = None,
        observer: EngineObserver | None = None,
    ) -> None:
        self.loop, self.tokenizer, self.max_waiting, self.observer = loop, tokenizer, max_waiting, observer
        self._blank: EngineState = loop.engine.initial_state()  # a pure value to validate against, any thread
        self.config = self._blank.config
        self._inbox: queue.SimpleQueue[_Add | _Abort | str] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_queued = 0  # submitted adds the engine thread has not applied yet
        self._num_prompt_tokens = 0
        self._num_failed_steps = 0
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._outbox: list[tuple[RequestStream, Item]] = []  # engine thread only: events not yet handed over
        self._thread: threading.Thread | None = None
        self.closing = False
        loop.on_step = self._on_step
        self.snapshot = self._take_snapshot()

    @property
    def max_total_tokens(self) -> int:
        """The most prompt + output tokens one request may have (model length and KV pool)."""
        cfg = self.config
        return min(cfg.max_model_len, cfg.num_blocks * cfg.block_size + 1)

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fnvllm-engine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Refuse new requests and abort the live ones (safe from a signal handler)."""
        self.closing = True
        self._inbox.put(_Abort(None))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything and end the engine thread."""
        self.closing = True
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, prompt: str | None = None, request_id: str = ""
    ) -> RequestStream:
        """Queue a request from the event loop; returns its stream.

        Raises InvalidRequestError (naming the field) for a request that can never run, EngineOverloaded when
        the waiting queue is full or the engine is closing. Nothing is queued when it raises."""
        rid = request_id or uuid.uuid4().hex
        ids = tuple(prompt_ids)
        validate_request(self._blank, rid, ids, params)
        stream = RequestStream(rid, ids, asyncio.get_running_loop())
        tracker = RequestTracker(0, rid, prompt, ids, params, self._detokenizer(ids, params))
        tracker.on_delta = lambda delta: self._deliver(tracker, stream, delta)
        with self._lock:
            self._check_capacity()
            self._num_queued += 1
            self._inbox.put(_Add(tracker, stream))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); its KV blocks are freed between steps."""
        self._inbox.put(_Abort(request_id))

    def _check_capacity(self) -> None:
        if self.closing:
            raise EngineOverloaded("the server is shutting down (or its engine stopped)")
        num_waiting = self._num_queued + self.snapshot.num_waiting
        if self.max_waiting is not None and num_waiting >= self.max_waiting:
            raise EngineOverloaded(
                f"the server is overloaded: {num_waiting} requests are waiting (max_waiting={self.max_waiting}); "
                "retry later"
            )

    def _detokenizer(self, ids: tuple[int, ...], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, ids, True, params.stop, params.include_stop_str_in_output)

    # ---- engine thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        """The engine thread's body; if it ever dies, its requests fail and new ones are refused (never hang)."""
        try:
            self._serve_forever()
        except BaseException as error:
            logger.exception("the engine thread died")
            self.closing = True
            failure = EngineFailure(f"the engine thread died: {error!r}")
            queued = [c.stream for c in self._take_commands(block=False) if isinstance(c, _Add)]
            for stream in [*self._streams.values(), *queued]:
                stream.put(failure)
            raise

    def _serve_forever(self) -> None:
        """Apply commands, step while work exists, sleep on the inbox when idle; return on _STOP."""
        while True:
            commands = self._take_commands(block=not self.loop.has_unfinished)
            for command in commands:
                if command != _STOP:
                    self._apply(command)
            if _STOP in commands:
                self._abort_all()  # every stream, including those added just now, ends with "abort"
                self._flush()
                self.snapshot = self._take_snapshot()
                return
            self._flush()
            if self.loop.has_unfinished:
                self._step()
                self._flush()
            self.snapshot = self._take_snapshot()
            num_added = sum(isinstance(c, _Add) for c in commands)
            if num_added:
                with self._lock:
                    self._num_queued -= num_added  # after publishing, so the waiting count never dips

    def _take_commands(self, block: bool) -> list[_Add | _Abort | str]:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Add | _Abort | str) -> None:
        if isinstance(command, _Abort):
            if command.request_id is None:
                self._abort_all()
            else:
                self.loop.abort(command.request_id)
            return
        assert isinstance(command, _Add)  # the only other command; _STOP is handled by _serve_forever
        tracker, stream = command.tracker, command.stream
        try:
            self.loop.add(tracker.request_id, tracker.prompt_ids, tracker.params, tracker)
        except Exception as error:  # validated at submit: anything left fails this request only
            stream.put(EngineFailure(f"request rejected by the engine: {error}"))
            return
        self._streams[tracker.request_id] = stream
        self._num_prompt_tokens += len(tracker.prompt_ids)

    def _step(self) -> None:
        try:
            self.loop.step()
        except Exception as error:  # the loop restored itself; fail what was in flight, keep serving
            logger.exception("engine step failed; failing the %d requests in flight", len(self._streams))
            self._num_failed_steps += 1
            for rid, stream in list(self._streams.items()):
                stream.put(EngineFailure(f"the engine failed while running this request: {error!r}"))
                self.loop.abort(rid)
            self._streams.clear()

    def _abort_all(self) -> None:
        for rid in list(self._streams):
            self.loop.abort(rid)

    def _flush(self) -> None:
        if self._outbox:
            deliver(self._outbox)
            self._outbox = []

    def _deliver(self, tracker: RequestTracker, stream: RequestStream, delta: StreamDelta) -> None:
        """The tracker's ``on_delta``: queue one delta (with its logprobs) for the request's stream; the outbox
        goes to the event loop after the step."""
        n = len(delta.new_token_ids)
        logprobs = tuple(tracker.logprobs[max(0, len(tracker.logprobs) - n) :]) if n and tracker.logprobs else ()
        self._outbox.append((stream, TokenEvent(delta.new_text, delta.new_token_ids, logprobs, delta.finish_reason)))
        if delta.finish_reason is not None:
            self._streams.pop(tracker.request_id, None)
            if self.observer is not None:
                self.observer.on_finish(tracker.result())

    def _on_step(self, state: EngineState, plan: StepPlan, output: EngineOutput) -> None:
        if self.observer is not None:
            self.observer.on_step(len(plan.seq_ids))

    def _take_snapshot(self) -> EngineSnapshot:
        state = self.loop.state
        return EngineSnapshot(
            num_running=len(state.running),
            num_waiting=len(state.waiting),
            num_used_blocks=self.config.num_blocks - state.pool.num_free,
            num_blocks=self.config.num_blocks,
            num_prompt_tokens=self._num_prompt_tokens,
            num_failed_steps=self._num_failed_steps,
            stats=self.loop.stats,
        )
