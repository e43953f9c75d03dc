"""The few-row CUDA projections (``fnvllm.kernels.cuda_skinny``): which products they take and, on a GPU, their
results against ``F.linear`` / ``silu_and_mul(F.linear)`` and through the dispatchers and CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fnvllm.kernels import cuda_skinny, skinny_gemm
from fnvllm.kernels.cuda_skinny import CUDA_CONFIGS, CudaConfig, cuda_config
from fnvllm.kernels.fused_ops import SplitPartials, fused_add_rmsnorm, silu_and_mul

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PARTIALS = [key for key in CUDA_CONFIGS if key[0] == "partials"]
GLU = [key for key in CUDA_CONFIGS if key[0] == "glu"]


def _operands(m: int, n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) and weight (N, K) in bf16, seeded by the shape, scaled so the products are O(1)."""
    gen = torch.Generator().manual_seed(m * 7919 + n + k)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, torch.bfloat16)
    return x, w


@pytest.mark.parametrize("key", list(CUDA_CONFIGS))
def test_every_entry_covers_its_k_and_has_a_kernel(key: tuple[str, int, int]) -> None:
    """Each entry's launch shape spans K exactly (split x 8 warps x 32 x kb) and names a kernel of the source."""
    kind, n, k = key
    cfg = CUDA_CONFIGS[key]
    assert cfg.split * cuda_skinny.WARPS * 32 * cfg.kb == k
    assert n % cuda_skinny.COLUMNS == 0
    name = cuda_skinny._KERNELS[(kind, cfg.kb)]
    assert f"void __launch_bounds__(256) {name}(" in cuda_skinny.SOURCE
    assert kind != "glu" or cfg.split == 1


def test_cpu_tensors_never_take_the_cuda_path() -> None:
    """On the CPU every table shape stays on the other path, and linear_partials gives F.linear's product."""
    for kind, n, k in CUDA_CONFIGS:
        x, w = _operands(16, n, k, "cpu")
        assert cuda_config(kind, x, w) is None
    x, w = _operands(16, *PARTIALS[0][1:], "cpu")
    out = skinny_gemm.linear_partials(x, w)
    assert isinstance(out, torch.Tensor) and torch.equal(out, F.linear(x, w))


@pytest.mark.parametrize(("value", "expected"), [("0", False), ("1", True), (None, True)])
def test_switch_reads_zero_and_one(monkeypatch: pytest.MonkeyPatch, value: str | None, expected: bool) -> None:
    """FNVLLM_CUDA_SKINNY: "0" off, "1" or unset on."""
    if value is None:
        monkeypatch.delenv(cuda_skinny.ENV, raising=False)
    else:
        monkeypatch.setenv(cuda_skinny.ENV, value)
    assert cuda_skinny.enabled_from_env() is expected


def test_switch_rejects_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any other value is a ValueError naming the variable."""
    monkeypatch.setenv(cuda_skinny.ENV, "yes")
    with pytest.raises(ValueError, match="FNVLLM_CUDA_SKINNY"):
        cuda_skinny.enabled_from_env()


@pytest.mark.parametrize(("m", "n", "k"), [(17, 4096, 1024), (16, 4010, 1024), (16, 4096, 1000)])
def test_a_shape_the_launch_does_not_cover_is_refused(m: int, n: int, k: int) -> None:
    """More than 16 rows, N not a multiple of 32, or K other than split * 256 * kb: a ValueError saying what fits."""
    with pytest.raises(ValueError, match="M in \\[1, 16\\]"):
        cuda_skinny._check_shape(m, n, k, CudaConfig(2, 2))


@pytest.mark.gpu
@needs_cuda
def test_the_table_shapes_take_the_cuda_path_on_this_gpu() -> None:
    """On an sm_90+ GPU the kernels compile and every entry is taken at 2 and 16 rows, not at 1 or 17."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the kernels need sm_90 (griddepcontrol)")
    for kind, n, k in CUDA_CONFIGS:
        for rows, taken in ((1, False), (2, True), (16, True), (17, False)):
            x, w = _operands(rows, n, k, "cuda")
            assert (cuda_config(kind, x, w) is not None) is taken, (kind, n, k, rows)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("key", PARTIALS)
@pytest.mark.parametrize("m", [2, 5, 16])
def test_split_partials_sum_to_the_product(key: tuple[str, int, int], m: int) -> None:
    """The (S, M, N) float32 partials sum to F.linear's float32 product to float32 rounding."""
    _, n, k = key
    x, w = _operands(m, n, k, "cuda")
    parts = cuda_skinny.skinny_partials(x, w, CUDA_CONFIGS[key])
    assert parts.shape == (CUDA_CONFIGS[key].split, m, n) and parts.dtype == torch.float32
    exact = F.linear(x.float(), w.float())
    torch.testing.assert_close(parts.sum(0), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("key", GLU)
@pytest.mark.parametrize("m", [2, 7, 16])
def test_glu_epilogue_matches_silu_and_mul_of_the_product(key: tuple[str, int, int], m: int) -> None:
    """silu(gate) * up from the products rounded to bf16, as silu_and_mul(F.linear(x, w)): within one bf16
    rounding step (the sums' order differs from cuBLAS's), nearly all elements equal."""
    _, n, k = key
    x, w = _operands(m, n, k, "cuda")
    got = cuda_skinny.glu_out(x, w, CUDA_CONFIGS[key])
    ref = silu_and_mul(F.linear(x, w))
    assert got.shape == (m, n // 2) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=1e-3)
    assert (got == ref).float().mean().item() > 0.98


@pytest.mark.gpu
@needs_cuda
def test_dispatchers_take_it_and_a_graph_replay_gives_the_same_bits() -> None:
    """linear_partials and norm_mlp's gate/up at 16 rows return the CUDA kernels' values, and replaying them in a
    CUDA graph (programmatic dependent launch on) reproduces the eager bits."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the kernels need sm_90 (griddepcontrol)")
    key = PARTIALS[0]
    x, w = _operands(16, *key[1:], "cuda")
    got = skinny_gemm.linear_partials(x, w)
    assert isinstance(got, SplitPartials)
    assert torch.equal(got.parts, cuda_skinny.skinny_partials(x, w, CUDA_CONFIGS[key]))
    gx, gw = _operands(16, *GLU[0][1:], "cuda")
    _, down = _operands(16, gx.shape[1], gw.shape[0] // 2, "cuda")  # (K, I): the MLP's down projection
    residual, norm_w = torch.randn_like(gx), torch.rand(gx.shape[1], device="cuda", dtype=torch.bfloat16) + 0.5
    y, new_residual = skinny_gemm.norm_mlp(gx, residual, norm_w, 1e-6, gw, None, down)
    normed, expected_residual = fused_add_rmsnorm(gx, residual, norm_w, 1e-6)
    act = cuda_skinny.glu_out(normed.contiguous(), gw, CUDA_CONFIGS[GLU[0]])
    assert torch.equal(new_residual, expected_residual) and torch.equal(y, skinny_gemm.linear(act, down))
    eager_parts, eager_glu = got.parts.clone(), cuda_skinny.glu_out(gx, gw, CUDA_CONFIGS[GLU[0]])
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        parts = cuda_skinny.skinny_partials(x, w, CUDA_CONFIGS[key])
        glu = cuda_skinny.glu_out(gx, gw, CUDA_CONFIGS[GLU[0]])
    for _ in range(3):
        parts.zero_()
        glu.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(parts, eager_parts) and torch.equal(glu, eager_glu)


@pytest.mark.gpu
@needs_cuda
def test_first_use_inside_a_graph_capture_keeps_the_triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Modules are not loaded while a stream captures: a first use there gets None (Triton) and builds nothing;
    the next use outside the capture builds the kernels and takes the entry."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the kernels need sm_90 (griddepcontrol)")
    monkeypatch.setattr(cuda_skinny, "_BUILT", {})
    kind, n, k = PARTIALS[0]
    x, w = _operands(16, n, k, "cuda")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        inside = cuda_config(kind, x, w)
    assert inside is None and cuda_skinny._BUILT == {}
    assert cuda_config(kind, x, w) == CUDA_CONFIGS[(kind, n, k)]
