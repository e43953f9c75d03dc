"""Sliding-window attention (Mistral's sliding_window, Qwen2's use_sliding_window): the torch reference, the Triton
decode and prefill kernels (split partitions, fused or separate merge, FP8 caches, the captured work list) against a
dense float64 computation of transformers' rule (query i sees key j iff 0 <= i - j < window), with every cache slot
before the window poisoned with NaN (a kernel that reads one gives NaN); backends that cannot do it are refused by
name; tiny random Mistral and Qwen2 checkpoints give transformers' logits and greedy tokens with windows far shorter
than their prompts and outputs. Kernels run under TRITON_INTERPRET=1 on the CPU; the GPU-only checks are marked."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from triton_guard import require_triton

DEVICE = require_triton()

from test_llm_equality import check_prefix_hits  # noqa: E402
from test_model import check_chunked_prefill, hf_logits, prompt, run_schedule  # noqa: E402
from tiny_models import _write_random_hf, hf_model, write_mistral_family  # noqa: E402

import fnvllm.kernels.backends as backends_module  # noqa: E402
from fnvllm.executor.device_inputs import build_attention_metadata  # noqa: E402
from fnvllm.kernels import decode_attention, prefill_attention, prefill_work  # noqa: E402
from fnvllm.kernels.attention import attend_stored, check_window  # noqa: E402
from fnvllm.kernels.backends import BackendUnavailableError, get_backend, resolve_backend  # noqa: E402
from fnvllm.kernels.fp8 import FP8_DTYPE, quantize_fp8  # noqa: E402
from fnvllm.model import ModelConfig, load_model  # noqa: E402

HEADS, KV_HEADS = 4, 2
SCALE = 0.25
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def dense_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Naive float64 attention of q (n, Hq, D), the last n of L positions, over k, v (L, Hkv, D): the query at
    position i sees key j iff 0 <= i - j < window (any j <= i when window is None)."""
    num_queries, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    k = k.double().repeat_interleave(num_heads // num_kv_heads, dim=1)  # (L, Hq, D)
    v = v.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * SCALE  # (Hq, n, L)
    distance = torch.arange(seq_len - num_queries, seq_len)[:, None] - torch.arange(seq_len)[None, :]  # (n, L)
    seen = (distance >= 0) & (distance < (window or seq_len + 1))
    return torch.einsum("hnl,lhd->nhd", scores.masked_fill(~seen, float("-inf")).softmax(dim=-1), v)


@attrs.frozen
class Case:
    """A batch fed through a poisoned paged cache: its metadata, q (T, Hq, D), the caches and the dense answer."""

    meta: Any
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    dense: torch.Tensor  # (T, Hq, D) float64
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def make_case(
    batch: tuple[tuple[int, int], ...],
    window: int | None,
    block_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    fp8: bool = False,
    head_dim: int = 16,
) -> Case:
    """Sequence b holds start_b cached tokens and feeds q_len_b more (``batch``: (start, q_len) each), its blocks
    shuffled; every slot outside the sequences, and every slot of a position before the window of the sequence's
    first query (start - window + 1), holds NaN. FP8 caches hold the keys and values quantized by per-head scales
    (the dense answer reads the dequantized values)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [start + q_len for start, q_len in batch]
    needed = [max(1, math.ceil(n / block_size)) for n in lengths]
    perm = torch.randperm(sum(needed) + 3, generator=gen).tolist()
    tables = [tuple(perm[sum(needed[:i]) : sum(needed[: i + 1])]) for i in range(len(batch))]
    shape = (len(perm) * block_size, KV_HEADS, head_dim)  # flat slots
    k_flat, v_flat = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    scales = (torch.rand(KV_HEADS, generator=gen) + 0.5, torch.rand(KV_HEADS, generator=gen) + 0.5) if fp8 else None
    queries, dense = [], []
    for (start, q_len), table in zip(batch, tables, strict=True):
        n = start + q_len
        k, v = (torch.randn(n, KV_HEADS, head_dim, generator=gen).to(dtype).float() for _ in range(2))
        if scales is not None:  # what the cache holds, read back
            k, v = (quantize_fp8(x, s).float() * s[:, None] for x, s in zip((k, v), scales, strict=True))
        pos = torch.arange(n)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        seen = pos >= (0 if window is None else start - window + 1)
        k_flat[slots[seen]], v_flat[slots[seen]] = k[seen], v[seen]
        queries.append(torch.randn(q_len, HEADS, head_dim, generator=gen).to(dtype))
        dense.append(dense_window_attention(queries[-1], k, v, window))
    cache_shape = (len(perm), block_size, KV_HEADS, head_dim)
    k_cache, v_cache = k_flat.view(cache_shape), v_flat.view(cache_shape)
    if scales is not None:
        k_cache, v_cache = (_fp8_cache(x, s) for x, s in zip((k_cache, v_cache), scales, strict=True))
    else:
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    starts, q_lens = [s for s, _ in batch], [n for _, n in batch]
    meta = build_attention_metadata(starts, q_lens, list(tables), block_size, DEVICE)
    k_scale, v_scale = (None, None) if scales is None else (s.to(DEVICE) for s in scales)
    q = torch.cat(queries).to(DEVICE)
    return Case(meta, q, k_cache.to(DEVICE), v_cache.to(DEVICE), torch.cat(dense), k_scale, v_scale)


def _fp8_cache(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 cache quantized to e4m3 by its (Hkv,) scale; its NaN slots as e4m3 NaN bytes (0x7F)."""
    poisoned = cache.isnan()
    out = quantize_fp8(cache.nan_to_num(), scale).view(torch.uint8)
    return out.masked_fill(poisoned, 0x7F).view(FP8_DTYPE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; any NaN in out (a poisoned slot read, an unwritten row) gives inf."""
    out = out.detach().cpu().double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref.double()).norm() / ref.double().norm()).item()


# Fresh prefills, chunks over cached prefixes (chunked prefill, prefix-cache hits) and decodes, one batch.
MIXED = ((0, 21), (13, 1), (5, 17), (30, 1), (0, 1), (17, 4), (40, 9))
DECODES = ((0, 1), (4, 1), (36, 1), (69, 1), (15, 1))
WINDOWS = [1, 4, 5, 16, 200]  # a single key; on block boundaries (block_size 4 / 16) and not; longer than any context


@pytest.mark.parametrize("window", [*WINDOWS, None])
@pytest.mark.parametrize("block_size", [1, 4])
def test_reference_equals_dense_window_attention(window: int | None, block_size: int) -> None:
    """The torch reference (the backend "torch") of a mixed batch equals dense attention within the window, and
    reads no slot before the window's start (those hold NaN)."""
    case = make_case(MIXED, window, block_size)
    out = attend_stored(case.q, case.k_cache, case.v_cache, case.meta, SCALE, get_backend("torch"), window=window)
    assert rel_err(out, case.dense) < 1e-6


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(
    "knobs",
    [
        dict(partition_size=16, tile_size=16, fused_reduce=False),
        dict(partition_size=16, tile_size=16, fused_reduce=True),
        dict(partition_size=64, tile_size=32, gqa_mode="sum"),
        dict(partition_size=32, tile_size=16, gqa_mode="kq", prefetch=True, heads_inner=False),
        dict(partition_size=128, tile_size=64),
    ],
)
def test_decode_kernel_equals_dense(window: int, block_size: int, knobs: dict[str, Any]) -> None:
    """The split-K decode kernel within the window equals dense attention: partitions wholly before the window
    skipped (the merge starts at the first live one, in-kernel or by the reduce kernel), the boundary tile masked,
    no poisoned slot read; a padding row (length 0) gives zeros."""
    case = make_case(DECODES, window, block_size)
    meta = case.meta
    table = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables[:1])])  # + a padding row
    seq_lens = torch.cat([meta.seq_lens, torch.zeros_like(meta.seq_lens[:1])])
    q = torch.cat([case.q, torch.randn_like(case.q[:1])])
    out = decode_attention.paged_decode_attention(
        q, case.k_cache, case.v_cache, table, seq_lens, SCALE, window=window, **knobs
    )
    assert rel_err(out[:-1], case.dense) < 1e-5
    assert torch.all(out[-1] == 0)


@pytest.mark.parametrize("window", [3, 16, 40])
@pytest.mark.parametrize("fp8_path", ["mma", "mma_eo", "mma_pairs", "kq"])
def test_decode_kernel_fp8_equals_dense(window: int, fp8_path: str) -> None:
    """The FP8 decode paths (bf16 q, head_dim 32 so "mma_eo" takes its int16 pairs) within the window equal dense
    attention over the dequantized cache."""
    case = make_case(DECODES, window, 16, seed=3, dtype=torch.bfloat16, fp8=True, head_dim=32)
    path = dict(fp8_path="mma", gqa_mode="kq") if fp8_path == "kq" else dict(fp8_path=fp8_path)
    out = decode_attention.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens, SCALE, window=window,
        k_scale=case.k_scale, v_scale=case.v_scale, partition_size=32, tile_size=16, **path,
    )  # fmt: skip
    assert rel_err(out, case.dense) < 2e-2


@pytest.mark.parametrize("window", [*WINDOWS, 7])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("tiles", [(16, 16), (64, 32)])
def test_prefill_kernel_equals_dense(window: int, block_size: int, tiles: tuple[int, int]) -> None:
    """The varlen prefill kernel within the window equals dense attention on a batch of fresh prefills, chunks
    over cached prefixes and decode rows: key tiles before a query tile's first window skipped, the rest masked."""
    case = make_case(MIXED, window, block_size, seed=1)
    meta = case.meta
    out = prefill_attention.paged_prefill_attention(
        case.q, case.k_cache, case.v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.max_seqlen_q,
        SCALE, block_m=tiles[0], block_n=tiles[1], window=window,
    )  # fmt: skip
    assert rel_err(out, case.dense) < 1e-5


@pytest.mark.parametrize("window", [2, 9])
def test_prefill_kernel_fp8_and_work_list_equal_dense(window: int) -> None:
    """The prefill kernel as a captured mixed step launches it (its work list sizing the grid) and over an FP8
    cache: both within the window equal dense attention."""
    case = make_case(MIXED, window, 4, seed=2)
    meta = case.meta
    q_lens = np.diff(meta.cu_seqlens_q.cpu().numpy())
    tokens = prefill_work.prefill_tokens_per_tile(HEADS, KV_HEADS)
    work = torch.from_numpy(prefill_work.prefill_work_list(q_lens, tokens, 40)).to(DEVICE)
    args = (meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.max_seqlen_q, SCALE)
    out = prefill_attention.paged_prefill_attention(case.q, case.k_cache, case.v_cache, *args, work=work, window=window)
    assert rel_err(out, case.dense) < 1e-5
    case8 = make_case(MIXED, window, 4, seed=2, dtype=torch.bfloat16, fp8=True)
    meta8 = case8.meta
    out8 = prefill_attention.paged_prefill_attention(
        case8.q, case8.k_cache, case8.v_cache, meta8.cu_seqlens_q, meta8.seq_lens, meta8.block_tables,
        meta8.max_seqlen_q, SCALE, k_scale=case8.k_scale, v_scale=case8.v_scale, window=window,
    )  # fmt: skip
    assert rel_err(out8, case8.dense) < 2e-2


@pytest.mark.parametrize("batch", [MIXED, DECODES])
def test_triton_backend_takes_the_window(batch: tuple[tuple[int, int], ...]) -> None:
    """The backend "triton" passes ``window`` to the kernel a step takes (decode or prefill)."""
    case = make_case(batch, 5, 4, seed=4)
    out = attend_stored(case.q, case.k_cache, case.v_cache, case.meta, SCALE, get_backend("triton"), window=5)
    assert rel_err(out, case.dense) < 1e-5


def test_bad_windows_and_backends_without_windows_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window that is not an int >= 1 is a ValueError; a backend without sliding windows is refused by name, when
    called with one and when resolved for a model that has one, and "auto" resolves to one that has them."""
    for bad in (0, -3, True, 2.0, "8"):
        with pytest.raises(ValueError, match=r"window must be None .* or an int >= 1"):
            check_window(bad)  # type: ignore[arg-type]
    blind = attrs.evolve(get_backend("torch"), name="blind", supports_sliding_window=False)
    case = make_case(DECODES, 3, 4)
    with pytest.raises(ValueError, match=r"backend 'blind' has no sliding-window attention .*'torch'"):
        attend_stored(case.q, case.k_cache, case.v_cache, case.meta, SCALE, blind, window=3)
    k_cache, v_cache = case.k_cache.nan_to_num(), case.v_cache.nan_to_num()
    full = attend_stored(case.q, k_cache, v_cache, case.meta, SCALE, blind)  # no window: no refusal
    assert full.shape == case.q.shape
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, sliding_window=True).supports_sliding_window
    monkeypatch.setattr(backends_module, "get_backend", lambda name: attrs.evolve(blind, name=name))
    with pytest.raises(BackendUnavailableError, match=r"attention_backend='torch' has no sliding-window attention"):
        resolve_backend("torch", cpu, sliding_window=True)
    assert resolve_backend("torch", cpu).name == "torch"


def test_decode_preload_with_a_window_is_refused() -> None:
    """preload_kv (each partition's first tile read early) cannot serve a window: asked for with one, a ValueError."""
    case = make_case(DECODES, 3, 4)
    with pytest.raises(ValueError, match=r"preload_kv .* sliding window"):
        decode_attention.paged_decode_attention(
            case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens, SCALE, window=3,
            preload_kv=True,
        )  # fmt: skip


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_windowed_decode_kernel_compiles_for_hopper(kv: str) -> None:
    """The decode kernel with a window compiles for sm_90 (Triton's front end is stricter than the interpreter; the
    FP8 default path reads int16 pairs). In a process of its own: ``benchmarks/sass_count.py --window``."""
    script = Path(__file__).parents[1] / "benchmarks" / "sass_count.py"
    args = [sys.executable, str(script), "--kv", kv, "--window", "100", "--top", "0"]
    env = {**os.environ, "PYTHONPATH": str(script.parents[1])}
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "programs an SM" in done.stdout


# ---------------------------------------------------------------------------------------------- whole models


def write_qwen2_window(root: Path, **overrides: Any) -> Path:
    """A tiny random fp32 Qwen2 checkpoint (transformers' writer) whose layers 1 and 2 of 3 attend within a
    5-token window (use_sliding_window, max_window_layers 1)."""
    import transformers

    options = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.1, bos_token_id=0,
        eos_token_id=255, use_sliding_window=True, sliding_window=5, max_window_layers=1,
    )  # fmt: skip
    config = transformers.Qwen2Config(**{**options, **overrides})
    return _write_random_hf(transformers.Qwen2ForCausalLM, config, root / "qwen2_window")


# name -> (writer, each layer's window)
WINDOWED = {
    "mistral": (lambda root: write_mistral_family(root, "mistral", sliding_window=6), [6, 6, 6]),
    "qwen2": (write_qwen2_window, [None, 5, 5]),
}


@pytest.fixture(scope="module", params=list(WINDOWED))
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    """(name, checkpoint folder, transformers' model of it) of a tiny windowed Mistral / Qwen2."""
    path = WINDOWED[request.param][0](tmp_path_factory.mktemp("window"))
    return f"{request.param}_sliding", path, hf_model(path)  # (the name keys check_prefix_hits' reference cache)


def test_config_gives_each_layer_its_window(windowed: tuple[str, Path, Any]) -> None:
    """Each layer's window is the one transformers' config gives it (Qwen2's layer_types from max_window_layers)."""
    name, path, hf = windowed
    config = ModelConfig.from_pretrained(path)
    want = [hf.config.sliding_window if t == "sliding_attention" else None for t in _layer_types(hf.config)]
    assert [config.layer_window(i) for i in range(config.num_hidden_layers)] == want
    assert want == WINDOWED[name.removesuffix("_sliding")][1]


def _layer_types(hf_config: Any) -> list[str]:
    """transformers' kind of each layer ("sliding_attention" on all of a Mistral with a window)."""
    kinds = getattr(hf_config, "layer_types", None)
    return kinds or ["sliding_attention"] * hf_config.num_hidden_layers


@pytest.mark.parametrize(
    "overrides,sliding",
    [
        (dict(max_window_layers=0), [0, 1, 2]),
        (dict(max_window_layers=3), []),
        (dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"]), [0, 2]),
        (dict(use_sliding_window=False), []),
    ],
)
def test_qwen2_sliding_layers_follow_transformers(tmp_path: Path, overrides: dict[str, Any], sliding: list) -> None:
    """Qwen2's sliding layers from max_window_layers or an explicit layer_types are transformers' own (none without
    use_sliding_window), also from a config.json without layer_types (as the published checkpoints, where
    transformers derives them from max_window_layers)."""
    import transformers

    path = write_qwen2_window(tmp_path, **overrides)
    config = ModelConfig.from_pretrained(path)
    assert list(config.sliding_layers) == _hf_sliding_layers(transformers.AutoConfig.from_pretrained(path)) == sliding
    assert config.has_sliding_window == bool(sliding)
    legacy = {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k != "layer_types"}
    want = _hf_sliding_layers(transformers.Qwen2Config(**legacy))
    assert list(ModelConfig.from_dict(legacy).sliding_layers) == want
    assert want == (sliding if "layer_types" not in overrides else [1, 2])


def _hf_sliding_layers(hf_config: Any) -> list[int]:
    """The layers transformers' Qwen2 config makes sliding (none when its sliding_window is None)."""
    if hf_config.sliding_window is None:
        return []
    return [i for i, kind in enumerate(hf_config.layer_types) if kind == "sliding_attention"]


def test_windows_refused_or_ignored_by_name(tmp_path: Path) -> None:
    """use_sliding_window on another family, a malformed layer_types or max_window_layers are ValueErrors naming
    the field; a window no shorter than max_position_embeddings hides nothing, so its layers attend in full."""
    base = dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=96, vocab_size=256, max_position_embeddings=64, use_sliding_window=True, sliding_window=8,
    )  # fmt: skip
    assert ModelConfig.from_dict(base).layer_window(2) is None  # max_window_layers defaults to 28 > 3 layers
    for arch in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2MoeForCausalLM"):
        with pytest.raises(ValueError, match=f"use_sliding_window=True is not supported for {arch}"):
            ModelConfig.from_dict({**base, "architectures": [arch]})
    with pytest.raises(ValueError, match="layer_types must be a list of 3 entries"):
        ModelConfig.from_dict({**base, "layer_types": ["sliding_attention"] * 2})
    with pytest.raises(ValueError, match="max_window_layers must be an int >= 0"):
        ModelConfig.from_dict({**base, "max_window_layers": -1})
    mistral = {**base, "architectures": ["MistralForCausalLM"], "use_sliding_window": False, "sliding_window": 64}
    config = ModelConfig.from_dict(mistral)
    assert config.sliding_window == 64 and config.sliding_layers == (0, 1, 2) and config.layer_window(0) is None
    assert ModelConfig.from_dict({**mistral, "sliding_window": 63}).layer_window(1) == 63


def test_logits_equal_transformers(windowed: tuple[str, Path, Any]) -> None:
    """Prefill in three chunks (11, 7, 13 tokens), then decodes, through the paged cache with 4-token blocks: our
    logits equal transformers' with windows of 5-6 tokens over a 37-token prompt; the same model attending in full
    differs from them (so the window is what makes them equal)."""
    _, path, hf = windowed
    config = ModelConfig.from_pretrained(path)
    check_chunked_prefill(load_model(path, config, "cpu"), hf, block_size=4, seed=1)
    full = load_model(path, attrs.evolve(config, sliding_window=None, sliding_layers=()), "cpu")
    tokens = prompt(2)
    (logits,) = run_schedule(full, [tokens], [[(0, 20)], [(0, 17)]], block_size=4)
    assert (logits[10:] - hf_logits(hf, tokens)[10:]).abs().max() > 1e-2


class WithBackend:
    """Our model as ``run_schedule`` calls it, attending with ``backend`` instead of the default "torch"."""

    def __init__(self, model: Any, backend: Any) -> None:
        self._model, self._backend = model, backend
        self.config, self.model = model.config, model.model

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, caches: Any, meta: Any) -> torch.Tensor:
        return self._model(ids, positions, caches, meta, self._backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._model.compute_logits(hidden)


def test_logits_equal_transformers_with_the_triton_kernels(windowed: tuple[str, Path, Any]) -> None:
    """The same chunked prefill and decodes with the Triton store, prefill and decode kernels (interpreted on the
    CPU) give transformers' logits."""
    _, path, hf = windowed
    model = load_model(path, ModelConfig.from_pretrained(path), "cpu")
    check_chunked_prefill(WithBackend(model, get_backend("triton")), hf, block_size=4, seed=2)


def test_greedy_equals_transformers(windowed: tuple[str, Path, Any]) -> None:
    """Greedy tokens through LLM equal transformers' generate for 10 mixed prompts (1-70 tokens, 16 new each) with
    prefix-cache hits: whole prompts and cached prefixes longer than the window."""
    check_prefix_hits(*windowed)


# ---------------------------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.gpu
def test_gpu_greedy_equals_transformers_with_cuda_graphs(windowed: tuple[str, Path, Any]) -> None:
    """On a GPU (Triton kernels, decode steps replayed from CUDA graphs) greedy tokens equal transformers'."""
    check_prefix_hits(*windowed, device="cuda")


@gpu
@pytest.mark.gpu
def test_gpu_decode_cuda_graph_replays_the_window() -> None:
    """A captured decode launch with a window replays correctly after seq_lens and q change in place."""
    case = make_case(tuple((n, 1) for n in (100, 300, 511, 7)), None, 16, dtype=torch.bfloat16)
    meta, out = case.meta, torch.empty_like(case.q)
    k_cache, v_cache = case.k_cache.nan_to_num(), case.v_cache.nan_to_num()  # (only unused slots are NaN)
    workspace = decode_attention.make_decode_workspace(case.q, meta.block_tables, 16, partition_size=64)
    args = (case.q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE, out)
    kw = dict(partition_size=64, workspace=workspace, window=40)
    decode_attention.paged_decode_attention(*args, **kw)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention.paged_decode_attention(*args, **kw)
    meta.seq_lens.copy_(torch.tensor([61, 301, 200, 8], dtype=torch.int32))  # (no longer than before)
    case.q.copy_(torch.randn_like(case.q))
    graph.replay()
    ref = decode_attention.paged_decode_attention_ref(
        case.q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE, window=40
    )
    assert rel_err(out, ref.cpu().double()) < 1e-2


@gpu
@pytest.mark.gpu
def test_gpu_flash_backend_takes_the_window() -> None:
    """The backend "flash" (FlashAttention-4's window_size (w - 1, 0)) within the window equals dense attention."""
    try:
        backend = resolve_backend("flash", torch.device("cuda"), sliding_window=True)
    except BackendUnavailableError as e:
        pytest.skip(f"flash backend unavailable: {e}")
    case = make_case(MIXED, 5, 16, dtype=torch.bfloat16)
    k_cache, v_cache = case.k_cache.nan_to_num(), case.v_cache.nan_to_num()
    out = attend_stored(case.q, k_cache, v_cache, case.meta, SCALE, backend, window=5)
    assert rel_err(out, case.dense) < 1e-2
