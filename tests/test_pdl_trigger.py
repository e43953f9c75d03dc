"""The small kernels' early trigger under programmatic dependent launch (``fused_ops.triggers_first``): which rows
take it, and, on a GPU, that a layer-like chain of kernels gives the same bytes with it as without, eager and in
replays of a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from fnvllm.kernels import fused_ops, skinny_gemm


def test_small_kernels_trigger_first_only_at_the_measured_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """With PDL on, 17-64 rows trigger first (where it measured faster), 1-16 and 65+ wait first; with PDL off
    (every CPU device) nothing does."""
    cpu = torch.device("cpu")
    assert not any(fused_ops.triggers_first(cpu, rows) for rows in (1, 16, 32, 64))
    monkeypatch.setattr(fused_ops, "use_pdl", lambda device: True)
    taken = [rows for rows in range(1, 300) if fused_ops.triggers_first(cpu, rows)]
    assert taken == list(range(17, 65))
    monkeypatch.setattr(fused_ops, "EARLY_TRIGGER_ROWS", (0, 0))  # what FNVLLM_EARLY_TRIGGER=0 sets
    assert not any(fused_ops.triggers_first(cpu, rows) for rows in range(1, 300))


def _layer_chain(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """Residual add + RMSNorm, gate/up, SiLU-and-mul, down, per layer: the small kernels between projections."""
    residual = torch.zeros_like(x)
    for norm_w, gate_up, down in weights:
        h, residual = fused_ops.fused_add_rmsnorm(x, residual, norm_w, 1e-6)
        x = skinny_gemm.linear(fused_ops.silu_and_mul(skinny_gemm.linear(h, gate_up)), down)
    return x + residual


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [16, 32, 64])
def test_layer_chain_is_bit_equal_with_and_without_the_early_trigger(
    monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    """Eight Qwen3-0.6B-sized MLP layers (hidden 1024, intermediate 3072, bf16): the output with the early trigger
    equals the output without it bit for bit, eager and over CUDA-graph replays (a kernel reading before its wait
    what an earlier kernel writes would show here as a difference)."""
    gen = torch.Generator(device="cuda").manual_seed(rows)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) / shape[-1] ** 0.5

    weights = [(1 + rand(1024), rand(6144, 1024), rand(1024, 3072)) for _ in range(8)]
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    outputs = {}
    for label, trigger_rows in (("off", (0, 0)), ("on", (17, 64))):
        monkeypatch.setattr(fused_ops, "EARLY_TRIGGER_ROWS", trigger_rows)
        eager = _layer_chain(x, weights)
        static_x = x.clone()
        _layer_chain(static_x, weights)  # compiles and warms every kernel outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = _layer_chain(static_x, weights)
        replays = []
        for _ in range(3):
            graph.replay()
            replays.append(static_out.clone())
        torch.cuda.synchronize()
        outputs[label] = (eager, replays)
    reference = outputs["off"][0]
    for label, (eager, replays) in outputs.items():
        assert torch.equal(eager, reference), label
        assert all(torch.equal(r, reference) for r in replays), label
