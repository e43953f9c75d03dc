"""What a request's caller receives: ``RequestOutput`` (one prompt's result, its ``CompletionOutput``s), the
``StreamDelta``s of a stream, and ``RequestMetrics``. Plain frozen values: the output processor
(``fnvllm.engine.output``) builds them, and they pickle across the server's engine process.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from fnvllm.executor.base import TokenLogprobs
from fnvllm.state import FinishReason


@attrs.frozen
class RequestMetrics:
    """Wall-clock times of one request (``time.perf_counter`` seconds) and its prefix-cache savings.

    arrival_time: when it was added. first_token_time / finish_time: None until they happen.
    num_cached_tokens: prompt tokens served from the prefix cache at its (last) admission instead of computed.
    scheduled_time: when the plan that first admitted it was made (None until then, and for metrics built by
        hand); a preempted request keeps its first. Splits the time to first token into ``queue_time`` and
        ``prefill_time``, as vLLM's metrics do.
    """

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_cached_tokens: int
    scheduled_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        """Arrival to first admission, seconds (None until admitted)."""
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """First admission to first token, seconds (None until both happened)."""
        if self.scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.scheduled_time

    @property
    def decode_time(self) -> float | None:
        """First token to finish, seconds (0 for a one-token answer; None until both happened)."""
        if self.first_token_time is None or self.finish_time is None:
            return None
        return self.finish_time - self.first_token_time

    @property
    def inference_time(self) -> float | None:
        """First admission to finish, seconds (None until both happened)."""
        if self.scheduled_time is None or self.finish_time is None:
            return None
        return self.finish_time - self.scheduled_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish, seconds."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    def tpot(self, num_tokens: int) -> float | None:
        """Mean time per output token after the first (seconds); None with fewer than two tokens."""
        if self.finish_time is None or self.first_token_time is None or num_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (num_tokens - 1)


@attrs.frozen
class CompletionOutput:
    """One completion of a prompt (one sampled sequence): an entry of ``RequestOutput.outputs``.

    index: its place among the prompt's n completions (``SamplingParams.n``), 0 .. n-1. Copy j of a seeded
        request drew from seed + j (``fnvllm.state.copies``).
    text / token_ids / finish_reason / logprobs: as RequestOutput's fields of the same names, for this completion.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    logprobs: Sequence[TokenLogprobs] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs (each entry's ``TokenLogprobs.logprob``) when logprobs were
        asked (``SamplingParams.logprobs`` set, 0 included), else None. Computed when read, like the entries it
        adds up: an output that is never asked for it never builds them."""
        if self.logprobs is None:
            return None
        return sum((entry.logprob for entry in self.logprobs), 0.0)

    @property
    def finished(self) -> bool:
        """True once the completion ended."""
        return self.finish_reason is not None


def _first_completion(output: RequestOutput) -> tuple[CompletionOutput, ...]:
    """``outputs`` of a RequestOutput built without them: one completion, its flat fields."""
    return (CompletionOutput(0, output.text, output.token_ids, output.finish_reason, output.logprobs),)


@attrs.frozen
class RequestOutput:
    """The result of one prompt.

    request_id: engine-wide id (with n > 1: completion 0's; each completion ran as its own engine request).
    prompt: the text prompt (None for token-id prompts). prompt_token_ids: its ids.
    text: generated text (stop string excluded unless include_stop_str_in_output; special tokens skipped).
    token_ids: generated ids (including an EOS or stop token that ended it).
    finish_reason: "stop", "length" or "abort"; None while it runs.
    logprobs: one entry per generated token when SamplingParams.logprobs was set, else None. From the engine it
        is a ``LogprobView``: an immutable sequence that builds its entries when first read (equal to, hashing
        and pickling as the tuple of them), so a caller that never reads them never pays for building them.
    metrics: arrival / first-token / finish times and prefix-cache savings (with n > 1: of the whole group, see
        ``group_outputs``).
    prompt_logprobs: when SamplingParams.prompt_logprobs was set, one entry per prompt token: None for the first,
        then the token's logprob given the tokens before it and the top-k there (``TokenLogprobs``); else None.
    outputs: the prompt's completions (``CompletionOutput``), index 0 .. n-1 (``SamplingParams.n``); one for an
        n = 1 request, equal to the flat fields (the default when built by hand). The flat fields text,
        token_ids, finish_reason and logprobs are completion 0's, kept for n = 1 callers.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    logprobs: Sequence[TokenLogprobs] | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    outputs: tuple[CompletionOutput, ...] = attrs.field(default=attrs.Factory(_first_completion, takes_self=True))

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        """True once the request ended (every completion, for ``generate`` results)."""
        return all(completion.finish_reason is not None for completion in self.outputs)


def group_outputs(parts: Sequence[RequestOutput]) -> RequestOutput:
    """One prompt's completions as one RequestOutput: ``parts`` are the n single-completion outputs of its copies,
    in completion order (``parts[j].outputs == (completion j,)``). Its flat fields, request_id and
    prompt_logprobs are completion 0's; ``outputs`` holds every completion; ``metrics`` span the group: the
    earliest arrival and first token, the latest finish (None until every completion finished) and the prompt
    tokens the prefix cache served summed over the copies (each copy reads the prompt: up to n times its
    length); None if a part has none. One part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    timings = [p.metrics for p in parts if p.metrics is not None]
    metrics = _group_metrics(timings) if len(timings) == len(parts) else None
    return attrs.evolve(parts[0], metrics=metrics, outputs=tuple(p.outputs[0] for p in parts))


def _group_metrics(parts: Sequence[RequestMetrics]) -> RequestMetrics:
    """Metrics of a group of requests: earliest arrival, admission and first token, latest finish (None while any
    runs)."""
    firsts = [m.first_token_time for m in parts if m.first_token_time is not None]
    finishes = [m.finish_time for m in parts if m.finish_time is not None]
    scheduled = [m.scheduled_time for m in parts if m.scheduled_time is not None]
    return RequestMetrics(
        arrival_time=min(m.arrival_time for m in parts),
        first_token_time=min(firsts) if firsts else None,
        finish_time=max(finishes) if len(finishes) == len(parts) else None,
        num_cached_tokens=sum(m.num_cached_tokens for m in parts),
        scheduled_time=min(scheduled) if scheduled else None,
    )


@attrs.frozen
class StreamDelta:
    """What one step added to one request: the index of its prompt, new text and ids, and its finish reason.

    completion: which of the prompt's n completions (``SamplingParams.n``) it belongs to, 0 .. n-1 (the index
    of ``RequestOutput.outputs`` it adds to); 0 for an n = 1 request. ``(index, completion)`` names one sequence.
    """

    index: int
    request_id: str
    new_text: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    completion: int = 0
