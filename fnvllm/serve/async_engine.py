"""The server's engine in two halves: ``EngineWorker`` (the one engine loop: commands in, step reports out) and
``AsyncEngine`` (the front the asyncio handlers use: submit, abort, one stream per request).

    HTTP handlers (asyncio thread)                    EngineWorker (sole owner of the EngineLoop)
    submit(): validate, check the waiting cap  --->   commands: drain add/abort between steps
    stream.drain() / async for event in stream <---   tracker.on_delta -> events; after each round one
                                                      StepReport; the front hands all its events to the
                                                      event loop with one call_soon_threadsafe

``AsyncEngine`` runs the core on a thread of the server process; ``engine_process.ProcessEngine`` (what
``fnvllm serve`` uses) runs it in a process of its own, so the web server never holds the engine's GIL. The core
steps while any request is live and sleeps on its commands when idle; a slow consumer never blocks it (its queue
just grows). An exception in a step fails the requests in flight (each stream raises ``EngineFailure``) and the
core keeps serving.

Progress (for ``/health``): the front stamps, by its own clock (``clock``, ``time.monotonic``), each report it
receives (one per round of the core: a step, or commands applied while idle) and the moment work reaches an idle
engine. ``seconds_without_progress()`` is the time since the later of the two while work is pending. Stamping on
the receiving side keeps an engine process's clock out of it (no skew across processes).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from fnvllm.engine import EngineLoop, EngineOutput, EngineStats, RequestOutput, RequestTracker, StreamDelta
from fnvllm.engine.text import DetokenizerFactory, detokenizer_factory
from fnvllm.serve.stream import EngineFailure, Item, RequestStream, TokenEvent, deliver
from fnvllm.state import EngineState, SamplingParams, StepPlan, validate_request

logger = logging.getLogger(__name__)


class EngineOverloaded(Exception):
    """The waiting queue is full, or the engine is shutting down: retry later."""


@attrs.frozen
class EngineSnapshot:
    """The engine's gauges and totals, published with each step report (read from any thread).

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
class AddCommand:
    """Queue a request (validated at submit). arrival: its ``time.perf_counter()`` at submit (a system-wide
    monotonic clock on Linux, so an engine process measures latencies from it too)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    prompt: str | None
    arrival: float


@attrs.frozen
class AbortCommand:
    """Abort a request; None: every live request."""

    request_id: str | None


@attrs.frozen
class Submission:
    """One request for ``AsyncEngine.submit_many``: prompt ids, params, prompt text (or None), request id ("":
    a fresh one)."""

    prompt_ids: Sequence[int]
    params: SamplingParams
    prompt: str | None = None
    request_id: str = ""


STOP = "stop"
Command = AddCommand | AbortCommand | str


@attrs.frozen
class StepReport:
    """What the engine core sends the front after applying commands and running (at most) one step.

    events: (request id, event) in order; a request's last event has a finish reason or is an EngineFailure.
    finished: the results of the requests that finished (for latency metrics).
    step_sizes: sequences in each step run. num_applied: add commands applied (no longer "queued").
    snapshot: the gauges after it.
    """

    events: list[tuple[str, Item]]
    finished: list[RequestOutput]
    step_sizes: list[int]
    num_applied: int
    snapshot: EngineSnapshot


class EngineWorker:
    """The engine side of the server: an ``EngineLoop`` that takes commands, steps while work exists and reports.
    It runs on a thread of the server process (``AsyncEngine``) or in a process of its own
    (``fnvllm.serve.engine_process``); it knows requests by id only.

    detokenizer_for(prompt_ids, params): the request's incremental detokenizer (None: token ids only).
    """

    def __init__(
        self,
        loop: EngineLoop,
        report: Callable[[StepReport], None],
        detokenizer_for: DetokenizerFactory,
    ) -> None:
        self.loop, self.report, self.detokenizer_for = loop, report, detokenizer_for
        self.config = loop.engine.config
        self._live: set[str] = set()
        self._events: list[tuple[str, Item]] = []
        self._finished: list[RequestOutput] = []
        self._step_sizes: list[int] = []
        self._num_prompt_tokens = 0
        self._num_failed_steps = 0
        loop.on_step = self._on_step

    def serve_forever(self, take_commands: Callable[[bool], list[Command]]) -> None:
        """Apply commands (``take_commands(block)`` blocks for one when ``block``), step while work exists,
        report after each round; return after STOP (every live request aborted and reported)."""
        while True:
            commands = take_commands(not self.loop.has_unfinished)
            for command in commands:
                if command != STOP:
                    self._apply(command)
            num_added = sum(isinstance(c, AddCommand) for c in commands)
            if STOP in commands:
                self._abort_all()
                self._send(num_added)
                return
            if self.loop.has_unfinished:
                self._step()
            self._send(num_added)

    def fail_all(self, error: BaseException) -> None:
        """The core is dying: report a failure for every live request."""
        failure = EngineFailure(f"the engine stopped: {error!r}")
        self._events += [(rid, failure) for rid in self._live]
        self._live.clear()
        self._send(0)

    def snapshot(self) -> EngineSnapshot:
        """The gauges now."""
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

    def _send(self, num_applied: int) -> None:
        events, finished, sizes = self._events, self._finished, self._step_sizes
        self._events, self._finished, self._step_sizes = [], [], []
        self.report(StepReport(events, finished, sizes, num_applied, self.snapshot()))

    def _apply(self, command: Command) -> None:
        if isinstance(command, AbortCommand):
            if command.request_id is None:
                self._abort_all()
            else:
                self.loop.abort(command.request_id)
            return
        assert isinstance(command, AddCommand)  # the only other command; STOP is handled by serve_forever
        rid, ids, params = command.request_id, command.prompt_ids, command.params
        try:
            tracker = RequestTracker(0, rid, command.prompt, ids, params, self.detokenizer_for(ids, params))
            tracker.arrival_time = command.arrival
            tracker.on_delta = lambda delta: self._on_delta(tracker, delta)
            self.loop.add(rid, ids, params, tracker)
        except Exception as error:  # validated at submit: anything left fails this request only
            self._events.append((rid, EngineFailure(f"request rejected by the engine: {error}")))
            return
        self._live.add(rid)
        self._num_prompt_tokens += len(ids)

    def _step(self) -> None:
        try:
            self.loop.step()
        except Exception as error:  # the loop restored itself; fail what was in flight, keep serving
            logger.exception("engine step failed; failing the %d requests in flight", len(self._live))
            self._num_failed_steps += 1
            failure = EngineFailure(f"the engine failed while running this request: {error!r}")
            for rid in list(self._live):
                self._events.append((rid, failure))
                self.loop.abort(rid)
            self._live.clear()

    def _abort_all(self) -> None:
        for rid in list(self._live):
            self.loop.abort(rid)

    def _on_delta(self, tracker: RequestTracker, delta: StreamDelta) -> None:
        """A tracker's ``on_delta``: one event (with its logprobs) for the request, sent after the step."""
        n = len(delta.new_token_ids)
        logprobs = tuple(tracker.logprobs[max(0, len(tracker.logprobs) - n) :]) if n and tracker.logprobs else ()
        first = n > 0 and len(tracker.token_ids) == n  # the prompt is complete: its logprobs go with this event
        prompt = tuple(tracker.prompt_logprobs) if first and tracker.prompt_logprobs is not None else None
        event = TokenEvent(delta.new_text, delta.new_token_ids, logprobs, delta.finish_reason, prompt)
        self._events.append((tracker.request_id, event))
        if delta.finish_reason is not None:
            self._live.discard(tracker.request_id)
            self._finished.append(tracker.result())

    def _on_step(self, state: EngineState, plan: StepPlan, output: EngineOutput) -> None:
        self._step_sizes.append(len(plan.seq_ids))


class AsyncEngine:
    """The front of the engine for asyncio handlers: ``submit`` and ``abort`` from any asyncio task; events reach
    each request's ``RequestStream``. This class runs the ``EngineWorker`` on a thread of this process
    (``fnvllm.serve.engine_process.ProcessEngine`` runs it in a process of its own, with the same front).

    max_waiting: submissions beyond this many waiting (not yet running) requests raise ``EngineOverloaded``.
    observer: sees each step and each finished request (on the thread that receives the core's reports).
    clock: seconds, monotonic; when reports arrive and work starts (``seconds_without_progress``). Tests pass a
    fake one to age a stall without waiting for it.
    """

    def __init__(
        self,
        loop: EngineLoop,
        tokenizer: Any,
        max_waiting: int | None = None,
        observer: EngineObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._init_front(loop.engine.initial_state(), tokenizer, max_waiting, observer, clock)
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._core = EngineWorker(loop, self._on_report, detokenizer_factory(tokenizer))
        self._thread: threading.Thread | None = None
        self.snapshot = self._core.snapshot()

    def _init_front(
        self,
        blank: EngineState,
        tokenizer: Any,
        max_waiting: int | None,
        observer: EngineObserver | None,
        clock: Callable[[], float],
    ) -> None:
        self.tokenizer, self.max_waiting, self.observer, self.clock = tokenizer, max_waiting, observer, clock
        self._progress_time = clock()  # the last report, or work reaching an idle engine (``clock`` seconds)
        self._blank = blank  # a pure value to validate against, any thread
        self.config = blank.config
        self._lock = threading.Lock()
        self._num_queued = 0  # submitted adds the core has not applied yet
        self._streams: dict[str, RequestStream] = {}
        self.closing = False

    @property
    def max_total_tokens(self) -> int:
        """The most prompt + output tokens one request may have (model length and KV pool)."""
        cfg = self.config
        return min(cfg.max_model_len, cfg.num_blocks * cfg.block_size + 1)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to run: in the core's queue (as of its last report), or submitted and not yet taken
        in by it."""
        return self.snapshot.num_waiting + self._num_queued

    @property
    def has_work(self) -> bool:
        """True while a request runs or waits (``num_waiting``)."""
        return self.snapshot.num_running + self.num_waiting > 0

    def seconds_without_progress(self) -> float | None:
        """While work is pending: seconds (``clock``) since the core's last report or since work reached it idle,
        whichever is later. None when there is no work (an idle engine is not stalled, however long it idles)."""
        if not self.has_work:
            return None
        return max(0.0, self.clock() - self._progress_time)

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
        self._send(AbortCommand(None))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything and end the engine thread."""
        self.closing = True
        if self._thread is not None:
            self._send(STOP)
            self._thread.join(timeout)
            self._thread = None

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, prompt: str | None = None, request_id: str = ""
    ) -> RequestStream:
        """Queue a request from the event loop; returns its stream.

        Raises InvalidRequestError (naming the field) for a request that can never run, EngineOverloaded when
        the waiting queue is full or the engine is closing. Nothing is queued when it raises."""
        return self.submit_many([Submission(prompt_ids, params, prompt, request_id)])[0]

    def submit_many(
        self, submissions: Sequence[Submission], aloop: asyncio.AbstractEventLoop | None = None
    ) -> list[RequestStream]:
        """Queue several requests at once (``n`` copies of a prompt, a batch of prompts): all or none.

        Every one is validated first (copies of one prompt list that differ only in their seed, once); then the
        waiting cap is checked once for the whole group (a group is admitted while the queue has room, so a large
        ``n`` cannot be refused forever). Raises as ``submit``. From a worker thread (validating a long prompt
        takes a while), pass ``aloop``: the event loop that reads the streams."""
        aloop = aloop or asyncio.get_running_loop()
        prompts: dict[int, tuple[int, ...]] = {}
        validated: set[tuple[int, SamplingParams]] = set()
        checked = []
        for s in submissions:
            key = id(s.prompt_ids)
            if key not in prompts:
                prompts[key] = tuple(s.prompt_ids)
            rid, ids = s.request_id or uuid.uuid4().hex, prompts[key]
            unseeded = attrs.evolve(s.params, seed=None)
            if (key, unseeded) not in validated:
                validate_request(self._blank, rid, ids, s.params)
                validated.add((key, unseeded))
            checked.append((rid, ids, s))
        streams = [RequestStream(rid, ids, aloop) for rid, ids, _ in checked]
        with self._lock:
            self._check_capacity()
            if not self.has_work:  # the stall clock starts now, not at the last step of an earlier busy spell
                self._progress_time = self.clock()
            self._num_queued += len(checked)
            for (rid, ids, s), stream in zip(checked, streams, strict=True):
                self._streams[rid] = stream
                self._send(AddCommand(rid, ids, s.params, s.prompt, time.perf_counter()))
        return streams

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); its KV blocks are freed between steps."""
        self._send(AbortCommand(request_id))

    def _send(self, command: Command) -> None:
        self._inbox.put(command)

    def _check_capacity(self) -> None:
        if self.closing:
            raise EngineOverloaded("the server is shutting down (or its engine stopped)")
        num_waiting = self.num_waiting
        if self.max_waiting is not None and num_waiting >= self.max_waiting:
            raise EngineOverloaded(
                f"the server is overloaded: {num_waiting} requests are waiting (max_waiting={self.max_waiting}); "
                "retry later"
            )

    def _on_report(self, report: StepReport) -> None:
        """One round of the core: publish the snapshot and tell the observer (so a consumer that sees its last
        token sees the totals that include it), hand every event to its stream's event loop (one call per loop);
        then the applied adds stop counting as queued (after the snapshot that counts them as waiting, so the
        waiting count never dips). The report's arrival is the core's progress, stamped by this side's clock."""
        self._progress_time = self.clock()
        self.snapshot = report.snapshot
        if self.observer is not None:
            for size in report.step_sizes:
                self.observer.on_step(size)
            for output in report.finished:
                self.observer.on_finish(output)
        batch: list[tuple[RequestStream, Item]] = []
        for rid, item in report.events:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            batch.append((stream, item))
            if isinstance(item, EngineFailure) or item.finish_reason is not None:
                del self._streams[rid]
        if batch:
            deliver(batch)
        if report.num_applied:
            with self._lock:
                self._num_queued -= report.num_applied

    def _fail_streams(self, message: str) -> None:
        """The core is gone: fail every stream still open, refuse new requests."""
        self.closing = True
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        failure = EngineFailure(message)
        deliver([(stream, failure) for stream in streams])

    # ---- engine thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        """The engine thread's body; if it ever dies, its requests fail and new ones are refused (never hang)."""
        try:
            self._core.serve_forever(self._take_commands)
        except BaseException as error:
            logger.exception("the engine thread died")
            self._fail_streams(f"the engine thread died: {error!r}")
            raise

    def _take_commands(self, block: bool) -> list[Command]:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands
