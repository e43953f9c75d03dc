"""The example scripts run as a user runs them (``python examples/X.py``), and the docs' code blocks run in order.

examples/serve_client.py needs a running server (the server tests drive the same client); examples/
simulate_cpu_validation.py is a minutes-long measurement, left to be run by hand.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


Command = tuple[list[str], dict[str, str], Path]  # argv, environment, working folder


def example_command(name: str, *args: str) -> Command:
    """``python examples/NAME ARGS`` from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return [sys.executable, str(EXAMPLES / name), *args], env, ROOT


def _in_temp_dir(command: Command, tmp: Path) -> Command:
    """``command`` with TMPDIR set to ``tmp`` (so a test can see what it leaves behind)."""
    argv, env, cwd = command
    return argv, {**env, "TMPDIR": str(tmp)}, cwd


def checked(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """``result`` after checking it exited 0 without a traceback."""
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result


SIMULATE_ARGS = ["--num-requests", "200", "--rate", "50"]
# the fresh-interpreter runs of each test (those of the selected tests run two at a time: see ``runs``)
TEST_RUNS = {
    "test_drive_scheduler_runs_every_request_to_the_end": ("drive_scheduler.py",),
    "test_policy_property_test_passes_as_a_script": ("policy_property_test.py",),
    "test_policy_property_test_is_collected_by_pytest": ("pytest policy_property_test.py",),
    "test_generate_tiny_prints_both_prompts": ("generate_tiny.py",),
    "test_simulate_speed_small": ("simulate_speed.py " + " ".join(SIMULATE_ARGS),),
    "test_drive_the_scheduler_doc_blocks_run_in_order": ("drive-the-scheduler.md",),
    "test_test_your_policy_doc_blocks_run_in_order": ("test-your-policy.md",),
}


def commands(tmp: Path) -> dict[str, Command]:
    """Every run of TEST_RUNS by its key."""
    pytest_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    pytest_argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(EXAMPLES / "policy_property_test.py"),
    ]
    build, loop, policy = doc_blocks("drive-the-scheduler.md")
    return {
        "drive_scheduler.py": example_command("drive_scheduler.py"),
        "policy_property_test.py": example_command("policy_property_test.py"),
        "pytest policy_property_test.py": (pytest_argv, pytest_env, EXAMPLES),
        "generate_tiny.py": _in_temp_dir(example_command("generate_tiny.py"), tmp),
        "simulate_speed.py " + " ".join(SIMULATE_ARGS): example_command("simulate_speed.py", *SIMULATE_ARGS),
        "drive-the-scheduler.md": code_command("\n".join([build, loop, policy, loop])),
        "test-your-policy.md": code_command("\n".join([*doc_blocks("test-your-policy.md"), POLICY_CHECKS])),
    }


@pytest.fixture(scope="module")
def example_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The TMPDIR of the examples that make temporary folders (so a test can see what they leave behind)."""
    return tmp_path_factory.mktemp("example-tmp")


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, example_tmp: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    """The runs of the selected tests, each in a fresh interpreter, two at a time (CI has two cores; each run is
    mostly one busy thread): key -> its CompletedProcess (not yet checked)."""
    selected = {getattr(item, "originalname", None) for item in request.session.items}
    table = commands(example_tmp)
    keys = [key for test, keys in TEST_RUNS.items() if test in selected for key in keys]

    def one(key: str) -> subprocess.CompletedProcess[str]:
        argv, env, cwd = table[key]
        return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=cwd, check=False)

    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        return dict(zip(keys, pool.map(one, keys), strict=True))


def test_drive_scheduler_runs_every_request_to_the_end(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """The hand-written engine loop on the demo model finishes all three requests, shortest prompt first."""
    lines = [line for line in checked(runs["drive_scheduler.py"]).stdout.splitlines() if line.startswith("step")]
    assert [line.split()[2] for line in lines] == ["r1", "r0", "r2"]
    assert all("(length)" in line for line in lines)


def test_policy_property_test_passes_as_a_script(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """The policy example's state machine and output-invariance property both hold when run as a script."""
    out = checked(runs["policy_property_test.py"]).stdout
    assert "every invariant held" in out and "generates what FCFS generates: held" in out


def test_policy_property_test_is_collected_by_pytest(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """``pytest examples/policy_property_test.py`` collects and passes both checks (as the docs say to run it)."""
    result = runs["pytest policy_property_test.py"]
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 passed" in result.stdout


def test_generate_tiny_prints_both_prompts(
    runs: dict[str, subprocess.CompletedProcess[str]], example_tmp: Path
) -> None:
    """The public-API example writes a tiny checkpoint and prints one line per prompt."""
    out = checked(runs["generate_tiny.py"]).stdout
    assert "'Hello, my name is' ->" in out and "'The capital of France is' ->" in out
    assert list(example_tmp.glob("fnvllm-example-*")) == []  # its checkpoint folder was removed


@pytest.mark.parametrize("args", [SIMULATE_ARGS])
def test_simulate_speed_small(args: list[str], runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """The simulator speed example runs end to end on a small workload."""
    assert checked(runs["simulate_speed.py " + " ".join(args)]).stdout.strip()


def doc_blocks(name: str) -> list[str]:
    """The Python blocks of docs/NAME, in order."""
    return FENCE.findall((ROOT / "docs" / name).read_text())


def code_command(code: str) -> Command:
    """``python -c CODE`` from the repository root (without Triton's interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return [sys.executable, "-c", code], env, ROOT


def test_drive_the_scheduler_doc_blocks_run_in_order(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """docs/drive-the-scheduler.md's blocks (build, loop, own policy) run in order, and the loop runs again after
    the policy block restores the executor."""
    lines = checked(runs["drive-the-scheduler.md"]).stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("r0 ") for line in lines)
    assert lines[0] == lines[1]  # greedy: the same text under either policy


POLICY_CHECKS = """
from hypothesis.stateful import run_state_machine_as_test
run_state_machine_as_test(ShortestJobMachine, settings=TestShortestJobMachine.settings)
test_policy_does_not_change_outputs()
print("ok")
"""


def test_test_your_policy_doc_blocks_run_in_order(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """docs/test-your-policy.md's blocks define a policy, a state machine and a property; both checks pass."""
    assert checked(runs["test-your-policy.md"]).stdout.strip() == "ok"
