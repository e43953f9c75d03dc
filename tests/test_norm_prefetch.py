"""The add + RMSNorm that asks L2 for the weight of the cuBLAS product after it (``fused_ops.fused_add_rmsnorm``'s
prefetch, ``skinny_gemm.prefetches_for_cublas``): which products get it, that ``norm_linear`` hands the weight over,
that the prefetch sits before the kernel's launch wait in the sm_90 code, and that it changes no value."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fnvllm.kernels import fused_ops
from fnvllm.kernels import skinny_gemm as sg
from fnvllm.kernels.reference import add_rmsnorm_ref

ROOT = Path(__file__).resolve().parents[1]
# Qwen3-0.6B: gate/up (6144 x 1024, 12 MiB in bf16) goes to cuBLAS at 17-64 rows, qkv (4096 x 1024) to the skinny kernel
GATE_UP, QKV = (6144, 1024), (4096, 1024)


@pytest.fixture
def prefetch_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch on, and CPU tensors taken for GPU ones by the dispatchers (``on_gpu``)."""
    monkeypatch.setattr(sg, "NORM_PREFETCH", True)
    monkeypatch.setattr(sg, "on_gpu", lambda t: True)


def _weight(shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


@pytest.mark.usefixtures("prefetch_on")
def test_only_a_cublas_product_at_17_to_32_rows_that_fits_the_budget_is_prefetched() -> None:
    assert not sg.prefers_skinny(32, *GATE_UP) and sg.prefers_skinny(32, *QKV)  # the premise, from the tables
    assert sg.prefetches_for_cublas(32, _weight(GATE_UP)) and sg.prefetches_for_cublas(17, _weight(GATE_UP))
    assert not sg.prefetches_for_cublas(32, _weight(QKV))  # the skinny kernel prefetches its own slice
    assert not sg.prefetches_for_cublas(16, _weight(GATE_UP))  # few rows: the skinny kernels' range
    assert not sg.prefetches_for_cublas(33, _weight(GATE_UP))  # 48 and 64 rows measured slower with it
    assert not sg.prefetches_for_cublas(64, _weight(GATE_UP))
    big = _weight((8192, 1025))  # ~16.0 MiB + 16 KiB: over NORM_PREFETCH_MAX_BYTES
    assert big.numel() * big.element_size() > sg.NORM_PREFETCH_MAX_BYTES
    assert not sg.prefetches_for_cublas(32, big)
    assert not sg.prefetches_for_cublas(32, _weight(GATE_UP[::-1]).t())  # not contiguous


def test_the_switch_off_prefetches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sg, "on_gpu", lambda t: True)
    monkeypatch.setattr(sg, "NORM_PREFETCH", False)
    assert not sg.prefetches_for_cublas(32, _weight(GATE_UP))


@pytest.mark.usefixtures("prefetch_on")
@pytest.mark.parametrize("shape,expected", [(GATE_UP, True), (QKV, False)])
def test_norm_linear_hands_the_cublas_weight_to_the_norm(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int], expected: bool
) -> None:
    seen: list[torch.Tensor | None] = []
    products: list[tuple[int, ...]] = []

    def norm(x, residual, weight, eps, prefetch=None):  # the reference, recording what the norm was asked to prefetch
        seen.append(prefetch)
        return add_rmsnorm_ref(x, residual, weight, eps)

    def product(x, weight, bias=None):  # F.linear on the CPU, whichever kernel the GPU would run
        products.append(tuple(weight.shape))
        return torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(sg, "fused_add_rmsnorm", norm)
    monkeypatch.setattr(sg, "linear", product)
    torch.manual_seed(0)
    k = shape[1]
    x, residual = torch.randn(32, k, dtype=torch.bfloat16), torch.randn(32, k, dtype=torch.bfloat16)
    norm_w, weight = torch.rand(k, dtype=torch.bfloat16) + 0.5, torch.randn(shape, dtype=torch.bfloat16) / 32
    y, new_residual = sg.norm_linear(x, residual, norm_w, 1e-6, weight)
    assert (seen[0] is weight) == expected and (seen[0] is None) == (not expected)
    assert products == [shape]
    normed, want_residual = add_rmsnorm_ref(x, residual, norm_w, 1e-6)
    assert torch.equal(new_residual, want_residual)
    assert torch.equal(y, torch.nn.functional.linear(normed, weight))


def test_the_norm_refuses_a_prefetch_it_cannot_read_and_a_hint_changes_no_value() -> None:
    """(On a CPU the interpreter ignores the hint: no PDL; on a GPU it is issued, and the GPU test below checks the
    shapes the engine gives it.)"""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(1)
    x, residual = torch.randn(3, 64, device=dev), torch.randn(3, 64, device=dev)
    weight = torch.rand(64, device=dev) + 0.5
    with pytest.raises(ValueError, match="prefetch must be a contiguous tensor"):
        fused_ops.fused_add_rmsnorm(x, residual, weight, 1e-6, prefetch=torch.randn(8, 16, device=dev).t())
    plain = fused_ops.fused_add_rmsnorm(x, residual, weight, 1e-6)
    hinted = fused_ops.fused_add_rmsnorm(x, residual, weight, 1e-6, prefetch=torch.randn(16, 8, device=dev))
    assert torch.equal(plain[0], hinted[0]) and torch.equal(plain[1], hinted[1])


# Compiles ``_rmsnorm_kernel`` for sm_90 as the launcher does at 17-64 rows under PDL, with and without the prefetch,
# and prints where in the PTX the prefetches and the launch wait are (in a process of its own: the interpreter,
# which the test session turns on, compiles nothing).
_COMPILE = textwrap.dedent(
    """
    import json, os
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fnvllm.kernels import fused_ops
    sig = {"x_ptr": "*fp32", "res_ptr": "*bf16", "res_out_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
           "pf_ptr": "*u8", "pf_lines": "i32", "eps": "fp32", "n_rows": "i32", "n_cols": "i32"}
    report = {}
    for prefetch in (True, False):
        consts = {"HAS_RESIDUAL": True, "NUM_PARTS": 4, "BLOCK": 1024, "USE_PDL": True, "TRIGGER_FIRST": True,
                  "PREFETCH": prefetch}
        names = [*sig, *consts]
        src = ASTSource(fused_ops._rmsnorm_kernel, {**sig, **dict.fromkeys(consts, "constexpr")},
                        constexprs={(names.index(k),): v for k, v in consts.items()},
                        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in sig if n.endswith("_ptr")})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        lines = ptx.splitlines()
        where = lambda text: [i for i, line in enumerate(lines) if text in line]
        report[str(prefetch)] = {"prefetch": where("prefetch.global.L2"), "wait": where("griddepcontrol.wait")}
    print(json.dumps(report))
    """
)


def test_the_prefetch_is_issued_before_the_launch_wait_in_the_hopper_code() -> None:
    """The point of the prefetch is to overlap the kernel before the norm: in the compiled code every prefetch comes
    before ``griddepcontrol.wait``, and without PREFETCH there is none."""
    import json

    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    on, off = report["True"], report["False"]
    assert on["prefetch"] and len(on["wait"]) == 1 and max(on["prefetch"]) < on["wait"][0]
    assert not off["prefetch"] and len(off["wait"]) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (PDL and the inline PTX)")
@pytest.mark.parametrize("rows", [17, 32])
def test_the_prefetching_norm_gives_the_same_bits_on_gpu(rows: int) -> None:
    if not fused_ops.use_pdl(torch.device("cuda")):
        pytest.skip("programmatic dependent launch is off or the GPU is older than sm_90: no prefetch is issued")
    torch.manual_seed(2)
    dev = torch.device("cuda")
    parts = torch.randn(4, rows, 1024, device=dev)  # o_proj's split partials, as at 17-64 rows
    x = fused_ops.SplitPartials(parts, torch.bfloat16)
    residual = torch.randn(rows, 1024, device=dev, dtype=torch.bfloat16)
    norm_w = torch.rand(1024, device=dev, dtype=torch.bfloat16) + 0.5
    gate_up = torch.randn(*GATE_UP, device=dev, dtype=torch.bfloat16)
    plain = fused_ops.fused_add_rmsnorm(x, residual, norm_w, 1e-6)
    hinted = fused_ops.fused_add_rmsnorm(x, residual, norm_w, 1e-6, prefetch=gate_up)
    torch.cuda.synchronize()
    assert torch.equal(plain[0], hinted[0]) and torch.equal(plain[1], hinted[1])
