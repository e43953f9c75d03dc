"""logit_bias: validation in SamplingParams and at add_request, the sparse per-row add in the sampler, and the
offline API end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_device import kernel_device
from tiny_models import write_family

from fnvllm.executor.sampler import Sampler, apply_logit_bias, prepare_logit_bias, prepare_sampling
from fnvllm.llm import LLM
from fnvllm.state import InvalidRequestError, SamplingParams
from fnvllm.state.errors import RequestTypeError


def test_logit_bias_is_normalised_to_sorted_pairs() -> None:
    """A dict or a list of pairs becomes sorted (id, float) pairs; an empty one is None."""
    assert SamplingParams(logit_bias={7: 5, 2: -1.5}).logit_bias == ((2, -1.5), (7, 5.0))
    assert SamplingParams(logit_bias=[(3, 1.0)]).logit_bias == ((3, 1.0),)
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.parametrize(
    ("bias", "error", "text"),
    [
        ({1: 100.5}, InvalidRequestError, "[-100, 100]"),
        ({-1: 1.0}, InvalidRequestError, "token id"),
        ({1: float("nan")}, InvalidRequestError, "[-100, 100]"),
        ({"1": 1.0}, RequestTypeError, "token id"),
        ("x", RequestTypeError, "logit_bias"),
    ],
)
def test_logit_bias_out_of_range_names_the_field(bias: object, error: type[Exception], text: str) -> None:
    """Biases outside [-100, 100], negative or non-int ids, and a wrong type raise naming logit_bias."""
    with pytest.raises(error, match="logit_bias") as raised:
        SamplingParams(logit_bias=bias)
    assert text in str(raised.value)


def test_apply_logit_bias_adds_only_at_its_pairs() -> None:
    """The bias lands at each (row, token) pair; other rows and tokens, and the input tensor, are unchanged."""
    logits = torch.randn(3, 10)
    params = [SamplingParams(), SamplingParams(logit_bias={4: 2.5, 9: -100}), SamplingParams(logit_bias={0: 1})]
    bias = prepare_logit_bias(params, torch.device("cpu"))
    assert bias is not None
    expected = logits.clone()
    expected[1, 4] += 2.5
    expected[1, 9] -= 100
    expected[2, 0] += 1
    before = logits.clone()
    assert torch.equal(apply_logit_bias(logits, bias), expected)
    assert torch.equal(logits, before)
    assert prepare_logit_bias([SamplingParams()] * 2, torch.device("cpu")) is None


@pytest.mark.parametrize("kernels", [False, True], ids=["references", "kernels"])
def test_sampler_follows_the_bias_row_by_row(kernels: bool) -> None:
    """A +100 bias makes greedy and sampled rows pick that token, by the torch references and by the Triton kernels
    (on the GPU where there is one, else interpreted on the CPU); an unbiased row keeps its argmax; logprobs stay
    raw."""
    device = kernel_device(kernels)
    logits = torch.randn(3, 50, device=device)
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100}, logprobs=0),
        SamplingParams(temperature=0.8, top_p=0.9, logit_bias={11: 100}),
        SamplingParams(temperature=0),
    ]
    batch = prepare_sampling(params, [0, 0, 0], [None] * 3, 50, device)
    out = Sampler(seed=0, kernels=kernels).sample(logits, batch)
    assert out.token_ids.tolist() == [7, 11, int(logits[2].argmax())]
    assert out.logprobs is not None
    raw = torch.log_softmax(logits[0].double(), -1)[7].item()
    assert out.logprobs.sampled_logprobs[0].item() == pytest.approx(raw, abs=1e-5)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path: Path = write_family(tmp_path_factory.mktemp("bias"), "qwen3")
    return LLM(path, dtype="float32", block_size=8, num_blocks=64)


def test_llm_bans_and_forces_tokens(llm: LLM) -> None:
    """-100 on the greedy token changes the first token; +100 on a token makes every greedy token that one."""
    prompt = [[5, 9, 13, 200, 7]]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    first = greedy[0].token_ids[0]
    banned = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={first: -100})
    assert llm.generate(prompt, banned, use_tqdm=False)[0].token_ids[0] != first
    forced = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={33: 100})
    assert llm.generate(prompt, forced, use_tqdm=False)[0].token_ids == (33, 33, 33, 33)


def test_llm_refuses_ids_outside_the_vocabulary(llm: LLM) -> None:
    """A bias on an id >= the vocabulary size is an InvalidRequestError naming logit_bias and the range."""
    with pytest.raises(InvalidRequestError, match=r"logit_bias.*\[0, 256\)"):
        llm.generate([[1, 2, 3]], SamplingParams(logit_bias={256: 1.0}), use_tqdm=False)
