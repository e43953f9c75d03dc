"""Request: the immutable facts of one generation request, fixed when it is added."""

from __future__ import annotations

from typing import Literal

import attrs

from fnvllm.state.params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


@attrs.frozen
class Request:
    """One request as the core sees it.

    request_id: unique among live requests.
    prompt: prompt token ids (non-empty).
    params: sampling and stop settings.
    arrival: admission-order stamp assigned by ``add_request`` (0, 1, 2, ...).
    priority: used by the priority policy; lower is served first.
    """

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival: int = 0
    priority: int = 0
    # token_limit (derived): prompt length + max_tokens, the total at which the request stops for length.
    token_limit: int = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "token_limit", len(self.prompt) + self.params.max_tokens)


@attrs.frozen
class SequenceView:
    """A read-only snapshot of one live sequence, for users and tests (built on demand, not stored).

    status: "waiting" (never admitted, or preempted) or "running".
    output: generated token ids so far.
    num_computed: tokens whose KV is written.
    block_table: KV block ids, position p lives in block_table[p // block_size].
    """

    request: Request
    status: Literal["waiting", "running"]
    output: tuple[int, ...]
    num_computed: int
    block_table: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.request.prompt) + len(self.output)


@attrs.frozen
class FinishedRequest:
    """A request that left the engine, with everything it generated."""

    request_id: str
    prompt_len: int
    output: tuple[int, ...]
    reason: FinishReason


@attrs.frozen
class StepOutput:
    """What one commit produced, columnar like the plan.

    step: the committed plan's step.
    seq_ids / new_tokens: each sequence that received a token this step and that token, aligned.
    finished: requests that finished this step (their full output and why).
    """

    step: int
    seq_ids: tuple[str, ...] = ()
    new_tokens: tuple[int, ...] = ()
    finished: tuple[FinishedRequest, ...] = ()
