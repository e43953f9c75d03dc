"""FP8 KV cache (``kv_cache_dtype="fp8"``): the e4m3 format, the Triton kernels against the torch reference, the
reference against full precision, and the engine end to end on the CPU.

Without a GPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by conftest.py) at tiny
shapes. The store kernel writes e4m3 bits it computes itself (the interpreter's float32 -> e4m3 cast is wrong), so
it is compared bit for bit; the attention kernels read e4m3 natively and are compared with the reference within
1e-5 (float32 queries) or 1e-2 (bfloat16) of ||ref||. Tolerances against full precision are stated per test.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from triton_guard import require_triton

DEVICE = require_triton()

from safetensors.torch import load_file, save_file  # noqa: E402

from fnvllm.config import EngineConfig  # noqa: E402
from fnvllm.kernels import fp8  # noqa: E402
from fnvllm.kernels.backends import available_backends, resolve_backend  # noqa: E402
from fnvllm.kernels.decode_attention import FP8_PATHS, paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from fnvllm.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref  # noqa: E402
from fnvllm.kernels.store_kv import store_kv, store_kv_ref  # noqa: E402
from fnvllm.llm import LLM  # noqa: E402
from fnvllm.model.config import CheckpointError, ModelConfig  # noqa: E402
from fnvllm.model.kv_scales import read_kv_scales  # noqa: E402
from fnvllm.model.sharding import TensorParallel  # noqa: E402
from fnvllm.state import InvalidConfigError, SamplingParams  # noqa: E402
from fnvllm.testing.checkpoints import write_tiny_checkpoint  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; anything non-finite in out gives inf."""
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a float8 tensor (bitwise comparison; NaN == NaN)."""
    return t.view(torch.uint8)


# ---------------------------------------------------------------------------------------------- the format


def test_round_trip_error_is_within_half_an_e4m3_step() -> None:
    """quantize then dequantize is within 2**-4 relative (normals) or 2**-10 * scale absolute (subnormals)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 2, 8, generator=gen) * torch.exp(torch.randn(4096, 2, 8, generator=gen) * 2)
    scale = torch.tensor([0.5, 3.0])
    x = x.clamp(-400 * scale[:, None], 400 * scale[:, None])  # inside the range: no saturation here
    back = fp8.dequantize_fp8(fp8.quantize_fp8(x, scale), scale)
    bound = torch.maximum(x.abs() * 2**-4, 2**-10 * scale[:, None].expand_as(x))
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert (back - x).abs().max() > 0  # the test sees rounding at all


def test_out_of_range_values_saturate() -> None:
    """Values beyond +-448 * scale are stored as +-448 (finite, never inf or NaN)."""
    scale = torch.tensor([2.0])
    x = torch.tensor([[1e4, -1e4, 897.0, -2000.0, 1e30]]).view(5, 1, 1)
    back = fp8.dequantize_fp8(fp8.quantize_fp8(x, scale), scale).flatten()
    assert back.tolist() == [896.0, -896.0, 896.0, -896.0, 896.0]


def test_bad_kv_cache_dtype_is_refused() -> None:
    """kv_cache_dtype="fp4" is an InvalidConfigError naming the field and the choices."""
    with pytest.raises(InvalidConfigError, match=r"kv_cache_dtype.*'auto', 'fp8'"):
        EngineConfig(kv_cache_dtype="fp4")
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


def test_fp8_backends() -> None:
    """With an FP8 cache, "auto" picks a backend that reads FP8, and every candidate supports it."""
    device = torch.device(DEVICE)
    assert resolve_backend("auto", device, "fp8").supports_fp8_kv
    assert all(b.supports_fp8_kv for b in available_backends(device, "fp8"))
    assert resolve_backend("torch", device, "fp8").name == "torch"


# ---------------------------------------------------------------------------------------------- store kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_fp8_is_bit_exact(dtype: torch.dtype) -> None:
    """The Triton store writes the reference's e4m3 bytes for strided k/v views, per-head scales, saturating,
    subnormal and signed-zero values."""
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_dim = 9, 2, 16
    qkv = torch.randn(num_tokens, 4 * num_kv_heads * head_dim, generator=gen) * 30
    qkv[0, :8] = torch.tensor([1e5, -1e5, 1e-4, -1e-4, -0.0, 0.0, 3e-3, 449.0])
    qkv = qkv.to(dtype).to(DEVICE)
    k = qkv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)  # strided (T, Hkv, D)
    v = qkv[:, 2 * num_kv_heads * head_dim : 3 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    k_scale = torch.tensor([0.7, 1.3], device=DEVICE)
    v_scale = torch.tensor([1.0, 0.05], device=DEVICE)
    shape = (4, 16, num_kv_heads, head_dim)
    k_cache, v_cache, k_ref, v_ref = (torch.zeros(shape, device=DEVICE).to(fp8.FP8_DTYPE) for _ in range(4))
    slots = torch.randperm(64, generator=gen)[:num_tokens].to(DEVICE)
    store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    store_kv_ref(k, v, k_ref, v_ref, slots, k_scale, v_scale)
    assert torch.equal(bits(k_cache), bits(k_ref)) and torch.equal(bits(v_cache), bits(v_ref))
    assert bits(k_cache).any()


def test_store_kv_rounds_every_e4m3_value_and_midpoint_like_torch() -> None:
    """Every finite e4m3 value, and every midpoint between neighbours (ties to even), encodes as torch's cast."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(fp8.FP8_DTYPE).float()
    values = values[torch.isfinite(values)].unique()  # sorted, -448 .. 448 (+-0 merged)
    mids = (values[1:] + values[:-1]) / 2  # exact in float32
    x = torch.cat([values, mids, torch.tensor([-0.0])])
    pad = (-len(x)) % 16
    x = torch.cat([x, torch.zeros(pad)]).view(-1, 1, 16).to(DEVICE)  # (T, 1, 16)
    slots = torch.arange(x.shape[0], device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    cache, ref = (torch.zeros(x.shape[0], 1, 1, 16, device=DEVICE).to(fp8.FP8_DTYPE) for _ in range(2))
    store_kv(x, x, cache, cache, slots, one, one)
    store_kv_ref(x, x, ref, ref, slots, one, one)
    assert torch.equal(bits(cache), bits(ref))


def test_store_kv_refuses_missing_scales() -> None:
    """An FP8 cache without scales, or with scales of the wrong shape, is a ValueError naming the scale."""
    k = torch.zeros(2, 2, 16, device=DEVICE)
    cache = torch.zeros(1, 16, 2, 16, device=DEVICE).to(fp8.FP8_DTYPE)
    slots = torch.arange(2, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale"):
        store_kv(k, k, cache, cache, slots)
    with pytest.raises(ValueError, match=r"v_scale must be \(2,\)"):
        store_kv(k, k, cache, cache, slots, torch.ones(2, device=DEVICE), torch.ones(3, device=DEVICE))


# ---------------------------------------------------------------------------------------------- attention kernels


def random_tables(lengths: list[int], block_size: int, gen: torch.Generator) -> torch.Tensor:
    """(B, width) int32 block tables drawn from a shuffled pool, padded with 0."""
    needed = [max(1, math.ceil(n / block_size)) for n in lengths]
    perm = torch.randperm(sum(needed) + 2, generator=gen)
    table = torch.zeros(len(lengths), max(needed), dtype=torch.int32)
    used = 0
    for i, n in enumerate(needed):
        table[i, :n] = perm[used : used + n]
        used += n
    return table


def fp8_caches(
    table: torch.Tensor, num_kv_heads: int, head_dim: int, block_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v) float32 caches with random values (a few times larger than 1, like real K/V), their FP8
    quantization by per-head scales, and the scales: (k, v, k8, v8, k_scale, v_scale)."""
    num_blocks = int(table.max()) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen) * 3, torch.randn(shape, generator=gen) * 3
    k_scale = torch.linspace(0.02, 0.05, num_kv_heads)  # calibrated-like: |x| / scale up to ~400
    v_scale = torch.linspace(1.0, 0.5, num_kv_heads)
    k8, v8 = fp8.quantize_fp8(k, k_scale), fp8.quantize_fp8(v, v_scale)
    return tuple(t.to(DEVICE) for t in (k, v, k8, v8, k_scale, v_scale))  # type: ignore[return-value]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition_size", [32, None])
@pytest.mark.parametrize("knobs", [{}, {"preload_kv": True}, {"preload_kv": True, "gqa_mode": "kq"}],
                         ids=["plain", "preload", "preload-kq"])  # fmt: skip
def test_decode_fp8_matches_reference(dtype: torch.dtype, partition_size: int | None, knobs: dict) -> None:
    """The Triton decode kernel on FP8 caches (split-K or one partition, GQA 2; the first tile read before the
    launch wait, with the plain and the transposed products) matches the torch reference."""
    gen = torch.Generator().manual_seed(3)
    lengths, block_size, num_heads, num_kv_heads, head_dim = [1, 37, 70, 0], 16, 4, 2, 16
    table = random_tables(lengths, block_size, gen)
    _, _, k8, v8, k_scale, v_scale = fp8_caches(table, num_kv_heads, head_dim, block_size, gen)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    table = table.to(DEVICE)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        q, k8, v8, table, seq_lens, scale, partition_size=partition_size, tile_size=16, k_scale=k_scale,
        v_scale=v_scale, **knobs,
    )  # fmt: skip
    ref = paged_decode_attention_ref(q, k8, v8, table, seq_lens, scale, k_scale, v_scale)
    assert rel_err(out.float(), ref.float()) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_path", ["wgmma_qk8", "mma_pairs", "mma_v16", "mma_eo", "gqa_mode=kq"])
def test_decode_fp8_paths_match_reference(dtype: torch.dtype, fp8_path: str) -> None:
    """The other FP8 decode paths (the transposed products K q^T, V^T P^T with K as stored or widened; two KV
    heads a program) match the torch reference, split (partials merged by the reduce kernel or in-kernel) or not,
    with GQA 4; "wgmma_qk8" rounds q to e4m3 first, so its reference gets the e4m3-rounded q."""
    knobs = {"gqa_mode": "kq"} if fp8_path == "gqa_mode=kq" else {"fp8_path": fp8_path}
    gen = torch.Generator().manual_seed(13)
    # head_dim 32: the e4m3 product of "wgmma_qk8" is 32 deep on a GPU (16 failed to compile there, H100 2026-12-06)
    lengths, block_size, num_heads, num_kv_heads, head_dim = [1, 37, 70, 0, 16], 16, 8, 2, 32
    table = random_tables(lengths, block_size, gen)
    _, _, k8, v8, k_scale, v_scale = fp8_caches(table, num_kv_heads, head_dim, block_size, gen)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    table = table.to(DEVICE)
    scale = head_dim**-0.5
    q_ref = q.float().to(fp8.FP8_DTYPE).float() if "_qk8" in fp8_path else q.float()
    ref = paged_decode_attention_ref(q_ref, k8, v8, table, seq_lens, scale, k_scale, v_scale)
    tile = 16
    for partition_size, fused in ((32, False), (32, True), (128, None)):
        out = paged_decode_attention(
            q, k8, v8, table, seq_lens, scale, partition_size=partition_size, tile_size=tile, fused_reduce=fused,
            k_scale=k_scale, v_scale=v_scale, **knobs,
        )  # fmt: skip
        assert rel_err(out.float(), ref) < TOLERANCE[dtype], (partition_size, fused)


def test_fp8_path_is_checked() -> None:
    """An unknown fp8_path, a transposed one with gqa_mode "sum" or below head_dim 32, or "mma_pairs" over an odd
    number of KV heads is a ValueError naming the knob."""
    q = torch.zeros(1, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 16, 1, 16, device=DEVICE).to(fp8.FP8_DTYPE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    seq_lens, scales = torch.ones(1, dtype=torch.int32, device=DEVICE), torch.ones(1, device=DEVICE)
    for knobs in ({"fp8_path": "tensor"}, {"fp8_path": "wgmma_qk8", "gqa_mode": "sum"}, {"fp8_path": "mma_pairs"}):
        with pytest.raises(ValueError, match="fp8_path"):
            paged_decode_attention(q, cache, cache, table, seq_lens, 1.0, k_scale=scales, v_scale=scales, **knobs)
    with pytest.raises(ValueError, match="'wgmma_qk8' needs head_dim >= 32"):  # q and the caches are 16 wide
        paged_decode_attention(
            q, cache, cache, table, seq_lens, 1.0, k_scale=scales, v_scale=scales, fp8_path="wgmma_qk8"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_fp8_matches_reference(dtype: torch.dtype) -> None:
    """The Triton varlen prefill kernel on FP8 caches (chunks over cached prefixes, a decode row) matches the
    torch reference."""
    gen = torch.Generator().manual_seed(4)
    q_lens, lengths, block_size, num_heads, num_kv_heads, head_dim = [12, 1, 5], [32, 9, 5], 16, 4, 2, 16
    table = random_tables(lengths, block_size, gen)
    _, _, k8, v8, k_scale, v_scale = fp8_caches(table, num_kv_heads, head_dim, block_size, gen)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    table = table.to(DEVICE)
    args = (q, k8, v8, cu, seq_lens, table, max(q_lens), head_dim**-0.5)
    out = paged_prefill_attention(*args, block_m=16, block_n=16, k_scale=k_scale, v_scale=v_scale)
    ref = paged_prefill_attention_ref(*args, k_scale, v_scale)
    assert rel_err(out.float(), ref.float()) < TOLERANCE[dtype]


def test_fp8_reference_is_close_to_full_precision() -> None:
    """Attention over the FP8 cache is within 6 % (||out - ref|| / ||ref||) of attention over the float32 cache
    it was quantized from (measured: 4.2 %, the e4m3 rounding of K and V, at most 6.25 % an element)."""
    gen = torch.Generator().manual_seed(5)
    lengths, block_size, num_heads, num_kv_heads, head_dim = [50, 200, 7], 16, 4, 2, 32
    table = random_tables(lengths, block_size, gen)
    k, v, k8, v8, k_scale, v_scale = fp8_caches(table, num_kv_heads, head_dim, block_size, gen)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    table = table.to(DEVICE)
    scale = head_dim**-0.5
    full = paged_decode_attention_ref(q, k, v, table, seq_lens, scale)
    quantized = paged_decode_attention_ref(q, k8, v8, table, seq_lens, scale, k_scale, v_scale)
    err = rel_err(quantized, full)
    assert 1e-3 < err < 0.06


# ---------------------------------------------------------------------------------------------- checkpoint scales


def add_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add tensors to the checkpoint's one safetensors file."""
    file = path / "model.safetensors"
    save_file({**load_file(file), **tensors}, file, metadata={"format": "pt"})


def test_checkpoint_scales_are_read_per_rank(tmp_path: Path) -> None:
    """k_scale (scalar) and v_scale (per KV head) are read for each layer; a layer without them gets 1.0; under
    tensor parallelism each rank gets its own KV heads' values."""
    path = write_tiny_checkpoint(tmp_path, "qwen3", num_kv_heads=2, num_layers=2)
    add_tensors(
        path,
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.25),
            "model.layers.0.self_attn.v_scale": torch.tensor([0.5, 2.0]),
            "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([3.0]),
        },
    )
    config = ModelConfig.from_pretrained(path)
    files = [path / "model.safetensors"]
    scales = read_kv_scales(files, config, torch.device("cpu"))
    assert [s.tolist() for s in scales[0]] == [[0.25, 0.25], [0.5, 2.0]]
    assert [s.tolist() for s in scales[1]] == [[3.0, 3.0], [1.0, 1.0]]
    rank1 = read_kv_scales(files, config, torch.device("cpu"), TensorParallel(rank=1, world_size=2))
    assert [s.tolist() for s in rank1[0]] == [[0.25], [2.0]]


def test_engine_uses_checkpoint_scales(tmp_path: Path) -> None:
    """A checkpoint with k_scale / v_scale loads with either cache dtype; the FP8 cache carries its scales, a
    model-dtype cache none."""
    path = write_tiny_checkpoint(tmp_path, "qwen3", num_kv_heads=2, num_layers=2)
    add_tensors(path, {"model.layers.1.self_attn.k_scale": torch.tensor([0.5, 0.25])})
    options = dict(load_tokenizer=False, device="cpu", num_blocks=8)
    cache = LLM(path, kv_cache_dtype="fp8", **options).executor.kv_caches[1]
    assert cache.k_scale is not None and cache.k_scale.tolist() == [0.5, 0.25]
    assert cache.v_scale is not None and cache.v_scale.tolist() == [1.0, 1.0]
    plain = LLM(path, **options).executor.kv_caches[1]
    assert plain.k.dtype == torch.float32 and plain.k_scale is None


def test_bad_checkpoint_scale_is_a_checkpoint_error(tmp_path: Path) -> None:
    """A scale with the wrong number of values, or a non-positive one, is a CheckpointError naming it."""
    path = write_tiny_checkpoint(tmp_path, "qwen3", num_kv_heads=2, num_layers=2)
    add_tensors(path, {"model.layers.1.self_attn.v_scale": torch.tensor([1.0, 2.0, 3.0])})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.v_scale"):
        read_kv_scales([path / "model.safetensors"], ModelConfig.from_pretrained(path), torch.device("cpu"))
    add_tensors(path, {"model.layers.1.self_attn.v_scale": torch.tensor(0.0)})
    with pytest.raises(CheckpointError, match="finite and > 0"):
        read_kv_scales([path / "model.safetensors"], ModelConfig.from_pretrained(path), torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- the engine

# Python openings for the demo model (it writes Python), after a shared first line that the prefix cache serves.
PROMPTS = (
    "def fib(",
    "class Stack:\n    def __init__(self",
    "def read_file(path):\n    ",
    "class Node:\n    ",
    'class Config(object):\n    """',
    "def parse_args(argv",
    "import re\n\n_PATTERN = re.compile(",
    "    def __repr__(self):\n        return ",
    "from collections import defaultdict\n\n\ndef count_words(",
    "try:\n    import json\nexcept ImportError:\n    ",
    "def _get_executable(executable=None):\n    ",
    "class Error(Exception):\n    ",
    "if __name__ == '__main__':\n    ",
    "    for i in range(len(",
    "def test_",
    "def main():\n    ",
)


def tiny_bf16(tmp_path: Path) -> Path:
    """A tiny random Qwen3 checkpoint in bfloat16."""
    return write_tiny_checkpoint(tmp_path, "qwen3", vocab_size=256, hidden_size=64, head_dim=32, dtype="bfloat16")


def demo_greedy(kv_cache_dtype: str) -> tuple[LLM, list[tuple[int, ...]]]:
    """The demo model's greedy tokens for PROMPTS on the CPU (torch backend) with prefix caching and chunked
    prefill (a 16-token budget, 4-token blocks)."""
    from fnvllm.demo import model_path

    llm = LLM(
        model_path(),
        device="cpu",
        kv_cache_dtype=kv_cache_dtype,
        block_size=4,
        num_blocks=1024,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    prompts = [llm.tokenizer.encode("import os\nimport sys\n\n\n" + p) for p in PROMPTS]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    return llm, [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_llm_fp8_kv_generates_close_to_bf16() -> None:
    """LLM(demo, kv_cache_dtype="fp8") on the CPU generates with prefix caching and chunked prefill; its first
    greedy token agrees with the bf16 cache's on >= 14 of 16 prompts (measured: 16) and its greedy tokens on
    >= 40 % of positions (measured: 58 %; runs part at near-ties, top-2 margins under 0.2 nats, and then differ)."""
    _, base = demo_greedy("auto")
    llm, ours = demo_greedy("fp8")
    assert llm.executor.kv_caches[0].k.dtype == fp8.FP8_DTYPE
    assert llm.stats.num_cached_tokens > 0  # the prefix cache served the shared first line
    first = sum(b[0] == o[0] for b, o in zip(base, ours, strict=True))
    same = sum(x == y for b, o in zip(base, ours, strict=True) for x, y in zip(b, o, strict=True))
    assert first >= 14, (base, ours)
    assert same / sum(map(len, base)) >= 0.4, (base, ours)


def test_fp8_kv_doubles_the_blocks(tmp_path: Path) -> None:
    """For the same cpu_kv_cache_gib, a bf16 model's FP8 cache holds twice the blocks."""
    path = tiny_bf16(tmp_path)
    counts = {
        kv: LLM(path, load_tokenizer=False, device="cpu", kv_cache_dtype=kv, cpu_kv_cache_gib=0.01).executor.num_blocks
        for kv in ("auto", "fp8")
    }
    assert counts["fp8"] in (2 * counts["auto"], 2 * counts["auto"] + 1), counts


def test_tp2_fp8_equals_tp1(tmp_path: Path) -> None:
    """At tensor_parallel_size=2 on the CPU, each rank's FP8 cache uses its own KV heads' checkpoint scales: the
    greedy tokens equal one process's with the same scales (and differ without them: the scales matter)."""
    path = write_tiny_checkpoint(tmp_path, "qwen3", num_kv_heads=2, num_layers=2, vocab_size=256)
    options = dict(device="cpu", load_tokenizer=False, block_size=4, num_blocks=64, attention_backend="torch")
    options |= dict(kv_cache_dtype="fp8")
    prompts = [[(7 * i + 3 * j) % 250 + 3 for i in range(12 + 5 * j)] for j in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    unscaled = [o.token_ids for o in LLM(path, **options).generate(prompts, params, use_tqdm=False)]
    # head 0's keys saturate at 448 * 0.01: a rank reading the other head's scale would change the tokens
    add_tensors(path, {f"model.layers.{n}.self_attn.k_scale": torch.tensor([0.01, 4.0]) for n in range(2)})
    expected = [o.token_ids for o in LLM(path, **options).generate(prompts, params, use_tqdm=False)]
    assert expected != unscaled
    llm = LLM(path, tensor_parallel_size=2, **options)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        llm.close()


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@gpu
def test_fp8_kernels_at_real_sizes() -> None:
    """On a GPU, bf16 queries over FP8 caches at the Qwen3 shape (16/8 heads, D 128, 256-token blocks): store
    is bit-exact and decode / prefill match the reference within 1e-2."""
    gen = torch.Generator().manual_seed(7)
    lengths, block_size, num_heads, num_kv_heads, head_dim = [1, 300, 1000, 2048, 513], 256, 16, 8, 128
    table = random_tables(lengths, block_size, gen)
    _, _, k8, v8, k_scale, v_scale = fp8_caches(table, num_kv_heads, head_dim, block_size, gen)
    table = table.cuda()
    slots = torch.randperm(k8.shape[0] * block_size, generator=gen)[:200].cuda()
    new_k, new_v = (torch.randn(200, num_kv_heads, head_dim, generator=gen).cuda().bfloat16() * 3 for _ in "kv")
    k8_ref, v8_ref = k8.clone(), v8.clone()
    store_kv(new_k, new_v, k8, v8, slots, k_scale, v_scale)
    store_kv_ref(new_k, new_v, k8_ref, v8_ref, slots, k_scale, v_scale)
    assert torch.equal(bits(k8), bits(k8_ref)) and torch.equal(bits(v8), bits(v8_ref))
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).cuda().bfloat16()
    out = paged_decode_attention(q, k8, v8, table, seq_lens, head_dim**-0.5, k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_attention_ref(q, k8, v8, table, seq_lens, head_dim**-0.5, k_scale, v_scale)
    assert rel_err(out.float(), ref.float()) < 1e-2
    q_lens = [1, 300, 64, 2048, 13]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    qp = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).cuda().bfloat16()
    args = (qp, k8, v8, cu, seq_lens, table, max(q_lens), head_dim**-0.5)
    out = paged_prefill_attention(*args, k_scale=k_scale, v_scale=v_scale)
    assert rel_err(out.float(), paged_prefill_attention_ref(*args, k_scale, v_scale).float()) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fp8_path", [*FP8_PATHS, "gqa_mode=kq"])
@pytest.mark.parametrize("num_heads", [16, 32])
def test_fp8_decode_paths_at_real_sizes(fp8_path: str, num_heads: int) -> None:
    """On a GPU, every FP8 decode path at the Qwen3-0.6B / 8B head shapes (16 or 32 q heads over 8 KV heads, D 128,
    256-token blocks), split into partitions and not, tiles of 64 and 128, matches the reference within 1e-2
    (the "_qk8" paths: the reference over e4m3-rounded queries)."""
    gen = torch.Generator().manual_seed(8)
    knobs = {"gqa_mode": "kq"} if fp8_path == "gqa_mode=kq" else {"fp8_path": fp8_path}
    lengths, block_size, num_kv_heads, head_dim = [1, 300, 1000, 2048, 513, 0, 64], 256, 8, 128
    table = random_tables(lengths, block_size, gen)
    _, _, k8, v8, k_scale, v_scale = fp8_caches(table, num_kv_heads, head_dim, block_size, gen)
    table, seq_lens = table.cuda(), torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).cuda().bfloat16()
    q_ref = q.float().to(fp8.FP8_DTYPE).float() if "_qk8" in fp8_path else q
    ref = paged_decode_attention_ref(q_ref, k8, v8, table, seq_lens, head_dim**-0.5, k_scale, v_scale).float()
    for partition_size, tile_size in ((4096, 128), (512, 64), (64, 64)):
        out = paged_decode_attention(
            q, k8, v8, table, seq_lens, head_dim**-0.5, partition_size=partition_size, tile_size=tile_size,
            num_stages=2, k_scale=k_scale, v_scale=v_scale, **knobs,
        )  # fmt: skip
        assert rel_err(out.float(), ref) < 1e-2, (partition_size, tile_size)


@pytest.mark.gpu
@gpu
def test_fp8_kv_cuda_graphs_match_eager(tmp_path: Path) -> None:
    """On a GPU (Triton backend), FP8-cache greedy tokens are the same with CUDA graphs and overlap as eager."""
    path = tiny_bf16(tmp_path)
    prompts = [[5, 6, 7, 8] * 5, [9, 10] * 7, [1] * 33]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * len(prompts)
    runs = []
    for eager in (True, False):
        llm = LLM(path, load_tokenizer=False, kv_cache_dtype="fp8", enforce_eager=eager, num_blocks=512)
        assert llm.executor.backend.name == "triton" and (llm.executor.graphs is None) == eager
        runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.close()
    assert runs[0] == runs[1]


def test_fp8_path_default_from_the_environment() -> None:
    """FNVLLM_FP8_PATH sets the FP8 decode default's fp8_path; a value outside FP8_PATHS is refused, naming it."""
    import os
    import subprocess
    import sys

    code = "from fnvllm.kernels.decode_attention import DEFAULT_FP8_DECODE_CONFIG as c; print(c.fp8_path)"
    env = {**os.environ, "FNVLLM_FP8_PATH": "mma_pairs"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "mma_pairs"
    env["FNVLLM_FP8_PATH"] = "fast"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "FNVLLM_FP8_PATH must be one of" in bad.stderr


@pytest.mark.parametrize("fp8_path", ["mma", "wgmma_qk8"])
def test_decode_fp8_in_a_given_order_equals_batch_order(monkeypatch: pytest.MonkeyPatch, fp8_path: str) -> None:
    """With the step's order (sequences longest first, ``longest_first``) the FP8 decode kernel takes its programs
    in that order and writes each sequence's row as in batch order; a shuffled order too (any permutation gives
    the same output); a wrong-shaped order is a ValueError naming seq_order."""
    from fnvllm.executor.cuda_graphs import longest_first
    from fnvllm.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "ORDERED_MIN_PROGRAMS", 1)  # the tiny batch counts as large
    gen = torch.Generator().manual_seed(21)
    lengths, block_size, num_heads, num_kv_heads, head_dim = [5, 70, 0, 33, 70, 1], 16, 4, 2, 32  # qk8: >= 32
    table = random_tables(lengths, block_size, gen)
    _, _, k8, v8, k_scale, v_scale = fp8_caches(table, num_kv_heads, head_dim, block_size, gen)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    table = table.to(DEVICE)
    order = np.zeros(len(lengths), dtype=np.int32)
    longest_first(np.array(lengths, dtype=np.int32), order)
    assert order.tolist() == [1, 4, 3, 0, 5, 2]
    knobs = {"tile_size": 16, "fp8_path": fp8_path, "k_scale": k_scale, "v_scale": v_scale}
    plain = paged_decode_attention(q, k8, v8, table, seq_lens, 0.25, **knobs)
    for given in (order, np.array([2, 0, 5, 3, 1, 4], dtype=np.int32)):
        seq_order = torch.from_numpy(given).to(DEVICE)
        got = paged_decode_attention(q, k8, v8, table, seq_lens, 0.25, seq_order=seq_order, **knobs)
        assert torch.equal(got, plain)
    repeated = torch.zeros(len(lengths), dtype=torch.int32, device=DEVICE)  # serves sequence 0 only: the order is read
    poisoned = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k8, v8, table, seq_lens, 0.25, poisoned, seq_order=repeated, **knobs)
    assert torch.equal(poisoned[0], plain[0]) and bool(poisoned[1].isnan().all())
    with pytest.raises(ValueError, match="seq_order"):
        paged_decode_attention(q, k8, v8, table, seq_lens, 0.25, seq_order=seq_order.long(), **knobs)
