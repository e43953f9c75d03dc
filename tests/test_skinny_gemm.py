"""The skinny (few-row) GEMM kernel against its reference, ``F.linear``, under Triton's CPU interpreter at tiny
shapes, and at the real decode shapes on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fnvllm.kernels import skinny_gemm
from fnvllm.kernels.fused_ops import fused_add_rmsnorm, rmsnorm, rmsnorm_ref, silu_and_mul
from fnvllm.kernels.skinny_gemm import (
    FUSED_TIMES,
    TUNED_CONFIGS,
    Fused,
    Norm,
    SkinnyConfig,
    Tuned,
    fused_config,
    linear,
    norm_linear,
    prefers_fused,
    prefers_skinny,
    silu_mul_linear,
    skinny_config,
    skinny_linear,
    split_counters,
    tuned_config,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (M, N, K): one row, odd sizes that leave partial column blocks and K tails, a full 16-row block.
SHAPES = ((1, 48, 40), (3, 100, 300), (16, 64, 256), (5, 33, 520))
CONFIGS = (
    None,
    SkinnyConfig(16, 16, 32, 4),
    SkinnyConfig(16, 16, 64, 1),
    SkinnyConfig(16, 32, 16, 2),
    SkinnyConfig(16, 16, 32, 4, fused_reduce=False),  # the separate sum kernel
    SkinnyConfig(16, 16, 32, 3, use_dot=False),  # CUDA cores, an odd split
    SkinnyConfig(16, 8, 64, 1, use_dot=False),
    SkinnyConfig(16, 16, 32, 3, num_stages=1, preload=True),  # weights a tile ahead in registers, odd split
    SkinnyConfig(16, 8, 512, 1, use_dot=False, num_stages=1, preload=True),  # one tile per program
)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_matches_f_linear(shape: tuple[int, int, int], config: SkinnyConfig | None, with_bias: bool) -> None:
    """In float32 (exact "ieee" dot) every launch shape gives F.linear's product to rounding, bias included."""
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    b = torch.randn(n, generator=gen).to(DEVICE) if with_bias else None
    got = skinny_linear(x, w, b, config)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES)
def test_bfloat16_within_rounding_of_f_linear(shape: tuple[int, int, int]) -> None:
    """In bf16 the kernel (float32 accumulation, one rounding) agrees with F.linear to bf16 rounding."""
    m, n, k = shape
    gen = torch.Generator().manual_seed(7 + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, torch.bfloat16)
    exact = F.linear(x.float(), w.float())
    got = skinny_linear(x, w, config=SkinnyConfig(16, 16, 32, 2)).float()
    assert (got - exact).abs().max().item() <= 2 * exact.abs().max().item() * 2**-8


def test_split_partials_are_summed_in_a_fixed_order() -> None:
    """Two calls with split K give bit-identical results (the partials are reduced deterministically)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 256, generator=gen).to(DEVICE)
    w = torch.randn(40, 256, generator=gen).to(DEVICE)
    cfg = SkinnyConfig(16, 16, 32, 4)
    assert torch.equal(skinny_linear(x, w, config=cfg), skinny_linear(x, w, config=cfg))


def test_weight_prefetch_is_off_without_pdl() -> None:
    """The L2 prefetch (inline PTX) is only asked for under programmatic dependent launch on a GPU: never here."""
    assert not skinny_gemm.prefetch_weights(torch.device("cpu"))


def test_fused_and_separate_split_reduce_agree_bitwise_and_reset_counters() -> None:
    """The in-kernel split-K reduce equals the separate sum kernel bit for bit, and leaves every counter at 0."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 200, generator=gen).to(DEVICE)
    w = torch.randn(70, 200, generator=gen).to(DEVICE)
    b = torch.randn(70, generator=gen).to(DEVICE)
    fused = skinny_linear(x, w, b, SkinnyConfig(16, 16, 32, 4))
    separate = skinny_linear(x, w, b, SkinnyConfig(16, 16, 32, 4, fused_reduce=False))
    assert torch.equal(fused, separate)
    assert int(split_counters(x.device, 5).abs().sum()) == 0


def test_cuda_core_variant_takes_unpadded_rows() -> None:
    """use_dot=False runs with block_m = 1 (no padding to 16 rows) and matches F.linear in float32."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(1, 96, generator=gen).to(DEVICE)
    w = torch.randn(20, 96, generator=gen).to(DEVICE)
    got = skinny_linear(x, w, None, SkinnyConfig(1, 8, 32, 2, use_dot=False))
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="block_m"):
        skinny_linear(x, w, None, SkinnyConfig(1, 8, 32, 2, use_dot=True))


PRELOAD_ONE_TILE = SkinnyConfig(4, 8, 128, 1, use_dot=False, num_stages=1, preload=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "config", [SkinnyConfig(16, 16, 32, 4), SkinnyConfig(4, 8, 64, 1, use_dot=False), PRELOAD_ONE_TILE]
)
def test_glu_prologue_equals_silu_and_mul_then_the_kernel(dtype: torch.dtype, config: SkinnyConfig) -> None:
    """glu=True (SiLU-and-mul on load) gives the same bits as fused_ops.silu_and_mul followed by the kernel."""
    gen = torch.Generator().manual_seed(13)
    x = (torch.randn(3, 2 * 96, generator=gen) * 2).to(DEVICE, dtype)
    w = (torch.randn(40, 96, generator=gen) / 10).to(DEVICE, dtype)
    b = torch.randn(40, generator=gen).to(DEVICE, dtype)
    fused = skinny_linear(x, w, b, config, glu=True)
    assert torch.equal(fused, skinny_linear(silu_and_mul(x), w, b, config))
    with pytest.raises(ValueError, match="glu"):
        skinny_linear(x[:, :-2], w, b, config, glu=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(
    "config",
    [
        SkinnyConfig(16, 16, 32, 4),
        SkinnyConfig(4, 8, 64, 1, use_dot=False),
        PRELOAD_ONE_TILE,
        SkinnyConfig(16, 16, 32, 1, late_norm=True),  # three K steps, three column blocks: the scale at the end
        SkinnyConfig(4, 8, 64, 1, use_dot=False, late_norm=True),
        PRELOAD_ONE_TILE._replace(late_norm=True),
    ],
)
def test_norm_prologue_equals_add_rmsnorm_then_the_kernel(
    dtype: torch.dtype, with_residual: bool, config: SkinnyConfig
) -> None:
    """norm= (residual add + RMSNorm on load) gives fused_add_rmsnorm followed by the kernel (to one rounding of
    the statistics), and writes x + residual exactly."""
    gen = torch.Generator().manual_seed(15)
    x = (torch.randn(3, 96, generator=gen) * 2).to(DEVICE, dtype)
    res = (torch.randn(3, 96, generator=gen) * 2).to(DEVICE, dtype) if with_residual else None
    nw = (torch.rand(96, generator=gen) + 0.5).to(DEVICE, dtype)
    w = (torch.randn(40, 96, generator=gen) / 10).to(DEVICE, dtype)
    res_out = torch.full_like(x, float("nan")) if with_residual else None
    got = skinny_linear(x, w, None, config, norm=Norm(nw, 1e-6, res, res_out))
    if with_residual:
        normed, expect_res = fused_add_rmsnorm(x, res, nw, 1e-6)
        assert torch.equal(res_out, expect_res)
    else:
        normed = rmsnorm(x, nw, 1e-6)
    want = skinny_linear(normed, w, None, config)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)
    with pytest.raises(ValueError, match="both"):
        skinny_linear(x, w, None, config, norm=Norm(nw, 1e-6, x, None))


def test_late_norm_needs_one_split() -> None:
    """A late norm (the row scale at the end) with split-K is a ValueError naming split_k: a split's partial
    would see only part of the rows' sums of squares."""
    x = torch.randn(3, 96).to(DEVICE, torch.bfloat16)
    w = torch.randn(40, 96).to(DEVICE, torch.bfloat16)
    nw = torch.ones(96).to(DEVICE, torch.bfloat16)
    with pytest.raises(ValueError, match="split_k"):
        skinny_linear(x, w, None, SkinnyConfig(16, 16, 32, 2, late_norm=True), norm=Norm(nw, 1e-6))


def test_norm_statistics_in_narrow_steps_match_one_wide_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The norm prologue's row statistics give the same bits whether read in one wide step or in 16-column steps
    (a ragged last step included)."""
    gen = torch.Generator().manual_seed(17)
    x, res = (torch.randn(3, 200, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    nw = (torch.rand(200, generator=gen) + 0.5).to(DEVICE, torch.bfloat16)
    w = (torch.randn(24, 200, generator=gen) / 10).to(DEVICE, torch.bfloat16)
    cfg = SkinnyConfig(16, 8, 64, 2)
    wide = skinny_linear(x, w, None, cfg, norm=Norm(nw, 1e-6, res, torch.empty_like(x)))
    monkeypatch.setattr(skinny_gemm, "_NORM_ELEMENTS", 256)  # 16 rows x 16 columns a step: 13 steps
    narrow_res = torch.empty_like(x)
    narrow = skinny_linear(x, w, None, cfg, norm=Norm(nw, 1e-6, res, narrow_res))
    torch.testing.assert_close(narrow.float(), wide.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(narrow_res, x + res)


def test_norm_linear_off_gpu_is_add_rmsnorm_then_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the GPU dispatch (``on_gpu`` false) ``norm_linear`` is fused_add_rmsnorm (rmsnorm without a residual)
    then F.linear."""
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda x: False)  # (the norm kernels still run where x lives)
    gen = torch.Generator().manual_seed(16)
    x, res = torch.randn(2, 32, generator=gen).to(DEVICE), torch.randn(2, 32, generator=gen).to(DEVICE)
    nw, w = (torch.rand(32, generator=gen) + 0.5).to(DEVICE), torch.randn(24, 32, generator=gen).to(DEVICE)
    y, new_res = norm_linear(x, res, nw, 1e-6, w)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(y, F.linear(rmsnorm_ref(x + res, nw, 1e-6), w), rtol=1e-5, atol=1e-5)
    y0, same = norm_linear(x, None, nw, 1e-6, w)
    assert same is x
    torch.testing.assert_close(y0, F.linear(rmsnorm_ref(x, nw, 1e-6), w), rtol=1e-5, atol=1e-5)


def test_silu_mul_linear_off_gpu_is_activation_then_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the GPU dispatch (``on_gpu`` false) ``silu_mul_linear`` is silu_and_mul then F.linear (leading dims
    kept)."""
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda x: False)
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(2, 3, 64, generator=gen).to(DEVICE)
    w = torch.randn(24, 32, generator=gen).to(DEVICE)
    got = silu_mul_linear(x, w, None)
    assert got.shape == (2, 3, 24)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.linear(F.silu(gate) * up, w), rtol=1e-5, atol=1e-5)


def test_tuned_table_serves_its_row_bucket_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry for the 16-row bucket serves 2..16 rows (rows padded), neither 1 row nor 17; it makes the product
    skinny there and only there."""
    monkeypatch.setitem(TUNED_CONFIGS, (40, 64, 16), Tuned(SkinnyConfig(16, 8, 32, 2), 4.0, 5.0))
    assert tuned_config(3, 40, 64) == SkinnyConfig(16, 8, 32, 2)
    assert tuned_config(1, 40, 64) is None and tuned_config(17, 40, 64) is None and tuned_config(3, 40, 80) is None
    assert prefers_skinny(3, 40, 64) and not prefers_skinny(1, 40, 64) and not prefers_skinny(17, 40, 64)
    monkeypatch.setitem(TUNED_CONFIGS, (40, 64, 1), Tuned(SkinnyConfig(1, 8, 32, 2, use_dot=False), 6.0, 5.0))
    assert tuned_config(1, 40, 64) == SkinnyConfig(1, 8, 32, 2, use_dot=False)
    assert not prefers_skinny(1, 40, 64)  # measured slower than cuBLAS: kept there


def test_fused_table_decides_where_it_has_an_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A FUSED_TIMES entry fuses its kind only where it measured faster than the two launches, with its own
    config (block_m fitted to the rows); without one the plain tuned config serves."""
    monkeypatch.setitem(TUNED_CONFIGS, (40, 64, 1), Tuned(SkinnyConfig(1, 8, 32, 2, use_dot=False), 6.0, 5.0))
    fused_cfg = SkinnyConfig(1, 8, 64, 1, 4, 1, use_dot=False, preload=True)
    monkeypatch.setitem(FUSED_TIMES, ("norm", 40, 64, 1), Fused(fused_cfg, 3.0, 6.5))
    monkeypatch.setitem(FUSED_TIMES, ("silu", 40, 64, 1), Fused(fused_cfg, 7.0, 6.5))
    assert prefers_fused("norm", 1, 40, 64) and not prefers_fused("silu", 1, 40, 64)
    assert fused_config("norm", 1, 40, 64) == fused_cfg
    assert fused_config("silu", 3, 40, 64) is None  # no 16-row entry of either table
    monkeypatch.setitem(TUNED_CONFIGS, (40, 64, 16), Tuned(SkinnyConfig(16, 8, 32, 2), 6.0, 5.0))
    assert fused_config("norm", 3, 40, 64) == SkinnyConfig(16, 8, 32, 2)
    with pytest.raises(ValueError, match="kind"):
        prefers_fused("gelu", 1, 40, 64)


def test_late_norm_config_is_the_tuned_one_with_one_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """A late norm takes the plain product's measured config (late_norm set) inside LATE_NORM_ROWS, and only
    where that config has one K split; outside the rows, without an entry, or with split-K, None."""
    monkeypatch.setattr(skinny_gemm, "LATE_NORM_ROWS", (2, 64))
    monkeypatch.setitem(TUNED_CONFIGS, (40, 64, 16), Tuned(SkinnyConfig(16, 8, 32, 1), 4.0, 5.0))
    monkeypatch.setitem(TUNED_CONFIGS, (40, 64, 1), Tuned(SkinnyConfig(1, 8, 64, 1, use_dot=False), 3.0, 5.0))
    monkeypatch.setitem(TUNED_CONFIGS, (40, 64, 64), Tuned(SkinnyConfig(64, 8, 32, 2), 4.0, 5.0))
    assert skinny_gemm.late_norm_config(3, 40, 64) == SkinnyConfig(16, 8, 32, 1, late_norm=True)
    assert skinny_gemm.late_norm_config(1, 40, 64) is None  # below the rows
    assert skinny_gemm.late_norm_config(40, 40, 64) is None  # split-K
    assert skinny_gemm.late_norm_config(3, 48, 64) is None  # no entry
    monkeypatch.setattr(skinny_gemm, "LATE_NORM_ROWS", (0, 0))
    assert skinny_gemm.late_norm_config(3, 40, 64) is None  # off


def test_shipped_tables_decide_by_their_measured_times() -> None:
    """Every shipped TUNED_CONFIGS entry sends its plain product to the kernel exactly where it measured faster than
    cuBLAS, at every row count of its bucket, with a launchable config; every FUSED_TIMES entry fuses exactly where
    the one launch measured faster than the two (prologues up to NORM_MAX_ROWS rows, the GLU epilogue up to 64)."""
    for (n, k, bucket), tuned in TUNED_CONFIGS.items():
        lowest = 1 + max((r for r in skinny_gemm.MEASURED_ROWS if r < bucket), default=0)
        for m in {lowest, bucket}:
            assert prefers_skinny(m, n, k) == (tuned.skinny_us < tuned.cublas_us), (n, k, m)
            cfg = tuned_config(m, n, k)
            assert cfg is not None and cfg.block_m >= m and cfg.split_k >= 1 and cfg.block_k >= 16
    for (kind, n, k, bucket), fused in FUSED_TIMES.items():
        assert bucket <= skinny_gemm.NORM_MAX_ROWS or kind == "glu"  # the GLU epilogue goes up to 64 rows
        assert prefers_fused(kind, bucket, n, k) == (fused.fused_us < fused.unfused_us), (kind, n, k, bucket)
        assert fused_config(kind, bucket, n, k).block_m >= bucket


def test_dispatch_picks_narrow_deep_products_at_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without table entries, the rule: few rows, N <= 2048 and K >= 2N (Qwen3-0.6B's o_proj and down_proj),
    nothing else."""
    monkeypatch.setattr(skinny_gemm, "TUNED_CONFIGS", {})
    assert prefers_skinny(1, 1024, 2048) and prefers_skinny(16, 1024, 3072)
    assert not prefers_skinny(17, 1024, 2048)  # too many rows
    assert not prefers_skinny(1, 4096, 1024)  # wide and shallow: cuBLAS
    assert not prefers_skinny(1, 4096, 12288)  # too wide
    assert not prefers_skinny(0, 1024, 2048)


def test_linear_keeps_leading_dims_and_falls_back_for_many_rows() -> None:
    """``linear`` takes (..., K) inputs; on a CPU, or above SKINNY_MAX_ROWS rows, it is F.linear exactly."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 32, generator=gen).to(DEVICE)
    w = torch.randn(24, 32, generator=gen).to(DEVICE)
    got = linear(x, w, None)
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)
    many = torch.randn(40, 32, generator=gen).to(DEVICE)
    assert torch.equal(linear(many, w, None), F.linear(many, w))


def test_bad_shapes_name_the_problem() -> None:
    """Mismatched features and too many rows are ValueErrors that say what is wrong."""
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="features"):
        skinny_linear(torch.zeros(1, 12, device=DEVICE), w)
    with pytest.raises(ValueError, match="at most 64 rows"):
        skinny_linear(torch.zeros(65, 16, device=DEVICE), w)


def test_config_fills_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The heuristic launch (shapes without a measured config) has about two programs per SM or more."""
    monkeypatch.setattr(skinny_gemm, "TUNED_CONFIGS", {})
    for n, k in ((6144, 4096), (4096, 12288), (2048, 512)):
        cfg = skinny_config.__wrapped__(1, n, k)  # uncached: the table is empty here
        programs = -(-n // cfg.block_n) * cfg.split_k
        assert programs >= 256, (n, k, cfg)
        assert k // cfg.split_k >= cfg.block_k  # every split has work


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 2, 7, 16])
def test_real_decode_shapes_on_gpu(m: int) -> None:
    """At the Qwen3-0.6B projections in bf16, the kernel matches F.linear to bf16 rounding."""
    for n, k in ((1024, 2048), (1024, 3072)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        exact = F.linear(x.float(), w.float())
        got = linear(x, w, None).float()
        assert (got - exact).abs().max().item() <= 2 * exact.abs().max().item() * 2**-8


def three_launches(
    x: torch.Tensor, gate_up: torch.Tensor, w: torch.Tensor, norm: Norm, cfg: SkinnyConfig
) -> list[torch.Tensor]:
    """The plain, GLU and norm-prologue skinny launches of one weight."""
    return [
        skinny_linear(x, w, None, cfg),
        skinny_linear(gate_up, w, None, cfg, glu=True),
        skinny_linear(x, w, None, cfg, norm=norm),
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "m,cfg",
    [
        (1, SkinnyConfig(16, 16, 128, 4)),
        (16, SkinnyConfig(16, 16, 128, 4)),
        (1, SkinnyConfig(1, 8, 1024, 4, 4, 1, use_dot=False, preload=True)),  # weights read before the PDL wait
        (16, SkinnyConfig(16, 32, 256, 2, 4, 1, preload=True)),
    ],
)
def test_gpu_in_kernel_reduce_is_exact_over_graph_replays(m: int, cfg: SkinnyConfig) -> None:
    """At Qwen3-0.6B's four projections (norm and SiLU prologues included), 20 CUDA-graph replays of split-K
    launches with the in-kernel reduce, weights loaded ahead or not, give the eager result bit for bit (no lost or
    early partials), and that result is F.linear's to bf16 rounding."""
    for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        norm = Norm(torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-6, torch.randn_like(x), x * 0)
        gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        eager = [t.clone() for t in three_launches(x, gate_up, w, norm, cfg)]
        exact = F.linear(x.float(), w.float())
        assert (eager[0].float() - exact).abs().max().item() <= 2 * exact.abs().max().item() * 2**-8
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = three_launches(x, gate_up, w, norm, cfg)
        for _ in range(20):
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(static, eager, strict=True))
        assert int(split_counters(x.device, 1024).abs().sum()) == 0
