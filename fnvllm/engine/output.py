"""The output processor: routes each committed step's tokens to the request that owns them.

Every live request has a ``RequestTracker``: its ids, logprobs, incremental detokenizer (stop strings), timing
metrics, and its own queue of ``StreamDelta``s. ``OutputProcessor.process`` folds one ``EngineOutput`` into the
trackers; a stop string seen in the text ends the request in the core with the pure ``finish``. Token routing
lives here, not in any caller's loop, so any number of consumers (interleaved ``LLM.stream`` generators, HTTP
handlers) each read exactly their own deltas, whoever drove the step. The values it hands out (RequestOutput,
CompletionOutput, StreamDelta, RequestMetrics) are in ``fnvllm.engine.results`` (imported here too).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping

from fnvllm.detokenizer import IncrementalDetokenizer
from fnvllm.engine.core import EngineOutput
from fnvllm.engine.results import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta
from fnvllm.executor.base import PromptLogprobs, TokenLogprobs
from fnvllm.executor.logprob_rows import LogprobList, RequestLogprobs
from fnvllm.state import EngineState, FinishReason, SamplingParams, finish


class RequestTracker:
    """Host-side progress of one request: ids, logprobs, detokenizer, metrics and its queue of deltas.

    ``on_delta`` (optional) is called with every delta instead of queueing it (a server forwards deltas to its
    client's queue this way); without it, deltas wait in ``deltas`` for whoever consumes this request. The loop
    calls it only once the step is complete, so it may add or abort requests; if it raises, the loop finishes the
    step and then raises that exception to whoever called ``step``.
    ``arrival_time``: when the request arrived (default: now, by ``time.perf_counter``).
    ``completion``: which completion of its prompt this request is (``StreamDelta.completion``; 0 .. n-1).
    """

    def __init__(
        self,
        index: int,
        request_id: str,
        prompt: str | None,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer | None,
        on_delta: Callable[[StreamDelta], None] | None = None,
        arrival_time: float | None = None,
        completion: int = 0,
    ) -> None:
        self.index, self.request_id, self.prompt, self.prompt_ids = index, request_id, prompt, prompt_ids
        self.completion = completion
        self.params, self.detokenizer, self.on_delta = params, detokenizer, on_delta
        self.token_ids: list[int] = []
        self.logprobs = LogprobList(request_id)  # a Sequence[TokenLogprobs]: each entry built when read
        self.wants_logprobs = params.logprobs is not None
        self.finish_reason: FinishReason | None = None
        self.deltas: deque[StreamDelta] = deque()
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_cached_tokens = 0
        self.scheduled_time: float | None = None  # when the plan that first admitted it was made
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(prompt_ids)

    def add_prompt_logprobs(self, scored: PromptLogprobs) -> None:
        """Record the prompt logprobs a step computed (a recomputed prefill overwrites the same positions)."""
        if self.prompt_logprobs is None:
            return
        for position, entry in enumerate(scored.entries, scored.start):
            if entry is not None and position < len(self.prompt_logprobs):
                self.prompt_logprobs[position] = entry

    @property
    def finished(self) -> bool:
        """True once the request ended (its last delta is queued or delivered)."""
        return self.finish_reason is not None

    def add_token(
        self, token: int, logprobs: TokenLogprobs | RequestLogprobs | None, now: float, stops: bool = False
    ) -> str:
        """Record one sampled token and its logprobs (a TokenLogprobs, or the step's ``RequestLogprobs``, which holds
        this request's row, built when read; ignored unless the request asked for logprobs); returns the new text
        (empty while held back). Sets "stop" on a stop string. ``stops``: the token ends the request by itself (EOS
        or a stop token id): it is kept in ``token_ids`` but its text is not rendered unless
        include_stop_str_in_output, as a stop string's is not (and as vLLM renders neither)."""
        self.token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        if logprobs is not None and self.wants_logprobs:
            self.logprobs.append(logprobs)
        if self.detokenizer is None or (stops and not self.params.include_stop_str_in_output):
            return ""
        delta = self.detokenizer.add([token])
        if delta.stopped:
            self.finish_reason = "stop"
        return delta.new_text

    def close(self, reason: FinishReason, now: float) -> str:
        """End the request (keeps a stop-string reason already set); returns any held-back text."""
        if self.finish_reason is None:
            self.finish_reason = reason
        self.finish_time = now
        if self.detokenizer is None:
            return ""
        flushed = self.detokenizer.finish()
        if flushed.stopped and reason == "length":
            self.finish_reason = "stop"  # the stop string was only complete in the held-back text
        return flushed.new_text

    def delta(self, text: str, token_ids: tuple[int, ...]) -> StreamDelta:
        """One delta carrying the current finish reason."""
        return StreamDelta(self.index, self.request_id, text, token_ids, self.finish_reason, self.completion)

    def deliver(self, delta: StreamDelta) -> None:
        """Hand ``delta`` to ``on_delta``, or queue it in ``deltas``."""
        if self.on_delta is not None:
            self.on_delta(delta)
        else:
            self.deltas.append(delta)

    def emit(self, text: str, token_ids: tuple[int, ...]) -> None:
        """Deliver one delta carrying the current finish reason at once."""
        self.deliver(self.delta(text, token_ids))

    def metrics(self) -> RequestMetrics:
        """The request's timing metrics so far."""
        return RequestMetrics(
            self.arrival_time, self.first_token_time, self.finish_time, self.num_cached_tokens, self.scheduled_time
        )

    def result(self) -> RequestOutput:
        """The request's output so far (final once ``finished``): one completion, numbered ``completion``
        (``group_outputs`` joins a prompt's n of them)."""
        text = self.detokenizer.text if self.detokenizer is not None else ""
        token_ids = tuple(self.token_ids)
        logprobs = self.logprobs.view() if self.wants_logprobs else None  # built if and when it is read
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            text=text,
            token_ids=token_ids,
            finish_reason=self.finish_reason,
            logprobs=logprobs,
            metrics=self.metrics(),
            prompt_logprobs=tuple(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            outputs=(CompletionOutput(self.completion, text, token_ids, self.finish_reason, logprobs),),
        )


Outbox = list[tuple[RequestTracker, StreamDelta]]


def discard_delta(_: StreamDelta) -> None:
    """An ``on_delta`` that drops every delta, for a caller that reads whole outputs (``LLM.generate``): the output
    loop then builds no delta for that request at all (at 256 rows, building the deltas was about a third of the
    loop's routing time on the host)."""


def deliver_all(outbox: Outbox, errors: list[BaseException]) -> None:
    """Deliver every delta of ``outbox``; an exception from a consumer's callback is appended to ``errors`` and
    the other deltas are still delivered (one consumer's bug must not starve the others)."""
    for tracker, delta in outbox:
        try:
            tracker.deliver(delta)
        except BaseException as error:  # user code; re-raised by the loop once the step is complete
            errors.append(error)


class OutputProcessor:
    """The trackers of live requests, and the fold of each step's output into them.

    clock: the time source of the metrics (``time.perf_counter``; a test passes a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.trackers: dict[str, RequestTracker] = {}
        self.clock = clock

    def add(self, tracker: RequestTracker) -> None:
        """Start routing outputs of ``tracker.request_id`` to ``tracker``."""
        self.trackers[tracker.request_id] = tracker

    def note_cached(self, cached: Mapping[str, int], scheduled_time: float | None = None) -> None:
        """Record prompt tokens the prefix cache served to requests admitted this step, and when the step was
        planned (``scheduled_time``, default now) for those admitted the first time."""
        if not cached:
            return
        when = self.clock() if scheduled_time is None else scheduled_time
        for rid, num in cached.items():
            tracker = self.trackers.get(rid)
            if tracker is not None:
                tracker.num_cached_tokens = num
                if tracker.scheduled_time is None:
                    tracker.scheduled_time = when

    def abort(self, request_id: str) -> None:
        """Close a request that was aborted (no more tokens will come)."""
        tracker = self.trackers.pop(request_id, None)
        if tracker is not None:
            tracker.emit(tracker.close("abort", self.clock()), ())

    def process(self, state: EngineState, out: EngineOutput) -> tuple[EngineState, Outbox]:
        """Route one committed step to the trackers. Returns ``state`` with stop-string finishes applied, and the
        deltas to deliver (``deliver_all``) once the caller has adopted that state: a consumer's callback may
        then add or abort requests, and its exceptions cannot leave the step half-applied."""
        now = self.clock()
        finished = {f.request_id: f.reason for f in out.output.finished}
        outbox: Outbox = []
        for rid, scored in out.prompt_logprobs.items():  # before the tokens: a request may finish this step
            tracker = self.trackers.get(rid)
            if tracker is not None:
                tracker.add_prompt_logprobs(scored)
        shared, lookup = _logprob_routes(out.logprobs)
        # A multi-step plan's output lists a request once per token it kept: a finished one closes at its last.
        last = {rid: i for i, rid in enumerate(out.output.seq_ids) if rid in finished} if finished else {}
        for i, (rid, token) in enumerate(zip(out.output.seq_ids, out.output.new_tokens, strict=True)):
            tracker = self.trackers.get(rid)
            if tracker is None:
                continue  # driven by hand, not tracked
            ends_here = (rid in finished and last.get(rid, i) == i) if finished else False  # most steps: none end
            stop_token = ends_here and finished[rid] == "stop"  # EOS or a stop id (the core's token-level stops)
            text = tracker.add_token(token, shared if lookup is None else lookup(rid), now, stop_token)
            stopped = tracker.finish_reason == "stop"
            if stopped and rid not in finished:
                state = finish(state, rid)  # a stop string ended it; the core only knows token-level stops
                finished[rid] = "stop"
            if stopped or ends_here:
                text += tracker.close(finished[rid] if ends_here else "stop", now)
                del self.trackers[rid]
            if tracker.on_delta is not discard_delta:  # no delta is built for a caller that drops them
                outbox.append((tracker, tracker.delta(text, (token,))))
        return state, outbox


def _logprob_routes(
    logprobs: Mapping[str, TokenLogprobs],
) -> tuple[RequestLogprobs | None, Callable[[str], TokenLogprobs | None] | None]:
    """How a step's logprobs reach each tracker: (shared, None) hands every tracker the step's ``RequestLogprobs``
    as it is (no row is built or even found while the loop runs: a tracker's entry is one list append); (None,
    lookup) looks each request up in a plain mapping; (None, None) when there are none."""
    if isinstance(logprobs, RequestLogprobs):
        return logprobs, None
    return None, (logprobs.get if logprobs else None)
