"""Head-major ("HND") KV caches against token-major ("NHD") ones: every kernel that writes or reads the paged
caches indexes them by their logical (num_blocks, block_size, Hkv, D) shape, so a head-major cache must come out
of each store with the same logical values, bit for bit, and give each attention kernel the same output, under
Triton's interpreter at tiny shapes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import attrs
import pytest
import torch
from triton_guard import require_triton

DEVICE = require_triton()

from fnvllm.config import EngineConfig  # noqa: E402
from fnvllm.kernels import decode_attention as dec  # noqa: E402
from fnvllm.kernels import fp8  # noqa: E402
from fnvllm.kernels.attention import KV_LAYOUTS, kv_layout, write_kv, zeros_kv_cache  # noqa: E402
from fnvllm.kernels.backends import BackendUnavailableError, get_backend, resolve_kv_layout  # noqa: E402
from fnvllm.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref  # noqa: E402
from fnvllm.kernels.store_kv import norm_rope_store, store_kv  # noqa: E402
from fnvllm.llm import LLM  # noqa: E402
from fnvllm.state import InvalidConfigError, SamplingParams  # noqa: E402
from fnvllm.testing.checkpoints import write_tiny_checkpoint  # noqa: E402

BLOCKS, BLOCK_SIZE, HQ, HKV, D = 6, 16, 4, 2, 32


def cache_pair(dtype: torch.dtype, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed k and v caches of BLOCKS blocks in ``layout``."""
    return tuple(zeros_kv_cache(BLOCKS, BLOCK_SIZE, HKV, D, dtype, torch.device(DEVICE), layout) for _ in "kv")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two caches hold the same logical values, bit for bit (FP8 ones compared as bytes)."""
    if a.dtype == fp8.FP8_DTYPE:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def filled(dtype: torch.dtype, layout: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Caches in ``layout`` holding the same random logical values for every layout (FP8: random e4m3 bytes
    of finite values)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = cache_pair(dtype, layout)
    for cache in (k, v):
        values = torch.randn(cache.shape, generator=gen)
        if dtype == fp8.FP8_DTYPE:
            cache.view(torch.uint8).copy_(values.to(fp8.FP8_DTYPE).view(torch.uint8).to(DEVICE))
        else:
            cache.copy_(values.to(dtype).to(DEVICE))
    return k, v


def test_layouts_are_told_by_strides() -> None:
    """zeros_kv_cache makes each layout with the logical shape; kv_layout reads it back and refuses other strides."""
    for layout in KV_LAYOUTS:
        cache = zeros_kv_cache(BLOCKS, BLOCK_SIZE, HKV, D, torch.bfloat16, torch.device("cpu"), layout)
        assert cache.shape == (BLOCKS, BLOCK_SIZE, HKV, D) and kv_layout(cache) == layout
        assert not cache.any()
    hnd = zeros_kv_cache(BLOCKS, BLOCK_SIZE, HKV, D, fp8.FP8_DTYPE, torch.device("cpu"), "HND")
    assert hnd.stride() == (HKV * BLOCK_SIZE * D, D, BLOCK_SIZE * D, 1)  # one head's block: BLOCK_SIZE * D in a run
    with pytest.raises(ValueError, match="layout must be one of"):
        zeros_kv_cache(BLOCKS, BLOCK_SIZE, HKV, D, torch.bfloat16, torch.device("cpu"), "HDN")
    with pytest.raises(ValueError, match="contiguous"):
        kv_layout(torch.zeros(BLOCKS, HKV, D, BLOCK_SIZE).permute(0, 3, 1, 2))
    with pytest.raises(ValueError, match="num_blocks, block_size, Hkv, D"):
        kv_layout(torch.zeros(BLOCKS, BLOCK_SIZE, HKV * D))


def store_inputs(tokens: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Keys and values (T, Hkv, D) as strided views of one buffer, distinct slots spread over all blocks, and
    per-head FP8 scales."""
    gen = torch.Generator().manual_seed(seed)
    buf = (torch.randn(tokens, 2, HKV, D, generator=gen) * 2).to(dtype).to(DEVICE)
    return {
        "k": buf[:, 0],
        "v": buf[:, 1],
        "slots": torch.randperm(BLOCKS * BLOCK_SIZE, generator=gen)[:tokens].to(DEVICE),
        "scales": (torch.tensor([0.7, 1.3], device=DEVICE), torch.tensor([1.0, 0.05], device=DEVICE)),
    }


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, fp8.FP8_DTYPE])
@pytest.mark.parametrize("store", ["triton", "reference"])
def test_store_kv_writes_the_same_logical_cache(cache_dtype: torch.dtype, store: str) -> None:
    """store_kv (Triton) and write_kv (torch) into head-major caches give the logical values they give into
    token-major ones, bit for bit, and leave every other slot zero."""
    inp = store_inputs(37, torch.bfloat16, seed=3)
    scales = inp["scales"] if cache_dtype == fp8.FP8_DTYPE else ()
    fn = store_kv if store == "triton" else write_kv
    written = {}
    for layout in KV_LAYOUTS:
        written[layout] = cache_pair(cache_dtype, layout)
        fn(inp["k"], inp["v"], *written[layout], inp["slots"], *scales)
    stored = torch.zeros(BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    stored[inp["slots"]] = True
    for nhd, hnd in zip(written["NHD"], written["HND"], strict=True):
        assert same_bits(nhd, hnd)
        rows = hnd.view(torch.uint8).reshape(BLOCKS * BLOCK_SIZE, -1)  # (slots, Hkv * D bytes), logical order
        assert rows[stored].any(dim=1).all() and not rows[~stored].any()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, fp8.FP8_DTYPE])
@pytest.mark.parametrize("grid", ["token", "head"])
def test_norm_rope_store_writes_the_same_logical_cache(cache_dtype: torch.dtype, grid: str) -> None:
    """The fused attention prologue (both grids) stores the same logical K and V bits into head-major caches, and
    returns the same q."""
    gen = torch.Generator().manual_seed(5)
    tokens = 19
    qkv = (torch.randn(tokens, (HQ + 2 * HKV) * D, generator=gen) * 2).to(torch.bfloat16).to(DEVICE)
    angles = torch.rand(tokens, D // 2, generator=gen) * 6.28
    weights = [(torch.rand(D, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE) for _ in range(2)]
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=gen)[:tokens].to(DEVICE)
    scales = store_inputs(1, torch.bfloat16, 0)["scales"] if cache_dtype == fp8.FP8_DTYPE else ()
    out = {}
    for layout in KV_LAYOUTS:
        kv = cache_pair(cache_dtype, layout)
        q = norm_rope_store(qkv, HQ, HKV, *weights, 1e-6, angles.cos().to(DEVICE), angles.sin().to(DEVICE), *kv,
                            slots, *scales, grid=grid)  # fmt: skip
        out[layout] = (q, *kv)
    assert torch.equal(out["NHD"][0], out["HND"][0])
    assert same_bits(out["NHD"][1], out["HND"][1]) and same_bits(out["NHD"][2], out["HND"][2])
    assert out["HND"][2].view(torch.uint8).any()


def decode_problem(seed: int) -> dict[str, torch.Tensor]:
    """Three sequences (one shorter than a block, one spanning three) over shuffled blocks, bf16 queries."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor([5, 40, 17], dtype=torch.int32)
    return {
        "q": torch.randn(3, HQ, D, generator=gen).to(torch.bfloat16).to(DEVICE),
        "tables": torch.stack([torch.randperm(BLOCKS, generator=gen)[:3] for _ in range(3)]).int().to(DEVICE),
        "lens": lens.to(DEVICE),
        "scales": (torch.tensor([0.7, 1.3], device=DEVICE), torch.tensor([1.0, 0.5], device=DEVICE)),
    }


BF16_SMALL = dataclasses.replace(dec.DEFAULT_DECODE_CONFIG, tile_size=16, partition_size=32)
FP8_SMALL = dataclasses.replace(dec.DEFAULT_FP8_DECODE_CONFIG, tile_size=16, partition_size=32)
DECODE_SETS = [
    (torch.bfloat16, BF16_SMALL),
    (torch.bfloat16, dataclasses.replace(BF16_SMALL, partition_size=64, preload_kv=True)),
    (fp8.FP8_DTYPE, FP8_SMALL),  # "mma_eo": the caches read as int16 views
    (fp8.FP8_DTYPE, dataclasses.replace(FP8_SMALL, fp8_path="mma")),
]


@pytest.mark.parametrize(("cache_dtype", "cfg"), DECODE_SETS, ids=["bf16", "bf16-preload", "fp8-mma_eo", "fp8-mma"])
def test_decode_reads_head_major_caches(cache_dtype: torch.dtype, cfg: dec.DecodeKernelConfig) -> None:
    """The decode kernel over head-major caches gives the token-major output bit for bit (same tiles, same order)
    and matches the torch reference."""
    p = decode_problem(7)
    scales = p["scales"] if cache_dtype == fp8.FP8_DTYPE else (None, None)
    outs = {}
    for layout in KV_LAYOUTS:
        k, v = filled(cache_dtype, layout, seed=11)
        out = torch.full_like(p["q"], float("nan"))
        dec.paged_decode_attention(p["q"], k, v, p["tables"], p["lens"], 0.2, out, k_scale=scales[0],
                                   v_scale=scales[1], **dataclasses.asdict(cfg))  # fmt: skip
        outs[layout] = out
    assert torch.equal(outs["NHD"], outs["HND"])
    k, v = filled(cache_dtype, "HND", seed=11)
    ref = dec.paged_decode_attention_ref(p["q"], k, v, p["tables"], p["lens"], 0.2, *scales)
    torch.testing.assert_close(outs["HND"].float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, fp8.FP8_DTYPE])
def test_prefill_reads_head_major_caches(cache_dtype: torch.dtype) -> None:
    """The varlen prefill kernel over head-major caches gives the token-major output and matches the reference."""
    p = decode_problem(8)
    gen = torch.Generator().manual_seed(9)
    q_lens = [3, 9, 17]  # the last query chunks of the three sequences
    cu = torch.tensor([0, 3, 12, 29], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen).to(torch.bfloat16).to(DEVICE)
    scales = p["scales"] if cache_dtype == fp8.FP8_DTYPE else (None, None)
    args = (cu, p["lens"], p["tables"], max(q_lens), 0.2)
    outs = {}
    for layout in KV_LAYOUTS:
        k, v = filled(cache_dtype, layout, seed=12)
        outs[layout] = paged_prefill_attention(q, k, v, *args, k_scale=scales[0], v_scale=scales[1])
    assert torch.equal(outs["NHD"], outs["HND"])
    k, v = filled(cache_dtype, "HND", seed=12)
    ref = paged_prefill_attention_ref(q, k, v, *args, *scales)
    torch.testing.assert_close(outs["HND"].float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_mixed_layouts_are_refused() -> None:
    """A head-major k_cache with a token-major v_cache is a ValueError naming both, before any kernel runs."""
    inp = store_inputs(2, torch.bfloat16, seed=1)
    k, _ = cache_pair(torch.bfloat16, "HND")
    _, v = cache_pair(torch.bfloat16, "NHD")
    with pytest.raises(ValueError, match="one shape and one layout"):
        store_kv(inp["k"], inp["v"], k, v, inp["slots"])
    p = decode_problem(2)
    with pytest.raises(ValueError, match="one shape and one layout"):
        dec.paged_decode_attention(p["q"], k, v, p["tables"], p["lens"], 0.2)
    assert not k.any() and not v.any()


# ---------------------------------------------------------------------------------------------- the engine


def test_layout_option_is_checked_and_resolved() -> None:
    """EngineConfig.kv_layout takes "auto", "NHD" or "HND" (InvalidConfigError naming the field otherwise); "auto"
    is the backend's first layout, and a layout the backend does not read is refused, naming both."""
    assert EngineConfig().kv_layout == "auto" and EngineConfig(kv_layout="HND").kv_layout == "HND"
    with pytest.raises(InvalidConfigError, match="kv_layout"):
        EngineConfig(kv_layout="hnd")
    only_nhd = attrs.evolve(get_backend("torch"), name="nhd_only", kv_layouts=("NHD",))
    assert resolve_kv_layout("auto", only_nhd) == "NHD" and resolve_kv_layout("NHD", only_nhd) == "NHD"
    with pytest.raises(BackendUnavailableError, match="'nhd_only' cannot read a HND KV cache"):
        resolve_kv_layout("HND", only_nhd)
    assert resolve_kv_layout("HND", get_backend("torch")) == "HND"
    triton_backend = get_backend("triton")  # measured: head-major pays for FP8 caches only
    assert resolve_kv_layout("auto", triton_backend, "fp8") == "HND"
    assert resolve_kv_layout("auto", triton_backend, "auto") == "NHD"
    assert resolve_kv_layout("auto", get_backend("torch"), "fp8") == "NHD"


def greedy_tokens(path: Path, device: str, **options: object) -> tuple[LLM, list[tuple[int, ...]]]:
    """Greedy tokens of four prompts sharing a prefix, with prefix caching and chunked prefill (4-token blocks,
    a 16-token budget)."""
    llm = LLM(path, load_tokenizer=False, device=device, block_size=4, num_blocks=256, max_num_batched_tokens=16,
              enable_prefix_caching=True, **options)  # fmt: skip
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    prompts = [shared + [(7 * i + 3 * j) % 250 + 3 for i in range(5 + 6 * j)] for j in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return llm, [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_tokens_are_the_same_in_either_layout(tmp_path: Path, kv_cache_dtype: str) -> None:
    """On the CPU (torch backend) an engine with head-major caches allocates them so and generates exactly the
    token-major engine's greedy tokens, prefix cache hits included."""
    path = write_tiny_checkpoint(tmp_path, "qwen3", num_kv_heads=2, num_layers=2, vocab_size=256)
    runs = {}
    for layout in KV_LAYOUTS:
        llm, runs[layout] = greedy_tokens(path, "cpu", kv_cache_dtype=kv_cache_dtype, kv_layout=layout)
        assert llm.executor.kv_layout == layout and kv_layout(llm.executor.kv_caches[1].v) == layout
        assert llm.stats.num_cached_tokens > 0
    assert runs["NHD"] == runs["HND"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_triton_engine_tokens_are_the_same_in_either_layout(tmp_path: Path, kv_cache_dtype: str) -> None:
    """On a GPU (Triton backend, CUDA graphs, overlap) head-major caches give the token-major greedy tokens."""
    path = write_tiny_checkpoint(tmp_path, "qwen3", vocab_size=256, hidden_size=64, head_dim=32, dtype="bfloat16")
    runs = {}
    for layout in KV_LAYOUTS:
        llm, runs[layout] = greedy_tokens(path, "cuda", kv_cache_dtype=kv_cache_dtype, kv_layout=layout)
        assert llm.executor.backend.name == "triton" and llm.executor.graphs is not None
        assert kv_layout(llm.executor.kv_caches[0].k) == layout
        llm.close()
    assert runs["NHD"] == runs["HND"]
