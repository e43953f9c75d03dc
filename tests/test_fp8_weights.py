"""FP8 weights: official block-quantized checkpoints and quantization="fp8" load and match their references, the
activation quantization and the blockwise GEMM match their torch references (interpreted on the CPU; the other GEMM
kernels: tests/test_fp8_gemm.py), TP=2 matches TP=1, bad input is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fnvllm.bench import weight_bytes
from fnvllm.executor.device_inputs import build_attention_metadata
from fnvllm.kernels import fp8_gemm as g
from fnvllm.llm import LLM
from fnvllm.model import ModelConfig, load_model
from fnvllm.model.config import CheckpointError
from fnvllm.model.quant import quantize_fp8_blocks
from fnvllm.state import InvalidConfigError, SamplingParams
from fnvllm.testing.checkpoints import write_dequantized_checkpoint, write_fp8_checkpoint, write_tiny_checkpoint

# hidden 320: K of qkv / gate_up and N of o / down end on a partial 64-wide block; head_dim 128 and intermediate 512
# keep every fused part and every TP=2 shard on 128 multiples (as in real models).
SHAPE: dict[str, Any] = dict(
    hidden_size=320, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512, vocab_size=256, num_layers=2
)
OPTIONS: dict[str, Any] = dict(
    device="cpu", load_tokenizer=False, block_size=4, num_blocks=64, max_num_seqs=4, attention_backend="torch"
)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * n) % 250 + 3 for i in range(n)] for n in (5, 17, 30)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny fp32 Qwen3, its official-layout FP8 copy, and the fp32 checkpoint of that copy's dequantized weights."""
    root = tmp_path_factory.mktemp("fp8")
    src = write_tiny_checkpoint(root / "src", "qwen3", **SHAPE)
    fp8 = write_fp8_checkpoint(src, root / "fp8")
    return {"src": src, "fp8": fp8, "dequantized": write_dequantized_checkpoint(fp8, root / "dequantized")}


@torch.inference_mode()
def prefill_logits(
    path: Path, quantization: str | None = None, dtype: str = "float32", prompts: list[list[int]] = PROMPTS
) -> torch.Tensor:
    """Float32 logits (sum of prompt lengths, vocab) of ``prompts``, each prefilled alone through a fresh cache."""
    config = ModelConfig.from_pretrained(path, dtype=dtype, quantization=quantization)
    return model_logits(load_model(path, config, "cpu"), config, prompts)


def model_logits(model: Any, config: ModelConfig, prompts: list[list[int]] = PROMPTS) -> torch.Tensor:
    """Float32 logits (sum of prompt lengths, vocab) of ``prompts`` through ``model`` (of ``config``), each prompt
    prefilled alone through a fresh cache."""
    out = []
    for ids in prompts:
        blocks = tuple(range(len(ids) // 4 + 1))
        shape = (len(blocks), 4, config.num_key_value_heads, config.head_dim)
        caches = [
            (torch.zeros(shape, dtype=config.torch_dtype), torch.zeros(shape, dtype=config.torch_dtype))
            for _ in range(config.num_hidden_layers)
        ]
        meta = build_attention_metadata([0], [len(ids)], [blocks], 4, "cpu")
        out.append(model.compute_logits(model(torch.tensor(ids), meta.positions, caches, meta)).float())
    return torch.cat(out)


def greedy(path: Path, **options: Any) -> list[tuple[int, ...]]:
    """Greedy token ids of PROMPTS through LLM."""
    llm = LLM(path, **OPTIONS, **options)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.close()


# ---- loading ----------------------------------------------------------------------------------------------------


def test_fp8_checkpoint_matches_dequantized_reference(checkpoints: dict[str, Path]) -> None:
    """An official-layout FP8 checkpoint (detected from config.json) gives the logits and greedy tokens of the fp32
    model built from its dequantized weights, and keeps its linears in e4m3."""
    config = ModelConfig.from_pretrained(checkpoints["fp8"])
    assert config.quantization is not None and config.quantization.is_checkpoint_fp8
    model = load_model(checkpoints["fp8"], config, "cpu")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and tuple(qkv.weight_scale_inv.shape) == (8, 3)
    assert model.model.embed_tokens.weight.dtype == torch.float32 and model.lm_head.weight.dtype == torch.float32
    ours, reference = prefill_logits(checkpoints["fp8"]), prefill_logits(checkpoints["dequantized"])
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    assert greedy(checkpoints["fp8"]) == greedy(checkpoints["dequantized"])
    assert greedy(checkpoints["fp8"], quantization="fp8") == greedy(checkpoints["dequantized"])


def test_quantize_at_load_stays_close(checkpoints: dict[str, Path]) -> None:
    """quantization="fp8" on a float32 checkpoint (128-row groups: the weights themselves are checked in
    tests/test_fp8_rowwise.py) keeps its logits close to the unquantized model's: RMS error under 15 % of the
    logits' spread (e4m3 rounds each weight by up to 1/16, ~3.6 % RMS; this random model's seven GEMMs compound it
    to a measured 10 %), within 10 % of the official 128 x 128 block layout's error."""
    on_load = prefill_logits(checkpoints["src"], quantization="fp8")
    full = prefill_logits(checkpoints["src"])
    blocks = prefill_logits(checkpoints["fp8"])
    rms = (on_load - full).pow(2).mean().sqrt()
    assert rms < 0.15 * full.std()
    assert rms < 1.1 * (blocks - full).pow(2).mean().sqrt()  # measured: 0.1011 vs 0.1007 of the spread
    assert (on_load - full).abs().max() < 0.6 * full.std()
    assert (on_load - full).pow(2).mean().sqrt() < 0.15 * full.std()
    assert (on_load - full).abs().max() < 0.6 * full.std()


def test_quantize_at_load_on_the_demo_model_keeps_its_predictions() -> None:
    """On the trained demo checkpoint (real margins), quantization="fp8" keeps >= 90 % of the bf16 model's
    next-token argmaxes on Python text (teacher-forced) and a mean per-token KL(bf16 || fp8) under 0.01 nats
    (measured: 97 %, 0.002 on held-out stdlib files)."""
    from transformers import AutoTokenizer

    from fnvllm import demo

    texts = [
        "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv[1:]:\n        if os.path.isdir(name):",
        "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n        self._init(",
        "def read_file(path):\n    with open(path, encoding='utf-8') as f:\n        return f.read()\n",
    ]
    tokenizer = AutoTokenizer.from_pretrained(demo.model_path())
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    bf16 = prefill_logits(demo.model_path(), None, "bfloat16", prompts).log_softmax(-1)
    fp8 = prefill_logits(demo.model_path(), "fp8", "bfloat16", prompts).log_softmax(-1)
    assert (bf16.argmax(-1) == fp8.argmax(-1)).float().mean() >= 0.9
    assert (bf16.exp() * (bf16 - fp8)).sum(-1).mean() < 0.01


def test_tp2_fp8_equals_tp1_fp8(checkpoints: dict[str, Path]) -> None:
    """At tensor_parallel_size=2 (gloo) each rank loads its block-aligned slice of the FP8 weights and scales (or
    quantizes its slice of the float32 ones), and the greedy tokens equal one process's."""
    assert greedy(checkpoints["fp8"], tensor_parallel_size=2) == greedy(checkpoints["fp8"])
    on_load = greedy(checkpoints["src"], quantization="fp8")
    assert greedy(checkpoints["src"], quantization="fp8", tensor_parallel_size=2) == on_load


# ---- bad input --------------------------------------------------------------------------------------------------


def test_unknown_quantization_is_refused() -> None:
    """quantization="int4" is an InvalidConfigError naming the field and the choice it allows."""
    with pytest.raises(InvalidConfigError, match=r"EngineConfig\.quantization.*fp8"):
        LLM("unused", quantization="int4")


def test_other_quant_methods_are_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A checkpoint with quant_method "awq" (or a per-channel FP8 one) is a CheckpointError naming what is
    supported."""
    config = json.loads((checkpoints["src"] / "config.json").read_text())
    cases = {
        "awq": ({"quant_method": "awq", "bits": 4}, r"quant_method 'awq' is not supported; supported: \('fp8',\)"),
        "fp8-channel": ({"quant_method": "fp8", "weight_block_size": None}, r"supported: \[128, 128\]"),
    }
    for name, (quantization_config, message) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
        with pytest.raises(CheckpointError, match=message):
            ModelConfig.from_pretrained(tmp_path / name)


def test_misaligned_fused_layer_is_refused(tmp_path: Path) -> None:
    """A model whose fused q/k/v parts do not start on 128-row blocks (head_dim 32) is refused by name at load."""
    path = write_tiny_checkpoint(tmp_path, "qwen3", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match=r"k_proj rows .* 128"):
        load_model(path, ModelConfig.from_pretrained(path, quantization="fp8"), "cpu")


# ---- format and kernels -----------------------------------------------------------------------------------------


def test_block_quantization_round_trips_with_edge_blocks() -> None:
    """quantize_fp8_blocks gives one amax/448 scale per 128 x 128 block (edge blocks partial, an all-zero block
    harmless) and dequantizes to within e4m3's half step (1/16 relative) of each block's values."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    w[:128, :128] = 0.0
    q, scale = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (2, 3)
    assert scale[1, 2] == w[128:, 256:].abs().max() / 448
    back = g.dequantize_fp8_blocks(q, scale, torch.float32)
    assert back[:128, :128].eq(0).all()
    bound = g.expand_block_scales(scale, 200, 300) * 16 + w.abs() / 16  # half a subnormal step, or 1/16 relative
    assert ((back - w).abs() <= bound).all()


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight (n, k) with varied block scales."""
    generator = torch.Generator().manual_seed(seed)
    return quantize_fp8_blocks(torch.randn(n, k, generator=generator) * torch.rand(n, 1, generator=generator))


def test_activation_quantization_kernel_matches_reference() -> None:
    """quantize_activations gives the reference's per-(token, 128 columns) scales, and e4m3 values within half a
    step of x / scale (rounding ties may go either way)."""
    x = (torch.randn(7, 300, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    x_q, x_scale = g.quantize_activations(x)
    ref_q, ref_scale = g.quantize_activations_ref(x)
    torch.testing.assert_close(x_scale, ref_scale)
    exact = x.float() / x_scale.repeat_interleave(128, dim=1)[:, :300]
    assert ((x_q.float() - exact).abs() <= exact.abs() / 16 + 2**-10).all()
    assert (x_q.float() == ref_q.float()).float().mean() > 0.97


@pytest.mark.parametrize(("m", "n", "k"), [(70, 200, 300), (3, 128, 128)])
def test_blockwise_kernel_matches_reference(m: int, n: int, k: int) -> None:
    """fp8_gemm_blockwise on quantized activations equals the float32 math of the same fp8 operands and scales."""
    w, scale = _weights(n, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x_q, x_scale = g.quantize_activations_ref(x)
    out = g.fp8_gemm_blockwise(x_q, x_scale, w, scale, torch.float32, block_m=32)
    torch.testing.assert_close(out, g.fp8_blockwise_ref(x_q, x_scale, w, scale, torch.float32), atol=1e-4, rtol=1e-4)


def test_benchmark_floor_counts_one_byte_per_fp8_weight(checkpoints: dict[str, Path]) -> None:
    """The bench floor's weight bytes count the FP8 linears at 1 byte (+ their scales), the rest at 2."""
    plain = ModelConfig.from_pretrained(checkpoints["src"])
    fp8 = ModelConfig.from_pretrained(checkpoints["src"], quantization="fp8")
    h, i, q, kv = 320, 512, 512, 256
    linears = 2 * (h * (q + 2 * kv) + q * h + 3 * h * i)
    scales = 2 * 4 * (8 * 3 + 3 * 4 + 8 * 3 + 3 * 4)  # float32 scale blocks of qkv, o, gate_up, down
    assert weight_bytes(plain) - weight_bytes(fp8) == linears - scales


# ---- on a GPU ---------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_fp8_checkpoint_on_cuda_graphs_equal_eager(checkpoints: dict[str, Path]) -> None:
    """On CUDA (bf16, Triton attention) the FP8 checkpoint's greedy tokens are the same with decode CUDA graphs
    as eagerly (the FP8 kernels capture and replay)."""
    options = dict(device="cuda", dtype="bfloat16", load_tokenizer=False, num_blocks=64, max_num_seqs=4)
    runs = []
    for eager in (False, True):
        llm = LLM(checkpoints["fp8"], enforce_eager=eager, **options)
        runs.append([o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)])
        llm.close()
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 5, 16, 300])
def test_cublas_block_scaled_gemm_matches_its_reference(m: int) -> None:
    """fp8_scaled_mm (cuBLAS, 1 x 128 activation and 128 x 128 weight scales) computes fp8_blockwise_ref's product
    on the same quantized operands, M padded and sliced back."""
    from fnvllm.kernels import fp8_gemm as g
    from fnvllm.model.quant import quantize_fp8_blocks

    if not g._has_block_scaled_mm(0):
        pytest.skip("torch._scaled_mm has no block-scaled recipe on this GPU / CUDA")
    w8, ws = quantize_fp8_blocks(torch.randn(384, 512, device="cuda", dtype=torch.bfloat16) / 20)
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    ref = g.fp8_blockwise_ref(*g.quantize_activations(x), w8, ws, torch.float32)
    got = g.fp8_scaled_mm(x, w8, ws).float()
    assert got.shape == (m, 384)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
