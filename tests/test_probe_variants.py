"""benchmarks/probe_step_variants.py's launch-shape variants compute what the shipped shapes do: each GEMM variant's
config against the float32 product (on a GPU at its real shape; under Triton's interpreter with the real K and few
output rows), each attention variant's knobs against the torch reference, and each variant goes into the table the
engine reads."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from triton_guard import require_triton

DEVICE = require_triton()

from benchmarks import probe_step_variants as probe  # noqa: E402
from fnvllm.kernels import decode_attention, fused_ops, skinny_gemm, store_kv  # noqa: E402

GEMMS = probe.gemm_variants()
ON_GPU = DEVICE == "cuda"


def _operands(rows: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16).to(DEVICE)
    return x, w


@pytest.mark.parametrize("name", sorted(GEMMS))
def test_gemm_variant_computes_the_product(name: str) -> None:
    """The variant's launch, as the engine makes it (split partials where split_k > 1, SiLU-and-mul for "glu"),
    equals the float32 product within bf16 rounding: at 64 and 33 rows and the real N on a GPU, at 20 rows and 64
    output features (the real K) under the interpreter."""
    variant = GEMMS[name]
    n, k, _ = variant.key
    for rows in (64, 33) if ON_GPU else (20,):
        x, w = _operands(rows, n if ON_GPU else 64, k)
        exact = F.linear(x.float(), w.float())
        cfg = skinny_gemm._fit_rows(variant.config, rows)
        if variant.table == "glu":
            got = skinny_gemm.skinny_linear(x, w, None, cfg, glu_out=True).float()
            gate, up = exact.to(torch.bfloat16).float().chunk(2, dim=-1)
            want = F.silu(gate) * up
            assert torch.allclose(got, want, rtol=2**-6, atol=2e-2), name
        elif cfg.split_k > 1:
            parts = skinny_gemm.skinny_partials(x, w, cfg).parts
            assert parts.shape == (cfg.split_k, rows, w.shape[0])
            assert torch.allclose(parts.sum(0), exact, rtol=1e-4, atol=1e-4), name
        else:
            got = skinny_gemm.skinny_linear(x, w, None, cfg).float()
            assert torch.allclose(got, exact, rtol=2**-7, atol=2**-7), name


@pytest.mark.parametrize("name", sorted(probe.ATTENTION_VARIANTS))
def test_attention_variant_matches_the_reference(name: str) -> None:
    """The short-context entry with the variant's knobs put in (as the probe does) attends as the torch reference
    does, within bf16 rounding, at three sequences of 100-511 tokens of 64-token blocks."""
    variant = probe.ATTENTION_VARIANTS[name]
    gen = torch.Generator().manual_seed(len(name))
    batch, hq, hkv, dim, block, blocks = 3, 4, 2, 32, 64, 8
    k = torch.randn(blocks * batch, block, hkv, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(k.shape, generator=gen).to(torch.bfloat16).to(DEVICE)
    q = torch.randn(batch, hq, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    tables = torch.arange(blocks * batch, dtype=torch.int32, device=DEVICE).view(batch, blocks)
    lens = torch.tensor([100, 300, 511], dtype=torch.int32, device=DEVICE)
    entry = decode_attention.SMALL_BATCH_DECODE_SHORT[variant.rows]
    knobs = dataclasses.asdict(dataclasses.replace(entry, **variant.knobs))
    out = decode_attention.paged_decode_attention(q, k, v, tables, lens, 0.2, **knobs)
    ref = decode_attention.paged_decode_attention_ref(q, k, v, tables, lens, 0.2)
    assert torch.allclose(out.float(), ref.float(), rtol=2**-7, atol=4e-3), name


def test_variants_go_into_the_tables_the_engine_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """apply_gemm / apply_attention / apply_trigger put each variant where the dispatchers look (the tables are
    the module's own dicts, restored after the test)."""
    monkeypatch.setattr(skinny_gemm, "TUNED_CONFIGS", dict(skinny_gemm.TUNED_CONFIGS))
    monkeypatch.setattr(skinny_gemm, "PARTIALS_CONFIGS", dict(skinny_gemm.PARTIALS_CONFIGS))
    monkeypatch.setattr(skinny_gemm, "FUSED_TIMES", dict(skinny_gemm.FUSED_TIMES))
    monkeypatch.setattr(decode_attention, "SMALL_BATCH_DECODE_SHORT", dict(decode_attention.SMALL_BATCH_DECODE_SHORT))
    own = {model: dict(entries) for model, entries in decode_attention.DEVICE_SHORT_CONFIGS.items()}
    monkeypatch.setattr(decode_attention, "DEVICE_SHORT_CONFIGS", own)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None  # the model whose entry it edits
    monkeypatch.setattr(fused_ops, "EARLY_TRIGGER_ROWS", fused_ops.EARLY_TRIGGER_ROWS)
    for name in ("qkv_p4", "o_p4", "glu_2t", "down_p6"):
        probe.apply_gemm(GEMMS[name])
    n_qkv, k_qkv, _ = probe.QKV
    assert skinny_gemm.skinny_config(48, n_qkv, k_qkv) == GEMMS["qkv_p4"].config._replace(block_m=64)
    assert skinny_gemm.partials_config(40, *probe.O[:2]) == GEMMS["o_p4"].config
    assert skinny_gemm.prefers_fused("glu", 64, *probe.GATE_UP[:2])
    assert skinny_gemm.fused_config("glu", 64, *probe.GATE_UP[:2]) == GEMMS["glu_2t"].config
    assert skinny_gemm.prefers_skinny(64, *probe.DOWN[:2])
    probe.apply_attention(probe.ATTENTION_VARIANTS["attn16_p128t32"])
    short = decode_attention.short_table_config(16, 300, False, gpu)
    assert short is not None and (short.partition_size, short.tile_size) == (128, 32)
    monkeypatch.setattr(store_kv, "triggers_first", store_kv.triggers_first)
    probe.apply_trigger(*probe.TRIGGER_VARIANTS["prologue_first"])
    monkeypatch.setattr(fused_ops, "use_pdl", lambda device: True)  # as on a GPU with PDL
    assert store_kv.triggers_first(torch.device("cpu"), 8) and not store_kv.triggers_first(torch.device("cpu"), 65)
    assert not fused_ops.triggers_first(torch.device("cpu"), 8)  # the other small kernels keep the shipped rows
    probe.apply_trigger(*probe.TRIGGER_VARIANTS["trigger_2"])
    assert fused_ops.EARLY_TRIGGER_ROWS == (2, 64) and fused_ops.triggers_first(torch.device("cpu"), 8)


def test_prefetch_variants_set_the_rows_the_dispatcher_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(skinny_gemm, "NORM_PREFETCH", skinny_gemm.NORM_PREFETCH)
    monkeypatch.setattr(skinny_gemm, "NORM_PREFETCH_ROWS", skinny_gemm.NORM_PREFETCH_ROWS)
    monkeypatch.setattr(skinny_gemm, "on_gpu", lambda t: True)
    gate_up = torch.empty(probe.GATE_UP[:2], dtype=torch.bfloat16)
    probe.apply_prefetch(probe.PREFETCH_VARIANTS["pf_to64"])
    assert skinny_gemm.prefetches_for_cublas(64, gate_up) and skinny_gemm.prefetches_for_cublas(32, gate_up)
    probe.apply_prefetch(probe.PREFETCH_VARIANTS["pf_off"])
    assert not skinny_gemm.prefetches_for_cublas(32, gate_up)


def test_skipped_norms_still_pass_a_prefetch_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """``no_norms``' stand-in for the norm takes the prefetch ``norm_linear`` hands it, and runs the real norm (with
    it) for the projections it does not skip."""
    seen = []
    monkeypatch.setattr(skinny_gemm, "fused_add_rmsnorm", lambda x, r, w, eps, prefetch=None: seen.append(prefetch))
    probe.skip_norms((4096,))
    x, weight = torch.randn(32, 8), torch.randn(8)
    assert skinny_gemm.fused_add_rmsnorm(x, x, weight, 1e-6, weight) is None and seen == [weight]
