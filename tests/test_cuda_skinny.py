"""The few-row CUDA projections (``fnvllm.kernels.cuda_skinny``): which products they take and, on a GPU, their
results against ``F.linear`` / ``silu_and_mul(F.linear)`` and through the dispatchers and CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fnvllm.kernels import cuda_skinny, skinny_gemm
from fnvllm.kernels.cuda_skinny import CUDA_CONFIGS, DEVICE_CONFIGS, CudaConfig, cuda_config
from fnvllm.kernels.fused_ops import SplitPartials, fused_add_rmsnorm, silu_and_mul

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PARTIALS = [key for key in CUDA_CONFIGS if key[0] == "partials"]
GLU = [key for key in CUDA_CONFIGS if key[0] == "glu"]
# every launch shape shipped: CUDA_CONFIGS' entries and each GPU model's own (DEVICE_CONFIGS)
ALL_ENTRIES = [*CUDA_CONFIGS.items(), *(item for table in DEVICE_CONFIGS.values() for item in table.items())]


def _row_range(tile: int) -> tuple[int, int]:
    """The rows a tile size covers: 2-16, 17-32, 33-64."""
    index = cuda_skinny.TILE_ROWS.index(tile)
    return (2 if index == 0 else cuda_skinny.TILE_ROWS[index - 1] + 1), tile


def _cases(keys: list[tuple[str, int, int, int]]) -> list[tuple[tuple[str, int, int, int], int]]:
    """(entry, rows) pairs: each entry at the ends of its row range and one row count between them."""
    cases = []
    for key in keys:
        lo, hi = _row_range(key[3])
        cases += [(key, m) for m in sorted({lo, (lo + hi) // 2 + 1, hi})]
    return cases


def _operands(m: int, n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) and weight (N, K) in bf16, seeded by the shape, scaled so the products are O(1)."""
    gen = torch.Generator().manual_seed(m * 7919 + n + k)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, torch.bfloat16)
    return x, w


@pytest.mark.parametrize(("key", "cfg"), ALL_ENTRIES)
def test_every_entry_covers_its_k_and_has_a_kernel(key: tuple[str, int, int, int], cfg: CudaConfig) -> None:
    """Each entry's launch shape (CUDA_CONFIGS' and every GPU model's) spans K exactly (split x 8 warps x 32 x kb)
    and names a kernel of the source."""
    kind, n, k, tile = key
    assert cfg.split * cuda_skinny.WARPS // cfg.nw * 32 * cfg.kb == k
    assert n % (cuda_skinny.COLUMNS * cfg.nw) == 0 and tile in cuda_skinny.TILE_ROWS
    assert (kind, cfg.kb, tile, cfg.nw) in cuda_skinny._KERNELS
    assert kind != "glu" or cfg.split == 1


@pytest.mark.parametrize("entry", list(cuda_skinny._KERNELS.items()))
def test_every_kernel_is_instantiated_with_its_kb_and_tiles(entry: tuple[tuple[str, int, int, int], str]) -> None:
    """Each (kind, kb, tile rows, nw) names an entry point SOURCE instantiates with that kb, tile count and nw."""
    (kind, kb, tile, nw), name = entry
    macro = "GLU_OUT" if kind == "glu" else "PARTIALS"
    assert f"\n{macro}({kb}, {tile // 16}, {nw}, {name})\n" in cuda_skinny.SOURCE


def test_tile_rows_and_shared_memory() -> None:
    """Rows map to the smallest tile holding them; one tile keeps static shared memory, more take (tiles, 8 warps,
    16, 33) floats."""
    assert [cuda_skinny.tile_rows(m) for m in (1, 16, 17, 32, 33, 64, 65)] == [16, 16, 32, 32, 64, 64, None]
    assert [cuda_skinny.shared_bytes(t) for t in (16, 32, 64)] == [0, 2 * 8 * 16 * 33 * 4, 4 * 8 * 16 * 33 * 4]
    assert cuda_skinny.shared_bytes(64, nw=2) == 4 * 4 * 16 * 65 * 4  # four K warps, 64 columns


def test_cpu_tensors_never_take_the_cuda_path() -> None:
    """On the CPU every table shape stays on the other path, and linear_partials gives F.linear's product."""
    for kind, n, k, tile in CUDA_CONFIGS:
        x, w = _operands(tile, n, k, "cpu")
        assert cuda_config(kind, x, w) is None
    x, w = _operands(16, *PARTIALS[0][1:3], "cpu")
    out = skinny_gemm.linear_partials(x, w)
    assert isinstance(out, torch.Tensor) and torch.equal(out, F.linear(x, w))


@pytest.mark.parametrize(("value", "expected"), [("0", False), ("1", True), (None, True)])
def test_switch_reads_zero_and_one(monkeypatch: pytest.MonkeyPatch, value: str | None, expected: bool) -> None:
    """FNVLLM_CUDA_SKINNY: "0" off, "1" or unset on."""
    if value is None:
        monkeypatch.delenv(cuda_skinny.ENV, raising=False)
    else:
        monkeypatch.setenv(cuda_skinny.ENV, value)
    assert cuda_skinny.enabled_from_env() is expected


def test_switch_rejects_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any other value is a ValueError naming the variable."""
    monkeypatch.setenv(cuda_skinny.ENV, "yes")
    with pytest.raises(ValueError, match="FNVLLM_CUDA_SKINNY"):
        cuda_skinny.enabled_from_env()


@pytest.mark.parametrize(
    ("m", "n", "k", "weight_k", "config"),
    [(65, 4096, 1024, 1024, CudaConfig(2, 2)), (16, 4010, 1024, 1024, CudaConfig(2, 2)),
     (16, 4096, 1000, 1000, CudaConfig(2, 2)), (20, 4096, 1024, 1024, CudaConfig(4, 1)),
     (16, 4096, 1024, 2048, CudaConfig(2, 2)), (20, 4128, 1024, 1024, CudaConfig(2, 4, 2))],
)  # fmt: skip
def test_a_shape_the_launch_does_not_cover_is_refused(
    m: int, n: int, k: int, weight_k: int, config: CudaConfig
) -> None:
    """More than 64 rows, N not a multiple of 32 * nw, K other than split * 8 / nw * 32 * kb, no kernel for (kb,
    tile rows, nw), or x's K not the weight's: a ValueError saying what fits, before anything is launched."""
    x, w = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(n, weight_k, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M in \\[1, 64\\]"):
        cuda_skinny.skinny_partials(x, w, config)


def test_a_gpu_model_takes_its_own_entries_and_others_the_shared_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """listed_config: on a model DEVICE_CONFIGS names, its entry in place of CUDA_CONFIGS' for that product and
    CUDA_CONFIGS' for the others; on any other model, CUDA_CONFIGS'; device_table agrees with it for every key."""
    model, own = "GPU model X", CudaConfig(4, 3)
    key, other = ("partials", 1024, 3072, 16), ("partials", 4096, 1024, 16)
    monkeypatch.setitem(DEVICE_CONFIGS, model, {key: own})
    monkeypatch.setitem(CUDA_CONFIGS, key, CudaConfig(2, 6))
    monkeypatch.setitem(CUDA_CONFIGS, other, CudaConfig(2, 2))
    names = {0: model, 1: "GPU model Y"}
    monkeypatch.setattr(cuda_skinny, "_device_name", names.__getitem__)
    gpu0, gpu1, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    assert cuda_skinny.listed_config(key, gpu0) == own and cuda_skinny.listed_config(other, gpu0) == CudaConfig(2, 2)
    assert cuda_skinny.listed_config(key, gpu1) == cuda_skinny.listed_config(key, cpu) == CudaConfig(2, 6)
    assert cuda_skinny.listed_config(("glu", 64, 64, 16), gpu0) is None
    for device in (gpu0, gpu1):
        table = cuda_skinny.device_table(names[device.index])
        assert set(table) == set(CUDA_CONFIGS) and all(table[k] == cuda_skinny.listed_config(k, device) for k in table)


def test_the_benchmark_entries_replace_a_gpu_models_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_cuda_skinny.py run --entries: the entry goes in CUDA_CONFIGS and no GPU model keeps its own for that
    product (what the step runs measure is the entry asked for), the model's other entries stay."""
    from benchmarks.bench_cuda_skinny import apply_entries

    key, kept = ("partials", 1024, 3072, 16), ("partials", 4096, 1024, 16)
    monkeypatch.setattr(cuda_skinny, "CUDA_CONFIGS", dict(CUDA_CONFIGS))
    monkeypatch.setattr(cuda_skinny, "DEVICE_CONFIGS", {"GPU model X": {key: CudaConfig(4, 3), kept: CudaConfig(1, 4)}})
    apply_entries({key: (1, 12, 1)})
    assert cuda_skinny.CUDA_CONFIGS[key] == CudaConfig(1, 12)
    assert cuda_skinny.DEVICE_CONFIGS["GPU model X"] == {kept: CudaConfig(1, 4)}


def test_glu_out_refuses_a_k_split() -> None:
    """The SiLU-and-mul epilogue needs whole sums: a config with more than one K split is a ValueError."""
    x, w = torch.empty(16, 1024, dtype=torch.bfloat16), torch.empty(6144, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one K split"):
        cuda_skinny.glu_out(x, w, CudaConfig(2, 2))


@pytest.mark.gpu
@needs_cuda
def test_the_table_shapes_take_the_cuda_path_on_this_gpu() -> None:
    """On an sm_90+ GPU the kernels compile and every entry is taken at both ends of its row range, and not at
    the rows next to the range that no entry of the same product covers (1 row; past 64)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the kernels need sm_90 (griddepcontrol)")
    table = cuda_skinny.device_table(torch.cuda.get_device_name())
    for kind, n, k, tile in table:
        lo, hi = _row_range(tile)
        for rows in (lo - 1, lo, hi, hi + 1):
            x, w = _operands(rows, n, k, "cuda")
            listed = table.get((kind, n, k, cuda_skinny.tile_rows(rows) or 0)) if rows >= 2 else None
            assert cuda_config(kind, x, w) == listed, (kind, n, k, rows)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("key", "config", "m"),
    [(key, config, m) for key, config in ALL_ENTRIES if key[0] == "partials" for _, m in _cases([key])],
)
def test_split_partials_sum_to_the_product(key: tuple[str, int, int, int], config: CudaConfig, m: int) -> None:
    """The (S, M, N) float32 partials sum to F.linear's float32 product to float32 rounding, for CUDA_CONFIGS'
    launch shapes and each GPU model's own."""
    _, n, k, _ = key
    x, w = _operands(m, n, k, "cuda")
    parts = cuda_skinny.skinny_partials(x, w, config)
    assert parts.shape == (config.split, m, n) and parts.dtype == torch.float32
    exact = F.linear(x.float(), w.float())
    torch.testing.assert_close(parts.sum(0), exact, rtol=1e-5, atol=1e-5)


def test_glu_reference_rounds_the_product_first_and_the_match_allows_two_steps() -> None:
    """glu_out_ref is silu(gate) * up of the bf16-rounded float32 product; glu_out_matches takes a result two bf16
    steps off in a few elements and refuses three steps, a 3 % share of changed elements, or another shape."""
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    w = (torch.randn(128, 256, generator=torch.Generator().manual_seed(2)) / 16).bfloat16()
    ref = cuda_skinny.glu_out_ref(x, w)
    gate, up = F.linear(x.float(), w.float()).bfloat16().float().chunk(2, dim=-1)
    assert torch.equal(ref, (gate * torch.sigmoid(gate) * up).bfloat16())

    def stepped(steps: int, count: int) -> torch.Tensor:
        """ref with its first count elements (each above 1/4 in size) moved steps bf16 steps up."""
        bits = ref.view(torch.int16).flatten().clone()
        where = (ref.float().abs() > 0.25).flatten().nonzero()[:count, 0]
        bits[where] += steps
        return bits.view(torch.bfloat16).view_as(ref)

    assert cuda_skinny.glu_out_matches(ref, ref)
    assert cuda_skinny.glu_out_matches(stepped(2, 5), ref)
    assert not cuda_skinny.glu_out_matches(stepped(3, 1), ref)
    assert not cuda_skinny.glu_out_matches(stepped(1, ref.numel() * 3 // 100), ref)
    assert not cuda_skinny.glu_out_matches(ref[:4], ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("key", "m"), _cases(GLU))
def test_glu_epilogue_matches_silu_and_mul_of_the_product(key: tuple[str, int, int, int], m: int) -> None:
    """silu(gate) * up from the products rounded to bf16 (glu_out_ref): within the two bf16 steps the kernel's sum
    order allows, nearly all elements equal; and the cuBLAS path (silu_and_mul(F.linear(x, w))) within the same."""
    _, n, k, _ = key
    x, w = _operands(m, n, k, "cuda")
    got = cuda_skinny.glu_out(x, w, CUDA_CONFIGS[key])
    assert got.shape == (m, n // 2) and got.dtype == torch.bfloat16
    assert cuda_skinny.glu_out_matches(got, cuda_skinny.glu_out_ref(x, w))
    assert cuda_skinny.glu_out_matches(got, silu_and_mul(F.linear(x, w)))


@pytest.mark.gpu
@needs_cuda
def test_dispatchers_take_it_and_a_graph_replay_gives_the_same_bits() -> None:
    """linear_partials and norm_mlp's gate/up at 16 rows return the CUDA kernels' values, and replaying them in a
    CUDA graph (programmatic dependent launch on) reproduces the eager bits."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the kernels need sm_90 (griddepcontrol)")
    key = PARTIALS[0]
    x, w = _operands(16, *key[1:3], "cuda")
    got = skinny_gemm.linear_partials(x, w)
    assert isinstance(got, SplitPartials)
    assert torch.equal(got.parts, cuda_skinny.skinny_partials(x, w, cuda_skinny.listed_config(key, w.device)))
    gx, gw = _operands(16, *GLU[0][1:3], "cuda")
    _, down = _operands(16, gx.shape[1], gw.shape[0] // 2, "cuda")  # (K, I): the MLP's down projection
    residual, norm_w = torch.randn_like(gx), torch.rand(gx.shape[1], device="cuda", dtype=torch.bfloat16) + 0.5
    y, new_residual = skinny_gemm.norm_mlp(gx, residual, norm_w, 1e-6, gw, None, down)
    normed, expected_residual = fused_add_rmsnorm(gx, residual, norm_w, 1e-6)
    act = cuda_skinny.glu_out(normed.contiguous(), gw, CUDA_CONFIGS[GLU[0]])
    assert torch.equal(new_residual, expected_residual) and torch.equal(y, skinny_gemm.linear(act, down))
    eager_parts, eager_glu = got.parts.clone(), cuda_skinny.glu_out(gx, gw, CUDA_CONFIGS[GLU[0]])
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        parts = cuda_skinny.skinny_partials(x, w, cuda_skinny.listed_config(key, w.device))
        glu = cuda_skinny.glu_out(gx, gw, CUDA_CONFIGS[GLU[0]])
    for _ in range(3):
        parts.zero_()
        glu.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(parts, eager_parts) and torch.equal(glu, eager_glu)


@pytest.mark.gpu
@needs_cuda
def test_first_use_inside_a_graph_capture_keeps_the_triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Modules are not loaded while a stream captures: a first use there gets None (Triton) and builds nothing;
    the next use outside the capture builds the kernels and takes the entry."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the kernels need sm_90 (griddepcontrol)")
    monkeypatch.setattr(cuda_skinny, "_BUILT", {})
    kind, n, k, tile = PARTIALS[0]
    x, w = _operands(tile, n, k, "cuda")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        inside = cuda_config(kind, x, w)
    assert inside is None and cuda_skinny._BUILT == {}
    assert cuda_config(kind, x, w) == cuda_skinny.listed_config(PARTIALS[0], w.device)


def _kernel_cases() -> list[tuple[str, int, int, int, int]]:
    """(kind, kb, tile rows, nw, rows) for every kernel SOURCE defines, at the ends and the middle of its rows."""
    return [(kind, kb, tile, nw, m) for kind, kb, tile, nw in cuda_skinny._KERNELS
            for m in sorted(set(_row_range(tile)) | {sum(_row_range(tile)) // 2})]  # fmt: skip


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("kind", "kb", "tile", "nw", "m"), _kernel_cases())
def test_every_kernel_gives_the_product_eagerly_and_in_a_graph(kind: str, kb: int, tile: int, nw: int, m: int) -> None:
    """Each kernel of SOURCE (listed in CUDA_CONFIGS or not: a benchmark may list it) on a small shape: partials
    that sum to the float32 product, or silu(gate) * up within a bf16 step of silu_and_mul(F.linear); replaying it
    in a CUDA graph gives the eager bits (the launches past one tile take dynamic shared memory)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the kernels need sm_90 (griddepcontrol)")
    config = CudaConfig(kb, 1 if kind == "glu" else 2, nw)
    k = config.split * cuda_skinny.WARPS // nw * 32 * kb
    x, w = _operands(m, 256, k, "cuda")
    run = cuda_skinny.glu_out if kind == "glu" else cuda_skinny.skinny_partials
    eager = run(x, w, config)
    if kind == "glu":
        ref = silu_and_mul(F.linear(x, w))
        torch.testing.assert_close(eager.float(), ref.float(), rtol=2**-7, atol=1e-3)
        assert (eager == ref).float().mean().item() > 0.98
    else:
        torch.testing.assert_close(eager.sum(0), F.linear(x.float(), w.float()), rtol=1e-5, atol=1e-5)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        replayed = run(x, w, config)
    replayed.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [17, 33, 64])
def test_norm_mlp_takes_a_listed_glu_entry_past_16_rows(monkeypatch: pytest.MonkeyPatch, m: int) -> None:
    """With a "glu" entry for the rows' tile (past 16 rows the gate/up product otherwise goes to cuBLAS and the
    SiLU-and-mul kernel), norm_mlp computes the activation with glu_out after the add + RMSNorm."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the kernels need sm_90 (griddepcontrol)")
    n, k = 512, 1024
    config = CudaConfig(4, 1)
    monkeypatch.setitem(CUDA_CONFIGS, ("glu", n, k, cuda_skinny.tile_rows(m)), config)
    x, gw = _operands(m, n, k, "cuda")
    _, down = _operands(m, k, n // 2, "cuda")
    residual, norm_w = torch.randn_like(x), torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    y, new_residual = skinny_gemm.norm_mlp(x, residual, norm_w, 1e-6, gw, None, down)
    normed, expected_residual = fused_add_rmsnorm(x, residual, norm_w, 1e-6)
    act = cuda_skinny.glu_out(normed.contiguous(), gw, config)
    assert torch.equal(new_residual, expected_residual) and torch.equal(y, skinny_gemm.linear(act, down))


def test_the_benchmark_reads_entries_and_refuses_a_bad_one() -> None:
    """benchmarks/bench_cuda_skinny.py's --entries: product names or KIND:NxK, KBxS, a tile; a malformed item is a
    ValueError that quotes it."""
    from benchmarks.bench_cuda_skinny import parse_entries

    assert parse_entries("gate_up=4x1@64,partials:1024x2048=2x4@32,qkv=1x8x2@64") == {
        ("glu", 6144, 1024, 64): (4, 1, 1),
        ("partials", 1024, 2048, 32): (2, 4, 1),
        ("partials", 4096, 1024, 64): (1, 8, 2),
    }
    for bad in ("qkv=2@64", "qkv=1x2x3x4@64", "qkv=2x2"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_entries(bad)


def test_the_benchmark_reads_an_early_trigger_range() -> None:
    """--early-trigger-rows LO-HI; a malformed or reversed range is a ValueError that quotes it."""
    from benchmarks.bench_cuda_skinny import parse_rows

    assert parse_rows("2-64") == (2, 64)
    for bad in ("2", "64-2", "a-b"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_rows(bad)


def test_the_kernel_bench_checks_times_and_proposes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/bench_cuda_skinny.py's kernel loop on the CPU, with the CUDA kernels replaced by exact torch products
    (wrong for the two-group kernels) and the timer by a table: every product and row count is printed, a variant
    whose check fails is reported and not timed, the listed entry is timed as the shipped path and not proposed,
    and only the variant faster than every path by MIN_GAIN_US is proposed, at each row count."""
    import functools

    from benchmarks import bench_cuda_skinny as bench
    from fnvllm.kernels import fused_ops
    from fnvllm.kernels.reference import silu_and_mul_ref

    def partials(x: torch.Tensor, w: torch.Tensor, config: CudaConfig) -> torch.Tensor:
        parts = torch.zeros(config.split, x.shape[0], w.shape[0])
        parts[0] = F.linear(x.float(), w.float()) + (config.nw == 2)  # the two-group kernels: off by one
        return parts

    faster = CudaConfig(1, 12)  # down_proj, one tile or four

    def timer(calls: list, reps: int) -> float:
        for call in calls:
            call()
        config = next((a for a in calls[0].args if isinstance(a, CudaConfig)), None)
        return 2.0 if config == faster else 3.0 if config is None else 3.05

    monkeypatch.setattr(fused_ops, "silu_and_mul", silu_and_mul_ref)
    monkeypatch.setattr(cuda_skinny, "skinny_partials", partials)
    monkeypatch.setattr(cuda_skinny, "glu_out", lambda x, w, config: cuda_skinny.glu_out_ref(x, w))
    monkeypatch.setattr(bench, "per_weight", lambda product, x, weights, *extra: [
        functools.partial(product, x, w, *extra) for w in weights])  # fmt: skip
    monkeypatch.setattr(bench, "chain_us", timer)
    proposed = bench.bench_kernels([16, 64], reps=1, device="cpu", weight_mib=1)
    out = capsys.readouterr().out
    assert proposed == ["down=1x12x1@16", "down=1x12x1@64"]
    assert out.strip().endswith("proposed --entries down=1x12x1@16,down=1x12x1@64")
    for name, (_, n, k) in bench.SHAPES.items():
        assert f"== {name} N={n} K={k} M=16" in out and f"== {name} N={n} K={k} M=64" in out
    assert "FAILED the check, not timed: qkv M=64 CudaConfig(kb=1, split=8, nw=2)" in out
    sections = {part.split(":")[0]: part for part in out.split("== ")[1:]}  # "gate_up N=6144 K=1024 M=16" -> rows
    assert "cuda_skinny kb=1 S=8 nw=2" not in sections["qkv N=4096 K=1024 M=64"]
    assert "cuda_skinny kb=1 S=4 nw=1" in sections["qkv N=4096 K=1024 M=64"]
    glu16, glu64 = sections["gate_up N=6144 K=1024 M=16"], sections["gate_up N=6144 K=1024 M=64"]
    assert "the listed CudaConfig(kb=4, split=1, nw=1)" in glu16 and "cuda_skinny kb=4" not in glu16
    assert "the listed" not in glu64 and "cuda_skinny kb=4 S=1 nw=1" in glu64
