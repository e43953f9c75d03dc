"""min_tokens: validation, the core's stop rule, the sampler's bans (references and kernels, the reuse memo), stop
strings in the detokenizer, and the offline API end to end (one step at a time, overlapped and multi-step)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
from kernel_device import kernel_device
from tiny_models import write_family

from fnvllm.detokenizer import IncrementalDetokenizer
from fnvllm.executor.sampler import (
    MASKED_LOGIT,
    Sampler,
    SamplingMemo,
    banned_now,
    min_tokens_rows,
    prepare_logit_bias,
    prepare_sampling,
)
from fnvllm.llm import LLM
from fnvllm.state import CoreConfig, InvalidRequestError, SamplingParams, StructuredOutput
from fnvllm.state.errors import RequestTypeError
from fnvllm.testing.drive import RequestSpec, run_to_completion
from fnvllm.testing.toy import CounterToyExecutor


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"min_tokens": -1}, InvalidRequestError, "[0, 9223372036854775807]"),
        ({"min_tokens": 17}, InvalidRequestError, "max_tokens=16"),
        ({"min_tokens": 5, "max_tokens": 4}, InvalidRequestError, "max_tokens=4"),
        ({"min_tokens": True}, RequestTypeError, "min_tokens"),
        ({"min_tokens": 2, "structured": StructuredOutput.json_object()}, InvalidRequestError, "structured"),
    ],
)
def test_bad_min_tokens_names_the_field(kwargs: dict[str, object], error: type[Exception], text: str) -> None:
    """A negative min_tokens, one above max_tokens, a bool, or one beside a grammar raise naming min_tokens."""
    with pytest.raises(error, match="min_tokens") as raised:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert text in str(raised.value)


def test_min_tokens_equal_to_max_tokens_is_accepted() -> None:
    """min_tokens may equal max_tokens (the request then always runs to its length)."""
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


@pytest.mark.parametrize("decode_steps", [1, 4])
@pytest.mark.parametrize(
    ("params", "length", "reason"),
    [
        (SamplingParams(max_tokens=10), 1, "stop"),
        (SamplingParams(max_tokens=10, min_tokens=3), 4, "stop"),
        (SamplingParams(max_tokens=10, min_tokens=3, ignore_eos=True, stop_token_ids=(0,)), 4, "stop"),
        (SamplingParams(max_tokens=5, min_tokens=5), 5, "length"),
        (SamplingParams(max_tokens=6, ignore_eos=True), 6, "length"),
    ],
)
def test_core_does_not_stop_before_min_tokens(
    params: SamplingParams, length: int, reason: str, decode_steps: int
) -> None:
    """With an executor that samples only EOS (id 0), a request ends at its first EOS past min_tokens (or at
    max_tokens): the core ignores EOS and stop ids among the first min_tokens tokens, in one-step and 4-step
    plans alike."""
    config = CoreConfig(block_size=4, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=32, eos_token_ids=[0])
    spec = RequestSpec("r", (3, 4, 5), params)
    result = run_to_completion(config, [spec], CounterToyExecutor(vocab_size=1), max_decode_steps=decode_steps)
    finished = result.finished["r"]
    assert (len(finished.output), finished.reason) == (length, reason)


@pytest.mark.parametrize("kernels", [False, True], ids=["references", "kernels"])
def test_sampler_never_draws_stop_ids_before_min_tokens(kernels: bool) -> None:
    """Logits that all but force EOS (id 0) or a row's stop id (id 5): rows short of their min_tokens, greedy and
    sampled (top-p, a seed), draw neither; a row at its min_tokens and a row without one draw the forced id;
    logprobs stay raw."""
    device = kernel_device(kernels)
    vocab = 40
    logits = torch.randn(5, vocab, device=device)
    logits[:, 0] = 30.0
    logits[1, 5] = 60.0
    params = [
        SamplingParams(temperature=0, max_tokens=8, min_tokens=2, logprobs=1),
        SamplingParams(temperature=0, max_tokens=8, min_tokens=2, stop_token_ids=(5,)),
        SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=8, min_tokens=4),
        SamplingParams(temperature=0, max_tokens=8, min_tokens=2),
        SamplingParams(temperature=0, max_tokens=8),
    ]
    batch = prepare_sampling(params, [0, 1, 3, 2, 0], [None] * 5, vocab, device, eos_token_ids=frozenset({0}))
    out = Sampler(seed=0, kernels=kernels).sample(logits, batch)
    tokens = out.token_ids.tolist()
    allowed = logits.clone()
    allowed[:, 0] = allowed[1, 5] = float("-inf")
    assert tokens[:2] == allowed[:2].argmax(-1).tolist()
    assert tokens[2] != 0
    assert tokens[3:] == [0, 0]
    assert out.logprobs is not None
    raw = torch.log_softmax(logits[0].double(), -1)[tokens[0]].item()
    assert out.logprobs.sampled_logprobs[0].item() == pytest.approx(raw, abs=1e-5)


def test_ban_entries_cover_eos_and_the_rows_stop_ids() -> None:
    """A banned row gets MASKED_LOGIT at every EOS id and its own stop ids, beside its logit_bias; other rows
    get nothing."""
    params = [SamplingParams(min_tokens=1, stop_token_ids=(9,), logit_bias={3: 1.5}), SamplingParams(min_tokens=1)]
    bias = prepare_logit_bias(params, torch.device("cpu"), [0], [0], frozenset({1, 2}))
    assert bias is not None
    entries = sorted(zip(bias.rows.tolist(), bias.tokens.tolist(), bias.values.tolist(), strict=True))
    masked = torch.tensor(MASKED_LOGIT, dtype=torch.float32).item()  # as stored: float32
    assert entries == [(0, 1, masked), (0, 2, masked), (0, 3, 1.5), (0, 9, masked)]


def test_memo_keeps_no_batch_while_a_row_is_banned() -> None:
    """The reuse memo never hands a banned step's batch to a later step of the same params: once the row reaches
    its min_tokens the ban is gone (and that batch may then be kept)."""
    params = (SamplingParams(temperature=0, min_tokens=2), SamplingParams(temperature=0))
    memo, eos = SamplingMemo(), frozenset({0})
    logits = torch.zeros(2, 8)
    logits[:, 0] = 10.0

    def step(generated: int) -> list[int]:
        batch = prepare_sampling(params, [generated, 0], [None, None], 8, "cpu", memo=memo, eos_token_ids=eos)
        return Sampler(seed=0, kernels=False).sample(logits, batch).token_ids.tolist()

    assert step(0)[0] != 0 and step(1)[0] != 0
    assert step(2) == [0, 0] and step(3) == [0, 0]


def test_banned_now_reads_the_step_counts() -> None:
    """Only rows with a min_tokens are listed, and a row is banned while its count is below it."""
    params = [SamplingParams(), SamplingParams(min_tokens=3), SamplingParams(min_tokens=1)]
    rows = min_tokens_rows(params)
    assert rows == (1, 2)
    assert banned_now(params, [0, 2, 1], rows) and not banned_now(params, [0, 3, 1], rows)


class _Chars:
    """A decoder whose token i is the character chr(ord('a') + i) (ids past 25 are '!')."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) if i < 26 else "!" for i in ids)


@pytest.mark.parametrize(("min_tokens", "expected"), [(0, "ab"), (2, "ab"), (4, "abcab")])
def test_stop_strings_count_only_past_min_tokens(min_tokens: int, expected: str) -> None:
    """Tokens "abcabcd" with stop string "c": the first "c" (token 3) ends the text unless it is among the first
    min_tokens tokens; then the next "c" does."""
    detok = IncrementalDetokenizer(_Chars(), [], stop=("c",), min_tokens=min_tokens)
    for token in (0, 1, 2, 0, 1, 2, 3):
        if detok.add([token]).stopped:
            break
    assert detok.text == expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(tmp_path_factory.mktemp("min_tokens"), "qwen3")


@pytest.mark.parametrize("options", [{}, {"num_decode_steps": 4}], ids=["one-step", "four-step"])
def test_llm_min_tokens_holds_back_a_stop_id(tiny: Path, options: dict[str, object]) -> None:
    """Greedy, stop id = the first greedy token: without min_tokens the output is that one token; with min_tokens
    3 none of the first 3 tokens is it, and the output is the greedy run of the model with that id banned there
    (logit_bias -100 on it for exactly those tokens is what the three one-token requests below reproduce)."""
    llm = LLM(tiny, dtype="float32", block_size=8, num_blocks=64, **options)  # type: ignore[arg-type]
    prompt = [5, 9, 13, 200, 7]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    stop_id = free[0].token_ids[0]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=(stop_id,))
    assert llm.generate([prompt], plain, use_tqdm=False)[0].token_ids == (stop_id,)
    held = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=(stop_id,), min_tokens=3)
    out = llm.generate([prompt], held, use_tqdm=False)[0]
    assert stop_id not in out.token_ids[:3]
    expected: list[int] = []
    for _ in range(3):  # the reference: each of the first 3 tokens greedy with the stop id biased away
        ban = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logit_bias={stop_id: -100})
        expected += llm.generate([prompt + expected], ban, use_tqdm=False)[0].token_ids
    assert list(out.token_ids[:3]) == expected
    assert len(out.token_ids) > 3 or out.finish_reason == "length"
    llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("decode_steps", [1, 4])
def test_gpu_graph_steps_hold_back_stop_ids_as_eager_steps_do(tiny: Path, decode_steps: int) -> None:
    """On a GPU (overlapped steps, decode CUDA graphs sampling in the graph), rows short of their min_tokens
    sample outside the graph with their stop id banned, beside rows without one: every row's tokens are those of
    eager steps, a min_tokens row's stop id is not among its first 3 tokens, and a plain row stops at once."""
    prompts = [[5, 9, 13, 200, 7], [1, 2, 3], [40, 41, 42, 43], [7]]
    runs = []
    for eager in (True, False):
        llm = LLM(
            tiny, dtype="float32", block_size=8, num_blocks=64, max_num_seqs=4, enforce_eager=eager,
            num_decode_steps=decode_steps,
        )  # fmt: skip
        assert (llm.executor.graphs is None) == eager
        free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        firsts = [out.token_ids[0] for out in free]
        base = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        params = [attrs.evolve(base, stop_token_ids=(first,), min_tokens=3 * (i % 2)) for i, first in enumerate(firsts)]
        runs.append([out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)])
        llm.close()
        for i, tokens in enumerate(runs[-1]):
            assert firsts[i] not in tokens[:3] if i % 2 else tokens == (firsts[i],)
    assert runs[0] == runs[1]
