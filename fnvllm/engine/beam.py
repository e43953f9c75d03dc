"""Beam search over the engine loop, as vLLM's offline ``LLM.beam_search``.

    outs = llm.beam_search(["The capital of France is"], BeamSearchParams(beam_width=4, max_tokens=32))
    best = outs[0].sequences[0]  # sequences are best first: tokens (prompt included), text, cum_logprob

The search lives in the front end; the engine only ever sees plain one-token requests. Each search step queues
every live beam of every prompt as one request (prompt + the beam's tokens, ``max_tokens=1``,
``logprobs=2 * beam_width``, the params' temperature) in one batch (``EngineLoop.add_many``) and steps the loop
until they all finish, so no request outlives the step. The prefix cache serves each beam's earlier tokens from the
blocks its parent's request left behind, so a step computes little more than the new token of each beam. The rules
are vLLM's (``vllm/beam_search.py`` and ``LLM.beam_search``, which follow Hugging Face's beam scorer):

- a beam's candidates are the step's top ``2 * beam_width`` tokens (and the sampled one, when temperature > 0
  draws outside them), each scored by the beam's cumulative logprob plus the token's logprob (raw logprobs: the
  temperature only picks the sampled token); a driver may ask its requests for more logprobs (the server does
  when a client asks for more top logprobs than that) and the candidates stay the top ``2 * beam_width``;
- a candidate that is an EOS id (the engine's ``eos_token_ids``, the ids ``generate`` stops on) joins the prompt's
  finished set, unless ``ignore_eos``; the other candidates of all the prompt's beams are ranked by score and the
  best ``beam_width`` live on;
- score = cum_logprob / (length ** length_penalty), length = the tokens' count *including the prompt*, less one
  when the last token is an EOS id (so a larger length_penalty favours longer sequences);
- after ``max_tokens`` steps, or once no beam is live, the finished and live beams are ranked by score together
  and the best ``beam_width`` are returned, best first.

The rules are pure values and functions (``BeamRules``, ``start``, ``live_beams``, ``expand``, ``check_search``), so
every driver shares them: ``beam_search`` here steps an ``EngineLoop`` itself; the server's
(``fnvllm.serve.beam``) submits each step's batch to its ``AsyncEngine`` and awaits it.

Within one prompt and one step the live candidates all have the same length, so the ranking is by cumulative
logprob (except an EOS id kept by ``ignore_eos``, whose length is one less). Beam width 1 with ``ignore_eos`` is
greedy decoding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import attrs
from tqdm.auto import tqdm

from fnvllm.engine.loop import EngineLoop
from fnvllm.engine.output import RequestTracker, discard_delta
from fnvllm.executor.base import TokenLogprobs
from fnvllm.state import CoreConfig, FinishReason, InvalidRequestError, SamplingParams
from fnvllm.state.checks import REQUEST, check_bool, check_int, check_real, fail, show
from fnvllm.state.errors import RequestTypeError
from fnvllm.state.params import MAX_INT64, MAX_LOGPROBS
from fnvllm.state.request import check_request

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
"""The widest beam: each step asks the engine for 2 * beam_width logprobs, and it returns at most MAX_LOGPROBS."""
LENGTH_PENALTY_RANGE = (-10.0, 10.0)
"""length ** length_penalty stays a finite float for every length up to CoreConfig's 2**21 tokens."""

Prompt = tuple[str | None, tuple[int, ...]]  # (text, or None for a token-id prompt; its token ids)


class Decoder(Protocol):
    """What the search needs of a tokenizer: ids to text."""

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``."""
        ...


@attrs.frozen
class BeamSearchParams:
    """How to beam-search each prompt (vLLM's fields and defaults). Checked when constructed: errors
    (InvalidRequestError, RequestTypeError for a wrong type) name the field, the allowed range and the value.

    beam_width: beams kept per prompt, and sequences returned per prompt, in [1, 10] (MAX_BEAM_WIDTH).
    max_tokens: most tokens to generate per sequence (search steps), >= 1.
    ignore_eos: keep beams going past EOS ids (an EOS id is then an ordinary token).
    temperature: of the token each step's request samples, in [0, 100]; at 0 (greedy) it is the top candidate,
        above 0 a random draw that may add one candidate beyond the top 2 * beam_width.
    length_penalty: the exponent of the length in the score, in [-10, 10] (LENGTH_PENALTY_RANGE); 1 ranks by
        mean logprob per token, 0 by cumulative logprob.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __attrs_post_init__(self) -> None:
        """Check every field strictly and store numbers as plain ints and floats."""
        name = "BeamSearchParams."
        checked = {
            "beam_width": check_int(self.beam_width, name + "beam_width", REQUEST, 1, MAX_BEAM_WIDTH),
            "max_tokens": check_int(self.max_tokens, name + "max_tokens", REQUEST, 1, MAX_INT64),
            "ignore_eos": check_bool(self.ignore_eos, name + "ignore_eos", REQUEST),
            "temperature": check_real(self.temperature, name + "temperature", REQUEST, 0, 100),
            "length_penalty": check_real(self.length_penalty, name + "length_penalty", REQUEST, *LENGTH_PENALTY_RANGE),
        }
        for field, value in checked.items():
            object.__setattr__(self, field, value)


@attrs.frozen
class BeamSearchSequence:
    """One sequence a beam search returns.

    tokens: the prompt's ids, then the generated ones (as vLLM's). num_prompt_tokens: how many of them are the
        prompt's.
    cum_logprob: the sum of the generated tokens' logprobs.
    logprobs: one entry per generated token: its id and logprob, and the top (id, logprob) of its step, best
        first: the 2 * beam_width its search ranked (a driver whose requests ask for more keeps them all).
    finish_reason: "stop" when it ended with an EOS id (never under ignore_eos), else "length".
    text: the tokenizer's decoding of ``tokens`` (prompt included, special tokens kept, as vLLM's); "" without
        a tokenizer.
    """

    tokens: tuple[int, ...]
    num_prompt_tokens: int
    cum_logprob: float
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: FinishReason
    text: str = ""

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt's ids."""
        return self.tokens[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """The generated ids (an EOS id that ended it included)."""
        return self.tokens[self.num_prompt_tokens :]

    @property
    def answer_token_ids(self) -> tuple[int, ...]:
        """The generated ids whose text is the answer: ``output_token_ids`` less the EOS id that ended the sequence
        (finish_reason "stop"), whose text vLLM's server leaves out of a beam's text (the CLI and our server too)."""
        return self.output_token_ids[:-1] if self.finish_reason == "stop" else self.output_token_ids


@attrs.frozen
class BeamSearchOutput:
    """One prompt's beam search result: its text (None for token ids), its ids, and up to beam_width
    ``sequences``, best (highest score) first."""

    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    sequences: tuple[BeamSearchSequence, ...]


@attrs.frozen
class Beam:
    """A sequence under search: all its tokens (the prompt's first), their cumulative logprob, one logprob entry
    per generated one."""

    tokens: tuple[int, ...]
    cum_logprob: float = 0.0
    logprobs: tuple[TokenLogprobs, ...] = ()


@attrs.frozen
class Search:
    """One prompt's search: the live beams (best first) and the beams that ended with an EOS id."""

    live: tuple[Beam, ...]
    finished: tuple[Beam, ...] = ()


def start(prompts: Sequence[Prompt]) -> list[Search]:
    """Each prompt's search before its first step: one live beam, the prompt itself."""
    return [Search((Beam(ids),)) for _, ids in prompts]


def live_beams(searches: Sequence[Search]) -> list[Beam]:
    """Every live beam of ``searches``, prompt by prompt: the rows of the next step's one batch (empty: done)."""
    return [beam for search in searches for beam in search.live]


def expand(beam: Beam, entry: TokenLogprobs | None, num_top: int) -> list[Beam]:
    """``beam`` extended by each candidate of its step (``entry``: the one-token request's logprobs): the first
    ``num_top`` top tokens, then the sampled one if not among them. None (the request ended without a token):
    none. Each child keeps the whole ``entry.top`` in its token's logprob entry (a client may ask for more top
    logprobs than the search ranks)."""
    if entry is None:
        return []
    candidates = dict(entry.top[:num_top])
    candidates.setdefault(entry.token_id, entry.logprob)
    return [
        Beam(
            (*beam.tokens, token),
            beam.cum_logprob + logprob,
            (*beam.logprobs, TokenLogprobs(token, logprob, entry.top)),
        )
        for token, logprob in candidates.items()
    ]


@attrs.frozen
class BeamRules:
    """The ranking rules of one search (the module docstring's), pure: which ids end a beam, how a beam scores, how
    many live on. Every driver (``beam_search`` over an EngineLoop, the server's over its AsyncEngine) runs
    ``start``, then per step ``live_beams`` -> one batch of one-token requests -> ``step``, then ``results``."""

    beam_width: int
    eos_token_ids: frozenset[int]
    ignore_eos: bool
    length_penalty: float

    def ends(self, beam: Beam) -> bool:
        """Whether ``beam`` ended: its last token is an EOS id and ignore_eos is off."""
        return not self.ignore_eos and beam.tokens[-1] in self.eos_token_ids

    def score(self, beam: Beam) -> float:
        """cum_logprob / length ** length_penalty; the length counts the prompt, not a final EOS id."""
        length = len(beam.tokens) - (beam.tokens[-1] in self.eos_token_ids)
        return beam.cum_logprob / math.pow(length, self.length_penalty)

    def best(self, beams: Iterable[Beam]) -> tuple[Beam, ...]:
        """The best ``beam_width`` of ``beams`` by score, best first (ties keep their order)."""
        return tuple(sorted(beams, key=self.score, reverse=True)[: self.beam_width])

    def advance(self, search: Search, entries: Sequence[TokenLogprobs | None]) -> Search:
        """The search after one step: ``entries`` are its live beams' logprobs, in order (None: the beam's request
        ended without a token, e.g. aborted; it is dropped). Pure: returns a new value."""
        finished, live = list(search.finished), list[Beam]()
        for beam, entry in zip(search.live, entries, strict=True):
            for child in expand(beam, entry, 2 * self.beam_width):
                (finished if self.ends(child) else live).append(child)
        return Search(self.best(live), tuple(finished))

    def step(self, searches: Sequence[Search], entries: Sequence[TokenLogprobs | None]) -> list[Search]:
        """Every search after one step whose batch was ``live_beams(searches)``: ``entries`` holds one logprob entry
        per row of that batch, in its order. Pure."""
        if len(entries) != sum(len(s.live) for s in searches):
            raise ValueError(f"one entry per live beam: {sum(len(s.live) for s in searches)}, got {len(entries)}")
        rows = iter(entries)
        return [self.advance(search, [next(rows) for _ in search.live]) for search in searches]

    def results(
        self, prompts: Sequence[Prompt], searches: Sequence[Search], tokenizer: Decoder | None
    ) -> list[BeamSearchOutput]:
        """Each prompt's best beam_width of its finished and live beams, as a BeamSearchOutput (in order)."""
        return [self._output(prompt, search, tokenizer) for prompt, search in zip(prompts, searches, strict=True)]

    def _output(self, prompt: Prompt, search: Search, tokenizer: Decoder | None) -> BeamSearchOutput:
        text, ids = prompt
        sequences = tuple(
            BeamSearchSequence(
                tokens=beam.tokens,
                num_prompt_tokens=len(ids),
                cum_logprob=beam.cum_logprob,
                logprobs=beam.logprobs,
                finish_reason="stop" if self.ends(beam) else "length",
                text=tokenizer.decode(list(beam.tokens)) if tokenizer is not None else "",
            )
            for beam in self.best((*search.finished, *search.live))
        )
        return BeamSearchOutput(text, ids, sequences)


def beam_search(
    loop: EngineLoop,
    prompts: Sequence[Prompt],
    params: BeamSearchParams,
    id_prefix: str,
    tokenizer: Decoder | None = None,
    use_tqdm: bool = True,
) -> list[BeamSearchOutput]:
    """Beam-search every prompt on ``loop`` (module docstring); one BeamSearchOutput per prompt, in order.

    All beams of all prompts run as one batch per step. Request ids are ``{id_prefix}-{step}-{row}``: the caller
    picks a prefix no other request of the loop uses (``LLM.beam_search``: ``beam<n>``). Every request has
    finished (or, on an error or interrupt, been aborted) when this returns. The progress bar (``use_tqdm``)
    counts search steps, up to max_tokens (fewer when every beam ended early). A bad argument raises
    InvalidRequestError (RequestTypeError for a wrong type) naming it, before anything is queued."""
    rules, step_params = check_search(loop.engine.config, prompts, params)
    searches = start(prompts)
    with tqdm(total=params.max_tokens, desc="beam search", disable=not use_tqdm, unit="step") as bar:
        for step in range(params.max_tokens):
            beams = live_beams(searches)
            if not beams:
                break
            searches = rules.step(
                searches, _run_step(loop, [b.tokens for b in beams], step_params, f"{id_prefix}-{step}")
            )
            bar.update(1)
    return rules.results(prompts, searches, tokenizer)


def check_search(config: CoreConfig, prompts: Sequence[Prompt], params: Any) -> tuple[BeamRules, SamplingParams]:
    """The search's rules and the params of its one-token requests, once every prompt is known to fit ``config``
    (the engine's): its ids in the vocabulary, prompt + max_tokens within max_model_len and the KV pool,
    2 * beam_width logprobs at most the vocabulary. Raises InvalidRequestError naming the argument otherwise
    (``prompts[i]: ...``, ``BeamSearchParams.beam_width ...``), RequestTypeError for params of another type."""
    if not isinstance(params, BeamSearchParams):
        raise RequestTypeError(f"params must be a BeamSearchParams, got {show(params)}")
    num_logprobs = 2 * params.beam_width
    if config.vocab_size is not None and num_logprobs > config.vocab_size:
        allowed = f"at most half the vocabulary size ({config.vocab_size})"
        raise fail(REQUEST, "BeamSearchParams.beam_width", allowed, params.beam_width)
    for index, (_, ids) in enumerate(prompts):
        try:
            check_prompt(config, ids, params)
        except InvalidRequestError as e:
            raise type(e)(f"prompts[{index}]: {e}") from None
    rules = BeamRules(params.beam_width, config.eos_token_ids, params.ignore_eos, params.length_penalty)
    # The search decides where a beam ends: the engine samples one token whatever it is (ignore_eos).
    return rules, SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=num_logprobs, ignore_eos=True)


def check_prompt(config: CoreConfig, ids: Sequence[int], params: BeamSearchParams) -> None:
    """InvalidRequestError naming the field (as a plain request's: ``prompt``, ``max_tokens``, ``logprobs``) when
    prompt ``ids`` cannot be searched under ``config``: the request of a beam at its last step must fit."""
    longest = SamplingParams(max_tokens=params.max_tokens, logprobs=2 * params.beam_width)
    check_request(config, (), "beam search", ids, longest)


def _run_step(
    loop: EngineLoop, token_lists: Sequence[tuple[int, ...]], params: SamplingParams, id_prefix: str
) -> list[TokenLogprobs | None]:
    """Queue one request per token list (one batch), step the loop until all have finished, and return each one's
    logprob entry (None for one that ended without a token). Aborts the unfinished ones on an early exit."""
    trackers = [
        RequestTracker(row, f"{id_prefix}-{row}", None, ids, params, None, discard_delta)
        for row, ids in enumerate(token_lists)
    ]
    loop.add_many([(t.request_id, t.prompt_ids, params, t) for t in trackers])
    try:
        while not all(t.finished for t in trackers):
            loop.step()
    finally:
        for tracker in trackers:
            if not tracker.finished:
                loop.abort(tracker.request_id)
    return [t.logprobs[0] if t.token_ids else None for t in trackers]
