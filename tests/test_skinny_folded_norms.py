"""Folded norms: the skinny GEMM's residual-add epilogue with the next RMSNorm's statistics (``skinny_linear_add``)
and the norm prologue that reads them (``Norm(stats=...)``), against their torch references under Triton's CPU
interpreter at tiny, odd shapes; and a tiny model whose layers fold both norms, against the torch ops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fnvllm.kernels import skinny_gemm
from fnvllm.kernels.reference import (
    RowStats,
    linear_add_stats_ref,
    rmsnorm_ref,
    silu_and_mul_ref,
    stats_rmsnorm_ref,
)
from fnvllm.kernels.skinny_gemm import FUSED_TIMES, Fused, Norm, SkinnyConfig, skinny_linear, skinny_linear_add

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (M, N, K): one row, odd widths leaving partial column blocks and K tails, a full 16-row block.
SHAPES = ((1, 24, 40), (3, 50, 300), (16, 32, 256))
CONFIGS = (
    SkinnyConfig(16, 32, 32, 1),
    SkinnyConfig(16, 16, 32, 4),  # split K, summed in-kernel, then the epilogue
    SkinnyConfig(16, 16, 512, 1, num_stages=1, preload=True),  # one tile per program
    SkinnyConfig(16, 8, 64, 2, use_dot=False),  # CUDA cores
)


def _inputs(m: int, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x (M, K), weight (N, K), bias (N,), residual (M, N), seeded by the shape."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype)
    res = torch.randn(m, n, generator=gen).to(DEVICE, dtype)
    return x, w, b, res


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_float32_add_epilogue_matches_reference(shape: tuple[int, int, int], config: SkinnyConfig) -> None:
    """In float32 every launch shape gives F.linear + residual and partials summing to its rows' sums of squares."""
    m, n, k = shape
    x, w, b, res = _inputs(m, n, k, torch.float32)
    got, stats = skinny_linear_add(x, w, b, res, config)
    ref, ref_stats = linear_add_stats_ref(x, res, w, b)
    assert stats.shape == (-(-n // config.block_n), m)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(stats.sum(dim=0), ref_stats.partials.sum(dim=0), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", CONFIGS[:3])
def test_float32_stats_prologue_matches_rmsnorm_then_linear(shape: tuple[int, int, int], config: SkinnyConfig) -> None:
    """A norm prologue fed a stream's RowStats gives F.linear(rmsnorm(stream)), as the reference from the stats
    and as rmsnorm_ref from the rows themselves."""
    m, n, k = shape
    stream, w, b, _ = _inputs(m, n, k, torch.float32)
    nw = torch.rand(k, generator=torch.Generator().manual_seed(k)).to(DEVICE) + 0.5
    partials = torch.stack([c.pow(2).sum(dim=-1) for c in stream.split(7, dim=-1)])  # (P, M), P = ceil(K / 7)
    got = skinny_linear(stream, w, b, config, norm=Norm(nw, 1e-6, stats=partials))
    from_stats = F.linear(stats_rmsnorm_ref(stream, RowStats(partials), nw, 1e-6), w, b)
    torch.testing.assert_close(got, from_stats, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, F.linear(rmsnorm_ref(stream, nw, 1e-6), w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[3]])
def test_float32_silu_prologue_with_add_epilogue_matches_reference(config: SkinnyConfig) -> None:
    """A down projection with SiLU-and-mul on load and the residual add after it: F.linear(silu_and_mul(x)) + res
    and its rows' sums of squares."""
    m, n, inter = 3, 40, 72
    gen = torch.Generator().manual_seed(9)
    gate_up = torch.randn(m, 2 * inter, generator=gen).to(DEVICE)
    w = (torch.randn(n, inter, generator=gen) / inter**0.5).to(DEVICE)
    res = torch.randn(m, n, generator=gen).to(DEVICE)
    got, stats = skinny_linear_add(gate_up, w, None, res, config, glu=True)
    ref, ref_stats = linear_add_stats_ref(silu_and_mul_ref(gate_up), res, w)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(stats.sum(dim=0), ref_stats.partials.sum(dim=0), rtol=1e-5, atol=1e-3)


def test_bfloat16_chain_stays_within_rounding_of_the_unfused_ops() -> None:
    """In bf16, o_proj + residual add (epilogue) then a norm + projection (prologue from its stats) stay within
    bf16 rounding of F.linear, the add and rmsnorm_ref done one by one."""
    m, n, k = 5, 64, 96
    x, w, b, res = _inputs(m, n, k, torch.bfloat16)
    w2 = (torch.randn(48, n, generator=torch.Generator().manual_seed(3)) / n**0.5).to(DEVICE, torch.bfloat16)
    nw = torch.ones(n, dtype=torch.bfloat16, device=DEVICE)
    cfg = SkinnyConfig(16, 16, 32, 2)
    stream, stats = skinny_linear_add(x, w, b, res, cfg)
    ref_stream = F.linear(x, w, b) + res
    assert (stream.float() - ref_stream.float()).abs().max().item() <= ref_stream.float().abs().max().item() * 2**-7
    got = skinny_linear(stream, w2, None, cfg, norm=Norm(nw, 1e-6, stats=stats)).float()
    ref = F.linear(rmsnorm_ref(ref_stream, nw, 1e-6), w2).float()
    assert (got - ref).abs().max().item() <= ref.abs().max().item() * 2**-6


def test_folded_launches_reject_what_they_cannot_run() -> None:
    """Stats with a residual, malformed stats, a wrong residual and a split without the in-kernel sum are refused."""
    x, w, b, res = _inputs(3, 16, 32, torch.float32)
    nw = torch.ones(32, device=DEVICE)
    stats = torch.ones(2, 3, device=DEVICE)
    with pytest.raises(ValueError, match="stats and residual"):
        skinny_linear(x, w, None, norm=Norm(nw, 1e-6, x, torch.empty_like(x), stats=stats))
    with pytest.raises(ValueError, match="norm stats must be"):
        skinny_linear(x, w, None, norm=Norm(nw, 1e-6, stats=torch.ones(2, 4, device=DEVICE)))
    with pytest.raises(ValueError, match="residual must be"):
        skinny_linear_add(x, w, b, res[:, :8])
    with pytest.raises(ValueError, match="fused_reduce"):
        skinny_linear_add(x, w, b, res, SkinnyConfig(16, 16, 16, 2, fused_reduce=False))


@pytest.mark.parametrize("glu_16", [False, True])
def test_model_with_folded_norms_matches_torch_ops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, glu_16: bool
) -> None:
    """A tiny Qwen3 whose layers fold both residual add + RMSNorm launches into their projections (FOLD_ROWS
    holding its row counts' buckets; with glu_16 the SiLU-and-mul in gate/up's epilogue at its 2-16-row chunks)
    gives the torch-ops logits through prefill chunks and decodes."""
    from test_fused_layer import CHUNKS, run

    from fnvllm.model import ModelConfig, load_model
    from fnvllm.model.ops import TORCH_OPS, triton_ops
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path, "qwen3", num_heads=4, num_kv_heads=2, num_layers=2)
    config = ModelConfig.from_pretrained(path)
    monkeypatch.setattr(skinny_gemm, "FOLD_ROWS", {1, 16})
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda t: True)
    if glu_16:
        key = ("glu", 2 * config.intermediate_size, config.hidden_size, 16)
        monkeypatch.setitem(FUSED_TIMES, key, Fused(SkinnyConfig(16, 32, 64, 1), 1.0, 2.0))
    ours = load_model(path, config, DEVICE, ops=triton_ops(fused_prologues=True))
    ref = load_model(path, config, DEVICE, ops=TORCH_OPS)
    hidden = torch.zeros(1, config.hidden_size, device=DEVICE)
    assert ours.model.layers[0].folds(hidden) and not ref.model.layers[0].folds(hidden)
    tokens = torch.randint(0, config.vocab_size, (sum(CHUNKS),), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(
        run(ours, tokens.to(DEVICE), False), run(ref, tokens.to(DEVICE), False), atol=1e-4, rtol=1e-4
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 64])
def test_folded_chain_over_graph_replays_at_qwen3_sizes(m: int) -> None:
    """o_proj + residual add (epilogue) then rmsnorm + qkv (prologue from its stats), Qwen3-0.6B sizes with the
    tuned configs, captured in one CUDA graph (programmatic dependent launch on) and replayed with new inputs:
    every replay within bf16 noise of F.linear, the add and rmsnorm_ref one by one."""
    from fnvllm.kernels.skinny_gemm import linear_add_stats, stats_norm_linear

    gen = torch.Generator().manual_seed(m)
    w_o = (torch.randn(1024, 2048, generator=gen) / 2048**0.5).bfloat16().cuda()
    w_qkv = (torch.randn(4096, 1024, generator=gen) / 1024**0.5).bfloat16().cuda()
    nw = (torch.rand(1024, generator=gen) + 0.5).bfloat16().cuda()
    x, res = torch.empty(m, 2048, device="cuda").bfloat16(), torch.empty(m, 1024, device="cuda").bfloat16()

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        stream, stats = linear_add_stats(x, res, w_o)
        return stream, stats_norm_linear(stream, stats, nw, 1e-6, w_qkv)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream, qkv = step()
    for i in range(3):
        x.copy_(torch.randn(m, 2048, generator=torch.Generator().manual_seed(i)).bfloat16())
        res.copy_(torch.randn(m, 1024, generator=torch.Generator().manual_seed(100 + i)).bfloat16())
        graph.replay()
        ref_stream = F.linear(x, w_o) + res
        ref_qkv = F.linear(rmsnorm_ref(ref_stream, nw, 1e-6), w_qkv)
        assert (stream.float() - ref_stream.float()).abs().max().item() < 0.05
        assert (qkv.float() - ref_qkv.float()).abs().max().item() < 0.05 * ref_qkv.float().abs().max().item()


@pytest.mark.parametrize("dense_layers", [[0], [1]])
def test_folded_layers_mixed_with_moe_layers_match_torch_ops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dense_layers: list[int]
) -> None:
    """A tiny Qwen3-MoE whose dense layer folds its norms and whose sparse layer does not (dense first: the sparse
    layer gets RowStats and normalises the stream itself; dense second: it folds from a plain residual) gives the
    torch-ops logits."""
    from test_fused_layer import CHUNKS, run

    from fnvllm.model import ModelConfig, load_model
    from fnvllm.model.ops import TORCH_OPS, triton_ops
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    path = write_tiny_checkpoint(
        tmp_path, "qwen3_moe", head_dim=32, num_layers=2, moe={**moe, "mlp_only_layers": dense_layers}
    )
    config = ModelConfig.from_pretrained(path)
    monkeypatch.setattr(skinny_gemm, "FOLD_ROWS", {1, 16})
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda t: True)
    ours = load_model(path, config, DEVICE, ops=triton_ops(fused_prologues=True))
    ref = load_model(path, config, DEVICE, ops=TORCH_OPS)
    hidden = torch.zeros(1, config.hidden_size, device=DEVICE)
    assert [layer.folds(hidden) for layer in ours.model.layers] == [i in dense_layers for i in range(2)]
    tokens = torch.randint(0, config.vocab_size, (sum(CHUNKS),), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(
        run(ours, tokens.to(DEVICE), False), run(ref, tokens.to(DEVICE), False), atol=1e-4, rtol=1e-4
    )


def test_folding_applies_only_on_a_gpu_at_listed_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """folds_norms: False off a GPU, for zero rows, above 64 or at a bucket FOLD_ROWS lacks; True at one it has."""
    from fnvllm.kernels.skinny_gemm import folds_norms

    rows = {m: torch.zeros(m, 8) for m in (0, 1, 5, 16, 17, 64, 65)}
    monkeypatch.setattr(skinny_gemm, "FOLD_ROWS", {16})
    assert not folds_norms(rows[16])  # CPU tensors never fold
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda t: True)
    assert [m for m, h in rows.items() if folds_norms(h)] == [5, 16]


def test_norm_epilogue_switch_parses_its_values() -> None:
    """FNVLLM_NORM_EPILOGUE: unset or 0 is off, 1 is every bucket, a list names buckets; anything else is refused."""
    from fnvllm.kernels.skinny_gemm import fold_rows_from_env

    assert fold_rows_from_env(None) == set() and fold_rows_from_env("0") == set()
    assert fold_rows_from_env("1") == {1, 16, 64} and fold_rows_from_env("16, 64") == {16, 64}
    for bad in ("yes", "32", "16,x", ","):
        with pytest.raises(ValueError, match="FNVLLM_NORM_EPILOGUE"):
            fold_rows_from_env(bad)


def test_greedy_tokens_with_folded_norms_equal_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine with Triton ops and folded norms at every bucket (decode steps fold) gives transformers' greedy
    tokens for the mixed prompts (tiny fp32 Qwen3, block size 16)."""
    from test_llm_equality import check_equal
    from tiny_models import hf_model, write_family

    from fnvllm.llm import LLM

    monkeypatch.setattr(skinny_gemm, "FOLD_ROWS", {1, 16, 64})
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda t: True)
    path = write_family(tmp_path, "qwen3")
    llm = LLM(path, dtype="float32", block_size=16, num_blocks=256, model_ops="triton")
    layer = llm.engine.executor.model.model.layers[0]
    assert layer.folds(torch.zeros(10, layer.input_layernorm.weight.shape[0], device=DEVICE))
    check_equal("qwen3 folded", hf_model(path), llm, "block16")
