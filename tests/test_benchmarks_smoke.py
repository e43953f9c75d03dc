"""Every script in benchmarks/ runs, so benchmarks cannot rot between GPU sessions.

Scripts that work on a CPU run end to end on the tiny shape with tiny sizes; scripts that need a GPU (or a
server, or a GPU run's output folder) must at least parse ``--help``, and the CUDA-only ones must refuse a CPU
with a one-line reason; shell scripts must parse (``bash -n``); helper modules must import. A new file in
benchmarks/ fails ``test_every_benchmark_file_is_covered`` until it is added to one of the tables below.

The quick checks (``--help``, the CPU refusal, the imports) share one interpreter (tests/script_batch.py runs each
script as ``__main__`` with its own argv, as ``python SCRIPT`` would), so the suite pays torch's import once, not
forty times; the end-to-end CPU runs each get their own process, two at a time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from script_batch import run_batch

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"

# script -> arguments of a small CPU run (tiny shape, few requests)
CPU_RUNS: dict[str, list[str]] = {
    "bench_core.py": ["--sizes", "16", "--repeats", "1"],
    "bench_output_routing.py": ["--rows", "4", "--number", "2", "--repeats", "1"],
    "sass_count.py": ["--fp8-path", "mma_v16", "--tile", "64", "--json", "{tmp}/sass.json"],
    "bench_llm.py": ["--model-shape", "tiny", "--num-requests", "2", "--max-input-len", "100", "--max-output-len",
                     "100", "--json"],
    "cpu_threads.py": ["--models", "demo", "tiny", "--repeats", "1", "--num-prompts", "2", "--max-tokens", "4"],
    "gpu_equality.py": ["--model-shape", "tiny", "--num-prompts", "4"],
    "profile_decode.py": ["--model-shape", "tiny", "--num-requests", "4", "--steps", "2"],
    "host_step.py": ["--model-shape", "tiny", "--batches", "1,2", "--steps", "3", "--warm", "2", "--prompt-len", "8",
                     "--logprobs", "2", "--with-plain", "--preset", "qwen3", "--profile", "5"],
    "bench_settings.py": ["--model-shape", "tiny", "--checkpoint", "{tmp}/ckpt", "--num-requests", "1", "--variants",
                          "temperature,logprobs", "--batches", "1", "--timeline", "--log-compiles"],
    "sim_serve_check.py": ["--model-shape", "tiny", "--quick", "--out", "{tmp}/serve"],
    "fp8_accuracy.py": ["--tokens", "3"],
    "bench_structured.py": ["--model-shape", "tiny", "--device", "cpu", "--rows", "4", "--max-tokens", "4",
                            "--repeats", "1", "--host-steps", "2", "--host-vocab", "512"],
    "logprobs_bias_check.py": ["--device", "cpu", "--skip-cost"],
    "structured_host.py": ["--rows", "2", "--steps", "2", "--vocab", "512", "--threads", "1"],
    "sweep_small.py": ["--smoke", "--budget-s", "5"],
    "bench_qkv_epilogue.py": ["--smoke"],
    "gc_probe.py": ["2", "700,10,10", "10000,10,10"],
    "read_ceiling.py": ["--gib", "0.01", "--repeats", "2"],
    "serve_wheels.py": ["{tmp}/no_wheels", "{tmp}/site"],
    "latency_tables.py": ["--tables", "{tmp}/missing.pkl", "bench", "--model-shape", "tiny", "--latency", "1",
                          "--max-output-len", "4"],
    "bench_cuda_skinny.py": ["run", "--entries", "gate_up=4x1@64,partials:1024x2048=2x4@32", "--early-trigger-rows",
                             "2-64", "bench", "--model-shape", "tiny", "--latency", "1", "--max-output-len", "4"],
    "step_summary.py": ["{tmp}", "missing_run", "--winners", "{tmp}/winners.txt"],
    "probe_step_variants.py": ["no_norms+no_attention+qkv_p4", "bench", "--model-shape", "tiny", "--latency", "2",
                               "--max-output-len", "4"],
}  # fmt: skip
# scripts that need a GPU, a server or a GPU run's output: --help only
HELP_ONLY = (  # sim_calibration.py's CPU dry run is tests/test_sim_calibrate.py's
    "bench_attention.py",
    "bench_moe.py",
    "bench_penalties.py",  # without CUDA it runs its bit-equality check on the CPU (interpreter), seconds
    "bench_sampling.py",
    "bench_serve.py",
    "sim_accuracy.py",
    "sim_calibration.py",
    "tp_check.py",
    "tp_profile.py",
)
# CUDA-only scripts: --help, and a clear refusal on a CPU
CUDA_ONLY = (
    "bench_cuda_fp8_skinny.py",
    "bench_fp8_gemm.py",
    "bench_fp8_kv.py",
    "bench_fp8_rowwise.py",
    "bench_late_norm.py",
    "bench_sampling_minp.py",
    "bench_sampling_topk.py",
    "bench_small_batch.py",
    "gemm_shapes.py",
    "open_targets.py",
    "probe_cluster_skinny.py",
    "probe_cuda_skinny.py",
    "probe_l2_prefetch.py",
    "profile_mixed.py",
    "sweep_decode_mid.py",
)
SHELL = (
    "cuda_rows_check.sh",
    "gpu_check.sh",
    "gpu_suite.sh",
    "serve_check.sh",
    "sim_h200_check.sh",
    "step_variants.sh",
)
MODULES = ("__init__.py", "green.py", "tp_phases.py", "tp_report.py")  # imported by the scripts


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run a command from the repository root with this checkout on the path, one CPU thread per op."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)


def test_every_benchmark_file_is_covered() -> None:
    """Each file in benchmarks/ is in exactly one of the smoke tables."""
    covered = [*CPU_RUNS, *HELP_ONLY, *CUDA_ONLY, *SHELL, *MODULES]
    assert len(covered) == len(set(covered))
    present = {p.name for p in BENCHMARKS.iterdir() if p.is_file() and p.suffix in (".py", ".sh")}
    assert present == set(covered), f"missing from the tables: {present - set(covered)}; gone: {set(covered) - present}"


# the longest CPU runs first, so two at a time finish together (the rest in table order)
SLOWEST_FIRST = ("sim_serve_check.py", "bench_structured.py", "bench_settings.py")


@pytest.fixture(scope="module")
def cpu_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The selected CPU_RUNS, each in its own process and temp folder, two at a time (CI has two cores and each
    run is mostly one busy thread): script -> its CompletedProcess."""
    selected = {
        item.callspec.params["script"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_cpu_script_runs_on_the_tiny_shape"
    }
    order = [s for s in SLOWEST_FIRST if s in selected] + sorted(selected - set(SLOWEST_FIRST))

    # the folders before the threads: a worker's first mktemp creates its base folder, and two threads racing to
    # create it fail (pytest-xdist workers make it on first use)
    folders = {script: tmp_path_factory.mktemp(script.removesuffix(".py")) for script in order}

    def one(script: str) -> subprocess.CompletedProcess[str]:
        args = [arg.replace("{tmp}", str(folders[script])) for arg in CPU_RUNS[script]]
        return run(sys.executable, str(BENCHMARKS / script), *args)

    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        return dict(zip(order, pool.map(one, order), strict=True))


@pytest.mark.parametrize("script", sorted(CPU_RUNS))
def test_cpu_script_runs_on_the_tiny_shape(script: str, cpu_runs: dict[str, Any]) -> None:
    """The script runs end to end on the CPU with tiny sizes and exits 0 ({tmp} in its arguments: a temp folder)."""
    result = cpu_runs[script]
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stdout.strip()


NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Results of every quick check, run in one interpreter by tests/script_batch.py: ``import:NAME`` (the helper
    modules, first, so no script has imported them yet), ``help:SCRIPT`` and, without CUDA, ``refuse:SCRIPT``."""
    jobs: list[dict[str, Any]] = [
        {"key": f"import:{name}", "run": "import", "target": name} for name in _module_names()
    ]
    for script in sorted([*CPU_RUNS, *HELP_ONLY, *CUDA_ONLY]):
        jobs.append({"key": f"help:{script}", "run": "script", "target": str(BENCHMARKS / script), "args": ["--help"]})
    if NO_CUDA:
        jobs += [{"key": f"refuse:{s}", "run": "script", "target": str(BENCHMARKS / s)} for s in CUDA_ONLY]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return run_batch(jobs, tmp_path_factory.mktemp("quick"), env)


def _module_names() -> list[str]:
    """The importable names of MODULES (``benchmarks`` for ``__init__.py``)."""
    return ["benchmarks" if m == "__init__.py" else f"benchmarks.{m.removesuffix('.py')}" for m in MODULES]


@pytest.mark.parametrize("script", sorted([*CPU_RUNS, *HELP_ONLY, *CUDA_ONLY]))
def test_help_parses(script: str, quick: dict[str, dict[str, Any]]) -> None:
    """``--help`` prints a usage line and exits 0 (imports and argument parsing work)."""
    result = quick[f"help:{script}"]
    assert result["returncode"] == 0, result["stderr"][-3000:]
    assert "usage:" in result["stdout"]


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("script", CUDA_ONLY)
def test_cuda_only_script_refuses_a_cpu_in_one_line(script: str, quick: dict[str, dict[str, Any]]) -> None:
    """Without CUDA the script exits non-zero with one line saying it needs a CUDA GPU, not a traceback."""
    result = quick[f"refuse:{script}"]
    assert result["returncode"] != 0 and "Traceback" not in result["stderr"], result["stderr"][-3000:]
    assert "needs a CUDA GPU" in result["stderr"]


@pytest.mark.parametrize("script", SHELL)
def test_shell_script_parses(script: str) -> None:
    """``bash -n`` accepts the script."""
    result = run("bash", "-n", str(BENCHMARKS / script), timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("module", _module_names())
def test_helper_module_imports(module: str, quick: dict[str, dict[str, Any]]) -> None:
    """The helper module imports (as the scripts import it)."""
    result = quick[f"import:{module}"]
    assert result["returncode"] == 0, result["stderr"][-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_sm_limit_refuses_a_machine_without_cuda() -> None:
    """benchmarks/green.py's limit_sms (behind --sms) stops with the reason on a machine without a CUDA GPU."""
    from benchmarks import green

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        green.limit_sms(88)
