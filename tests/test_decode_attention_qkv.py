"""Decode attention from the qkv projection in one launch (``paged_decode_attention_qkv``: the q/k norms, rotary and
this step's K/V store done by the decode kernel) against ``norm_rope_store_ref`` + ``paged_decode_attention_ref``,
under Triton's interpreter at tiny shapes. The step's own cache slot starts as NaN, so a kernel that read it back
instead of using its registers would fail."""

from __future__ import annotations

import math

import pytest
import torch
from test_kernels_triton import TOLERANCE, random_tables, rel_err

from fnvllm.kernels.decode_attention import paged_decode_attention_qkv, paged_decode_attention_qkv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_step(lengths: list[int], hq: int, hkv: int, d: int, block: int, dtype: torch.dtype, norm: bool, seed: int):
    """A decode step: qkv rows, norm weights, cos/sin, caches holding tokens < len - 1 (NaN elsewhere, this step's
    slot included), slots of the step's tokens, tables and lengths."""
    gen = torch.Generator().manual_seed(seed)
    table = random_tables(lengths, block, gen, width=max(1, math.ceil(max(lengths) / block)) + 1)
    num_blocks = int(table.max()) + 2
    k_cache = torch.full((num_blocks * block, hkv, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = []
    for row, n in zip(table, lengths, strict=True):
        pos = torch.arange(max(n, 1))
        flat = row[pos // block].long() * block + pos % block
        if n > 1:
            k_cache[flat[: n - 1]] = torch.randn(n - 1, hkv, d, generator=gen)
            v_cache[flat[: n - 1]] = torch.randn(n - 1, hkv, d, generator=gen)
        slots.append(int(flat[-1]) if n > 0 else 0)
    shape = (num_blocks, block, hkv, d)
    caches = [c.view(shape).to(dtype).to(DEVICE) for c in (k_cache, v_cache)]
    qkv = torch.randn(len(lengths), (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEVICE)
    weights = [(torch.rand(d, generator=gen) + 0.5).to(dtype).to(DEVICE) for _ in range(2)] if norm else [None, None]
    angles = torch.rand(len(lengths), d // 2, generator=gen) * 6.0
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return (
        qkv,
        weights,
        angles.cos().to(DEVICE),
        angles.sin().to(DEVICE),
        caches,
        slot_mapping,
        table.to(DEVICE),
        seq_lens,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(
    "knobs",
    [
        {"partition_size": 32, "tile_size": 16, "fused_reduce": True},
        {"partition_size": 16, "tile_size": 16, "fused_reduce": False, "preload_kv": True},
        {"partition_size": 64, "tile_size": 16, "preload_kv": True, "prefetch": True, "num_stages": 1},
    ],
    ids=["split-merged", "tile-partitions-reduce-preload", "one-partition-prefetch-preload"],
)
def test_qkv_decode_matches_norm_rope_store_then_attention(dtype: torch.dtype, norm: bool, knobs: dict) -> None:
    """Output and the caches (this step's k and v stored at its slot, nothing else touched) match the reference,
    for a one-token sequence, a padding row, tokens that end a partition and long ones; with and without norms."""
    lengths = [1, 16, 0, 17, 33, 40]
    hq, hkv, d, block = 4, 2, 16, 16
    qkv, (qw, kw), cos, sin, (kc, vc), slots, table, lens = make_step(lengths, hq, hkv, d, block, dtype, norm, 5)
    ref_k, ref_v = kc.clone(), vc.clone()
    out = paged_decode_attention_qkv(qkv, hq, hkv, qw, kw, 1e-6, cos, sin, kc, vc, slots, table, lens, d**-0.5, **knobs)
    live = [i for i, n in enumerate(lengths) if n > 0]
    ref = paged_decode_attention_qkv_ref(
        qkv.float()[live], hq, hkv, None if qw is None else qw.float(), None if kw is None else kw.float(), 1e-6,
        cos[live], sin[live], ref_k, ref_v, slots[live], table[live], lens[live], d**-0.5,
    )  # fmt: skip
    assert rel_err(out[live].float(), ref.float()) < TOLERANCE[dtype]
    assert torch.all(out[2] == 0)  # the padding row
    torch.testing.assert_close(kc, ref_k, equal_nan=True, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(vc, ref_v, equal_nan=True)


def test_qkv_decode_rejects_fp8_and_mismatched_caches() -> None:
    """Caches of another dtype than qkv's (FP8 among them) are refused with the dtype named."""
    qkv, (qw, kw), cos, sin, (kc, vc), slots, table, lens = make_step([5], 4, 2, 16, 16, torch.float32, True, 1)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention_qkv(
            qkv, 4, 2, qw, kw, 1e-6, cos, sin, kc.bfloat16(), vc.bfloat16(), slots, table, lens, 0.25
        )


def test_model_with_the_decode_prologue_in_the_kernel_matches_torch_ops(tmp_path) -> None:
    """A tiny Qwen3 whose decode steps run norm, rope, K/V store and attention in one kernel (the triton backend,
    interpreted here) gives the torch-ops logits through prefill chunks and decodes."""
    from test_fused_layer import BLOCK, CHUNKS

    from fnvllm.executor.device_inputs import build_attention_metadata
    from fnvllm.kernels.attention import KVCache
    from fnvllm.kernels.backends.triton import BACKEND
    from fnvllm.model import ModelConfig, load_model
    from fnvllm.model.ops import TORCH_OPS, triton_ops
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path, "qwen3", num_heads=4, num_kv_heads=2, num_layers=2)
    config = ModelConfig.from_pretrained(path)
    ours = load_model(path, config, DEVICE, ops=triton_ops(fused_prologues=True, decode_qkv=True))
    ref = load_model(path, config, DEVICE, ops=TORCH_OPS)
    assert ours.model.layers[0].self_attn.ops.decode_qkv_attention is not None
    tokens = torch.randint(0, config.vocab_size, (sum(CHUNKS),), generator=torch.Generator().manual_seed(6))

    @torch.inference_mode()
    def run(model, backend) -> torch.Tensor:
        shape = (6, BLOCK, config.num_key_value_heads, config.head_dim)
        caches = [KVCache(torch.zeros(shape), torch.zeros(shape)) for _ in model.model.layers]
        table = (3, 1, 4)[: math.ceil(sum(CHUNKS) / BLOCK)]
        start, outs = 0, []
        for n in CHUNKS:
            meta = build_attention_metadata([start], [n], [table], BLOCK, DEVICE)
            hidden = model(tokens[start : start + n], meta.positions, caches, meta, backend)
            outs.append(model.compute_logits(hidden))
            start += n
        return torch.cat(outs)

    torch.testing.assert_close(run(ours, BACKEND), run(ref, "torch"), atol=1e-4, rtol=1e-4)
