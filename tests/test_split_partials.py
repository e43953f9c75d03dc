"""K-split projections that leave their float32 partials for the residual add + RMSNorm after them to sum
(``skinny_gemm.linear_partials``, ``fused_ops.fused_add_rmsnorm`` of ``SplitPartials``): the same bits as the
projection summing them itself, under Triton's CPU interpreter, kernel by kernel and through a whole model."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_fused_layer
import torch
from test_fused_layer import run
from triton_guard import require_triton

DEVICE = require_triton()

from fnvllm.kernels import skinny_gemm  # noqa: E402
from fnvllm.kernels.fused_ops import SplitPartials, fused_add_rmsnorm  # noqa: E402
from fnvllm.kernels.reference import split_partials_sum_ref  # noqa: E402
from fnvllm.kernels.skinny_gemm import (  # noqa: E402
    SkinnyConfig,
    linear_partials,
    skinny_linear,
    skinny_partials,
    sum_split_partials,
)
from fnvllm.model import ModelConfig, load_model  # noqa: E402
from fnvllm.model.ops import ops_for, triton_ops  # noqa: E402
from fnvllm.testing.checkpoints import write_tiny_checkpoint  # noqa: E402


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 x (m, k) and weight (n, k) on the test device."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16).to(DEVICE)
    return x, w


@pytest.mark.parametrize("split", [2, 3, 4])
def test_partials_summed_in_split_order_are_the_fused_reduce_output(split: int) -> None:
    """The partials of a K-split launch, summed in split order and rounded (``sum_split_partials``), are bit for
    bit what the same launch writes when its last program sums them (a K tail and a partial column block
    included), and within one bf16 rounding of the torch reference (the interpreter rounds float32 to bf16
    toward zero, the GPU and torch to nearest)."""
    x, w = _operands(5, 40, 200, split)
    cfg = SkinnyConfig(16, 16, 32, split)
    parts = skinny_partials(x, w, cfg)
    assert parts.parts.shape == (split, 5, 40) and parts.parts.dtype == torch.float32 and parts.dtype == x.dtype
    fused = skinny_linear(x, w, None, cfg)
    assert torch.equal(sum_split_partials(parts), fused)
    assert torch.equal(sum_split_partials(parts), skinny_linear(x, w, None, cfg._replace(fused_reduce=False)))
    ref = split_partials_sum_ref(parts.parts, parts.dtype).float()
    assert torch.allclose(fused.float(), ref, rtol=2**-7, atol=0)


def test_add_rmsnorm_of_partials_is_add_rmsnorm_of_their_sum() -> None:
    """fused_add_rmsnorm sums split partials in its kernel into exactly the x their projection would have written:
    the normed rows and the new residual stream are bit-equal; a residual of another shape is a ValueError."""
    x, w = _operands(6, 48, 96, 7)
    parts = skinny_partials(x, w, SkinnyConfig(16, 16, 32, 3))
    residual = torch.randn(6, 48, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).to(DEVICE)
    norm_w = torch.rand(48, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(DEVICE)
    got = fused_add_rmsnorm(parts, residual, norm_w, 1e-6)
    want = fused_add_rmsnorm(sum_split_partials(parts), residual, norm_w, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="residual"):
        fused_add_rmsnorm(parts, residual[:5], norm_w, 1e-6)


def test_linear_partials_leaves_partials_only_for_a_split_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """Partials come back only where the skinny kernel takes the product with K split and no bias; a bias, one
    split or a product left to cuBLAS gives the plain output (``linear``'s)."""
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda x: True)
    monkeypatch.setattr(skinny_gemm, "prefers_skinny", lambda m, n, k: 0 < m <= 16)
    split = {"k": 2}
    monkeypatch.setattr(skinny_gemm, "skinny_config", lambda m, n, k: SkinnyConfig(16, 16, 32, split["k"]))
    x, w = _operands(4, 32, 128, 3)
    bias = torch.ones(32, dtype=torch.bfloat16, device=DEVICE)
    left = linear_partials(x, w)
    assert isinstance(left, SplitPartials) and left.parts.shape == (2, 4, 32)
    assert torch.equal(sum_split_partials(left), skinny_linear(x, w))
    assert torch.equal(linear_partials(x, w, bias), skinny_linear(x, w, bias))
    split["k"] = 1
    assert isinstance(linear_partials(x, w), torch.Tensor)
    monkeypatch.setattr(skinny_gemm, "prefers_skinny", lambda m, n, k: False)
    split["k"] = 2
    assert isinstance(linear_partials(x, w), torch.Tensor)


def test_split_partials_are_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton ops leave o_proj / down_proj partials for the norm unless FNVLLM_SPLIT_PARTIALS=0."""
    monkeypatch.delenv("FNVLLM_SPLIT_PARTIALS", raising=False)
    assert ops_for("triton").linear_partials is not None and ops_for("torch").linear_partials is None
    monkeypatch.setenv("FNVLLM_SPLIT_PARTIALS", "0")
    assert ops_for("triton").linear_partials is None


# How down_proj's product is reached at <= 16 rows: the SiLU-and-mul in gate/up's epilogue (``norm_mlp``'s GLU
# path), the SiLU-and-mul kernel then the product (``silu_mul_linear`` unfused), or without fused prologues at all
# (``MLP.down``'s own path).
DOWN_PATHS = ("glu", "silu", "plain")
SHORT_CHUNKS = [5, 1, 1]  # a prefill chunk, then decodes (the interpreter's time grows with the rows)


@pytest.mark.parametrize("down_path", DOWN_PATHS)
def test_model_with_split_partials_gives_the_same_logits_bitwise(
    tmp_path: Path, down_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model whose projections take two K splits at <= 16 rows: with the partials summed by their consumers
    (qkv's by the attention prologue, o_proj's by the post-attention norm, down_proj's by the next layer's input
    norm, which with the fused prologues runs inside qkv's load and sums them first), decodes and prefill chunks
    give the logits of the same model summing them in the projections, bit for bit, and all three left partials."""
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda x: True)
    monkeypatch.setattr(skinny_gemm, "prefers_skinny", lambda m, n, k: 0 < m <= 16)
    monkeypatch.setattr(skinny_gemm, "skinny_config", lambda m, n, k: SkinnyConfig(16, 16, 32, 2))
    left = []
    real = skinny_gemm.skinny_partials

    def counted(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig) -> SplitPartials:
        left.append(tuple(w.shape))
        return real(x, w, cfg)

    monkeypatch.setattr(skinny_gemm, "skinny_partials", counted)
    monkeypatch.setattr(test_fused_layer, "CHUNKS", SHORT_CHUNKS)
    path = write_tiny_checkpoint(tmp_path, "qwen3", num_heads=4, num_kv_heads=2, num_layers=2, dtype="bfloat16")
    config = ModelConfig.from_pretrained(path)
    hidden, inter = config.hidden_size, config.intermediate_size
    if down_path == "glu":
        glu = skinny_gemm.Fused(SkinnyConfig(16, 32, 32, 1), 1.0, 2.0)
        monkeypatch.setitem(skinny_gemm.FUSED_TIMES, ("glu", 2 * inter, hidden, 16), glu)
    if down_path == "silu":  # the SiLU-and-mul measured slower inside down_proj's load: its own kernel first
        monkeypatch.setitem(
            skinny_gemm.FUSED_TIMES,
            ("silu", hidden, inter, 16),
            skinny_gemm.Fused(SkinnyConfig(16, 16, 32, 1), 2.0, 1.0),
        )
    prologues = down_path != "plain"
    ours = load_model(path, config, DEVICE, ops=triton_ops(fused_prologues=prologues, split_partials=True))
    base = load_model(path, config, DEVICE, ops=triton_ops(fused_prologues=prologues, split_partials=False))
    tokens = torch.randint(0, config.vocab_size, (sum(SHORT_CHUNKS),), generator=torch.Generator().manual_seed(5)).to(
        DEVICE
    )
    assert torch.equal(run(ours, tokens, False), run(base, tokens, False))
    heads = config.num_attention_heads + 2 * config.num_key_value_heads
    o_shape, qkv_shape = (hidden, config.num_attention_heads * config.head_dim), (heads * config.head_dim, hidden)
    assert o_shape in left and (hidden, inter) in left and qkv_shape in left


@pytest.mark.parametrize("grid", ["head", "token"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_attention_prologue_of_qkv_partials_is_that_of_their_sum(grid: str, cache_dtype: torch.dtype) -> None:
    """norm_rope_store given the qkv projection's split partials writes the q and the K / V cache bytes it writes
    for the projection's own (summed) output: the head grid sums them as it reads, the token grid first."""
    from test_qkv_epilogue import layer_inputs, prologue_args, same_bits

    from fnvllm.kernels.store_kv import norm_rope_store

    hq, hkv, rows = 4, 2, 5
    inp = layer_inputs(rows, hq, hkv, 11, cache_dtype)
    parts = skinny_partials(inp["x"], inp["w"], SkinnyConfig(16, 16, 16, 2))
    summed = skinny_linear(inp["x"], inp["w"], None, SkinnyConfig(16, 16, 16, 2))
    q_sum = norm_rope_store(summed, *prologue_args(inp, hq, hkv, True, 0), grid=grid)
    q_parts = norm_rope_store(parts, *prologue_args(inp, hq, hkv, True, 1), grid=grid)
    assert torch.equal(q_sum, q_parts)
    assert same_bits(inp["caches"][0], inp["caches"][2]) and same_bits(inp["caches"][1], inp["caches"][3])
    assert inp["caches"][3].view(torch.uint8).any()


@pytest.mark.parametrize("rows", [17, 64])
def test_o_proj_takes_its_partials_shape_at_17_to_64_rows(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-0.6B's o_proj (1024 x 2048) at 17-64 rows leaves the four K splits of its ``PARTIALS_CONFIGS`` entry,
    where the plain product keeps one split; the norm after it, summing them, gives what it gives for the same
    launch summing them itself, and the product is the float32 one within bf16 rounding."""
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda x: True)
    entry = skinny_gemm.PARTIALS_CONFIGS[(1024, 2048, 64)].config
    assert skinny_gemm.skinny_config(rows, 1024, 2048).split_k == 1 and entry.split_k == 4
    x, w = _operands(rows, 1024, 2048, 11)
    left = linear_partials(x, w)
    assert isinstance(left, SplitPartials) and left.parts.shape == (4, rows, 1024)
    summed = skinny_linear(x, w, None, skinny_gemm._fit_rows(entry, rows))
    residual = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16).to(DEVICE)
    norm_w = torch.rand(1024, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16).to(DEVICE)
    got, want = fused_add_rmsnorm(left, residual, norm_w, 1e-6), fused_add_rmsnorm(summed, residual, norm_w, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    exact = x.float() @ w.float().t()
    assert (summed.float() - exact).abs().max() <= 2**-7 * exact.abs().max()
