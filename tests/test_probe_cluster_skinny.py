"""The cluster-staged few-row kernels of ``benchmarks/probe_cluster_skinny.py``: their CUDA builds (nvcc, where it is
installed) and, on an sm_90 GPU, their products against the float32 reference, eagerly and in a CUDA graph."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import probe_cluster_skinny as probe
from fnvllm.kernels import cuda_skinny

# every (kb, glu, nw, cl) the probe launches: CONFIGS' shapes at each cluster size
KERNELS = sorted({(kb, kind == "glu", nw, cl) for name, (kind, _, _) in probe.SHAPES.items()
                  for kb, _, nw in probe.CONFIGS[name] for cl in (1, 2, 4)})  # fmt: skip


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to build for sm_90a")
def test_every_staged_kernel_builds_for_sm90_without_spills(tmp_path: Path) -> None:
    """All the probe's kernels in one source compile for sm_90a (clusters, mapa, ld.shared::cluster, cp.async), and
    ptxas reports each entry point with no spill stores or loads."""
    names, wrappers = zip(*(probe.entry_point(*key) for key in KERNELS), strict=True)
    source = cuda_skinny.DEVICE_SOURCE + probe.BODY + "".join(wrappers)
    path = tmp_path / "staged.cu"
    path.write_text(source)
    done = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "staged.cubin"),
                           str(path)], capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = re.findall(r"Compiling entry function '(\w+)'", done.stderr)
    assert sorted(compiled) == sorted(names)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    assert len(spills) == len(names) and all(s == ("0", "0") for s in spills)


def test_shared_memory_of_every_launch_fits_an_sm() -> None:
    """Every launch's sums and staged x tiles fit the 227 KiB a Hopper block may take, and a block of a cluster of cl
    stages 1 / cl of the tiles that a block alone stages."""
    for kb, _, nw, cl in KERNELS:
        sums = probe.MT * (cuda_skinny.WARPS // nw) * 16 * (cuda_skinny.COLUMNS * nw + 1) * 4
        assert probe.shared_bytes(kb, nw, cl) <= 227 << 10
        assert probe.shared_bytes(kb, nw, 1) - sums == cl * (probe.shared_bytes(kb, nw, cl) - sums)


def test_launch_attributes_have_the_drivers_layout() -> None:
    """``cuda_skinny.launch``'s attributes are CUlaunchAttribute's 72 bytes (id, padding, a 64-byte value union), the
    cluster's dimensions at the value's start, as the driver reads them."""
    attr = cuda_skinny._LaunchAttr(id=cuda_skinny._CLUSTER_DIMENSION)
    attr.value.cluster_dim = cuda_skinny._Dim3(4, 1, 1)
    raw = bytes(attr)
    assert len(raw) == 72 and raw[:4] == (4).to_bytes(4, "little")
    assert raw[8:20] == b"".join(v.to_bytes(4, "little") for v in (4, 1, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("kb", "glu", "nw", "cl"), KERNELS)
def test_every_staged_kernel_gives_the_product_eagerly_and_in_a_graph(kb: int, glu: bool, nw: int, cl: int) -> None:
    """At 33, 48 and 64 rows (tiles past M skipped, rows past M zero), N = 256: the staged kernel's partials sum to
    the float32 product (or gate/up's SiLU-and-mul matches ``glu_out_ref``), and a CUDA-graph replay gives the eager
    bits."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the kernels need sm_90 (clusters, griddepcontrol)")
    kind, split = ("glu", 1) if glu else ("partials", 2)
    k = split * cuda_skinny.WARPS // nw * 32 * kb
    gen = torch.Generator().manual_seed(kb * 100 + nw * 10 + cl)
    w = (torch.randn(256, k, generator=gen) / k**0.5).to("cuda", torch.bfloat16)
    for m in (33, 48, 64):
        x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
        eager = probe.staged_product(kind, kb, split, nw, cl, x, w)
        assert probe.result_error(kind, x, w, eager) is None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = probe.staged_product(kind, kb, split, nw, cl, x, w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)
