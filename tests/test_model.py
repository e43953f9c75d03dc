"""Our Qwen3 / Qwen2 / Llama models give Hugging Face's logits, in one step or fed incrementally through the
paged KV cache."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fnvllm.executor.device_inputs import build_attention_metadata
from fnvllm.model import DecoderForCausalLM, ModelConfig, load_model
from fnvllm.testing.checkpoints import write_tiny_checkpoint

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# id -> write_tiny_checkpoint arguments: odd shapes (head_dim != hidden / heads, 1 or 2 KV heads, tied or not).
CASES: dict[str, dict[str, Any]] = {
    "qwen3-hd64-kv2-untied": dict(family="qwen3", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64),
    "qwen3-kv1-tied-3layers": dict(family="qwen3", num_heads=4, num_kv_heads=1, num_layers=3, tie_word_embeddings=True),
    "qwen2-hd64-kv1-tied": dict(family="qwen2", hidden_size=128, num_heads=2, num_kv_heads=1, tie_word_embeddings=True),
    "llama3-rope-kv2-4layers": dict(
        family="llama", num_layers=4, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, num_kv_heads=2
    ),
}
TOL = dict(atol=1e-4, rtol=1e-4)
PROMPT_LEN = 37


@pytest.fixture(scope="module", params=list(CASES))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(our model, HF model) on the same tiny fp32 checkpoint."""
    import transformers

    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    ours = load_model(path, ModelConfig.from_pretrained(path), "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32).eval()
    return ours, hf


def prompt(seed: int, length: int = PROMPT_LEN, vocab_size: int = 256) -> torch.Tensor:
    """A random prompt (length,) int64."""
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def hf_logits(hf: Any, tokens: torch.Tensor) -> torch.Tensor:
    """HF's logits (L, vocab) for the whole sequence in one forward."""
    return hf(tokens[None]).logits[0].float()


@torch.inference_mode()
def run_schedule(
    model: DecoderForCausalLM,
    sequences: Sequence[torch.Tensor],
    schedule: Sequence[Sequence[tuple[int, int]]],
    block_size: int,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Feed each step's (sequence index, num tokens) chunks through a NaN-initialised paged cache with shuffled
    block tables; returns each sequence's logits (L_i, vocab) in position order."""
    config = model.config
    needed = [math.ceil(len(s) / block_size) for s in sequences]
    num_blocks = sum(needed) + 2
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [tuple(perm[sum(needed[:i]) : sum(needed[: i + 1])]) for i in range(len(sequences))]
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    caches = [
        (torch.full(shape, float("nan")), torch.full(shape, float("nan"))) for _ in range(len(model.model.layers))
    ]
    fed = [0] * len(sequences)
    logits: list[list[torch.Tensor]] = [[] for _ in sequences]
    for step in schedule:
        ids = torch.cat([sequences[i][fed[i] : fed[i] + n] for i, n in step])
        meta = build_attention_metadata(
            [fed[i] for i, _ in step], [n for _, n in step], [tables[i] for i, _ in step], block_size, "cpu"
        )
        out = model.compute_logits(model(ids, meta.positions, caches, meta))
        for (i, n), chunk in zip(step, out.split([n for _, n in step]), strict=True):
            logits[i].append(chunk)
            fed[i] += n
    assert fed == [len(s) for s in sequences], "schedule must feed every token exactly once"
    return [torch.cat(chunks) for chunks in logits]


def test_single_prefill_matches_hf(models: Any) -> None:
    """A whole prompt in one step gives HF's full-sequence logits."""
    ours, hf = models
    tokens = prompt(1)
    (logits,) = run_schedule(ours, [tokens], [[(0, PROMPT_LEN)]], block_size=16)
    torch.testing.assert_close(logits, hf_logits(hf, tokens), **TOL)


def check_chunked_prefill(ours: Any, hf: Any, block_size: int, seed: int) -> None:
    """Prefill in three chunks (11, 7, 13 tokens), then single-token decodes, through the paged cache, give HF's
    logits (the check every family's equality tests run)."""
    tokens = prompt(2)
    chunks = [11, 7, 13] + [1] * (len(tokens) - 31)
    (logits,) = run_schedule(ours, [tokens], [[(0, n)] for n in chunks], block_size, seed=seed)
    torch.testing.assert_close(logits, hf_logits(hf, tokens), **TOL)


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_chunked_prefill_then_decode_matches_hf(models: Any, block_size: int) -> None:
    """Prefill in three chunks, then single-token decodes, through the paged cache, gives HF's logits."""
    ours, hf = models
    check_chunked_prefill(ours, hf, block_size, seed=block_size)


def test_mixed_batch_matches_alone(models: Any) -> None:
    """Two sequences sharing steps (one prefilling while the other decodes) give what each gives alone."""
    ours, hf = models
    a, b = prompt(3), prompt(4, length=29)
    schedule = [
        [(0, 20)],
        [(0, 14), (1, 12)],
        [(1, 10), (0, 1)],
        [(0, 1), (1, 5)],
        [(1, 1), (0, 1)],
        [(1, 1)],
    ]
    batched = run_schedule(ours, [a, b], schedule, block_size=4, seed=5)
    alone_a = run_schedule(ours, [a], [[(0, 20)], [(0, 14)], [(0, 1)], [(0, 1)], [(0, 1)]], block_size=4)
    alone_b = run_schedule(ours, [b], [[(0, 12)], [(0, 10)], [(0, 5)], [(0, 1)], [(0, 1)]], block_size=4)
    torch.testing.assert_close(batched[0], alone_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[1], alone_b[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[0], hf_logits(hf, a), **TOL)
    torch.testing.assert_close(batched[1], hf_logits(hf, b), **TOL)


def test_bfloat16_greedy_close_to_hf(tmp_path: Path) -> None:
    """In bf16 our logits stay within bf16 noise of HF's and agree on most greedy tokens."""
    import transformers

    path = write_tiny_checkpoint(tmp_path, "qwen3", dtype="bfloat16")
    ours = load_model(path, ModelConfig.from_pretrained(path), "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    tokens = prompt(6)
    (logits,) = run_schedule(ours, [tokens], [[(0, 20)], [(0, 17)]], block_size=16)
    expected = hf_logits(hf, tokens)
    assert (logits - expected).abs().max() < 0.1
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_hf(tmp_path: Path) -> None:
    """On a GPU, in fp32, a chunked prefill plus decodes gives HF's logits on the same device."""
    import transformers

    path = write_tiny_checkpoint(tmp_path, "qwen3", hidden_size=128, head_dim=64)
    ours = load_model(path, ModelConfig.from_pretrained(path), "cuda")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    tokens = prompt(7).cuda()
    config = ours.config
    shape = (8, 16, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape, device="cuda"), torch.zeros(shape, device="cuda")) for _ in range(2)]
    chunks, start, outs = [30, 1, 1, 1, 1, 1, 1, 1], 0, []
    with torch.inference_mode():
        for n in chunks:
            meta = build_attention_metadata([start], [n], [(5, 2, 7)], 16, "cuda")
            outs.append(ours.compute_logits(ours(tokens[start : start + n], meta.positions, caches, meta)))
            start += n
    with torch.inference_mode():
        expected = hf(tokens[None]).logits[0].float()
    torch.testing.assert_close(torch.cat(outs), expected, atol=1e-3, rtol=1e-3)
