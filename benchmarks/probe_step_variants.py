"""Run an fnvllm command (``fnvllm.cli``) with one decode-step variant applied: a probe for the whole step, GPU.

    PYTHONPATH=$PWD python3 benchmarks/probe_step_variants.py VARIANT[+VARIANT...] bench --model CK \
        --model-shape qwen3-0.6b --latency 32,64 --profile --json

Two kinds of variant, both applied in this process before the command runs (they change what the CUDA graphs
capture, so a run measures the variant's whole decode step; one process per run, alternated with ``base``):

- ``no_norms``, ``no_qkv_norm``, ``no_mlp_norm``: the residual add + RMSNorm launch before every qkv and/or gate/up
  projection at 2-64 rows is skipped, its output replaced by the residual stream as it stands (wrong values of the
  right shapes). Not a model: an upper bound on what removing those launches from the chain could save.
- ``no_attention``: the attention kernel after the fused prologue (``attend_stored``) is skipped, its output
  replaced by q: the same kind of bound for the attention launch.
- launch-shape entries for the Qwen3-0.6B projections at 17-64 rows (``TABLE_VARIANTS``): ``skinny_gemm``'s tables
  with the entry put in, as if measured faster (weights read before the programmatic-dependent-launch wait, where
  a chain of launches with a norm between them may hide what a chain of GEMMs alone does not).
- ``attn16_*`` / ``attn64_*``: the decode attention's knobs for 9-16 / 49-64 sequences at short contexts
  (``decode_attention.SMALL_BATCH_DECODE_SHORT``, the latency bench's case): finer partitions or tiles than the
  entry that won alone (fifth and twelfth sessions), since in the step the kernel before it may change the trade;
  and every other knob of the entry (warps, stages, a 128-token tile, the GQA product (``_sum``, the transposed
  ``_kq``), prefetch, no preload, the grid order) alone or in pairs (``_w8``, ``_s2``, ``_nopre``, ``_w8s2``, ...).
- ``pf_off``, ``pf_to48``, ``pf_to64``: the add + RMSNorm before a cuBLAS projection asks L2 for its weight
  (``skinny_gemm.prefetches_for_cublas``) never, or at 17-48 / 17-64 rows instead of the shipped 17-32.
- ``trigger_2``: the small kernels between projections let the next launch start before their own wait from 2 rows
  (``fused_ops.EARLY_TRIGGER_ROWS`` (2, 64); shipped from 17). ``prologue_first``: the attention prologue alone
  (``store_kv.norm_rope_store``) does so from 2 rows, so the attention launch is placed, and preloads its first
  K/V tile, while the qkv projection still runs.
- ``cuda:ENTRIES``: ``cuda_skinny.CUDA_CONFIGS`` entries in ``bench_cuda_skinny.py run --entries``' form (e.g.
  ``cuda:gate_up=4x1@32,qkv=2x2@64``): the CUDA kernels, which read a thread's whole weight share before the wait.

``base`` applies nothing. Outputs are the command's own (``bench --json``: ms per step, device and host ms per step).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

QKV, O, GATE_UP, DOWN = (4096, 1024, 64), (1024, 2048, 64), (6144, 1024, 64), (1024, 3072, 64)
# which projection's norm a variant skips, by the projection's output features (Qwen3-0.6B: qkv 4096, gate/up 6144)
NORM_VARIANTS = {"no_norms": (4096, 6144), "no_qkv_norm": (4096,), "no_mlp_norm": (6144,)}


class Gemm(NamedTuple):
    """A launch-shape variant: ``table`` "tuned" (``TUNED_CONFIGS``: the plain product, or ``linear_partials``' split
    where split_k > 1), "partials" (``PARTIALS_CONFIGS``) or "glu" (``FUSED_TIMES``' gate/up with SiLU-and-mul), at
    key (N, K, rows bucket), with this config (a ``skinny_gemm.SkinnyConfig``)."""

    table: str
    key: tuple[int, int, int]
    config: Any


class Attention(NamedTuple):
    """An attention variant: ``SMALL_BATCH_DECODE_SHORT[rows]`` with these knobs replaced."""

    rows: tuple[int, int]
    knobs: dict[str, Any]


def gemm_variants() -> dict[str, Gemm]:
    """name -> the launch shape it puts in skinny_gemm's tables (imported here: after sys.path)."""
    from fnvllm.kernels.skinny_gemm import SkinnyConfig as C

    return {
        "qkv_p4": Gemm("tuned", QKV, C(64, 32, 256, 4, 4, 1, preload=True)),  # split: the attention prologue sums
        "qkv_p2": Gemm("tuned", QKV, C(64, 32, 512, 2, 8, 1, preload=True)),
        "qkv_1p": Gemm("tuned", QKV, C(64, 32, 256, 1, 4, 1, preload=True)),
        "qkv_1p64": Gemm("tuned", QKV, C(64, 64, 128, 1, 4, 1, preload=True)),
        "qkv_1t": Gemm("tuned", QKV, C(64, 16, 1024, 1, 8, 1, preload=True)),  # one tile a program: all before the wait
        "o_p4": Gemm("partials", O, C(64, 32, 512, 4, 8, 1, preload=True)),
        "o_p8": Gemm("partials", O, C(64, 32, 256, 8, 4, 1, preload=True)),
        "gu_1p": Gemm("tuned", GATE_UP, C(64, 32, 256, 1, 4, 1, preload=True)),  # skinny in place of cuBLAS
        "gu_1t": Gemm("tuned", GATE_UP, C(64, 16, 1024, 1, 8, 1, preload=True)),
        "gu_tuned": Gemm("tuned", GATE_UP, C(64, 32, 128, 1, 4, 4)),  # its own measured best, weights prefetched
        "glu_1p": Gemm("glu", GATE_UP, C(64, 32, 256, 1, 4, 1, preload=True)),  # SiLU-and-mul in gate/up's epilogue
        "glu_base": Gemm("glu", GATE_UP, C(64, 32, 128, 1, 4, 4)),
        "glu_2t": Gemm("glu", GATE_UP, C(64, 32, 512, 1, 8, 1, preload=True)),
        "down_p6": Gemm("tuned", DOWN, C(64, 32, 512, 6, 8, 1, preload=True)),
        "down_p4": Gemm("tuned", DOWN, C(64, 32, 256, 4, 4, 1, preload=True)),
    }


ATTENTION_VARIANTS = {
    "attn16_p256": Attention((9, 16), {"partition_size": 256}),
    "attn16_p128": Attention((9, 16), {"partition_size": 128}),
    "attn16_t32": Attention((9, 16), {"tile_size": 32}),
    "attn16_p128t32": Attention((9, 16), {"partition_size": 128, "tile_size": 32}),
    "attn64_p256": Attention((49, 64), {"partition_size": 256}),
    "attn64_t16": Attention((49, 64), {"tile_size": 16}),
    # the knobs the sweeps above left alone: warps, stages, a wider tile, the GQA product, the register double
    # buffer in place of cp.async stages, no preload before the wait, and the grid's (B, Hkv) order
    **{
        f"attn{rows[1]}_{tag}": Attention(rows, knobs)
        for rows in ((9, 16), (49, 64))
        for tag, knobs in (
            ("w8", {"num_warps": 8}),
            ("w2", {"num_warps": 2}),
            ("s2", {"num_stages": 2}),
            ("s4", {"num_stages": 4}),
            ("t128", {"tile_size": 128}),
            ("sum", {"gqa_mode": "sum"}),
            ("pf", {"prefetch": True, "num_stages": 1}),
            ("nopre", {"preload_kv": False}),
            ("pre", {"preload_kv": True}),  # (the shared entries' own knobs, against a GPU model's own entry)
            ("s3", {"num_stages": 3}),
            ("bh", {"heads_inner": False}),
            ("w8s2", {"num_warps": 8, "num_stages": 2}),
            ("t128w8s2", {"tile_size": 128, "num_warps": 8, "num_stages": 2}),
            ("nopres2", {"preload_kv": False, "num_stages": 2}),
            ("kq", {"gqa_mode": "kq"}),  # the transposed products (heads padded to 8, not 16)
            ("kqw2", {"gqa_mode": "kq", "num_warps": 2}),
        )
    },
}
# name -> (which kernels, the fewest rows at which they trigger first): every small kernel between two projections,
# or the attention prologue alone (so the attention launch is placed, and preloads, while the qkv product runs)
TRIGGER_VARIANTS = {"trigger_2": ("small", 2), "prologue_first": ("prologue", 2)}
# name -> the rows at which the add + RMSNorm before a cuBLAS projection asks L2 for its weight
# (``skinny_gemm.NORM_PREFETCH_ROWS``; shipped 17-32), None: never (as ``FNVLLM_NORM_PREFETCH=0``)
PREFETCH_VARIANTS: dict[str, tuple[int, int] | None] = {"pf_off": None, "pf_to48": (17, 48), "pf_to64": (17, 64)}


def apply_gemm(variant: Gemm) -> None:
    """Put the variant's launch shape in its table, as if measured faster than cuBLAS / the unfused pair."""
    from fnvllm.kernels import skinny_gemm as sg

    if variant.table == "glu":
        sg.FUSED_TIMES[("glu", *variant.key)] = sg.Fused(variant.config, 1.0, 2.0)
    else:
        table = sg.TUNED_CONFIGS if variant.table == "tuned" else sg.PARTIALS_CONFIGS
        table[variant.key] = sg.Tuned(variant.config, 1.0, 2.0)


def apply_attention(variant: Attention) -> None:
    """Replace the variant's knobs in the short-context attention entry for its sequence counts: the GPU model's own
    (``DEVICE_SHORT_CONFIGS``) where it has one, else the shared table's."""
    import dataclasses

    import torch

    from fnvllm.kernels import decode_attention as da
    from fnvllm.kernels.fused_ops import gpu_model

    # (the launcher's own lookup of the model: fused_ops.gpu_model)
    own = da.DEVICE_SHORT_CONFIGS.get(gpu_model(torch.cuda.current_device()), {}) if torch.cuda.is_available() else {}
    table = own if variant.rows in own else da.SMALL_BATCH_DECODE_SHORT
    table[variant.rows] = dataclasses.replace(table[variant.rows], **variant.knobs)


def apply_trigger(kernels: str, lowest_rows: int) -> None:
    """Let the small kernels ("small": ``fused_ops.EARLY_TRIGGER_ROWS``) or the attention prologue alone
    ("prologue": ``store_kv``'s own ``triggers_first``) trigger first from lowest_rows rows."""
    from fnvllm.kernels import fused_ops, store_kv

    highest = fused_ops.EARLY_TRIGGER_ROWS[1]
    if kernels == "small":
        fused_ops.EARLY_TRIGGER_ROWS = (lowest_rows, highest)
    else:
        store_kv.triggers_first = lambda device, rows: fused_ops.use_pdl(device) and lowest_rows <= rows <= highest


def apply_prefetch(rows: tuple[int, int] | None) -> None:
    """Let the norm before a cuBLAS projection prefetch its weight at these rows, or never (None)."""
    from fnvllm.kernels import skinny_gemm

    if rows is None:
        skinny_gemm.NORM_PREFETCH = False
    else:
        skinny_gemm.NORM_PREFETCH, skinny_gemm.NORM_PREFETCH_ROWS = True, rows


def skip_norms(out_features: tuple[int, ...]) -> None:
    """Replace ``skinny_gemm.fused_add_rmsnorm`` so that before a projection of those output features at 2-64 rows
    it launches nothing and returns (residual, residual)."""
    from fnvllm.kernels import skinny_gemm

    real = skinny_gemm.fused_add_rmsnorm

    def patched(x: Any, residual: Any, weight: Any, eps: float, prefetch: Any = None) -> Any:
        caller = sys._getframe(1).f_locals  # norm_linear's weight or norm_mlp's gate_up_weight
        proj = caller.get("weight", caller.get("gate_up_weight"))
        if proj is not None and proj.shape[0] in out_features and 2 <= residual.shape[0] <= 64:
            return residual, residual
        return real(x, residual, weight, eps, prefetch)

    skinny_gemm.fused_add_rmsnorm = patched


def skip_attention() -> None:
    """Replace the model's ``attend_stored`` (attention over the stored K/V after the fused prologue) by a function
    that launches nothing and returns q (T, Hq, D): the attention's output shape."""
    from fnvllm.model import models

    models.attend_stored = lambda q, *args, **kwargs: q


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: probe_step_variants.py VARIANT[+VARIANT...] fnvllm-args...\n\n{__doc__}")
        return 0 if argv else 2
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    gemms = gemm_variants()
    names = argv[0].split("+")
    known = {"base", "no_attention", *NORM_VARIANTS, *gemms, *ATTENTION_VARIANTS, *TRIGGER_VARIANTS, *PREFETCH_VARIANTS}
    unknown = [n for n in names if n not in known and not n.startswith("cuda:")]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(sorted(known))}, cuda:ENTRIES")
    for name in names:
        if name in NORM_VARIANTS:
            skip_norms(NORM_VARIANTS[name])
        elif name == "no_attention":
            skip_attention()
        elif name in gemms:
            apply_gemm(gemms[name])
        elif name in ATTENTION_VARIANTS:
            apply_attention(ATTENTION_VARIANTS[name])
        elif name in TRIGGER_VARIANTS:
            apply_trigger(*TRIGGER_VARIANTS[name])
        elif name in PREFETCH_VARIANTS:
            apply_prefetch(PREFETCH_VARIANTS[name])
        elif name.startswith("cuda:"):
            from benchmarks.bench_cuda_skinny import apply_entries, parse_entries

            apply_entries(parse_entries(name.removeprefix("cuda:")))
    print(f"variant {argv[0]}", flush=True)
    from fnvllm.cli import main as cli_main

    return cli_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
