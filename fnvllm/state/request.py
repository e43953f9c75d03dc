"""Request: the immutable facts of one generation request, fixed when it is added."""

from __future__ import annotations

from collections.abc import Container
from typing import Any, Literal

import attrs

from fnvllm.state.checks import REQUEST, check_int, check_token_ids, fail, show
from fnvllm.state.config import CoreConfig
from fnvllm.state.errors import InvalidRequestError, RequestTypeError
from fnvllm.state.params import MAX_INT64, SamplingParams

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


_ONE_SEQUENCE = (
    "1 for a request of the core, which runs one sequence per request (LLM.generate, LLM.chat, LLM.stream and the "
    "server run n copies of a request: fnvllm.state.copies)"
)
_TOKEN_IDS_ONLY = (
    "empty for a request of the core, which reads token ids only (LLM and the server turn bad_words into "
    "bad_words_token_ids with their tokenizer: fnvllm.engine.text.resolve_bad_words)"
)


def _reject(field: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {message}")


def check_request(
    config: CoreConfig, live: Container[str], request_id: Any, prompt: Any, params: Any, priority: Any = 0
) -> tuple[tuple[int, ...], int]:
    """The request's prompt as a tuple of ints and its priority as an int, or InvalidRequestError (naming the
    field, the allowed range and the value) when it can never run under ``config`` beside the ``live`` ids.

    Checks, in order: the id (a non-empty str, not live), the params (a SamplingParams with n == 1: the core runs
    one sequence per request; without bad_words text, which a front end resolves to ids), the priority (an int),
    the prompt (a non-empty sequence of int ids in [0, vocab_size), see ``checks.check_token_ids``: a str, bytes
    or dict is not a prompt), the params against the vocabulary (stop ids, logprobs), and the size (prompt +
    max_tokens within max_model_len and the pool). Reads nothing else and changes nothing.
    """
    if not isinstance(request_id, str):
        raise RequestTypeError(f"request_id: must be a non-empty str, got {show(request_id)}")
    if not request_id:
        raise _reject("request_id", f"must be a non-empty str, got {request_id!r}")
    if request_id in live:
        raise _reject("request_id", f"{show(request_id)} is already live (waiting or running)")
    if not isinstance(params, SamplingParams):
        raise RequestTypeError(f"params: must be SamplingParams, got {show(params)}")
    if params.n != 1:
        raise fail(REQUEST, "SamplingParams.n", _ONE_SEQUENCE, params.n)
    if params.bad_words:
        raise fail(REQUEST, "SamplingParams.bad_words", _TOKEN_IDS_ONLY, params.bad_words)
    priority = check_int(priority, "priority", REQUEST, -MAX_INT64 - 1, MAX_INT64)
    ids = check_token_ids(prompt, "prompt", REQUEST, config.vocab_size)
    if not ids:
        raise _reject("prompt", "must hold at least 1 token")
    _check_params_fit(config, params)
    _check_size(config, len(ids), params.max_tokens)
    return ids, priority


def _check_params_fit(config: CoreConfig, params: SamplingParams) -> None:
    """Params that only make sense for a vocabulary: stop, biased and allowed ids inside it, no more logprobs than
    it has."""
    vocab = config.vocab_size
    if vocab is None:
        return
    outside = [i for i in params.stop_token_ids if i >= vocab]
    if outside:
        raise fail(REQUEST, "SamplingParams.stop_token_ids", f"ids in [0, {vocab}) (the vocabulary)", outside)
    if params.logprobs is not None and params.logprobs > vocab:
        raise fail(REQUEST, "SamplingParams.logprobs", f"at most the vocabulary size ({vocab})", params.logprobs)
    if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
        allowed = f"at most the vocabulary size ({vocab})"
        raise fail(REQUEST, "SamplingParams.prompt_logprobs", allowed, params.prompt_logprobs)
    biased = [i for i, _ in params.logit_bias or () if i >= vocab]
    if biased:
        raise fail(REQUEST, "SamplingParams.logit_bias", f"token ids in [0, {vocab}) (the vocabulary)", biased)
    unlisted = [i for i in params.allowed_token_ids or () if i >= vocab]
    if unlisted:
        raise fail(REQUEST, "SamplingParams.allowed_token_ids", f"token ids in [0, {vocab}) (the vocabulary)", unlisted)
    banned = [i for word in params.bad_words_token_ids for i in word if i >= vocab]
    if banned:
        raise fail(REQUEST, "SamplingParams.bad_words_token_ids", f"token ids in [0, {vocab}) (the vocabulary)", banned)


def kv_blocks_needed(block_size: int, prompt_len: int, max_tokens: int) -> int:
    """KV blocks a request takes at its longest: every token but the last generated one (whose KV is never
    written) has a slot. Example: block size 4, prompt 5, max_tokens 4 -> 8 slots -> 2 blocks."""
    return -(-(prompt_len + max_tokens - 1) // block_size)


def _check_size(config: CoreConfig, prompt_len: int, max_tokens: int) -> None:
    """The request fits max_model_len and, at its longest, the KV pool. The field named is the one to change: the
    prompt when it leaves no room for even one output token, else max_tokens."""
    total = prompt_len + max_tokens
    if prompt_len >= config.max_model_len:
        raise _reject(
            "prompt",
            f"{prompt_len} tokens leave no room for an output token under max_model_len ({config.max_model_len}): "
            f"at most {config.max_model_len - 1} prompt tokens",
        )
    if total > config.max_model_len:
        raise _reject(
            "max_tokens",
            f"prompt ({prompt_len}) + max_tokens ({max_tokens}) = {total} exceeds "
            f"max_model_len ({config.max_model_len}): at most {config.max_model_len - prompt_len} for this prompt",
        )
    blocks = kv_blocks_needed(config.block_size, prompt_len, max_tokens)
    if blocks > config.num_blocks:
        prompt_blocks = -(-prompt_len // config.block_size)  # the prompt and one output token
        raise _reject(
            "prompt" if prompt_blocks > config.num_blocks else "max_tokens",
            f"prompt ({prompt_len}) + max_tokens ({max_tokens}) needs {blocks} KV blocks of {config.block_size} "
            f"tokens; the pool has {config.num_blocks}",
        )


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
    seq_ids / new_tokens: each sequence that received a token this step and that token, aligned (a multi-step
        plan's commit lists them sub-step by sub-step, so a sequence appears once per token it kept).
    finished: requests that finished this step (their full output and why).
    """

    step: int
    seq_ids: tuple[str, ...] = ()
    new_tokens: tuple[int, ...] = ()
    finished: tuple[FinishedRequest, ...] = ()
