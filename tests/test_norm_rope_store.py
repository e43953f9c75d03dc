"""The fused attention prologue (q/k RMSNorm + rotary + KV store, ``store_kv.norm_rope_store``) against its torch
reference and against the unfused Triton kernels it replaces, under Triton's interpreter at tiny shapes."""

from __future__ import annotations

import pytest
import torch
from triton_guard import require_triton

DEVICE = require_triton()

from fnvllm.kernels import fp8, fused_ops  # noqa: E402
from fnvllm.kernels.store_kv import norm_rope_store, norm_rope_store_ref, store_kv  # noqa: E402


def make_inputs(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A qkv projection output with strided rows (a wider buffer), norm weights, angles and slots."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    buf = (torch.randn(num_tokens, width + 8, generator=gen) * 3).to(dtype).to(DEVICE)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 6.28
    return {
        "qkv": buf[:, :width],  # row stride width + 8: not contiguous
        "qw": (torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(DEVICE),
        "kw": (torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(DEVICE),
        "cos": angles.cos().to(DEVICE),
        "sin": angles.sin().to(DEVICE),
        "slots": torch.randperm(4 * 16, generator=gen)[:num_tokens].to(DEVICE),
    }


# Compiled for a GPU, two float32 kernels that compute the same formula in different orders of fused multiply-adds
# may differ in the last bits (the interpreter runs numpy: no contraction); 16-bit outputs round that away.
EXACT_FLOAT32 = DEVICE == "cpu"


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-equal, except float32 on a GPU: within a few float32 ulps."""
    if a.dtype == torch.float32 and not EXACT_FLOAT32:
        torch.testing.assert_close(a, b, rtol=4e-6, atol=1e-6)
    else:
        assert torch.equal(a, b)


def assert_same_e4m3(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """The same e4m3 bytes; from float32 values on a GPU (see assert_same) a byte may be the next code."""
    a8, b8 = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    if dtype == torch.float32 and not EXACT_FLOAT32:
        assert (a8 - b8).abs().max() <= 1
    else:
        assert torch.equal(a8, b8)


def caches(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (4 blocks of 16 slots) k and v caches."""
    shape = (4, 16, num_kv_heads, head_dim)
    return torch.zeros(shape, device=DEVICE).to(dtype), torch.zeros(shape, device=DEVICE).to(dtype)


def unfused(
    inp: dict[str, torch.Tensor], hq: int, hkv: int, norm: bool, kv: tuple[torch.Tensor, ...], scales: tuple
) -> torch.Tensor:
    """The three launches the fused kernel replaces: norm_rotary(q), norm_rotary(k), store_kv."""
    qkv = inp["qkv"]
    t, d = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    qw, kw = (inp["qw"], inp["kw"]) if norm else (None, None)
    q = fused_ops.norm_rotary(q.view(t, hq, d), qw, 1e-6, inp["cos"], inp["sin"])
    k = fused_ops.norm_rotary(k.view(t, hkv, d), kw, 1e-6, inp["cos"], inp["sin"])
    store_kv(k, v.view(t, hkv, d), *kv, inp["slots"], *scales)
    return q


def fused(
    inp: dict[str, torch.Tensor], hq: int, hkv: int, norm: bool, kv: tuple[torch.Tensor, ...], scales: tuple, fn=None
) -> torch.Tensor:
    """One call of norm_rope_store (or its reference, fn)."""
    fn = fn or norm_rope_store
    qw, kw = (inp["qw"], inp["kw"]) if norm else (None, None)
    return fn(inp["qkv"], hq, hkv, qw, kw, 1e-6, inp["cos"], inp["sin"], *kv, inp["slots"], *scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2), (6, 2), (3, 3), (8, 1)])
@pytest.mark.parametrize("norm", [True, False])
def test_fused_equals_the_unfused_kernels_bitwise(dtype: torch.dtype, heads: tuple[int, int], norm: bool) -> None:
    """q and both caches are the same bits as norm_rotary(q), norm_rotary(k), store_kv give; odd head counts."""
    hq, hkv = heads
    inp = make_inputs(5, hq, hkv, 16, dtype, seed=hq * 10 + hkv)
    kv_old, kv_new = caches(hkv, 16, dtype), caches(hkv, 16, dtype)
    q_old = unfused(inp, hq, hkv, norm, kv_old, ())
    q_new = fused(inp, hq, hkv, norm, kv_new, ())
    assert_same(q_old, q_new)
    for a, b in zip(kv_old, kv_new, strict=True):
        assert_same(a, b)
    assert kv_new[0].abs().sum() > 0 and kv_new[1].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_the_torch_reference(dtype: torch.dtype) -> None:
    """Against norm_rope_store_ref (torch): q and caches within the dtype's rounding."""
    inp = make_inputs(7, 4, 2, 32, dtype, seed=3)
    kv_ref, kv_new = caches(2, 32, dtype), caches(2, 32, dtype)
    q_ref = fused(inp, 4, 2, True, kv_ref, (), fn=norm_rope_store_ref)
    q_new = fused(inp, 4, 2, True, kv_new, ())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(q_new.float(), q_ref.float(), **tol)
    for a, b in zip(kv_new, kv_ref, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_fp8_store_is_the_unfused_bits(dtype: torch.dtype) -> None:
    """With an FP8 cache the stored e4m3 bytes (per-head scales) equal the unfused store's and are near the
    reference's quantization of the same k and v."""
    inp = make_inputs(6, 4, 2, 16, dtype, seed=5)
    scales = (torch.tensor([0.7, 1.3], device=DEVICE), torch.tensor([1.0, 0.05], device=DEVICE))
    kv_old, kv_new = caches(2, 16, fp8.FP8_DTYPE), caches(2, 16, fp8.FP8_DTYPE)
    q_old = unfused(inp, 4, 2, True, kv_old, scales)
    q_new = fused(inp, 4, 2, True, kv_new, scales)
    assert_same(q_old, q_new)
    for a, b in zip(kv_old, kv_new, strict=True):
        assert_same_e4m3(a, b, dtype)
    assert kv_new[0].view(torch.uint8).any()


def test_bad_arguments_name_the_problem() -> None:
    """A qkv of the wrong width, one norm weight without the other, and missing FP8 scales are ValueErrors."""
    inp = make_inputs(2, 4, 2, 16, torch.float32)
    kv = caches(2, 16, torch.float32)
    with pytest.raises(ValueError, match="qkv must be"):
        norm_rope_store(inp["qkv"][:, :-16], 4, 2, None, None, 1e-6, inp["cos"], inp["sin"], *kv, inp["slots"])
    with pytest.raises(ValueError, match="both"):
        norm_rope_store(inp["qkv"], 4, 2, inp["qw"], None, 1e-6, inp["cos"], inp["sin"], *kv, inp["slots"])
    kv8 = caches(2, 16, fp8.FP8_DTYPE)
    with pytest.raises(ValueError, match="scale"):
        norm_rope_store(inp["qkv"], 4, 2, None, None, 1e-6, inp["cos"], inp["sin"], *kv8, inp["slots"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (8, 1)])
@pytest.mark.parametrize("num_tokens", [1, 5, 17])
@pytest.mark.parametrize("norm", [True, False])
def test_head_grid_equals_token_grid_bitwise(
    dtype: torch.dtype, heads: tuple[int, int], num_tokens: int, norm: bool
) -> None:
    """The "head" grid (one program per token block and head) gives q and caches bit-identical to the "token"
    grid, over token counts that fill, split and overrun its 16-token blocks."""
    hq, hkv = heads
    inp = make_inputs(num_tokens, hq, hkv, 16, dtype, seed=num_tokens + hq)
    kv_old, kv_new = caches(hkv, 16, dtype), caches(hkv, 16, dtype)
    q_old = fused(inp, hq, hkv, norm, kv_old, (), fn=lambda *a: norm_rope_store(*a, grid="token"))
    q_new = fused(inp, hq, hkv, norm, kv_new, (), fn=lambda *a: norm_rope_store(*a, grid="head"))
    assert_same(q_old, q_new)
    for a, b in zip(kv_old, kv_new, strict=True):
        assert_same(a, b)
    assert kv_new[1].abs().sum() > 0


def test_head_grid_fp8_store_is_the_token_grid_bits() -> None:
    """With an FP8 cache and per-head scales the "head" grid stores the same e4m3 bytes as the "token" grid."""
    inp = make_inputs(6, 4, 2, 16, torch.bfloat16, seed=9)
    scales = (torch.tensor([0.7, 1.3], device=DEVICE), torch.tensor([1.0, 0.05], device=DEVICE))
    kv_old, kv_new = caches(2, 16, fp8.FP8_DTYPE), caches(2, 16, fp8.FP8_DTYPE)
    q_old = fused(inp, 4, 2, True, kv_old, scales, fn=lambda *a: norm_rope_store(*a, grid="token"))
    q_new = fused(inp, 4, 2, True, kv_new, scales, fn=lambda *a: norm_rope_store(*a, grid="head"))
    assert torch.equal(q_old, q_new)
    for a, b in zip(kv_old, kv_new, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_unknown_grid_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown grid, given or from FNVLLM_NORM_ROPE_GRID, is a ValueError naming the choices."""
    inp = make_inputs(2, 4, 2, 16, torch.float32)
    kv = caches(2, 16, torch.float32)
    with pytest.raises(ValueError, match="grid must be one of"):
        norm_rope_store(inp["qkv"], 4, 2, None, None, 1e-6, inp["cos"], inp["sin"], *kv, inp["slots"], grid="x")
    monkeypatch.setenv("FNVLLM_NORM_ROPE_GRID", "rows")
    with pytest.raises(ValueError, match="FNVLLM_NORM_ROPE_GRID"):
        norm_rope_store(inp["qkv"], 4, 2, None, None, 1e-6, inp["cos"], inp["sin"], *kv, inp["slots"])


def test_auto_grid_is_the_head_grid_up_to_64_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default grid is "auto": the per-head grid at 1-64 tokens and the per-token grid above;
    FNVLLM_NORM_ROPE_GRID overrides the default."""
    from fnvllm.kernels.store_kv import default_grid, resolve_grid

    monkeypatch.delenv("FNVLLM_NORM_ROPE_GRID", raising=False)
    assert default_grid() == "auto"
    assert [resolve_grid("auto", n) for n in (1, 16, 17, 64, 65)] == ["head", "head", "head", "head", "token"]
    assert resolve_grid("token", 1) == "token" and resolve_grid("head", 64) == "head"
    monkeypatch.setenv("FNVLLM_NORM_ROPE_GRID", "token")
    assert default_grid() == "token"
