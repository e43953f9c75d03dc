"""Beam search in the server: vLLM's ``use_beam_search`` extension of /v1/completions and /v1/chat/completions.

The web side cannot step the engine loop (it runs on the engine's thread, or in a process of its own), so the
search is driven here over the AsyncEngine's submit API, with the rules of ``fnvllm.engine.beam`` (one copy of
them, shared with the offline ``LLM.beam_search``):

    searches = start(prompts)
    each step: live_beams(searches) -> one batch of one-token requests (logprobs = max(2 * n, k)), submitted
               together and awaited -> rules.step(searches, each request's logprob entry)
    rules.results(prompts, searches) -> each prompt's n best beams, best first -> its n choices

A body's ``n`` is the beam width and the number of choices per prompt; ``max_tokens`` (completions: 16 by default,
chat: what fits), ``ignore_eos``, ``temperature`` and ``length_penalty`` (default 1.0) set the search. The
temperature defaults to the server's 1.0, as vLLM's server does: each step's request also samples one token, which
becomes an extra candidate when it falls outside the top 2n; send 0 for a deterministic search (then the answer is
``LLM.beam_search``'s). A choice's text is its generated tokens' text, an EOS id that ended it left out (kept under
include_stop_str_in_output), decoded under skip_special_tokens; its finish_reason is "stop" (an EOS id) or "length".
Every request of a step has finished before the next is submitted: none is left in the engine when the answer goes
out, and a client that leaves mid-search has the step's requests aborted.

Logprobs (completions ``logprobs: k``, chat ``logprobs: true`` with ``top_logprobs: k``): every beam keeps the
logprob entry of each of its tokens from the step that chose it, so a choice carries one entry per generated token
(an ending EOS id's too, as a plain request's), cut to the top k. The step requests ask for max(2n, k) logprobs;
the candidates stay the top 2n. With completions' ``echo``, the first step's requests (one per prompt: the prompt
itself) also ask for the prompt's logprobs, which the echoed prompt's entries carry.

Streaming (``stream: true``): the best beams are only known at the end, so the handler sends the opening chunks
(chat's role) at once and each choice as one chunk once the search is done (``sse.final_events``).
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
from fnvllm.state.request import check_request

Prompts = Sequence[tuple[Sequence[int], str | None]]  # the handlers' prompts: (ids, text or None)
RunBatch = Callable[[list[Submission]], Awaitable[list[Choice] | None]]
"""Submits one step's requests together and returns each one's whole output in order (None: the client left and
the requests were aborted)."""


@attrs.frozen
class BeamPlan:
    """A checked beam search of one HTTP request: its params, its rules, the params of each step's one-token
    requests, and how a choice is rendered: its text (the body's skip_special_tokens, include_stop_str_in_output),
    its tokens' logprobs (``num_logprobs``: the top k asked for; None: not asked) and its echoed prompt's
    (``num_prompt_logprobs``: completions' echo with logprobs, asked of the first step)."""

    params: BeamSearchParams
    rules: BeamRules
    step_params: SamplingParams
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    num_logprobs: int | None = None
    num_prompt_logprobs: int | None = None

    def params_of(self, step: int) -> SamplingParams:
        """The params of step ``step``'s requests: the first step's also ask for the prompt's logprobs (its one
        beam per prompt is the prompt itself) when the echo needs them."""
        if step > 0 or self.num_prompt_logprobs is None:
            return self.step_params
        return attrs.evolve(self.step_params, prompt_logprobs=self.num_prompt_logprobs)


@attrs.frozen
class Searched:
    """What a search found: each prompt's BeamSearchOutput and, when the plan asked (echo with logprobs), its
    prompt's logprobs as the first step returned them (``RequestOutput.prompt_logprobs``' shape), else None."""

    outputs: list[BeamSearchOutput]
    prompt_logprobs: list[tuple[TokenLogprobs | None, ...] | None]


def prepare(
    prompts: Prompts,
    params: SamplingParams,
    width: int,
    length_penalty: float | None,
    config: CoreConfig,
    aliases: Mapping[str, str],
) -> BeamPlan:
    """The beam search of a body whose SamplingParams are ``params`` (max_tokens, ignore_eos, temperature and
    logprobs are taken from them, already checked), whose ``n`` is ``width``, over ``prompts``; a 400 naming the
    body field (``n``, ``length_penalty``, ``max_tokens``, ``logprobs``, ``prompt``; ``aliases`` as
    ``errors.from_invalid_request``'s) when it cannot run under ``config``, the engine's."""
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
            check_request(config, (), "beam search", ids, params)  # the body's logprobs k too
        rules, step_params = check_search(config, _engine_prompts(prompts), beam)
    except InvalidRequestError as error:
        message = str(error).removeprefix("BeamSearchParams.")
        raise from_invalid_request(ValueError(message), {"beam_width": "n", **aliases}) from None
    if params.logprobs is not None and step_params.logprobs is not None:
        step_params = attrs.evolve(step_params, logprobs=max(step_params.logprobs, params.logprobs))
    return BeamPlan(
        beam, rules, step_params, params.skip_special_tokens, params.include_stop_str_in_output,
        params.logprobs, params.prompt_logprobs,
    )  # fmt: skip


def _engine_prompts(prompts: Prompts) -> list[Prompt]:
    """The handlers' (ids, text) prompts as the search's (text, ids)."""
    return [(text, tuple(ids)) for ids, text in prompts]


async def search(plan: BeamPlan, prompts: Prompts, request_id: str, run_batch: RunBatch) -> Searched | None:
    """Beam-search every prompt (module docstring), all beams of all prompts one batch per step; request ids are
    ``{request_id}-beam{step}-{row}``. None when ``run_batch`` returns None (the client left)."""
    engine_prompts = _engine_prompts(prompts)
    searches = start(engine_prompts)
    prompt_logprobs: list[tuple[TokenLogprobs | None, ...] | None] = [None] * len(prompts)
    for step in range(plan.params.max_tokens):
        beams = live_beams(searches)
        if not beams:
            break
        params = plan.params_of(step)
        batch = [
            Submission(beam.tokens, params, None, f"{request_id}-beam{step}-{row}") for row, beam in enumerate(beams)
        ]
        collected = await run_batch(batch)
        if collected is None:
            return None
        if step == 0:  # one row per prompt, in order: its one beam is the prompt
            prompt_logprobs = [choice.prompt_logprobs for choice in collected]
        searches = plan.rules.step(searches, [_entry(choice) for choice in collected])
    return Searched(plan.rules.results(engine_prompts, searches, None), prompt_logprobs)


def _entry(choice: Choice) -> TokenLogprobs | None:
    """The logprob entry of a one-token request's output (None: it ended without a token)."""
    first = choice.logprobs[0] if choice.token_ids and choice.logprobs else None
    return first if isinstance(first, TokenLogprobs) else None


def choices(searched: Searched, plan: BeamPlan, tokenizer: Any) -> list[Choice]:
    """Every prompt's sequences as choices, prompt-major and best first (the handlers number them and add the echo):
    the text of the answer's ids, all generated ids (for usage, and ``token_ids`` without a tokenizer), their
    logprobs cut to the top k asked for (None when not asked), the prompt's logprobs for the echo."""
    return [
        Choice(0, _text(seq, plan, tokenizer), seq.output_token_ids, _logprobs(seq, plan), seq.finish_reason, scored)
        for out, scored in zip(searched.outputs, searched.prompt_logprobs, strict=True)
        for seq in out.sequences
    ]


def _text(seq: BeamSearchSequence, plan: BeamPlan, tokenizer: Any) -> str:
    """A sequence's choice text: its answer's ids (all generated ids under include_stop_str_in_output), decoded
    under skip_special_tokens; "" without a tokenizer."""
    if tokenizer is None:
        return ""
    ids = seq.output_token_ids if plan.include_stop_str_in_output else seq.answer_token_ids
    return str(tokenizer.decode(list(ids), skip_special_tokens=plan.skip_special_tokens))


def _logprobs(seq: BeamSearchSequence, plan: BeamPlan) -> tuple[TokenLogprobs, ...] | None:
    """One entry per generated token (an ending EOS id's too), its top cut to the k the body asked for (the step
    requests asked for at least 2n); None when the body asked for no logprobs."""
    k = plan.num_logprobs
    if k is None:
        return None
    return tuple(TokenLogprobs(e.token_id, e.logprob, e.top[:k]) for e in seq.logprobs)
