"""README.md's code runs as written: its Python blocks and its cheap shell commands, against the embedded demo model.

Substitutions, all visible here: a checkpoint path the reader would supply (``path/to/Qwen3-0.6B``) becomes the
demo model's folder; the server's fixed port 8000 becomes the free port a test server (the demo model, started
as the README starts it) listens on. Install and test-suite commands are checked for what they install, not run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fnvllm.demo import model_path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
USER_MODEL = "path/to/Qwen3-0.6B"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)


def blocks(language: str) -> list[str]:
    """The README's fenced code blocks in ``language``, in order."""
    return [body for lang, body in FENCE.findall(README) if lang == language]


def commands(block: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    lines = [line.split("  #")[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def env() -> dict[str, str]:
    """The environment of a README command: this checkout first on the path, this venv's scripts on PATH, and no
    Triton interpreter (the test suite's CPU setting, which a user does not have)."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    return {**base, "PYTHONPATH": str(ROOT), "PATH": path, "PYTHONUNBUFFERED": "1"}


def python_run(code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (not yet checked)."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env(), check=False
    )


def shell_run(command: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run one README shell command with bash from the repository root (not yet checked)."""
    return subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=timeout, env=env(), check=False, cwd=ROOT
    )


def checked(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """``result`` after checking it exited 0 without a traceback."""
    assert result.returncode == 0 and "Traceback" not in result.stderr, f"{result.args}\n{result.stderr[-3000:]}"
    return result


def python_block(needle: str) -> str:
    """The one Python block that contains ``needle``."""
    found = [b for b in blocks("python") if needle in b]
    assert len(found) == 1, f"expected one Python block with {needle!r}, found {len(found)}"
    return found[0]


def _bench_command() -> str:
    """The Benchmarks block's ``fnvllm bench`` command."""
    (command,) = [c for b in blocks("bash") for c in commands(b) if c.startswith("fnvllm bench")]
    return command


# the README runs each test makes (those of the selected tests run two at a time: see ``runs``)
TEST_RUNS = {
    "test_first_command_runs_the_demo": "demo",
    "test_generate_block_runs_on_the_demo_model": "generate",
    "test_drive_the_scheduler_block_runs_to_the_end": "drive",
    "test_bench_block_runs_on_the_cpu": "bench",
}


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> dict[str, subprocess.CompletedProcess[str]]:
    """The README runs of the selected tests, each in a fresh process, two at a time (CI has two cores; each run
    is mostly one busy thread): key -> its CompletedProcess (not yet checked). The bench block runs without CUDA
    only (with CUDA it is a GPU benchmark)."""
    import torch

    selected = {getattr(item, "originalname", None) for item in request.session.items}
    keys = [key for test, key in TEST_RUNS.items() if test in selected]
    if torch.cuda.is_available() and "bench" in keys:
        keys.remove("bench")
    launch = {
        "demo": lambda: shell_run(commands(blocks("bash")[0])[0].split("&&")[-1].strip()),
        "generate": lambda: python_run(python_block("llm.generate(").replace(USER_MODEL, str(model_path()))),
        "drive": lambda: python_run(python_block("state.has_unfinished")),
        "bench": lambda: shell_run(_bench_command()),
    }
    order = sorted(keys, key=lambda k: k != "bench")  # the longest first
    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        return dict(zip(order, pool.map(lambda k: launch[k](), order), strict=True))


def test_install_line_installs_the_runtime_then_the_test_and_serve_extras() -> None:
    """The first commands install torch's pinned CPU wheel and the package, run the demo, then install the
    test, serve and compat extras (so the server and client-library tests run too) and run the whole suite."""
    first = commands(blocks("bash")[0])
    assert "pip install torch==2.13.0 -e ." in first[0] and first[0].endswith("&& fnvllm demo")
    test_command = first[1].split("&&")[-1].strip()
    assert "pip install -e '.[test,serve,compat]'" in first[1] and test_command.startswith("python -m pytest -q")
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines(), "CI runs another test command"
    assert "--index-url https://download.pytorch.org/whl/cpu" in README
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^test = \[", pyproject, re.M) and re.search(r"^serve = \[", pyproject, re.M)


def test_first_command_runs_the_demo(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """``fnvllm demo`` (the end of the install line) runs the embedded model and prints its summary."""
    result = checked(runs["demo"])
    assert "embedded demo model" in result.stdout and "tok/s" in result.stderr


def test_generate_block_runs_on_the_demo_model(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """The Generate block runs as written with the demo model's folder in place of the user's checkpoint."""
    checked(runs["generate"])


def test_drive_the_scheduler_block_runs_to_the_end(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """The hand-written engine loop runs as written and prints its finished request."""
    out = checked(runs["drive"]).stdout
    request_id, reason, text = out.split(" ", 2)
    assert request_id == "r0" and reason in ("stop", "length") and text.strip()


def test_bench_block_runs_on_the_cpu(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """``fnvllm bench`` from the Benchmarks block runs (the tiny shape on a machine without CUDA)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA, `fnvllm bench` runs the Qwen3-0.6B shape: a GPU benchmark, not a doc test")
    result = checked(runs["bench"])
    assert "tok_per_s" in result.stdout and "floor" not in result.stdout


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``fnvllm serve`` started with the README's arguments on a free port; yields its host:port."""
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        pytest.importorskip(module, reason="the server needs the [serve] extra")
    from fnvllm.serve.server_process import ServerProcess

    (start,) = [c for b in blocks("bash") for c in commands(b) if c.startswith("fnvllm serve")]
    args = shlex.split(start.rstrip("&").strip())[2:]
    args = [a for i, a in enumerate(args) if a != "--port" and (i == 0 or args[i - 1] != "--port")]
    log = tmp_path_factory.mktemp("readme-serve") / "server.log"
    with ServerProcess(args, log, env={**env(), "OMP_NUM_THREADS": "1"}) as proc:
        yield proc.base_url.removeprefix("http://")
        assert proc.terminate() == 0, proc.log()[-3000:]


def test_curl_commands_answer(server: str) -> None:
    """Each curl command of the Serve block gets a completion (plain, then streamed) from the demo server."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    curls = [c for b in blocks("bash") for c in commands(b) if c.startswith("curl")]
    assert len(curls) == 2
    plain, streamed = (checked(shell_run(c.replace("localhost:8000", server), timeout=120)).stdout for c in curls)
    assert '"choices"' in plain and '"text"' in plain
    assert streamed.rstrip().endswith("data: [DONE]")


def test_openai_client_block_runs_against_the_demo_server(server: str) -> None:
    """The Python client snippet runs as written against the demo server (it reads the model name from it)."""
    pytest.importorskip("openai", reason="the snippet uses the openai client (test extra)")
    block = python_block("OpenAI(")
    out = checked(python_run(block.replace("127.0.0.1:8000", server), timeout=120)).stdout
    assert "CompletionUsage" in out
