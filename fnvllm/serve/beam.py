"""Beam search in the server: vLLM's ``use_beam_search`` extension of /v1/completions and /v1/chat/completions.

The web side cannot step the engine loop (it runs on the engine's thread, or in a process of its own), so the
search is driven here over the AsyncEngine's submit API, with the rules of ``fnvllm.engine.beam`` (one copy of
them, shared with the offline ``LLM.beam_search``):

    searches = start(prompts)
    each step: live_beams(searches) -> one batch of one-token requests (logprobs = 2 * n), submitted together
               and awaited -> rules.step(searches, each request's logprob entry)
    rules.results(prompts, searches) -> each prompt's n best beams, best first -> its n choices

A body's ``n`` is the beam width and the number of choices per prompt; ``max_tokens`` (completions: 16 by default,
chat: what fits), ``ignore_eos``, ``temperature`` and ``length_penalty`` (default 1.0) set the search. The
temperature defaults to the server's 1.0, as vLLM's server does: each step's request also samples one token, which
becomes an extra candidate when it falls outside the top 2n; send 0 for a deterministic search (then the answer is
``LLM.beam_search``'s). A choice's text is its generated tokens' text, an EOS id that ended it left out (kept under
include_stop_str_in_output), decoded under skip_special_tokens; its finish_reason is "stop" (an EOS id) or "length".
Every request of a step has finished before the next is submitted: none is left in the engine when the answer goes
out, and a client that leaves mid-search has the step's requests aborted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs

from fnvllm.engine.beam import (
    BeamRules,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    Prompt,
    check_prompt,
    check_search,
    live_beams,
    start,
)
from fnvllm.executor.base import TokenLogprobs
from fnvllm.serve.async_engine import Submission
from fnvllm.serve.errors import from_invalid_request
from fnvllm.serve.formats import Choice
from fnvllm.state import CoreConfig, InvalidRequestError, SamplingParams

Prompts = Sequence[tuple[Sequence[int], str | None]]  # the handlers' prompts: (ids, text or None)
RunBatch = Callable[[list[Submission]], Awaitable[list[Choice] | None]]
"""Submits one step's requests together and returns each one's whole output in order (None: the client left and
the requests were aborted)."""


@attrs.frozen
class BeamPlan:
    """A checked beam search of one HTTP request: its params, its rules, the params of each step's one-token
    requests, and how a choice's text is decoded (the body's skip_special_tokens, include_stop_str_in_output)."""

    params: BeamSearchParams
    rules: BeamRules
    step_params: SamplingParams
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


def prepare(
    prompts: Prompts,
    params: SamplingParams,
    width: int,
    length_penalty: float | None,
    config: CoreConfig,
    aliases: Mapping[str, str],
) -> BeamPlan:
    """The beam search of a body whose SamplingParams are ``params`` (max_tokens, ignore_eos and temperature are
    taken from them, already checked), whose ``n`` is ``width``, over ``prompts``; a 400 naming the body field
    (``n``, ``length_penalty``, ``max_tokens``, ``prompt``; ``aliases`` as ``errors.from_invalid_request``'s) when
    it cannot run under ``config``, the engine's."""
    try:
        beam = BeamSearchParams(
            width,
            params.max_tokens,
            params.ignore_eos,
            params.temperature,
            1.0 if length_penalty is None else length_penalty,
        )
        for ids, _ in prompts:
            check_prompt(config, ids, beam)  # refused as a plain request of the same prompt would be
        rules, step_params = check_search(config, _engine_prompts(prompts), beam)
    except InvalidRequestError as error:
        message = str(error).removeprefix("BeamSearchParams.")
        raise from_invalid_request(ValueError(message), {"beam_width": "n", **aliases}) from None
    return BeamPlan(beam, rules, step_params, params.skip_special_tokens, params.include_stop_str_in_output)


def _engine_prompts(prompts: Prompts) -> list[Prompt]:
    """The handlers' (ids, text) prompts as the search's (text, ids)."""
    return [(text, tuple(ids)) for ids, text in prompts]


async def search(
    plan: BeamPlan, prompts: Prompts, request_id: str, run_batch: RunBatch
) -> list[BeamSearchOutput] | None:
    """Beam-search every prompt (module docstring), all beams of all prompts one batch per step; request ids are
    ``{request_id}-beam{step}-{row}``. None when ``run_batch`` returns None (the client left)."""
    engine_prompts = _engine_prompts(prompts)
    searches = start(engine_prompts)
    for step in range(plan.params.max_tokens):
        beams = live_beams(searches)
        if not beams:
            break
        batch = [
            Submission(beam.tokens, plan.step_params, None, f"{request_id}-beam{step}-{row}")
            for row, beam in enumerate(beams)
        ]
        collected = await run_batch(batch)
        if collected is None:
            return None
        searches = plan.rules.step(searches, [_entry(choice) for choice in collected])
    return plan.rules.results(engine_prompts, searches, None)


def _entry(choice: Choice) -> TokenLogprobs | None:
    """The logprob entry of a one-token request's output (None: it ended without a token)."""
    first = choice.logprobs[0] if choice.token_ids and choice.logprobs else None
    return first if isinstance(first, TokenLogprobs) else None


def choices(outputs: Sequence[BeamSearchOutput], plan: BeamPlan, tokenizer: Any) -> list[Choice]:
    """Every prompt's sequences as choices, prompt-major and best first (the handlers number them and add the echo):
    the text of the answer's ids, all generated ids (for usage, and ``token_ids`` without a tokenizer)."""
    return [
        Choice(0, _text(seq, plan, tokenizer), seq.output_token_ids, None, seq.finish_reason)
        for out in outputs
        for seq in out.sequences
    ]


def _text(seq: BeamSearchSequence, plan: BeamPlan, tokenizer: Any) -> str:
    """A sequence's choice text: its answer's ids (all generated ids under include_stop_str_in_output), decoded
    under skip_special_tokens; "" without a tokenizer."""
    if tokenizer is None:
        return ""
    ids = seq.output_token_ids if plan.include_stop_str_in_output else seq.answer_token_ids
    return str(tokenizer.decode(list(ids), skip_special_tokens=plan.skip_special_tokens))
