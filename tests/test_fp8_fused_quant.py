"""FP8 activations quantized by the kernel that writes them (issue 20): the RMSNorm, add + RMSNorm and SiLU-and-mul
producers (``fused_ops.*_quant``) give exactly ``quantize_activations`` of the unfused op's output, ``fp8_linear``
takes them in place of x, the switch and the routing rules, and on a GPU the model's greedy tokens with the switch
on equal those with it off (eager and CUDA graphs). Kernels run under Triton's CPU interpreter at tiny shapes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from fnvllm.kernels import fp8_gemm as g
from fnvllm.kernels import fused_ops as f
from fnvllm.model.ops import triton_ops
from fnvllm.model.quant import linear_forward, quantize_fp8_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The model-level tests below load the model on the CPU, so the producers' Triton kernels get CPU tensors: they run
# only under the interpreter (tests/conftest.py sets it where there is no GPU; a GPU host runs the GPU tests instead).
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs Triton kernels on CPU tensors: needs TRITON_INTERPRET=1"
)


def _x(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.bfloat16, spread: float = 4.0) -> torch.Tensor:
    """Random (rows, cols) activations whose columns differ in magnitude (so the 128-column scales differ)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.rand(1, cols, generator=gen) * spread
    return x.to(DEVICE, dtype)


def _norm_weight(cols: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An RMSNorm weight (cols,) around 1."""
    return (1 + 0.5 * torch.randn(cols, generator=torch.Generator().manual_seed(7))).to(DEVICE, dtype)


def _assert_same_quantization(acts: f.Fp8Activations, y: torch.Tensor) -> None:
    """acts equal quantize_activations(y): the e4m3 bytes, the scales and the dtype."""
    x_q, x_scale = g.quantize_activations(y)
    assert acts.dtype == y.dtype
    assert acts.x_scale.shape == x_scale.shape and torch.equal(acts.x_scale, x_scale)
    assert acts.x_q.shape == x_q.shape and torch.equal(acts.x_q.view(torch.uint8), x_q.view(torch.uint8))


# (rows, cols): whole 128-column groups; a partial last group (200 = 128 + 72); one token of three groups.
NORM_SHAPES = [(3, 256), (2, 200), (1, 384)]


@pytest.mark.parametrize(("rows", "cols"), NORM_SHAPES)
def test_rmsnorm_quant_equals_quantized_rmsnorm(rows: int, cols: int) -> None:
    """rmsnorm_quant writes exactly quantize_activations(rmsnorm(x)): e4m3 bytes and scales."""
    x, w = _x(rows, cols, seed=rows + cols), _norm_weight(cols)
    _assert_same_quantization(f.rmsnorm_quant(x, w, 1e-6), f.rmsnorm(x, w, 1e-6))


@pytest.mark.parametrize(("rows", "cols"), NORM_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_rmsnorm_quant_equals_quantized_add_rmsnorm(rows: int, cols: int, dtype: torch.dtype) -> None:
    """fused_add_rmsnorm_quant gives the same new residual as fused_add_rmsnorm and its normed output quantized."""
    x, res, w = _x(rows, cols, 1, dtype), _x(rows, cols, 2, dtype), _norm_weight(cols, dtype)
    acts, new_res = f.fused_add_rmsnorm_quant(x, res, w, 1e-6)
    normed, want_res = f.fused_add_rmsnorm(x, res, w, 1e-6)
    assert torch.equal(new_res, want_res)
    _assert_same_quantization(acts, normed)


# (rows, intermediate): a partial group; two column blocks of 1,024 (the second partial); one token.
SILU_SHAPES = [(3, 200), (2, 1100), (1, 256)]


@pytest.mark.parametrize(("rows", "inter"), SILU_SHAPES)
def test_silu_and_mul_quant_equals_quantized_silu_and_mul(rows: int, inter: int) -> None:
    """silu_and_mul_quant writes exactly quantize_activations(silu_and_mul(x)), also for strided rows."""
    wide = _x(rows, 2 * inter + 64, seed=inter)
    x = wide[:, : 2 * inter]  # rows strided by 2I + 64
    _assert_same_quantization(f.silu_and_mul_quant(x), f.silu_and_mul(x))


def test_zero_rows_and_all_zero_groups() -> None:
    """No tokens give empty outputs; an all-zero group gets the smallest scale (1e-12) and zero bytes."""
    empty = f.silu_and_mul_quant(torch.zeros(0, 512, device=DEVICE, dtype=torch.bfloat16))
    assert empty.x_q.shape == (0, 256) and empty.x_scale.shape == (0, 2)
    x = torch.zeros(2, 256, device=DEVICE, dtype=torch.bfloat16)
    x[:, :128] = 1.0  # the gate columns: silu(1) * up(0) = 0 everywhere
    acts = f.silu_and_mul_quant(x)
    assert torch.all(acts.x_q.view(torch.uint8) == 0)
    assert torch.allclose(acts.x_scale, torch.full_like(acts.x_scale, 1e-12))


def test_producers_refuse_bad_input() -> None:
    """float32 activations, a weight of another dtype and odd widths are ValueErrors naming the field."""
    w = _norm_weight(256)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        f.rmsnorm_quant(torch.zeros(2, 256, device=DEVICE), w.float(), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        f.rmsnorm_quant(torch.zeros(2, 256, device=DEVICE, dtype=torch.bfloat16), w.float(), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        f.fused_add_rmsnorm_quant(_x(2, 256, 1), _x(3, 256, 1), w, 1e-6)
    with pytest.raises(ValueError, match=r"\(T, 2I\)"):
        f.silu_and_mul_quant(_x(2, 255, 1))


@pytest.mark.parametrize(("m", "n", "k"), [(1, 200, 384), (5, 256, 300)])
def test_fp8_linear_takes_quantized_activations(m: int, n: int, k: int) -> None:
    """fp8_linear (and the model's linear_forward) on Fp8Activations equals the blockwise reference of the same
    quantized operands, plus the bias."""
    gen = torch.Generator().manual_seed(n)
    w, w_scale = (t.to(DEVICE) for t in quantize_fp8_blocks(torch.randn(n, k, generator=gen)))
    x = _x(m, k, seed=3)
    acts = f.Fp8Activations(*g.quantize_activations(x), x.dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, x.dtype)
    want = g.fp8_blockwise_ref(acts.x_q, acts.x_scale, w, w_scale, torch.float32)
    got = g.fp8_linear(acts, w, w_scale)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    # two bf16 roundings (the product, then the bias add) against one float32 sum: bf16's 2 ** -8 twice, with margin
    torch.testing.assert_close(linear_forward(acts, w, w_scale, bias).float(), (want + bias.float()), rtol=2e-2,
                               atol=2e-2)  # fmt: skip
    with pytest.raises(ValueError, match="FP8 weight"):
        linear_forward(acts, w.float(), None, None)


def test_takes_fp8_activations_follows_fp8_linear_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The producers apply exactly where fp8_linear would quantize + swap: 1..SWAP_MAX_M tokens of 16-bit
    activations, not under the in-kernel quantization, not where a row-scaled weight takes the row-wise GEMM."""
    takes = g.takes_fp8_activations
    assert not takes(0, 4096, 4096, False, torch.bfloat16)
    assert takes(1, 4096, 4096, False, torch.bfloat16) and takes(g.SWAP_MAX_M, 4096, 4096, True, torch.float16)
    assert not takes(g.SWAP_MAX_M + 1, 4096, 4096, False, torch.bfloat16)
    assert not takes(4, 4096, 4096, False, torch.float32)
    qkv_min = g.rowwise_min_m(6144, 4096)
    assert takes(qkv_min, 6144, 4096, True, torch.bfloat16)
    assert not takes(qkv_min + 1, 6144, 4096, True, torch.bfloat16) and takes(qkv_min + 1, 6144, 4096, False,
                                                                             torch.bfloat16)  # fmt: skip
    monkeypatch.setitem(g.SWAP_FUSED_MAX_M, (4096, 4096), 8)
    assert not takes(8, 4096, 4096, False, torch.bfloat16) and takes(9, 4096, 4096, False, torch.bfloat16)


def test_ready_swap_table_is_valid_and_falls_back() -> None:
    """TUNED_SWAP_READY's shapes are valid swap configs up to SWAP_MAX_M with the K split of the two-launch path's
    shape at each M they cover (so both paths give the same bits); off its entries (and off CUDA) the ready path
    takes pick_swap_config's shape."""
    for (n, k, up_to), cfg in g.TUNED_SWAP_READY.items():
        cfg.check()
        assert up_to <= g.SWAP_MAX_M
        for m in range(1, up_to + 1):
            if g._tuned(g.TUNED_SWAP_READY, m, n, k) is cfg:
                assert g._tuned(g.TUNED_SWAP, m, n, k).split_k == cfg.split_k  # type: ignore[union-attr]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert g.pick_ready_swap_config(1, 4096, 4096, cpu) == g.pick_swap_config(1, 4096, 4096, cpu)
    if torch.cuda.is_available():
        assert g.pick_ready_swap_config(1, 4096, 12288, cuda) == g.TUNED_SWAP_READY[4096, 12288, 1]
        assert g.pick_ready_swap_config(32, 4096, 12288, cuda) == g.pick_swap_config(32, 4096, 12288, cuda)


def test_producers_apply_only_to_fp8_linears_on_cuda() -> None:
    """Fp8Producers.applies: an FP8 projection (weight_scale_inv) and activations on CUDA; a 16-bit one never."""
    producers = g.fp8_producers()
    plain = torch.nn.Linear(256, 128, bias=False).to(torch.bfloat16)
    x = torch.zeros(2, 256, dtype=torch.bfloat16, device=DEVICE)
    assert not producers.applies(x, plain)
    plain.weight_scale_inv = torch.ones(1, 2)  # type: ignore[assignment]
    assert producers.applies(x, plain) == (DEVICE == "cuda")


def test_switch_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """FNVLLM_FP8_FUSED_QUANT: on by default (the Triton ops get FP8 producers), 0 turns it off, other values are
    refused."""
    monkeypatch.delenv(g.FUSED_QUANT_ENV, raising=False)
    assert triton_ops().fp8_producers == g.fp8_producers()
    assert triton_ops(fp8_fused_quant=False).fp8_producers is None
    monkeypatch.setenv(g.FUSED_QUANT_ENV, "0")
    assert triton_ops().fp8_producers is None
    monkeypatch.setenv(g.FUSED_QUANT_ENV, "1")
    assert triton_ops().fp8_producers is not None
    monkeypatch.setenv(g.FUSED_QUANT_ENV, "yes")
    with pytest.raises(ValueError, match=g.FUSED_QUANT_ENV):
        triton_ops()


# ---- the down projection's split sum in the next norm ------------------------------------------------------------


# (M, N, K, split_k): three splits of two K blocks; one split (partials (1, M, N)).
PARTIAL_CASES = [(3, 192, 768, 3), (1, 128, 256, 1)]


@pytest.mark.parametrize(("m", "n", "k", "split_k"), PARTIAL_CASES)
def test_swap_partials_sum_to_the_swap_output(m: int, n: int, k: int, split_k: int) -> None:
    """fp8_gemm_swap_partials' splits summed in order (sum_partials) equal fp8_gemm_swap's output, both split sums."""
    w, w_scale = (
        t.to(DEVICE) for t in quantize_fp8_blocks(torch.randn(n, k, generator=torch.Generator().manual_seed(n)))
    )
    x_q, x_scale = g.quantize_activations(_x(m, k, seed=m))
    for reduce in g.SPLIT_REDUCES:
        cfg = g.SwapConfig(64, 16, split_k, reduce=reduce)
        parts = g.fp8_gemm_swap_partials(x_q, x_scale, w, w_scale, cfg)
        assert parts.shape == (split_k, m, n) and parts.dtype == torch.float32
        want = g.fp8_gemm_swap(x_q, x_scale, w, w_scale, torch.bfloat16, cfg)
        assert torch.equal(g.sum_partials(f.SplitPartials(parts, torch.bfloat16)), want)


@pytest.mark.parametrize("num_parts", [1, 3])
def test_add_rmsnorm_quant_sums_split_partials(num_parts: int) -> None:
    """fused_add_rmsnorm_quant on SplitPartials equals it on their ordered sum (the GEMM's output): residual and
    quantized output."""
    gen = torch.Generator().manual_seed(num_parts)
    parts = torch.randn(num_parts, 3, 256, generator=gen).to(DEVICE)
    res, w = _x(3, 256, 4), _norm_weight(256)
    split = f.SplitPartials(parts, torch.bfloat16)
    acts, new_res = f.fused_add_rmsnorm_quant(split, res, w, 1e-6)
    want_acts, want_res = f.fused_add_rmsnorm_quant(g.sum_partials(split), res, w, 1e-6)
    assert torch.equal(new_res, want_res)
    assert torch.equal(acts.x_scale, want_acts.x_scale)
    assert torch.equal(acts.x_q.view(torch.uint8), want_acts.x_q.view(torch.uint8))
    with pytest.raises(ValueError, match=r"SplitPartials\.parts"):
        f.fused_add_rmsnorm_quant(f.SplitPartials(parts[0], torch.bfloat16), res, w, 1e-6)


# ---- the model's wiring (CPU: the producers made to apply there, under the interpreter) -------------------------

# hidden 256 and intermediate 384 give whole 128-column groups and one partial SiLU column block; head_dim 64
# keeps the qkv parts on 128-row blocks (4 + 2 + 2 heads x 64).
MODEL_SHAPE: dict[str, Any] = dict(
    hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=384, vocab_size=128, num_layers=2
)


def _unfused_producers() -> g.Fp8Producers:
    """Producers made of the unfused kernels and a separate ``quantize_activations`` (what ``fp8_linear`` runs
    when the switch is off), applying on the CPU too."""

    def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> f.Fp8Activations:
        return f.Fp8Activations(*g.quantize_activations(f.rmsnorm(x, w, eps)), x.dtype)

    def add_rmsnorm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[Any, torch.Tensor]:
        normed, residual = f.fused_add_rmsnorm(x, r, w, eps)
        return f.Fp8Activations(*g.quantize_activations(normed), x.dtype), residual

    def silu_and_mul(x: torch.Tensor) -> f.Fp8Activations:
        return f.Fp8Activations(*g.quantize_activations(f.silu_and_mul(x)), x.dtype)

    return g.Fp8Producers(rmsnorm, add_rmsnorm, silu_and_mul, device_types=("cpu", "cuda"))


@torch.inference_mode()
def _prefill_logits(path: Path, producers: g.Fp8Producers | None, num_tokens: int = 12) -> torch.Tensor:
    """Float32 logits of one prompt prefilled through the FP8 model (bf16, quantized at load) on the CPU, its FP8
    projections' inputs made by ``producers`` (None: 16-bit, the CPU reference path)."""
    import attrs

    from fnvllm.executor.device_inputs import build_attention_metadata
    from fnvllm.model import ModelConfig, load_model
    from fnvllm.model.ops import TORCH_OPS

    config = ModelConfig.from_pretrained(path, dtype="bfloat16", quantization="fp8")
    model = load_model(path, config, "cpu", ops=attrs.evolve(TORCH_OPS, fp8_producers=producers))
    ids = [(5 * i + 3) % 120 + 2 for i in range(num_tokens)]
    blocks = tuple(range(num_tokens // 4 + 1))
    shape = (len(blocks), 4, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))] * 2
    meta = build_attention_metadata([0], [num_tokens], [blocks], 4, "cpu")
    return model.compute_logits(model(torch.tensor(ids), meta.positions, caches, meta)).float()


@needs_interpreter
def test_model_with_fused_producers_equals_unfused_quantization(tmp_path: Path) -> None:
    """The decoder layers' norms and SiLU producing Fp8Activations give the same logits whether the quantization
    is fused into them or a separate launch after the unfused op; both differ from the 16-bit-activation path
    (so the producers were used)."""
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "qwen3", "qwen3", **MODEL_SHAPE)
    fused = _prefill_logits(path, g.Fp8Producers(device_types=("cpu", "cuda")))
    unfused = _prefill_logits(path, _unfused_producers())
    norm_sums = _prefill_logits(path, g.Fp8Producers(sum_down_splits=True, device_types=("cpu", "cuda")))
    plain = _prefill_logits(path, None)
    assert torch.equal(fused, unfused)
    assert torch.equal(norm_sums, unfused)
    assert not torch.equal(fused, plain)
    assert float((fused - plain).norm() / plain.norm()) < 0.15  # fp8 activations (~0.07 here): close, not equal


@needs_interpreter
@torch.inference_mode()
def test_mlp_hands_down_partials_only_when_asked(tmp_path: Path) -> None:
    """With sum_down_splits an FP8 MLP returns SplitPartials when its caller sums them (keep_partials), a tensor
    otherwise; without it always a tensor."""
    import attrs

    from fnvllm.model import ModelConfig, load_model
    from fnvllm.model.ops import TORCH_OPS
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "qwen3", "qwen3", **MODEL_SHAPE)
    config = ModelConfig.from_pretrained(path, dtype="bfloat16", quantization="fp8")
    x = _x(2, MODEL_SHAPE["hidden_size"], 5).cpu()  # the model is on the CPU
    for sums in (True, False):
        producers = g.Fp8Producers(sum_down_splits=sums, device_types=("cpu", "cuda"))
        model = load_model(path, config, "cpu", ops=attrs.evolve(TORCH_OPS, fp8_producers=producers))
        mlp = model.model.layers[0].mlp
        assert isinstance(mlp(x, keep_partials=True), f.SplitPartials) == sums
        assert isinstance(mlp(x), torch.Tensor)
    assert [layer.is_last for layer in model.model.layers] == [False, True]


# ---- GPU: real sizes and the model ----------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 7, 16, 32])
def test_producers_on_cuda_at_qwen3_8b_sizes(m: int) -> None:
    """On the GPU at Qwen3-8B widths (hidden 4096, intermediate 12288) every producer equals the unfused op
    quantized, bit for bit."""
    x, res, w = _x(m, 4096, 1), _x(m, 4096, 2), _norm_weight(4096)
    acts, new_res = f.fused_add_rmsnorm_quant(x, res, w, 1e-6)
    normed, want_res = f.fused_add_rmsnorm(x, res, w, 1e-6)
    assert torch.equal(new_res, want_res)
    _assert_same_quantization(acts, normed)
    _assert_same_quantization(f.rmsnorm_quant(x, w, 1e-6), f.rmsnorm(x, w, 1e-6))
    gate_up = _x(m, 2 * 12288, 3)
    _assert_same_quantization(f.silu_and_mul_quant(gate_up), f.silu_and_mul(gate_up))


@pytest.mark.gpu
@needs_cuda
def test_greedy_tokens_equal_with_the_switch_on_and_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3-shaped model (head_dim 128, widths multiples of 128) with FP8 weights decodes the same greedy tokens
    with FNVLLM_FP8_FUSED_QUANT=1 (also with FNVLLM_FP8_NORM_SUMS_SPLITS=1) as with 0, eagerly and with CUDA
    graphs."""
    from fnvllm.llm import LLM
    from fnvllm.state import SamplingParams
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    shape: dict[str, Any] = dict(
        hidden_size=512, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=1536, vocab_size=512,
        num_layers=3,
    )  # fmt: skip
    path = write_tiny_checkpoint(tmp_path / "qwen3", "qwen3", **shape)
    prompts = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (5, 17, 30, 9)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs: dict[tuple[str, bool], list[tuple[int, ...]]] = {}
    for switch in ("0", "1", "1+sums"):
        monkeypatch.setenv(g.FUSED_QUANT_ENV, switch[0])
        monkeypatch.setenv(g.NORM_SUMS_SPLITS_ENV, "1" if switch.endswith("sums") else "0")
        for eager in (True, False):
            llm = LLM(path, device="cuda", dtype="bfloat16", quantization="fp8", load_tokenizer=False, num_blocks=64,
                      max_num_seqs=4, enforce_eager=eager)  # fmt: skip
            try:
                runs[switch, eager] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            finally:
                llm.close()
    for eager in (True, False):
        assert runs["1", eager] == runs["0", eager]
        assert runs["1+sums", eager] == runs["0", eager]
