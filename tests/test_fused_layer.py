"""A whole tiny model with the Triton ops (fused q/k norm + rope + KV store among them), under Triton's CPU
interpreter, against the same checkpoint with the torch ops: same logits through prefill chunks and decodes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from triton_guard import require_triton

DEVICE = require_triton()

from fnvllm.executor.device_inputs import build_attention_metadata  # noqa: E402
from fnvllm.kernels import skinny_gemm  # noqa: E402
from fnvllm.kernels.attention import KVCache  # noqa: E402
from fnvllm.kernels.fp8 import FP8_DTYPE  # noqa: E402
from fnvllm.model import DecoderForCausalLM, ModelConfig, load_model  # noqa: E402
from fnvllm.model.ops import TORCH_OPS, ops_for, triton_ops  # noqa: E402
from fnvllm.testing.checkpoints import write_tiny_checkpoint  # noqa: E402

BLOCK = 8
CHUNKS = [11, 6, 1, 1, 1]  # two prefill chunks, then decodes


@torch.inference_mode()
def run(model: DecoderForCausalLM, tokens: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Logits (L, vocab) for tokens fed in CHUNKS through a paged cache (blocks 3, 1, 4; FP8 with scales)."""
    tokens = tokens.to(DEVICE)  # (the tests draw them on the CPU; on a GPU machine the model is on "cuda")
    config = model.config
    shape = (6, BLOCK, config.num_key_value_heads, config.head_dim)
    heads = config.num_key_value_heads
    caches = []
    for _ in model.model.layers:
        if fp8:
            scales = torch.full((heads,), 0.05, device=DEVICE), torch.full((heads,), 0.04, device=DEVICE)
            caches.append(KVCache(*(torch.zeros(shape, device=DEVICE).to(FP8_DTYPE) for _ in range(2)), *scales))
        else:
            caches.append(KVCache(torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)))
    table = (3, 1, 4)[: math.ceil(sum(CHUNKS) / BLOCK)]
    start, outs = 0, []
    for n in CHUNKS:
        meta = build_attention_metadata([start], [n], [table], BLOCK, DEVICE)
        outs.append(model.compute_logits(model(tokens[start : start + n], meta.positions, caches, meta)))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_ops_model_matches_torch_ops(tmp_path: Path, family: str, fp8: bool) -> None:
    """Qwen3 (q/k norms) and Qwen2 (none), bf16 or FP8 cache: the Triton-ops model (fused prologues on: their
    CPU fallbacks) gives the torch-ops logits."""
    path = write_tiny_checkpoint(tmp_path, family, num_heads=4, num_kv_heads=2, num_layers=2)
    config = ModelConfig.from_pretrained(path)
    ours = load_model(path, config, DEVICE, ops=triton_ops(fused_prologues=True))
    ref = load_model(path, config, DEVICE, ops=TORCH_OPS)
    assert ours.model.layers[0].self_attn.ops.norm_rope_store is not None
    tokens = torch.randint(0, config.vocab_size, (sum(CHUNKS),), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(DEVICE)
    torch.testing.assert_close(run(ours, tokens, fp8), run(ref, tokens, fp8), atol=1e-4, rtol=1e-4)


def test_fused_prologues_are_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton ops fuse norms and SiLU into the projections (where measured faster) unless the environment
    turns them off."""
    monkeypatch.delenv("FNVLLM_FUSED_PROLOGUES", raising=False)
    assert ops_for("triton").norm_linear is not None and ops_for("triton").silu_mul_linear is not None
    monkeypatch.setenv("FNVLLM_FUSED_PROLOGUES", "0")
    assert ops_for("triton").norm_linear is None and ops_for("triton").silu_mul_linear is None


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_skinny_paths_of_the_model_match_torch_ops(
    tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every few-row projection sent to the skinny kernel (as on a GPU: norm + qkv, norm + gate/up,
    SiLU-and-mul + down, o_proj), decodes and prefill chunks still give the torch-ops logits."""
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda x: True)
    monkeypatch.setattr(skinny_gemm, "prefers_skinny", lambda m, n, k: 0 < m <= 16)
    path = write_tiny_checkpoint(tmp_path, family, num_heads=4, num_kv_heads=2, num_layers=2)
    config = ModelConfig.from_pretrained(path)
    ours = load_model(path, config, DEVICE, ops=triton_ops(fused_prologues=True))
    ref = load_model(path, config, DEVICE, ops=TORCH_OPS)
    assert ours.model.layers[0].mlp.ops.norm_linear is not None
    tokens = torch.randint(0, config.vocab_size, (sum(CHUNKS),), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(run(ours, tokens, False), run(ref, tokens, False), atol=1e-4, rtol=1e-4)


def test_late_norm_model_matches_torch_ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every few-row residual add + RMSNorm run as a late row scale inside its projection (norm + qkv, and
    norm + gate/up with the SiLU-and-mul epilogue), decodes and prefill chunks still give the torch-ops logits."""
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda x: True)
    monkeypatch.setattr(skinny_gemm, "prefers_skinny", lambda m, n, k: 0 < m <= 16)
    late = []

    def late_config(m: int, n: int, k: int) -> skinny_gemm.SkinnyConfig | None:
        late.append(m)
        return skinny_gemm.SkinnyConfig(max(16, 1 << (m - 1).bit_length()), 16, 32, 1, late_norm=True)

    monkeypatch.setattr(skinny_gemm, "late_norm_config", late_config)
    path = write_tiny_checkpoint(tmp_path, "qwen3", num_heads=4, num_kv_heads=2, num_layers=2)
    config = ModelConfig.from_pretrained(path)
    gu_rows = 2 * config.intermediate_size
    glu = skinny_gemm.Fused(skinny_gemm.SkinnyConfig(16, 32, 32, 1), 1.0, 2.0)
    monkeypatch.setitem(skinny_gemm.FUSED_TIMES, ("glu", gu_rows, config.hidden_size, 16), glu)
    ours = load_model(path, config, DEVICE, ops=triton_ops(fused_prologues=True))
    ref = load_model(path, config, DEVICE, ops=TORCH_OPS)
    tokens = torch.randint(0, config.vocab_size, (sum(CHUNKS),), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(run(ours, tokens, False), run(ref, tokens, False), atol=1e-4, rtol=1e-4)
    assert set(late) >= {1, 6, 11}  # every chunk's norms went the late way


# (family, fp8 cache): each of the epilogue's q/k-norm and FP8-store branches on and off once (the interpreter
# takes ~7-20 s a case, and the kernel-level tests of test_qkv_epilogue.py cover the branches' combinations).
@pytest.mark.parametrize(("family", "fp8"), [("qwen3", True), ("qwen2", False)])
def test_qkv_epilogue_model_gives_the_unfused_logits_bitwise(
    tmp_path: Path, family: str, fp8: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the attention prologue in the qkv projection's epilogue (decodes and the 6-token chunk; the 11-token
    chunk too, all <= 16 rows), the logits are the bits of the same skinny paths without it."""
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda x: True)
    monkeypatch.setattr(skinny_gemm, "prefers_skinny", lambda m, n, k: 0 < m <= 16)
    path = write_tiny_checkpoint(tmp_path, family, num_heads=4, num_kv_heads=2, num_layers=2, dtype="bfloat16")
    config = ModelConfig.from_pretrained(path)
    ours = load_model(path, config, DEVICE, ops=triton_ops(fused_prologues=True, qkv_epilogue=True))
    base = load_model(path, config, DEVICE, ops=triton_ops(fused_prologues=True, qkv_epilogue=False))
    attn = ours.model.layers[0].self_attn
    assert attn.fuses_qkv_epilogue() and not base.model.layers[0].self_attn.fuses_qkv_epilogue()
    n, k = attn.qkv_proj.weight.shape
    assert skinny_gemm.epilogue_config(1, n, k, config.head_dim, False) is not None  # the epilogue really runs
    tokens = torch.randint(0, config.vocab_size, (sum(CHUNKS),), generator=torch.Generator().manual_seed(3))
    assert torch.equal(run(ours, tokens, fp8), run(base, tokens, fp8))


def test_qkv_epilogue_is_off_unless_turned_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton ops keep the prologue out of the qkv projection unless FNVLLM_QKV_EPILOGUE=1 (and never with
    the fused prologues off)."""
    monkeypatch.delenv("FNVLLM_QKV_EPILOGUE", raising=False)
    assert ops_for("triton").norm_linear_rope_store is None
    monkeypatch.setenv("FNVLLM_QKV_EPILOGUE", "1")
    assert ops_for("triton").norm_linear_rope_store is not None
    monkeypatch.setenv("FNVLLM_FUSED_PROLOGUES", "0")
    assert ops_for("triton").norm_linear_rope_store is None
