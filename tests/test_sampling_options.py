"""skip_special_tokens, truncate_prompt_tokens and allowed_token_ids (vLLM's SamplingParams options): validation,
the one truncation rule, the sampler's allowed-ids mask (references and kernels, the reuse memo, the graph path's
refusal), and the offline API end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_device import kernel_device
from tiny_models import write_family

from fnvllm.executor.sampler import Sampler, SamplingMemo, apply_allowed, graph_rows, prepare_allowed, prepare_sampling
from fnvllm.llm import LLM
from fnvllm.state import InvalidRequestError, SamplingParams
from fnvllm.state.errors import RequestTypeError
from fnvllm.state.params import truncate_prompt
from fnvllm.state.plan import TokenHistory

BOS = 0  # the test tokenizer's "<s>": a special token that is neither the tiny model's EOS nor a stop id


@pytest.mark.parametrize(
    ("kwargs", "error", "field", "text"),
    [
        ({"skip_special_tokens": 1}, RequestTypeError, "skip_special_tokens", "True or False"),
        ({"truncate_prompt_tokens": 0}, InvalidRequestError, "truncate_prompt_tokens", "[1, "),
        ({"truncate_prompt_tokens": True}, RequestTypeError, "truncate_prompt_tokens", "int"),
        ({"allowed_token_ids": []}, InvalidRequestError, "allowed_token_ids", "non-empty"),
        ({"allowed_token_ids": [3, -1]}, InvalidRequestError, "allowed_token_ids", "-1"),
        ({"allowed_token_ids": "12"}, RequestTypeError, "allowed_token_ids", "token ids"),
    ],
)
def test_bad_options_name_the_field(kwargs: dict[str, object], error: type[Exception], field: str, text: str) -> None:
    """A non-bool skip_special_tokens, a truncate_prompt_tokens below 1 or a bool, and an empty, negative or
    non-sequence allowed_token_ids raise naming the field."""
    with pytest.raises(error, match=field) as raised:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert text in str(raised.value)


def test_allowed_token_ids_are_stored_as_a_tuple() -> None:
    """A list of ids becomes a tuple; the defaults are None / True / None."""
    assert SamplingParams(allowed_token_ids=[4, 2]).allowed_token_ids == (4, 2)
    default = SamplingParams()
    assert (default.allowed_token_ids, default.skip_special_tokens, default.truncate_prompt_tokens) == (
        None,
        True,
        None,
    )


def test_truncate_prompt_keeps_the_last_tokens() -> None:
    """k keeps the last k ids; a prompt of k or fewer ids and None keep all; k < 1 names the field."""
    assert truncate_prompt([5, 6, 7, 8], 2) == (7, 8)
    assert truncate_prompt([5, 6], 2) == (5, 6) and truncate_prompt([5], 3) == (5,)
    assert truncate_prompt([5, 6, 7], None) == (5, 6, 7)
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        truncate_prompt([5, 6], 0)


def test_apply_allowed_masks_only_the_rows_that_ask() -> None:
    """Rows with allowed ids keep those logits and have every other id at MASKED_LOGIT; other rows and the input
    are unchanged."""
    logits = torch.randn(3, 10)
    params = [SamplingParams(), SamplingParams(allowed_token_ids=(4, 9)), SamplingParams(allowed_token_ids=(0,))]
    allowed = prepare_allowed(params, [1, 2], torch.device("cpu"))
    before = logits.clone()
    out = apply_allowed(logits, allowed)
    assert torch.equal(logits, before) and torch.equal(out[0], logits[0])
    assert out[1, [4, 9]].tolist() == logits[1, [4, 9]].tolist() and out[2, 0] == logits[2, 0]
    assert (out[1].topk(2).indices.sort().values.tolist(), out[2].argmax().item()) == ([4, 9], 0)
    assert out[1, 0].item() < -1e29 and out[2, 1:].max().item() < -1e29


@pytest.mark.parametrize("kernels", [False, True], ids=["references", "kernels"])
def test_sampler_draws_only_allowed_ids(kernels: bool) -> None:
    """Token 0 has by far the largest logit everywhere: greedy and sampled rows (top-p, a seed, a penalty) with
    allowed ids never draw it, only their ids, over many seeds; a row without them draws 0; logprobs stay raw."""
    device = kernel_device(kernels)
    vocab = 40
    params = [
        SamplingParams(temperature=0, allowed_token_ids=(5, 17), logprobs=1),
        SamplingParams(temperature=1.0, allowed_token_ids=(3, 8, 30)),
        SamplingParams(temperature=0.9, top_p=0.95, seed=7, allowed_token_ids=(11, 12)),
        SamplingParams(temperature=0),
    ]
    for seed in range(4):
        logits = torch.randn(4, vocab, device=device)
        logits[:, 0] = 40.0
        batch = prepare_sampling(params, [seed] * 4, [None] * 4, vocab, device)
        out = Sampler(seed=seed, kernels=kernels).sample(logits, batch)
        tokens = out.token_ids.tolist()
        assert tokens[0] == [5, 17][int(logits[0, [5, 17]].argmax())]
        assert tokens[1] in (3, 8, 30) and tokens[2] in (11, 12) and tokens[3] == 0
        assert out.logprobs is not None
        raw = torch.log_softmax(logits[0].double(), -1)[tokens[0]].item()
        assert out.logprobs.sampled_logprobs[0].item() == pytest.approx(raw, abs=1e-5)


def test_allowed_ids_compose_with_a_penalty_and_a_bias() -> None:
    """A penalised row (history rows) and a biased row with allowed ids still draw only them: the bias picks among
    them, and cannot lift an id outside them."""
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, allowed_token_ids=(2, 3)),
        SamplingParams(temperature=0, allowed_token_ids=(6, 7), logit_bias={7: 100, 0: 100}),
    ]
    logits = torch.randn(2, 12)
    logits[:, 0] = 30.0
    histories = [TokenHistory((2,), ()), None]
    batch = prepare_sampling(params, [0, 0], histories, 12, "cpu")
    tokens = Sampler(seed=0, kernels=False).sample(logits, batch).token_ids.tolist()
    assert tokens[0] in (2, 3) and tokens[1] == 7


def test_memo_keeps_an_allowed_batch_and_the_graphs_refuse_it() -> None:
    """The allowed ids depend on the params alone: the memo hands the same batch to the next step of the same
    params tuple; graph_rows refuses such a batch (it samples eagerly) and accepts it without them."""
    params = (SamplingParams(temperature=0, allowed_token_ids=(1,)), SamplingParams(temperature=0))
    memo = SamplingMemo()
    first = prepare_sampling(params, [0, 0], [None, None], 8, "cpu", memo=memo)
    assert first.allowed is not None
    assert prepare_sampling(params, [1, 1], [None, None], 8, "cpu", memo=memo) is first
    assert graph_rows(params, 8, 38) is None
    assert graph_rows((SamplingParams(temperature=0),) * 2, 8, 38) is not None
    assert prepare_sampling(params[1:], [0], [None], 8, "cpu").allowed is None


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path: Path = write_family(tmp_path_factory.mktemp("options"), "qwen3")
    return LLM(path, dtype="float32", block_size=8, num_blocks=64)


def test_llm_generates_only_allowed_ids(llm: LLM) -> None:
    """Greedy and sampled requests with allowed ids generate only those ids (greedy: not the free greedy run's
    first token, which is left out); a request beside them without the option is unchanged."""
    prompt = [5, 9, 13, 200, 7]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free = llm.generate([prompt], plain, use_tqdm=False)[0].token_ids
    allowed = tuple(t for t in (40, 41, 42, 43) if t != free[0])
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
    outs = llm.generate([prompt] * 3, [greedy, sampled, plain], use_tqdm=False)
    assert set(outs[0].token_ids) <= set(allowed) and set(outs[1].token_ids) <= set(allowed)
    assert outs[2].token_ids == free


def test_llm_refuses_allowed_ids_outside_the_vocabulary(llm: LLM) -> None:
    """An allowed id >= the vocabulary size is an InvalidRequestError naming allowed_token_ids and the range."""
    with pytest.raises(InvalidRequestError, match=r"allowed_token_ids.*\[0, 256\)"):
        llm.generate([[1, 2, 3]], SamplingParams(allowed_token_ids=(3, 256)), use_tqdm=False)


def test_llm_keeps_special_tokens_text_when_asked(llm: LLM) -> None:
    """A forced "<s>" (logit_bias +100) is in the text with skip_special_tokens False and not with the default;
    the token ids are the same."""
    base = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={BOS: 100})
    skipped, kept = llm.generate(
        [[5, 9, 13]] * 2, [SamplingParams(**base), SamplingParams(**base, skip_special_tokens=False)], use_tqdm=False
    )  # type: ignore[arg-type]
    assert skipped.token_ids == kept.token_ids == (BOS,) * 3
    assert "<s>" not in skipped.text and kept.text == "<s>" * 3


def test_llm_truncates_prompts_to_their_last_tokens(llm: LLM) -> None:
    """generate, stream and chat keep each prompt's last k ids: prompt_token_ids are those, and greedy tokens equal
    those of the cut prompt sent whole; a prompt of k or fewer ids is unchanged."""
    long, short = [5, 9, 13, 200, 7, 42, 17], [3, 4]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cut = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=3)
    outs = llm.generate([long, short], cut, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [(7, 42, 17), (3, 4)]
    assert outs[0].token_ids == llm.generate([long[-3:]], greedy, use_tqdm=False)[0].token_ids
    streamed = [d for d in llm.stream([long], cut)]
    assert tuple(t for d in streamed for t in d.new_token_ids) == outs[0].token_ids
    conversation = [{"role": "user", "content": "hello there, how are you"}]
    chat = llm.chat(conversation, cut, use_tqdm=False)[0]
    assert chat.prompt_token_ids == llm.chat(conversation, greedy, use_tqdm=False)[0].prompt_token_ids[-3:]
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        llm.generate([long], SamplingParams(truncate_prompt_tokens=0), use_tqdm=False)
