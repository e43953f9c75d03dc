"""The fused-MoE Triton kernel and its token alignment against the torch reference: under the interpreter at tiny
and odd sizes (experts with no token, one token, all tokens; one-token steps), with FP8 (e4m3, block-scaled) experts
against the reference on their dequantized weights, on a GPU at Qwen3-30B-A3B sizes and inside a CUDA graph.
Tolerances on ||out - ref|| / ||ref|| as in test_kernels_triton.py."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_guard import require_triton

DEVICE = require_triton()

from fnvllm.kernels import fused_moe as fm  # noqa: E402
from fnvllm.kernels import moe_route  # noqa: E402
from fnvllm.kernels.reference import dequantize_fp8_blocks, fused_moe_all_experts_ref  # noqa: E402
from fnvllm.kernels.reference import route_ref as route  # noqa: E402
from fnvllm.model.quant import quantize_fp8_blocks  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
TINY = fm.MoeKernelConfig(block_m=16, block_n=16, block_k=16, group_m=2)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = 1e-30) -> float:
    """||out - ref|| / max(||ref||, floor) in float64; NaN anywhere in out (an unwritten element) gives inf."""
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(floor)).item()


def problem(
    num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Random x, stacked weights and a softmax top-k routing (weights, ids) on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w_down = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    weights, ids = route(torch.randn(num_tokens, num_experts, generator=gen), top_k, normalize=True)
    tensors = (x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), weights.to(dtype), ids)
    return tuple(t.to(DEVICE) for t in tensors)


def check(args: tuple[torch.Tensor, ...], config: fm.MoeKernelConfig | None = TINY) -> None:
    """fused_moe equals fused_moe_ref on ``args`` (reference in float32 from the same rounded inputs). The norm
    the error is relative to is at least 0.01 per element: a routing whose output nearly cancels (one expert of
    intermediate 1, ||ref|| 3e-3) must not turn float32 rounding (1e-7) into a relative failure."""
    x, w_gate_up, w_down, weights, ids = args
    out = fm.fused_moe(x, w_gate_up, w_down, weights, ids, config)
    ref = fm.fused_moe_ref(x.float(), w_gate_up.float(), w_down.float(), weights.float(), ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, ref, floor=0.01 * math.sqrt(ref.numel())) < TOLERANCE[x.dtype]


@given(
    ids=st.lists(st.lists(st.integers(0, 5), min_size=2, max_size=2, unique=True), min_size=1, max_size=20),
    block_m=st.sampled_from([1, 2, 4, 16]),
)
def test_alignment_groups_every_assignment_once_in_single_expert_blocks(ids: list[list[int]], block_m: int) -> None:
    """Every assignment appears in exactly one slot, each used block holds one expert's assignments only, groups
    are padded to whole blocks and fit the static bound, and blocks past the used ones name no expert."""
    topk_ids = torch.tensor(ids, device=DEVICE)
    n = topk_ids.numel()
    align = fm.align_by_expert_ref(topk_ids, 6, block_m)
    used = int(align.num_slots)
    assert used % block_m == 0 and used <= align.sorted_ids.numel() == fm.max_slots(n, 6, block_m)
    slots = align.sorted_ids.tolist()
    assert sorted(s for s in slots if s < n) == list(range(n))
    assert all(s == n for s in slots[used:])
    flat = topk_ids.reshape(-1).tolist()
    for b, expert in enumerate(align.block_experts.tolist()):
        members = [s for s in slots[b * block_m : (b + 1) * block_m] if s < n]
        if b * block_m >= used:
            assert expert == 6 and not members
        else:
            assert members and all(flat[s] == expert for s in members)


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m", "programs", "scan"),
    [
        (5, 1, 3, 4, 128, None),
        (7, 2, 8, 16, 128, None),
        (1, 8, 128, 16, 128, None),
        (300, 8, 128, 32, 128, None),
        (9, 3, 200, 16, 128, None),
        (100, 8, 128, 16, 128, None),
        (1100, 8, 128, 128, 128, None),
        (300, 8, 128, 32, 3, None),
        (301, 8, 128, 16, 5, None),
        (37, 3, 6, 4, 2, None),
        (5, 1, 3, 4, 128, True),
        (300, 8, 128, 32, 3, True),
        (1100, 8, 128, 128, 1024, None),
        (37, 3, 6, 4, 2, True),
    ],
)
def test_alignment_kernel_equals_torch_path(
    num_tokens: int, top_k: int, num_experts: int, block_m: int, programs: int, scan: bool | None
) -> None:
    """The Triton alignment gives exactly the torch path's slots, block experts and slot count: one chunk, many
    chunks of one tile (800 assignments: 13), chunks of several tiles (8800: 69 chunks of 2; 2400 in 3 chunks of
    13 tiles; 2408 in 5 chunks, the last short), a non-power-of-two expert count; and with the scan launch (asked
    for, or 138 chunks > SCAN_ABOVE)."""
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices.to(DEVICE)
    got = fm.align_by_expert(ids, num_experts, block_m, programs, scan)
    ref = fm.align_by_expert_ref(ids, num_experts, block_m)
    for field in ("sorted_ids", "block_experts", "num_slots"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), field


@pytest.mark.parametrize(("programs", "scan"), [(1, None), (4, None), (128, None), (4, True)])
def test_alignment_kernel_invariants_skewed_routing(programs: int, scan: bool | None) -> None:
    """A skewed routing (expert 0 gets every token, expert 5 one, experts 1-4 and 6 none; 50 tokens, top-2):
    every assignment placed once, stable inside its group, padding slots hold T*K, each used block one expert."""
    ids = torch.zeros(50, 2, dtype=torch.int64)
    ids[:, 1] = 2
    ids[17, 1] = 5
    align = fm.align_by_expert(ids.to(DEVICE), 7, 8, programs, scan)
    slots, n, used = align.sorted_ids.tolist(), 100, int(align.num_slots)
    assert used == 56 + 56 + 8 and all(s == n for s in slots[used:])
    placed = [s for s in slots if s < n]
    assert sorted(placed) == list(range(n))
    groups = {e: [s for s in placed if ids.reshape(-1)[s] == e] for e in (0, 2, 5)}
    assert all(g == sorted(g) for g in groups.values()) and groups[5] == [35]
    assert align.block_experts.tolist()[: used // 8] == [0] * 7 + [2] * 7 + [5]
    assert set(align.block_experts.tolist()[used // 8 :]) <= {7}


def test_align_plan_bounds_the_programs() -> None:
    """An 8192-token prefill of Qwen3-30B-A3B (65,536 assignments, 128 experts) is 1,024 chunks of one tile of 64
    (128 chunks of 8 tiles at 128 programs); a 256-token decode step 32 chunks of one tile; twice the prefill 1,024
    chunks of 2 tiles; programs < 1 is a ValueError naming the field."""
    assert fm.align_plan(65536, 128) == fm.AlignPlan(tile=64, tiles=1, chunks=1024)
    assert fm.align_plan(65536, 128, programs=128) == fm.AlignPlan(tile=64, tiles=8, chunks=128)
    assert fm.align_plan(2048, 128) == fm.AlignPlan(tile=64, tiles=1, chunks=32)
    assert fm.align_plan(131072, 128) == fm.AlignPlan(tile=64, tiles=2, chunks=1024)
    with pytest.raises(ValueError, match="programs"):
        fm.align_plan(10, 4, programs=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_odd_sizes(dtype: torch.dtype) -> None:
    """Hidden 40 and intermediate 24 (not multiples of the tiles), 7 tokens over 8 experts top-2 (some experts
    get no token)."""
    args = problem(7, 40, 24, 8, 2, dtype)
    assert torch.unique(args[4]).numel() < 8
    check(args)


@settings(max_examples=20)
@given(
    num_tokens=st.integers(1, 20),
    hidden=st.integers(1, 80),
    inter=st.integers(1, 40),
    num_experts=st.integers(1, 10),
    data=st.data(),
)
def test_kernel_matches_reference_any_small_shape(
    num_tokens: int, hidden: int, inter: int, num_experts: int, data: st.DataObject
) -> None:
    """Any small shape (one expert, top-k = E, widths below the tile or not multiples of it) computes the
    reference."""
    top_k = data.draw(st.integers(1, min(num_experts, 4)), label="top_k")
    check(problem(num_tokens, hidden, inter, num_experts, top_k, torch.float32, seed=num_tokens))


def test_kernel_one_token_step() -> None:
    """A one-token step (M=1): its top-3 experts each get exactly one assignment."""
    check(problem(1, 32, 16, 6, 3, torch.float32, seed=1))


def test_kernel_all_tokens_on_one_expert() -> None:
    """All 40 tokens routed to expert 3 (top-1): one expert's group spans several blocks, the others are empty."""
    x, w_gate_up, w_down, _, _ = problem(40, 32, 16, 6, 1, torch.float32, seed=2)
    ids = torch.full((40, 1), 3, device=DEVICE)
    weights = torch.rand(40, 1, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    check((x, w_gate_up, w_down, weights, ids))


@pytest.mark.parametrize("config", [fm.SMALL_CONFIG, fm.DECODE_CONFIG, fm.MEDIUM_CONFIG, fm.PREFILL_CONFIG])
def test_kernel_shipped_configs(config: fm.MoeKernelConfig) -> None:
    """Each shipped tile config computes the reference (tiles larger than the tiny problem are masked)."""
    check(problem(9, 48, 40, 4, 2, torch.float32, seed=3), config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("down_block_n", "down_block_k"), [(None, None), (16, 32)])
def test_kernel_tma_path_matches_reference(
    dtype: torch.dtype, down_block_n: int | None, down_block_k: int | None
) -> None:
    """The TMA-descriptor path (weights and slot-ordered activations) computes the reference at sizes that are
    not multiples of the tiles (hidden 40, intermediate 24: descriptor tiles overrun into the next expert's rows),
    with experts that get no token."""
    config = fm.MoeKernelConfig(16, 16, 16, 2, tma=True, down_block_n=down_block_n, down_block_k=down_block_k)
    args = problem(20, 40, 24, 16, 2, dtype, seed=5)  # some experts get no token
    assert fm._tma_ok(config, args[1]) and torch.unique(args[4]).numel() < 16
    check(args, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("persistent", [False, True])
def test_kernel_fused_gate_up_matches_reference(dtype: torch.dtype, persistent: bool) -> None:
    """The fused gate_up variant (one 4-D TMA box per gate and up tile pair, one dot, the accumulator split after)
    computes the reference at sizes that are not multiples of the tiles (intermediate 24 in N tiles of 16: the box
    is zero past I), with experts that get no token."""
    config = fm.MoeKernelConfig(16, 16, 16, 2, tma=True, fused_gate_up=True, persistent=persistent)
    args = problem(20, 40, 24, 16, 2, dtype, seed=5)
    assert fm._tma_ok(config, args[1]) and torch.unique(args[4]).numel() < 16
    check(args, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_atomic_combine_matches_reference(dtype: torch.dtype) -> None:
    """The atomic-combine variant (the down kernel adds into a float32 per-token sum) computes the reference,
    with TMA and without, experts with no token included."""
    for tma in (False, True):
        config = fm.MoeKernelConfig(16, 16, 16, 2, tma=tma, atomic_combine=True)
        check(problem(20, 40, 24, 16, 3, dtype, seed=7), config)


@pytest.mark.parametrize(
    ("tma", "persistent", "down_persistent"),
    [(False, True, None), (True, True, None), (True, False, True), (False, True, False)],
)
def test_kernel_persistent_matches_reference(tma: bool, persistent: bool, down_persistent: bool | None) -> None:
    """The persistent variant (a few programs walking every used tile), in both kernels or in one only, computes
    the reference, with an expert spanning several slot blocks and experts with no token."""
    config = fm.MoeKernelConfig(16, 16, 16, 2, tma=tma, persistent=persistent, down_persistent=down_persistent)
    assert config.down_is_persistent == (persistent if down_persistent is None else down_persistent)
    x, w_gate_up, w_down, _, _ = problem(40, 40, 24, 6, 2, torch.float32, seed=8)
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.full((40,), 3), torch.randint(0, 2, (40,), generator=gen)], dim=1).to(DEVICE)
    weights = torch.rand(40, 2, generator=gen).to(DEVICE)
    check((x, w_gate_up, w_down, weights, ids), config)


@pytest.mark.parametrize(("block", "num_warps"), [(16, 1), (32, 2), (1024, 4)])
def test_combine_sums_each_tokens_rows_in_order(block: int, num_warps: int) -> None:
    """combine() sums the K rows of each token in k order (float32: bit-exact against the sequential sum; hidden
    40: column blocks of 16 and 32 leave a partial last block); a block that is not a power of two >= 16 is a
    ValueError."""
    rows = torch.randn(5, 3, 40, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    assert torch.equal(fm.combine(rows, block, num_warps), rows[:, 0] + rows[:, 1] + rows[:, 2])
    with pytest.raises(ValueError, match="block"):
        fm.combine(rows, 24)


def test_kernel_config_knobs_align_programs_and_combine_block() -> None:
    """Configs with one alignment program or two and the scan launch, a 16-column combine (several column
    blocks), and a persistent down kernel at two programs an SM, compute the reference."""
    args = problem(30, 40, 24, 8, 3, torch.float32, seed=11)
    check(args, attrs.evolve(TINY, align_programs=1, combine_block=16))
    check(args, attrs.evolve(TINY, align_programs=2, align_scan=True, combine_block=32, combine_warps=2))
    check(args, attrs.evolve(TINY, down_persistent=True, programs_per_sm=2))


@pytest.mark.parametrize(
    ("field", "value"),
    [("align_programs", 0), ("combine_block", 24), ("combine_block", 8), ("combine_warps", 3), ("programs_per_sm", 0)],
)
def test_kernel_config_rejects_unusable_settings(field: str, value: int) -> None:
    """An alignment program count < 1, a combine block that is not a power of two >= 16, or an odd warp count is
    a ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        attrs.evolve(TINY, **{field: value})


def test_kernel_tma_falls_back_on_unaligned_rows() -> None:
    """A row stride that is not 16-byte aligned (hidden 6, float32: 24 bytes) takes the pointer path, still exact
    (with down tiles of their own)."""
    config = fm.MoeKernelConfig(16, 16, 16, 2, tma=True, down_block_n=32, down_block_k=32)
    args = problem(5, 6, 8, 4, 2, torch.float32, seed=6)
    assert not fm._tma_ok(config, args[1])
    check(args, config)


def test_pick_config_by_assignments_per_expert() -> None:
    """Qwen3-30B-A3B sizes: a 256-token decode step gets the decode tiles, an 8192-token prefill the large ones."""
    assert fm.pick_config(256, 128, 8) == fm.DECODE_CONFIG
    assert fm.pick_config(1, 128, 8) == fm.SMALL_CONFIG
    assert fm.pick_config(8192, 128, 8) == fm.PREFILL_CONFIG


def test_empty_step_and_bad_arguments() -> None:
    """No tokens gives an empty result; mismatched shapes and dtypes are ValueErrors naming the argument."""
    x, w_gate_up, w_down, weights, ids = problem(3, 32, 16, 4, 2, torch.float32)
    assert fm.fused_moe(x[:0], w_gate_up, w_down, weights[:0], ids[:0]).shape == (0, 32)
    with pytest.raises(ValueError, match="do not fit"):
        fm.fused_moe(x, w_gate_up, w_down[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fm.fused_moe(x, w_gate_up, w_down, weights[:2], ids[:2])
    with pytest.raises(ValueError, match="share a dtype"):
        fm.fused_moe(x.bfloat16(), w_gate_up, w_down, weights, ids)


# ---------------------------------------------------------------------------------------------- FP8 weights


def fp8_problem(
    num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """problem()'s x and routing with e4m3 experts: (x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale,
    w_down_scale). Each expert's stacked gate/up and its down are quantized in 128 x 128 blocks
    (``quantize_fp8_blocks``) from weights whose rows (x 1/4 to 4) and 128-column blocks (the second x 3) differ in
    size, so every block has its own scale and a scale read from the wrong block shows."""
    x, w_gate_up, w_down, weights, ids = problem(num_tokens, hidden, inter, num_experts, top_k, torch.float32, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    quantized = []
    for w in (w_gate_up.cpu(), w_down.cpu()):
        rows = 4.0 ** (2 * torch.rand(*w.shape[:2], 1, generator=gen) - 1)  # (E, N, 1)
        columns = 1.0 + 2.0 * (torch.arange(w.shape[2]) >= 128)  # (K,)
        pairs = [quantize_fp8_blocks(expert) for expert in w * rows * columns]
        quantized.append((torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])))
    (q_gate_up, s_gate_up), (q_down, s_down) = quantized
    tensors = (x.to(dtype), q_gate_up, q_down, weights.to(dtype), ids, s_gate_up, s_down)
    return tuple(t.to(DEVICE) for t in tensors)


def dequantized(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stacked e4m3 experts (E, N, K) with their block scales -> the real weights in ``dtype``, expert by expert."""
    return torch.stack([dequantize_fp8_blocks(q, s, dtype) for q, s in zip(w, scale, strict=True)])


def check_fp8(args: tuple[torch.Tensor, ...], config: fm.MoeKernelConfig | None = TINY) -> None:
    """fused_moe on the e4m3 experts equals fused_moe_ref on their weights dequantized to x's dtype (the rounding the
    kernel's in-register dequantization does), the reference in float32, within ``check``'s tolerance."""
    x, w_gate_up, w_down, weights, ids, s_gate_up, s_down = args
    out = fm.fused_moe(x, w_gate_up, w_down, weights, ids, config, w_gate_up_scale=s_gate_up, w_down_scale=s_down)
    real_gate_up, real_down = dequantized(w_gate_up, s_gate_up, x.dtype), dequantized(w_down, s_down, x.dtype)
    ref = fm.fused_moe_ref(x.float(), real_gate_up.float(), real_down.float(), weights.float(), ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, ref, floor=0.01 * math.sqrt(ref.numel())) < TOLERANCE[x.dtype]


FP8_CONFIGS = {
    "tiny": TINY,
    "k128": fm.MoeKernelConfig(16, 32, 128, 2),  # a K tile is a whole scale block
    "tma": fm.MoeKernelConfig(16, 32, 64, 2, tma=True),
    "tma_fused_persistent": fm.MoeKernelConfig(16, 32, 64, 2, tma=True, fused_gate_up=True, persistent=True),
    "atomic_wide_down": fm.MoeKernelConfig(16, 32, 32, 2, atomic_combine=True, down_block_n=256),  # N over 2 blocks
}


@pytest.mark.parametrize("name", list(FP8_CONFIGS))
def test_fp8_kernel_matches_dequantized_reference(name: str) -> None:
    """e4m3 experts with block scales (hidden 208: two 128-column blocks, the last partial; intermediate 160: the up
    rows start inside a 128-row block, down's K ends on a partial one), float32 activations (exact products: 1e-5),
    through the pointer, TMA, fused gate/up, persistent and atomic paths, experts with no token included."""
    args = fp8_problem(12, 208, 160, 16, 2, torch.float32, seed=4)
    assert torch.unique(args[4]).numel() < 16
    assert fm._tma_ok(FP8_CONFIGS[name], args[1]) == FP8_CONFIGS[name].tma
    check_fp8(args, FP8_CONFIGS[name])


@pytest.mark.parametrize("name", ["tiny", "tma_fused_persistent"])
def test_fp8_kernel_bf16_activations(name: str) -> None:
    """bf16 activations with e4m3 experts: each tile dequantized to bf16 (rounded to nearest, as the reference's
    dequantized weights), hidden 200 (odd K tiles) for the pointer path."""
    hidden = 200 if name == "tiny" else 208
    check_fp8(fp8_problem(9, hidden, 160, 4, 2, torch.bfloat16, seed=5), FP8_CONFIGS[name])


@pytest.mark.parametrize("name", ["tiny", "tma_fused_persistent"])
def test_fp8_kernel_equals_the_16_bit_kernel_on_dequantized_weights(name: str) -> None:
    """With bf16 activations the FP8 kernel's output is bit for bit the bf16 kernel's on the weights dequantized to
    bf16 (``dequantize_fp8_blocks``): each tile is dequantized in float32 and rounded to nearest even, so both dot
    the same bf16 operands in the same order (under the interpreter, whose float32 -> bf16 cast truncates, too)."""
    x, w_gate_up, w_down, weights, ids, s_gate_up, s_down = fp8_problem(9, 208, 160, 4, 2, torch.bfloat16, seed=8)
    config = FP8_CONFIGS[name]
    out = fm.fused_moe(x, w_gate_up, w_down, weights, ids, config, w_gate_up_scale=s_gate_up, w_down_scale=s_down)
    real = (dequantized(w_gate_up, s_gate_up, x.dtype), dequantized(w_down, s_down, x.dtype))
    assert torch.equal(out, fm.fused_moe(x, *real, weights, ids, config))


def test_fp8_shipped_configs() -> None:
    """Each shipped tile config (K tiles of 64 or 128: one scale column a tile) computes the reference on e4m3
    experts."""
    args = fp8_problem(9, 208, 160, 4, 2, torch.float32, seed=6)
    for config in (fm.SMALL_CONFIG, fm.DECODE_CONFIG, fm.MEDIUM_CONFIG, fm.PREFILL_CONFIG):
        check_fp8(args, config)


def test_fp8_reference_dequantizes_the_visited_experts() -> None:
    """fused_moe_ref (and its every-expert form for CUDA graphs) with e4m3 weights and scales is exactly the
    reference on the weights dequantized to x's dtype."""
    x, w_gate_up, w_down, weights, ids, s_gate_up, s_down = fp8_problem(7, 40, 24, 6, 2, torch.bfloat16, seed=7)
    real = (dequantized(w_gate_up, s_gate_up, x.dtype), dequantized(w_down, s_down, x.dtype))
    scales = {"w_gate_up_scale": s_gate_up, "w_down_scale": s_down}
    for reference in (fm.fused_moe_ref, fused_moe_all_experts_ref):
        assert torch.equal(reference(x, w_gate_up, w_down, weights, ids, **scales), reference(x, *real, weights, ids))


def test_fp8_bad_arguments_are_refused() -> None:
    """One scale without the other, a scale of the wrong shape, e4m3 weights without scales and a K tile wider than
    a scale block are ValueErrors naming the argument or field."""
    x, w_gate_up, w_down, weights, ids, s_gate_up, s_down = fp8_problem(3, 40, 24, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="both w_gate_up_scale and w_down_scale"):
        fm.fused_moe(x, w_gate_up, w_down, weights, ids, w_gate_up_scale=s_gate_up)
    with pytest.raises(ValueError, match=r"w_down_scale must be float32 \(4, 1, 1\)"):
        fm.fused_moe(x, w_gate_up, w_down, weights, ids, w_gate_up_scale=s_gate_up, w_down_scale=s_down[:, :, :0])
    with pytest.raises(ValueError, match="share a dtype"):
        fm.fused_moe(x, w_gate_up, w_down, weights, ids)
    with pytest.raises(ValueError, match="block_k to divide 128"):
        config = fm.MoeKernelConfig(16, 16, 256, 2)
        fm.fused_moe(x, w_gate_up, w_down, weights, ids, config, w_gate_up_scale=s_gate_up, w_down_scale=s_down)


def test_route_matches_transformers_router() -> None:
    """route() picks the same experts and weights as transformers' Qwen3MoeTopKRouter, normalised or not."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(4))
    for normalize in (True, False):
        cfg = Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=normalize)
        router = Qwen3MoeTopKRouter(cfg)
        torch.nn.init.normal_(router.weight, std=0.3)
        _, hf_weights, hf_ids = router(x)
        weights, ids = route(x @ router.weight.T, 3, normalize)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights)


@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 2), (6, 1), (5, 5), (128, 8), (100, 3)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_kernel_matches_reference(num_experts: int, top_k: int, normalize: bool, dtype: torch.dtype) -> None:
    """The one-kernel router picks the reference's experts, best first, with its weights (non-power-of-two
    expert counts, k = 1 and k = E). Experts whose bf16 logits tie may come in either order: the picked logits,
    best first, must be the reference's, and with no tie the ids themselves."""
    logits = torch.randn(13, num_experts, generator=torch.Generator().manual_seed(num_experts)).to(dtype).to(DEVICE)
    weights, ids = moe_route.route(logits, top_k, normalize)
    ref_weights, ref_ids = moe_route.route_ref(logits, top_k, normalize)
    assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids)) and weights.dtype == dtype
    untied = torch.tensor([row.unique().numel() == row.numel() for row in logits], device=logits.device)
    assert torch.equal(ids[untied], ref_ids[untied])
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


def test_route_kernel_worked_example() -> None:
    """logits [0, ln 3, ln 2, 0], k=2: ids [1, 2], weights [3/7, 2/7], normalised [0.6, 0.4]."""
    logits = torch.tensor([[0.0, math.log(3), math.log(2), 0.0]], device=DEVICE)
    weights, ids = moe_route.route(logits, 2, normalize=False)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.tensor([[3 / 7, 2 / 7]], device=DEVICE))
    torch.testing.assert_close(moe_route.route(logits, 2, normalize=True)[0], torch.tensor([[0.6, 0.4]], device=DEVICE))
    with pytest.raises(ValueError, match="top_k"):
        moe_route.route(logits, 5, normalize=True)


# ---------------------------------------------------------------------------------------------- GPU, real sizes


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_gpu_qwen3_30b_a3b_sizes(num_tokens: int) -> None:
    """Hidden 2048, 128 experts of intermediate 768, top-8, bf16, with the config pick_config chooses."""
    check(problem(num_tokens, 2048, 768, 128, 8, torch.bfloat16), None)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        fm.MoeKernelConfig(128, 128, 64, 8, 8, 3, tma=True),
        fm.MoeKernelConfig(128, 128, 64, 8, 8, 3, tma=True, persistent=True),
        fm.MoeKernelConfig(128, 128, 64, 8, 8, 3, tma=True, atomic_combine=True),
        fm.MoeKernelConfig(128, 128, 64, 4, 8, 3, tma=True, fused_gate_up=True, down_persistent=True),
        fm.MoeKernelConfig(128, 128, 64, 4, 8, 3, tma=True, align_programs=1024, align_scan=True, combine_block=2048),
        fm.MoeKernelConfig(64, 128, 64, 8, 4, 4, tma=True, down_block_n=128, down_num_stages=3),
    ],
)
def test_gpu_variants_at_qwen3_30b_a3b_sizes(config: fm.MoeKernelConfig) -> None:
    """The TMA, persistent and atomic-combine variants compile on the GPU and compute the reference at real sizes
    (2048 tokens, bf16)."""
    check(problem(2048, 2048, 768, 128, 8, torch.bfloat16), config)


@gpu
@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_routing() -> None:
    """The kernel captures in a CUDA graph (no host sync) and replays correctly after x and the routing change."""
    x, w_gate_up, w_down, weights, ids = problem(64, 256, 128, 16, 4, torch.bfloat16)
    fm.fused_moe(x, w_gate_up, w_down, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(x, w_gate_up, w_down, weights, ids)
    new = problem(64, 256, 128, 16, 4, torch.bfloat16, seed=9)
    for dest, src in ((x, new[0]), (weights, new[3]), (ids, new[4])):
        dest.copy_(src)
    graph.replay()
    ref = fm.fused_moe_ref(x.float(), w_gate_up.float(), w_down.float(), weights.float(), ids)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 4096])
def test_gpu_fp8_qwen3_30b_a3b_sizes(num_tokens: int) -> None:
    """e4m3 experts of Qwen3-30B-A3B's sizes (hidden 2048, 128 experts of intermediate 768, top-8), bf16
    activations, with the config pick_config chooses (PREFILL_CONFIG's TMA and fused gate/up at 4096 tokens)."""
    check_fp8(fp8_problem(num_tokens, 2048, 768, 128, 8, torch.bfloat16), None)


@gpu
@pytest.mark.gpu
def test_gpu_fp8_cuda_graph_replay_with_new_routing() -> None:
    """The FP8 kernels capture in a CUDA graph and replay correctly after x and the routing change."""
    x, w_gate_up, w_down, weights, ids, s_gate_up, s_down = fp8_problem(64, 256, 128, 16, 4, torch.bfloat16)
    scales = {"w_gate_up_scale": s_gate_up, "w_down_scale": s_down}
    fm.fused_moe(x, w_gate_up, w_down, weights, ids, **scales)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(x, w_gate_up, w_down, weights, ids, **scales)
    new = fp8_problem(64, 256, 128, 16, 4, torch.bfloat16, seed=9)
    for dest, src in ((x, new[0]), (weights, new[3]), (ids, new[4])):
        dest.copy_(src)
    graph.replay()
    real = (dequantized(w_gate_up, s_gate_up, x.dtype).float(), dequantized(w_down, s_down, x.dtype).float())
    assert rel_err(out, fm.fused_moe_ref(x.float(), *real, weights.float(), ids)) < TOLERANCE[torch.bfloat16]


@gpu
@pytest.mark.gpu
def test_gpu_route_kernel_real_sizes() -> None:
    """The router kernel at a 256-token decode step of Qwen3-30B-A3B (128 experts, top-8, bf16 logits)."""
    logits = torch.randn(256, 128, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = moe_route.route(logits, 8, normalize=True)
    ref_weights, ref_ids = moe_route.route_ref(logits, 8, normalize=True)
    # bf16 logits of 128 experts tie often (4 % of picks here): tied experts may come in either order, and a tie at
    # the k-th place may pick either expert. The picked logits, best first, are the reference's exactly.
    assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids))
    torch.testing.assert_close(weights.sort(dim=-1).values, ref_weights.sort(dim=-1).values, rtol=1e-2, atol=1e-3)


@gpu
@pytest.mark.gpu
def test_gpu_reference_captures_in_a_cuda_graph() -> None:
    """fused_moe_ref (model_ops "torch" on a GPU) can be captured: it switches to every expert on every token."""
    x, w_gate_up, w_down, weights, ids = problem(16, 64, 32, 8, 2, torch.float32)
    expected = fm.fused_moe_ref(x, w_gate_up, w_down, weights, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe_ref(x, w_gate_up, w_down, weights, ids)
    graph.replay()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
