"""The attention prologue in the qkv projection's epilogue (``skinny_gemm`` with a ``QkvEpilogue``,
``norm_linear_rope_store``) against the unfused kernels it replaces (the projection, then ``norm_rope_store``),
bit for bit, under Triton's interpreter at tiny shapes."""

from __future__ import annotations

import pytest
import torch
from triton_guard import require_triton

DEVICE = require_triton()

from fnvllm.kernels import fp8, skinny_gemm  # noqa: E402
from fnvllm.kernels.attention import zeros_kv_cache  # noqa: E402
from fnvllm.kernels.skinny_gemm import (  # noqa: E402
    Norm,
    QkvEpilogue,
    SkinnyConfig,
    norm_linear,
    norm_linear_rope_store,
    skinny_linear,
    split_counters,
)
from fnvllm.kernels.store_kv import norm_rope_store, norm_rope_store_ref  # noqa: E402

HEAD_DIM = 16
HIDDEN = 32
# Configs whose block_n divides HEAD_DIM: CUDA cores (1-row style, weights preloaded), tl.dot, a whole head each.
CONFIGS = (
    SkinnyConfig(16, 8, 32, 1, use_dot=False, num_stages=1, preload=True),
    SkinnyConfig(16, 16, 16, 1),
    SkinnyConfig(16, 4, 32, 1, use_dot=False),
)


def layer_inputs(rows: int, hq: int, hkv: int, seed: int, cache_dtype: torch.dtype) -> dict[str, object]:
    """One layer's inputs: hidden x and residual (rows, HIDDEN), the RMSNorm, a qkv weight and bias, q/k norm
    weights, angles, distinct slots, zeroed caches (4 blocks of 16) and FP8 scales when the cache is FP8."""
    gen = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hkv) * HEAD_DIM

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEVICE)

    angles = torch.rand(rows, HEAD_DIM // 2, generator=gen) * 6.28
    shape = (4, 16, hkv, HEAD_DIM)
    scales = None
    if cache_dtype == fp8.FP8_DTYPE:
        scales = (torch.rand(hkv, generator=gen) + 0.5, torch.rand(hkv, generator=gen) + 0.05)
    return {
        "x": rand(rows, HIDDEN),
        "res": rand(rows, HIDDEN),
        "nw": (torch.rand(HIDDEN, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE),
        "w": rand(width, HIDDEN, scale=0.3),
        "bias": rand(width, scale=0.1),
        "qw": (torch.rand(HEAD_DIM, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE),
        "kw": (torch.rand(HEAD_DIM, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE),
        "cos": angles.cos().to(DEVICE),
        "sin": angles.sin().to(DEVICE),
        "slots": torch.randperm(64, generator=gen)[:rows].to(DEVICE),
        "caches": [torch.zeros(shape, device=DEVICE).to(cache_dtype) for _ in range(4)],  # two (k, v) pairs
        "scales": () if scales is None else tuple(s.to(DEVICE) for s in scales),
    }


def prologue_args(inp: dict, hq: int, hkv: int, norm: bool, pair: int) -> tuple:
    """norm_rope_store's arguments after qkv, with cache pair `pair` (0 or 1) of the inputs."""
    qw, kw = (inp["qw"], inp["kw"]) if norm else (None, None)
    k_cache, v_cache = inp["caches"][2 * pair], inp["caches"][2 * pair + 1]
    return (hq, hkv, qw, kw, 1e-6, inp["cos"], inp["sin"], k_cache, v_cache, inp["slots"], *inp["scales"])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bytes (FP8 caches compared as uint8)."""
    if a.dtype == fp8.FP8_DTYPE:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1)])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, fp8.FP8_DTYPE])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_epilogue_equals_projection_then_norm_rope_store(
    rows: int, heads: tuple[int, int], config: SkinnyConfig, cache_dtype: torch.dtype, layout: str
) -> None:
    """With the RMSNorm prologue and a bias, the fused launch's q, raw qkv and both caches are the bits of the
    same skinny launch without the epilogue followed by norm_rope_store, at 1-16 rows, bf16 and FP8 caches; the
    epilogue's caches in either memory order (``attention.kv_layout``: the same logical bits)."""
    hq, hkv = heads
    inp = layer_inputs(rows, hq, hkv, rows * 7 + hq, cache_dtype)
    if layout == "HND":  # the epilogue's pair head-major
        inp["caches"][2:] = [zeros_kv_cache(4, 16, hkv, HEAD_DIM, cache_dtype, torch.device(DEVICE), "HND")
                             for _ in range(2)]  # fmt: skip
    cfg = config._replace(block_m=16 if config.use_dot else max(1, 1 << (rows - 1).bit_length()))
    res_a, res_b = torch.empty_like(inp["x"]), torch.empty_like(inp["x"])
    qkv = skinny_linear(inp["x"], inp["w"], inp["bias"], cfg, norm=Norm(inp["nw"], 1e-6, inp["res"], res_a))
    q_old = norm_rope_store(qkv, *prologue_args(inp, hq, hkv, True, 0))
    q_new = torch.empty_like(q_old)
    epi = QkvEpilogue(q_new, *prologue_args(inp, hq, hkv, True, 1))
    raw = skinny_linear(
        inp["x"], inp["w"], inp["bias"], cfg, norm=Norm(inp["nw"], 1e-6, inp["res"], res_b), epilogue=epi
    )
    assert torch.equal(raw, qkv) and torch.equal(res_a, res_b)
    assert torch.equal(q_old, q_new)
    assert same_bits(inp["caches"][0], inp["caches"][2]) and same_bits(inp["caches"][1], inp["caches"][3])
    assert inp["caches"][3].view(torch.uint8).any()
    assert not split_counters(torch.device(DEVICE), hq + 2 * hkv)[: hq + 2 * hkv].any()  # reset for the next launch


@pytest.mark.parametrize("norm", [True, False])
def test_epilogue_without_qk_norm_or_input_norm(norm: bool) -> None:
    """Without q/k norm weights (plain rotary, Llama/Qwen2) and with or without the input RMSNorm, the epilogue
    still gives norm_rope_store's bits."""
    inp = layer_inputs(3, 4, 2, 11, torch.bfloat16)
    cfg = CONFIGS[1]
    norm_arg = Norm(inp["nw"], 1e-6) if norm else None
    qkv = skinny_linear(inp["x"], inp["w"], None, cfg, norm=norm_arg)
    q_old = norm_rope_store(qkv, *prologue_args(inp, 4, 2, False, 0))
    q_new = torch.empty_like(q_old)
    skinny_linear(
        inp["x"], inp["w"], None, cfg, norm=norm_arg, epilogue=QkvEpilogue(q_new, *prologue_args(inp, 4, 2, False, 1))
    )
    assert torch.equal(q_old, q_new)
    assert torch.equal(inp["caches"][0], inp["caches"][2]) and torch.equal(inp["caches"][1], inp["caches"][3])


@pytest.mark.parametrize("rows", [1, 4, 16, 17])
@pytest.mark.parametrize("fused_norm", [True, False])
def test_dispatcher_equals_the_unfused_layer_path(rows: int, fused_norm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """norm_linear_rope_store (on the "GPU" path: epilogue at <= 16 rows, the RMSNorm in the load or as its own
    kernel) gives the bits of norm_linear then norm_rope_store, and is within bf16 rounding of the torch reference;
    17 rows take the unfused path."""
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda x: True)
    monkeypatch.setattr(skinny_gemm, "EPILOGUE_MAX_ROWS", 16)  # the kernel at every row count it was built for
    monkeypatch.setattr(skinny_gemm, "prefers_fused", lambda kind, m, n, k: fused_norm and kind == "norm")
    monkeypatch.setattr(skinny_gemm, "prefers_skinny", lambda m, n, k: 0 < m <= 16)
    inp = layer_inputs(rows, 4, 2, rows, torch.bfloat16)
    args = (inp["x"], inp["res"], inp["nw"], 1e-6, inp["w"], inp["bias"])
    qkv, res_old = norm_linear(*args)
    q_old = norm_rope_store(qkv, *prologue_args(inp, 4, 2, True, 0))
    q_new, res_new = norm_linear_rope_store(*args, *prologue_args(inp, 4, 2, True, 1))
    assert torch.equal(q_old, q_new) and torch.equal(res_old, res_new)
    assert torch.equal(inp["caches"][0], inp["caches"][2]) and torch.equal(inp["caches"][1], inp["caches"][3])
    kv_ref = [torch.zeros_like(inp["caches"][0]) for _ in range(2)]
    q_ref = norm_rope_store_ref(qkv, 4, 2, inp["qw"], inp["kw"], 1e-6, inp["cos"], inp["sin"], *kv_ref, inp["slots"])
    torch.testing.assert_close(q_new.float(), q_ref.float(), rtol=2e-2, atol=2e-2)


def test_epilogue_config_needs_one_split_and_whole_heads() -> None:
    """A config that splits K, or whose block_n does not divide the head dim, is refused with a ValueError."""
    inp = layer_inputs(2, 4, 2, 3, torch.bfloat16)
    q = torch.empty(2, 4, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    epi = QkvEpilogue(q, *prologue_args(inp, 4, 2, True, 0))
    for cfg in (SkinnyConfig(16, 16, 16, 2), SkinnyConfig(16, 32, 16, 1)):
        with pytest.raises(ValueError, match="split_k 1, block_n dividing head_dim"):
            skinny_linear(inp["x"], inp["w"], None, cfg, epilogue=epi)
    with pytest.raises(ValueError, match="q must be a contiguous"):
        skinny_linear(inp["x"], inp["w"], None, CONFIGS[1], epilogue=epi._replace(q_out=q[:1]))


def test_epilogue_config_falls_back_when_nothing_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """epilogue_config is None above EPILOGUE_MAX_ROWS and where the product's config splits K; an
    EPILOGUE_CONFIGS entry is used at its rows bucket."""
    monkeypatch.setattr(skinny_gemm, "TUNED_CONFIGS", {})
    assert skinny_gemm.epilogue_config(2, 128, 32, 16, False) is None  # EPILOGUE_MAX_ROWS: verified at 1 row
    monkeypatch.setattr(skinny_gemm, "EPILOGUE_MAX_ROWS", 16)
    assert skinny_gemm.epilogue_config(17, 128, 32, 16, False) is None
    assert skinny_gemm.epilogue_config(1, 128, 4096, 16, False) is None  # deep K: the heuristic splits it
    entry = SkinnyConfig(1, 16, 32, 1, use_dot=False)
    monkeypatch.setitem(skinny_gemm.EPILOGUE_CONFIGS, (128, 4096, 1), entry)
    assert skinny_gemm.epilogue_config(1, 128, 4096, 16, False) == entry


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, fp8.FP8_DTYPE])
def test_real_qwen3_shape_on_gpu_over_graph_replays(rows: int, cache_dtype: torch.dtype) -> None:
    """At the Qwen3-0.6B qkv shape (16 q / 8 kv heads of 128, hidden 1024) the dispatcher's q, residual and caches
    are the unfused path's bits, eagerly and over CUDA-graph replays (the arrival counters reset themselves)."""
    hq, hkv, d, hidden = 16, 8, 128, 1024
    gen = torch.Generator().manual_seed(rows)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).cuda()

    angles = torch.rand(rows, d // 2, generator=gen) * 100
    x, res, nw, w = rand(rows, hidden), rand(rows, hidden), rand(hidden), rand((hq + 2 * hkv) * d, hidden, scale=0.03)
    qw, kw = rand(d) + 1, rand(d) + 1
    slots = torch.randperm(1024, generator=gen)[:rows].cuda()
    scales = (torch.rand(hkv) + 0.5, torch.rand(hkv) + 0.5) if cache_dtype == fp8.FP8_DTYPE else None
    pairs = [[torch.zeros(64, 16, hkv, d, device="cuda").to(cache_dtype) for _ in range(2)] for _ in range(2)]

    def rest(pair: list[torch.Tensor]) -> tuple:
        extra = () if scales is None else tuple(s.cuda() for s in scales)
        return (hq, hkv, qw, kw, 1e-6, angles.cos().cuda(), angles.sin().cuda(), *pair, slots, *extra)

    qkv, res_old = norm_linear(x, res, nw, 1e-6, w, None)
    q_old = norm_rope_store(qkv, *rest(pairs[0]))
    args = rest(pairs[1])  # on the device before the capture (no host-to-device copy may be captured)
    norm_linear_rope_store(x, res, nw, 1e-6, w, None, *args)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_new, res_new = norm_linear_rope_store(x, res, nw, 1e-6, w, None, *args)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(q_old, q_new) and torch.equal(res_old, res_new)
        assert all(same_bits(a, b) for a, b in zip(pairs[0], pairs[1], strict=True))
