"""LLM.beam_search against a plain beam search over transformers' forward, with vLLM's rules."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import hf_greedy, hf_model, write_family

from fnvllm import BeamSearchOutput, BeamSearchParams
from fnvllm.engine.beam import Beam, BeamRules, Search
from fnvllm.executor.base import TokenLogprobs
from fnvllm.llm import LLM
from fnvllm.state import InvalidRequestError, SamplingParams
from fnvllm.state.errors import RequestTypeError

MAX_TOKENS = 6
Reference = list[tuple[list[int], float]]  # (tokens with the prompt, cum_logprob), best first


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 240) for _ in range(n)] for n in (5, 11)]


PROMPTS = _prompts()


def _set_eos(path: Path, eos: int) -> None:
    """Make ``eos`` the checkpoint's EOS id (generation_config.json and config.json)."""
    for name in ("generation_config.json", "config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = eos
        (path / name).write_text(json.dumps(config))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, Any, list[int]]:
    """(LLM, the transformers model, the EOS ids): a tiny Qwen3 whose EOS id is the second token of its own greedy
    answer to PROMPTS[0], so EOS candidates come up early and the EOS rules really run; blocks of 4 tokens, so the
    prefix cache serves each beam's earlier tokens."""
    path = write_family(tmp_path_factory.mktemp("beam"), "qwen3")
    model = hf_model(path)
    greedy = hf_greedy(model, PROMPTS[0], 4, [])
    _set_eos(path, greedy[1])
    llm = LLM(path, dtype="float32", block_size=4, num_blocks=512)
    eos = sorted(llm.engine.config.eos_token_ids)
    assert greedy[1] in eos
    return llm, model, eos


def reference(
    model: Any, prompt: list[int], width: int, max_tokens: int, eos: list[int], ignore_eos: bool, penalty: float
) -> Reference:
    """Beam search written out over transformers' forward (log_softmax of the last logits), vLLM's rules: each beam
    offers its top 2 * width tokens; EOS candidates finish (unless ignore_eos); the best ``width`` of the rest live
    on; score = cum_logprob / length ** penalty, length counting the prompt and not a final EOS."""

    def score(beam: tuple[list[int], float]) -> float:
        tokens, cum = beam
        return cum / math.pow(len(tokens) - (tokens[-1] in eos), penalty)

    live: Reference = [(list(prompt), 0.0)]
    finished: Reference = []
    for _ in range(max_tokens):
        if not live:
            break
        with torch.no_grad():  # the live beams of one prompt have one length: one batch
            logits = model(torch.tensor([tokens for tokens, _ in live])).logits[:, -1].float()
        top = torch.log_softmax(logits, dim=-1).topk(2 * width, dim=-1)
        candidates: Reference = []
        for (tokens, cum), values, ids in zip(live, top.values.tolist(), top.indices.tolist(), strict=True):
            for logprob, token in zip(values, ids, strict=True):
                child = ([*tokens, token], cum + logprob)
                (finished if token in eos and not ignore_eos else candidates).append(child)
        live = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(finished + live, key=score, reverse=True)[:width]


def assert_matches(out: BeamSearchOutput, ref: Reference, prompt: list[int], eos: list[int], ignore_eos: bool) -> None:
    """Same sequences in the same order, cum_logprobs within float32 noise, coherent fields."""
    assert [list(s.tokens) for s in out.sequences] == [tokens for tokens, _ in ref]
    for seq, (_, cum) in zip(out.sequences, ref, strict=True):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
        assert seq.prompt_token_ids == tuple(prompt) and 1 <= len(seq.output_token_ids) <= MAX_TOKENS
        assert math.fsum(e.logprob for e in seq.logprobs) == pytest.approx(seq.cum_logprob, abs=1e-9)
        assert [e.token_id for e in seq.logprobs] == list(seq.output_token_ids)
        ended = not ignore_eos and seq.tokens[-1] in eos
        assert seq.finish_reason == ("stop" if ended else "length")
        if not ignore_eos:  # nothing follows an EOS id
            assert not set(seq.output_token_ids[:-1]) & set(eos)


CASES = [  # (beam_width, ignore_eos, length_penalty)
    (1, False, 1.0),
    (1, True, 1.0),
    (2, False, 1.0),
    (2, True, 1.0),
    (4, False, 1.0),
    (4, True, 1.0),
    (4, False, 2.0),
    (2, False, 0.0),
]


@pytest.mark.parametrize(("width", "ignore_eos", "penalty"), CASES)
def test_equals_reference_beam_search(
    tiny: tuple[LLM, Any, list[int]], width: int, ignore_eos: bool, penalty: float
) -> None:
    """Every prompt's sequences, their order and cum_logprobs equal the reference search's over transformers."""
    llm, model, eos = tiny
    params = BeamSearchParams(width, MAX_TOKENS, ignore_eos=ignore_eos, length_penalty=penalty)
    outs = llm.beam_search(PROMPTS, params, use_tqdm=False)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = reference(model, prompt, width, MAX_TOKENS, eos, ignore_eos, penalty)
        assert_matches(out, ref, prompt, eos, ignore_eos)
        assert len(out.sequences) == width and out.prompt_token_ids == tuple(prompt) and out.prompt is None


def test_sequences_keep_each_tokens_logprobs(tiny: tuple[LLM, Any, list[int]]) -> None:
    """Each returned sequence holds one logprob entry per generated token, transformers' at its own position: the
    token's logprob and the step's top 2 * beam_width (its search candidates), best first."""
    llm, model, _ = tiny
    width = 2
    for out in llm.beam_search(PROMPTS, BeamSearchParams(width, MAX_TOKENS), use_tqdm=False):
        for seq in out.sequences:
            with torch.no_grad():  # row j scores the token at j + 1
                rows = torch.log_softmax(model(torch.tensor([list(seq.tokens)])).logits[0].float(), dim=-1)
            assert len(seq.logprobs) == len(seq.output_token_ids)
            for position, entry in enumerate(seq.logprobs, start=seq.num_prompt_tokens):
                row, top = rows[position - 1], rows[position - 1].topk(2 * width)
                assert entry.token_id == seq.tokens[position]
                assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
                assert [t for t, _ in entry.top] == top.indices.tolist()
                assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize(("sampled", "candidates"), [(9, [5, 6, 9]), (7, [5, 6, 7]), (6, [5, 6])])
def test_candidates_are_the_top_two_widths(sampled: int, candidates: list[int]) -> None:
    """A step entry holding more top logprobs than 2 * beam_width (a driver that asked for more, as the server does
    for a client's top logprobs) offers only its top 2 * beam_width, and the sampled token when not among them;
    each child keeps the whole entry. (Every id is an EOS id here, so every candidate lands in ``finished``.)"""
    rules = BeamRules(1, frozenset({5, 6, 7, 8, 9}), ignore_eos=False, length_penalty=0.0)
    top = ((5, -0.1), (6, -0.2), (7, -0.3), (8, -0.4))
    entry = TokenLogprobs(sampled, dict(top).get(sampled, -3.0), top)
    after = rules.advance(Search((Beam((1, 2)),)), [entry])
    assert after.live == () and [beam.tokens for beam in after.finished] == [(1, 2, t) for t in candidates]
    for beam in after.finished:
        logprob = dict(top).get(beam.tokens[-1], -3.0)
        assert beam.cum_logprob == logprob and beam.logprobs == (TokenLogprobs(beam.tokens[-1], logprob, top),)


def test_eos_rules_run(tiny: tuple[LLM, Any, list[int]]) -> None:
    """The checkpoint's EOS id ends beams (they are returned with finish_reason "stop", ending in it), and the
    length penalty then reorders sequences of different lengths; with ignore_eos the same id is an ordinary token."""
    llm, _, eos = tiny
    results = {
        penalty: llm.beam_search(PROMPTS[0], BeamSearchParams(4, MAX_TOKENS, length_penalty=penalty), use_tqdm=False)
        for penalty in (0.0, 1.0, 2.0)
    }
    stopped = [s for s in results[1.0][0].sequences if s.finish_reason == "stop"]
    assert stopped and all(s.tokens[-1] in eos and len(s.output_token_ids) < MAX_TOKENS for s in stopped)
    orders = {tuple(s.tokens for s in out[0].sequences) for out in results.values()}
    assert len(orders) > 1, "the length penalty never changed the ranking: the case is vacuous"
    for width in (1, 4):
        kept = llm.beam_search(PROMPTS[0], BeamSearchParams(width, MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
        assert all(s.finish_reason == "length" and len(s.output_token_ids) == MAX_TOKENS for s in kept.sequences)
    assert kept.sequences != results[1.0][0].sequences
    greedy_params = BeamSearchParams(1, MAX_TOKENS, ignore_eos=True, length_penalty=0.0)
    (greedy,) = llm.beam_search(PROMPTS[0], greedy_params, use_tqdm=False)[0].sequences
    assert greedy.output_token_ids[1] in eos  # the fixture's EOS id, and the beam went on past it


def test_width_one_is_greedy_generate(tiny: tuple[LLM, Any, list[int]]) -> None:
    """Beam width 1 with ignore_eos and length_penalty 0 gives greedy generate's tokens and its cumulative logprob
    (PROMPTS[0]'s greedy answer repeats the EOS id). With another length penalty an EOS candidate scores with one
    token less of length, as in vLLM, so there width 1 is greedy only where no EOS id comes up."""
    llm, _, _ = tiny
    params = BeamSearchParams(1, MAX_TOKENS, ignore_eos=True, length_penalty=0.0)
    outs = llm.beam_search(PROMPTS, params, use_tqdm=False)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for out, gen in zip(outs, llm.generate(PROMPTS, greedy, use_tqdm=False), strict=True):
        (seq,) = out.sequences
        assert seq.output_token_ids == gen.token_ids
        assert seq.cum_logprob == pytest.approx(gen.outputs[0].cumulative_logprob, abs=1e-5)


def test_prompts_together_equal_one_at_a_time(tiny: tuple[LLM, Any, list[int]]) -> None:
    """Searching several prompts at once (one batch per step) gives each the result it gets alone, and each step
    runs every beam of every prompt in one engine step (none left for a later one)."""
    llm, _, _ = tiny
    params = BeamSearchParams(3, 4, ignore_eos=True)
    rows: list[int] = []
    llm.loop.on_step = lambda state, plan, out: rows.append(plan.num_seqs)
    try:
        together = llm.beam_search(PROMPTS, params, use_tqdm=False)
    finally:
        llm.loop.on_step = None
    assert rows == [len(PROMPTS)] + [len(PROMPTS) * 3] * (params.max_tokens - 1)  # one engine step per search step
    alone = [llm.beam_search([p], params, use_tqdm=False)[0] for p in PROMPTS]
    for a, b in zip(together, alone, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx([s.cum_logprob for s in b.sequences], abs=1e-5)


def test_nothing_left_in_the_engine(tiny: tuple[LLM, Any, list[int]]) -> None:
    """After a search every one of its requests has finished: no request waits or runs, no block is held, and the
    prefix cache served the beams' earlier tokens."""
    llm, _, _ = tiny
    cached = llm.stats.num_cached_tokens
    llm.beam_search(PROMPTS, BeamSearchParams(2, MAX_TOKENS), use_tqdm=False)
    state = llm.state
    assert not state.requests and not state.waiting and not state.running and not llm.loop.has_unfinished
    assert not llm.loop.processor.trackers
    assert llm.stats.num_cached_tokens > cached


def test_an_interrupted_search_leaves_nothing(tiny: tuple[LLM, Any, list[int]]) -> None:
    """A search stopped by an exception while its requests run (here from the step hook, after the first of the
    two steps that an 8-token budget needs for an 11-token prompt) aborts them; the LLM stays usable."""
    llm = LLM(tiny[0].model_path, dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=8)
    live: list[int] = []

    def interrupt(state: Any, *_: Any) -> None:
        live.append(len(state.requests))
        raise RuntimeError("interrupted")

    llm.loop.on_step = interrupt
    with pytest.raises(RuntimeError, match="interrupted"):
        llm.beam_search(PROMPTS, BeamSearchParams(2, MAX_TOKENS), use_tqdm=False)
    llm.loop.on_step = None
    assert live == [1]  # the 11-token prompt's request was still running
    assert not llm.state.requests and not llm.loop.processor.trackers
    assert llm.beam_search(PROMPTS[1], BeamSearchParams(2, 2), use_tqdm=False)[0].sequences


def test_text_prompts_and_text(tiny: tuple[LLM, Any, list[int]]) -> None:
    """A str prompt is encoded as generate encodes it, each sequence's text decodes all its tokens, and the
    progress bar (on by default, as generate's) runs."""
    llm, _, _ = tiny
    assert llm.tokenizer is not None
    (out,) = llm.beam_search("Hello there", BeamSearchParams(2, 3))  # with the progress bar
    assert out.prompt == "Hello there" and out.prompt_token_ids == tuple(llm.tokenizer.encode("Hello there"))
    for seq in out.sequences:
        assert seq.text == llm.tokenizer.decode(list(seq.tokens))


BAD_PARAMS: list[tuple[dict[str, Any], str, type[Exception]]] = [
    (dict(beam_width=0), "beam_width must be an int in [1, 10]", InvalidRequestError),
    (dict(beam_width=11), "beam_width must be an int in [1, 10]", InvalidRequestError),
    (dict(beam_width=True), "beam_width", RequestTypeError),
    (dict(max_tokens=0), "max_tokens must be an int in [1, ", InvalidRequestError),
    (dict(max_tokens=2.0), "max_tokens", RequestTypeError),
    (dict(ignore_eos=1), "ignore_eos must be True or False", RequestTypeError),
    (dict(temperature=-0.5), "temperature must be a number in [0, 100]", InvalidRequestError),
    (dict(length_penalty=float("nan")), "length_penalty must be a number in [-10, 10]", InvalidRequestError),
    (dict(length_penalty="1"), "length_penalty", RequestTypeError),
]


@pytest.mark.parametrize(("fields", "message", "error"), BAD_PARAMS)
def test_params_errors_name_the_field(fields: dict[str, Any], message: str, error: type[Exception]) -> None:
    """Each bad field is refused at construction, naming the field and the allowed range."""
    with pytest.raises(error, match=f"BeamSearchParams.{message}".replace("[", r"\[").replace("]", r"\]")):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})


def test_bad_calls_change_nothing(tiny: tuple[LLM, Any, list[int]]) -> None:
    """A wrong params type, a prompt too long for max_tokens and bad prompts raise naming the argument, before
    anything is queued."""
    llm, _, _ = tiny
    state = llm.state
    with pytest.raises(RequestTypeError, match="params must be a BeamSearchParams"):
        llm.beam_search(PROMPTS, SamplingParams(), use_tqdm=False)  # type: ignore[arg-type]
    limit = llm.engine.config.max_model_len
    with pytest.raises(InvalidRequestError, match=r"prompts\[1\]: .*max_tokens"):
        llm.beam_search([PROMPTS[0], PROMPTS[1]], BeamSearchParams(2, limit - 8), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"prompts\[0\]"):
        llm.beam_search([[3, 10**6]], BeamSearchParams(2, 3), use_tqdm=False)
    with pytest.raises(RequestTypeError, match="use_tqdm"):
        llm.beam_search(PROMPTS, BeamSearchParams(2, 3), use_tqdm=1)  # type: ignore[arg-type]
    assert llm.state is state
