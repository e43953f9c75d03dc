"""bad_words and bad_words_token_ids: validation, the core's refusal of unresolved text, the front ends' resolution
rule, the sampler's matching against a row's output (references, the slot buffer, the reuse memo), and the offline
API end to end against a reference built from one-token requests with a logit bias."""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
from tiny_models import write_family

from fnvllm.engine.loop import EngineLoop
from fnvllm.engine.text import load_local_tokenizer, resolve_bad_words
from fnvllm.executor.model_executor import ModelExecutor
from fnvllm.executor.penalties import TokenView
from fnvllm.executor.sampler import (
    MASKED_LOGIT,
    Sampler,
    SamplingMemo,
    apply_bad_words,
    graph_rows,
    prepare_bad_words,
    prepare_sampling,
)
from fnvllm.llm import LLM
from fnvllm.state import CoreConfig, InvalidRequestError, SamplingParams, add_request, initial_state
from fnvllm.state.errors import RequestTypeError
from fnvllm.state.plan import TokenHistory

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"bad_words": [""]}, InvalidRequestError, "bad_words[0]"),
        ({"bad_words": 5}, RequestTypeError, "bad_words"),
        ({"bad_words_token_ids": [[]]}, InvalidRequestError, "bad_words_token_ids[0]"),
        ({"bad_words_token_ids": [[1], [-1]]}, InvalidRequestError, "bad_words_token_ids[1]"),
        ({"bad_words_token_ids": [[True]]}, RequestTypeError, "bad_words_token_ids[0]"),
        ({"bad_words_token_ids": [3]}, RequestTypeError, "bad_words_token_ids[0]"),
        ({"bad_words_token_ids": "ab"}, RequestTypeError, "bad_words_token_ids"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], error: type[Exception], name: str) -> None:
    """An empty word, a non-list, an empty id sequence, a negative id, a bool id or a bare int raise naming the
    field (and the word's index)."""
    with pytest.raises(error) as raised:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert name in str(raised.value)


def test_fields_are_stored_as_tuples_and_history_follows_the_word_lengths() -> None:
    """One str is one word; lists become tuples; only a word of several ids needs the row's history."""
    assert SamplingParams(bad_words="x").bad_words == ("x",)
    single = SamplingParams(bad_words_token_ids=[[4], [9]])
    assert single.bad_words_token_ids == ((4,), (9,)) and not single.needs_history
    assert SamplingParams(bad_words_token_ids=[np.array([4, 5])]).needs_history


def test_core_refuses_text_and_ids_outside_the_vocabulary() -> None:
    """The core reads ids only: bad_words text is refused naming the field and the rule that resolves it; an id
    past the vocabulary is refused naming bad_words_token_ids. The state is unchanged."""
    state = initial_state(CoreConfig(block_size=4, num_blocks=8, vocab_size=32))
    with pytest.raises(InvalidRequestError, match=r"bad_words.*resolve_bad_words"):
        add_request(state, "a", (1, 2), SamplingParams(bad_words=["x"]))
    with pytest.raises(InvalidRequestError, match=r"bad_words_token_ids.*\[0, 32\)"):
        add_request(state, "a", (1, 2), SamplingParams(bad_words_token_ids=[[3, 40]]))
    assert not state.requests
    assert "a" in add_request(state, "a", (1, 2), SamplingParams(bad_words_token_ids=[[3, 31]])).requests


def _reference_banned(words: list[tuple[int, ...]], output: list[int]) -> set[int]:
    """vLLM's rule, spelled out: a word bans its last id when the output ends with the rest of it."""
    banned = set()
    for word in words:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and (not prefix or output[len(output) - len(prefix) :] == prefix):
            banned.add(word[-1])
    return banned


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_apply_bad_words_matches_the_rule_on_random_histories(device: str, seed: int) -> None:
    """Random rows (slots scattered in a buffer, prompts and outputs of random lengths over a 6-id alphabet, so
    prefixes often match) with random words (several per row, some ending in the same id): the logits come back
    with exactly the reference's banned ids at MASKED_LOGIT, every other logit untouched, the input unchanged."""
    rng = random.Random(seed)
    vocab, num_rows, max_len = 12, 5, 16
    tokens = torch.zeros(8, max_len, dtype=torch.int32)
    slots = rng.sample(range(8), num_rows)
    kept_rows = sorted(rng.sample(range(num_rows + 2), num_rows))  # batch rows that keep a history
    params, meta, outputs = [SamplingParams()] * (num_rows + 2), [], {}
    for row, slot in zip(kept_rows, slots, strict=True):
        prompt = [rng.randrange(6) for _ in range(rng.randint(1, 4))]
        output = [rng.randrange(6) for _ in range(rng.randint(0, 6))]
        tokens[slot, : len(prompt) + len(output)] = torch.tensor(prompt + output)
        tokens[slot, len(prompt) + len(output) :] = torch.tensor(rng.randrange(6))  # stale ids past the context
        words = [tuple(rng.randrange(6) for _ in range(rng.randint(2, 4))) for _ in range(rng.randint(1, 4))]
        words.append((rng.randrange(6), words[0][-1]))  # another word ending in the same id
        params[row] = SamplingParams(bad_words_token_ids=words)
        meta.append((slot, len(prompt) + len(output), len(output)))
        outputs[row] = output
    bad = prepare_bad_words(params, kept_rows, torch.device(device))
    assert bad is not None
    view = TokenView(tokens.to(device), torch.tensor(meta, dtype=torch.int64).T.contiguous().to(device))
    logits = torch.randn(num_rows + 2, vocab, generator=torch.Generator().manual_seed(seed)).to(device)
    before = logits.clone()
    out = apply_bad_words(logits, bad, view)
    assert torch.equal(logits, before)
    expected = before.clone()
    for row in kept_rows:
        for token in _reference_banned(list(params[row].bad_words_token_ids), outputs[row]):
            expected[row, token] = MASKED_LOGIT
    assert torch.equal(out, expected)


def test_one_id_words_are_bans_of_the_logit_bias_and_keep_the_graphs_off() -> None:
    """A one-id word is banned at every step (even with no output yet), through the logit bias: no history is
    kept, and the decode graphs refuse the batch (their sampling has no bias)."""
    params = [SamplingParams(temperature=0, bad_words_token_ids=[[3]]), SamplingParams(temperature=0)]
    batch = prepare_sampling(params, [0, 0], [None, None], 8, "cpu")
    assert batch.bad_words is None and batch.penalised is None
    logits = torch.zeros(2, 8)
    logits[:, 3] = 5.0
    assert Sampler(kernels=False).sample(logits, batch).token_ids.tolist() == [0, 3]
    assert graph_rows(params, 8, max_top_k=8) is None
    assert graph_rows(params[1:], 8, max_top_k=8) is not None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_bans_stay_finite_in_every_logits_dtype(dtype: torch.dtype) -> None:
    """MASKED_LOGIT is below float16's range: a one-id bad word, a min_tokens ban and a logit bias on the same ids
    (summed into one entry) leave the row finite in every dtype, at the dtype's floor or lower than any real logit,
    and a sampled row never draws them; a bad word of several ids too."""
    params = [
        SamplingParams(
            temperature=0.7, max_tokens=4, min_tokens=2, logit_bias={1: -100, 2: 3}, bad_words_token_ids=[[2]]
        ),
        SamplingParams(temperature=0.7, bad_words_token_ids=[[4, 5]]),
    ]
    history = [None, TokenHistory((0,), (4,))]
    batch = prepare_sampling(params, [0, 1], history, 8, "cpu", eos_token_ids=frozenset({2, 3}))
    logits = torch.zeros(2, 8, dtype=dtype)
    logits[:, 2] = logits[:, 3] = logits[1, 5] = 8.0
    sampler = Sampler(seed=3, kernels=False)
    for _ in range(20):
        out = sampler.sample(logits, batch)
        assert not out.non_finite.any()
        assert out.token_ids[0].item() not in (1, 2, 3) and out.token_ids[1].item() != 5


def test_memo_reuse_matches_each_steps_history() -> None:
    """A decode batch kept by the reuse memo (same params object) is matched against each step's tokens: the ban of
    (1, 2, 3) is off after output (1,), on after (1, 2), off again after (1, 2, 4); a greedy row that prefers id 3
    draws it only when the ban is off."""
    params = (SamplingParams(temperature=0, bad_words_token_ids=[[1, 2, 3]]),)
    memo, sampler = SamplingMemo(), Sampler(kernels=False)
    logits = torch.zeros(1, 6)
    logits[0, 3] = 5.0
    drawn = []
    for output in [(1,), (1, 2), (1, 2, 4), (2, 1, 2)]:
        batch = prepare_sampling(params, [len(output)], [TokenHistory((0,), output)], 6, "cpu", memo=memo)
        drawn.append(sampler.sample(logits, batch).token_ids.item())
    assert memo.batch is not None  # kept: the bans read the step's tokens, not the kept batch
    assert drawn == [3, 0, 3, 0]


def test_prompt_tokens_never_match() -> None:
    """Only generated tokens count (vLLM's rule): a prompt ending in the prefix bans nothing at the first draw."""
    params = [SamplingParams(temperature=0, bad_words_token_ids=[[1, 3]])]
    logits = torch.zeros(1, 6)
    logits[0, 3] = 5.0
    batch = prepare_sampling(params, [0], [TokenHistory((4, 1), ())], 6, "cpu")
    assert Sampler(kernels=False).sample(logits, batch).token_ids.item() == 3
    batch = prepare_sampling(params, [1], [TokenHistory((4,), (1,))], 6, "cpu")
    assert Sampler(kernels=False).sample(logits, batch).token_ids.item() == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(tmp_path_factory.mktemp("bad_words"), "qwen3")


def test_resolution_encodes_each_word_alone_and_after_a_space(tiny: Path) -> None:
    """A word's own ids always; its spaced ids too when they start with another id and are as many; ids given
    directly stay first; duplicates go; the text is cleared. Without a tokenizer, text is refused by name."""
    tokenizer = load_local_tokenizer(tiny)

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    candidates = ["hello", "world", "the", "cat", "ab", "a", "zq", "fnvllm", "Paris", "x y"]
    kinds = {}
    for word in candidates:
        alone, spaced = encode(word), encode(" " + word)
        resolved = resolve_bad_words(
            tokenizer, SamplingParams(bad_words=["  " + word, word], bad_words_token_ids=[[7]])
        )
        assert resolved.bad_words == ()
        both = spaced[0] != alone[0] and len(spaced) == len(alone)
        assert resolved.bad_words_token_ids == ((7,), alone, spaced) if both else ((7,), alone)
        kinds[both] = word
    assert set(kinds) == {True, False}, f"the test tokenizer should give both cases among {candidates}"
    plain = SamplingParams()
    assert resolve_bad_words(tokenizer, plain) is plain
    with pytest.raises(InvalidRequestError, match=r"bad_words.*tokenizer"):
        resolve_bad_words(None, SamplingParams(bad_words=["x"]))


def _greedy_with_bans(llm: LLM, prompt: list[int], words: list[tuple[int, ...]], length: int) -> list[int]:
    """The reference: each token by its own one-token greedy request, with the ids the rule bans after the output
    so far biased to -100."""
    output: list[int] = []
    for _ in range(length):
        bias = {token: -100.0 for token in _reference_banned(words, output)}
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logit_bias=bias or None)
        output += llm.generate([prompt + output], one, use_tqdm=False)[0].token_ids
    return output


@pytest.mark.parametrize("options", [{}, {"num_decode_steps": 4}], ids=["one-step", "four-step"])
def test_llm_output_avoids_bad_words_as_the_reference_does(tiny: Path, options: dict[str, object]) -> None:
    """Greedy runs of a tiny model: banning the first two tokens of the free output as a pair (and, in a second
    request, its first token alone) changes the output exactly where the one-token reference says, and the banned
    pair / token never appears; a row without bad words beside them is unchanged."""
    llm = LLM(tiny, dtype="float32", block_size=8, num_blocks=64, **options)  # type: ignore[arg-type]
    prompts = [[5, 9, 13, 200, 7], [1, 2, 3]]
    base = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    free = [list(out.token_ids) for out in llm.generate(prompts, base, use_tqdm=False)]
    pair = (free[0][0], free[0][1])
    first = (free[1][0],)
    params = [
        attrs.evolve(base, bad_words_token_ids=[pair]),
        attrs.evolve(base, bad_words_token_ids=[first]),
        base,
    ]
    outs = [list(out.token_ids) for out in llm.generate([*prompts, prompts[1]], params, use_tqdm=False)]
    assert outs[0][0] == free[0][0] and outs[0][1] != pair[1]
    assert all((a, b) != pair for a, b in zip(outs[0], outs[0][1:], strict=False))
    assert first[0] not in outs[1] and outs[2] == free[1]
    assert outs[0] == _greedy_with_bans(llm, prompts[0], [pair], 8)
    assert outs[1] == _greedy_with_bans(llm, prompts[1], [first], 8)
    llm.close()


def test_overlapped_steps_match_each_rows_latest_token(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlapped steps (forced on the CPU, as on a GPU) plan a step before the last one's tokens reach the host:
    the bans must read each row's latest token from the device. Rows banning a pair and a triple of their free
    output, with max_num_seqs 2 so rows join and leave mid-run, give the tokens of plain steps."""
    monkeypatch.setattr(ModelExecutor, "supports_overlap", property(lambda self: True))
    prompts = [[5, 9, 13, 200, 7], [1, 2, 3], [40, 41, 42, 43]]
    base = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = []
    for overlap in (False, True):
        llm = LLM(tiny, dtype="float32", block_size=4, num_blocks=64, max_num_seqs=2)
        llm.loop = EngineLoop(llm.engine, overlap=overlap)
        assert llm.loop.overlap == overlap
        free = [out.token_ids for out in llm.generate(prompts, base, use_tqdm=False)]
        words = [[free[0][2:4]], [free[1][1:4], free[1][5:7]], []]
        params = [attrs.evolve(base, max_tokens=10 - i, bad_words_token_ids=w) for i, w in enumerate(words)]
        runs.append([out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)])
        if overlap:
            assert llm.loop.overlap_stats.kept > 3
        llm.close()
    assert runs[0] == runs[1]


def test_llm_resolves_bad_words_text(tiny: Path) -> None:
    """``bad_words`` text through LLM.generate gives the output of its resolved ids (``resolve_bad_words``), which
    differs from the free output when a word is the text of a free token."""
    llm = LLM(tiny, dtype="float32", block_size=8, num_blocks=64)
    prompt = [5, 9, 13, 200, 7]
    base = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free = llm.generate([prompt], base, use_tqdm=False)[0]
    word = llm.tokenizer.decode([free.token_ids[1]])
    texted = attrs.evolve(base, bad_words=[word])
    resolved = resolve_bad_words(llm.tokenizer, texted)
    by_text = llm.generate([prompt], texted, use_tqdm=False)[0]
    by_ids = llm.generate([prompt], resolved, use_tqdm=False)[0]
    assert by_text.token_ids == by_ids.token_ids
    if (free.token_ids[1],) in resolved.bad_words_token_ids:
        assert by_text.token_ids != free.token_ids
    llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and overlapped steps need a GPU")
@pytest.mark.parametrize("decode_steps", [1, 4])
def test_gpu_overlapped_graph_runs_match_eager_runs(tiny: Path, decode_steps: int) -> None:
    """On a GPU (overlapped steps; decode graphs for the rows without bad words), rows with a banned pair and a
    banned id beside plain rows give the tokens of eager steps, and never the banned pair or id."""
    prompts = [[5, 9, 13, 200, 7], [1, 2, 3], [40, 41, 42, 43], [7]]
    runs = []
    for eager in (True, False):
        llm = LLM(
            tiny, dtype="float32", block_size=8, num_blocks=64, max_num_seqs=4, enforce_eager=eager,
            num_decode_steps=decode_steps,
        )  # fmt: skip
        base = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        free = [out.token_ids for out in llm.generate(prompts, base, use_tqdm=False)]
        words = [[(free[0][1], free[0][2])], [(free[1][0],)], [], [(free[3][2], free[3][3], free[3][4])]]
        params = [attrs.evolve(base, bad_words_token_ids=w) for w in words]
        runs.append([out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)])
        llm.close()
        for tokens, banned in zip(runs[-1], words, strict=True):
            for word in banned:
                n = len(word)
                assert all(tuple(tokens[i : i + n]) != word for i in range(len(tokens) - n + 1))
        assert runs[-1][2] == free[2]
    assert runs[0] == runs[1]
