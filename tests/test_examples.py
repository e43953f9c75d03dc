"""The example scripts run as a user runs them (``python examples/X.py``), and the docs' code blocks run in order.

examples/serve_client.py needs a running server (the server tests drive the same client); examples/
simulate_cpu_validation.py is a minutes-long measurement, left to be run by hand.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def run_example(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python examples/NAME ARGS`` from the repository root, checked to exit 0 without a traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result


def test_drive_scheduler_runs_every_request_to_the_end() -> None:
    """The hand-written engine loop on the demo model finishes all three requests, shortest prompt first."""
    lines = [line for line in run_example("drive_scheduler.py").stdout.splitlines() if line.startswith("step")]
    assert [line.split()[2] for line in lines] == ["r1", "r0", "r2"]
    assert all("(length)" in line for line in lines)


def test_policy_property_test_passes_as_a_script() -> None:
    """The policy example's state machine and output-invariance property both hold when run as a script."""
    out = run_example("policy_property_test.py").stdout
    assert "every invariant held" in out and "generates what FCFS generates: held" in out


def test_policy_property_test_is_collected_by_pytest() -> None:
    """``pytest examples/policy_property_test.py`` collects and passes both checks (as the docs say to run it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLES / "policy_property_test.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=EXAMPLES,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 passed" in result.stdout


def test_generate_tiny_prints_both_prompts() -> None:
    """The public-API example writes a tiny checkpoint and prints one line per prompt."""
    out = run_example("generate_tiny.py").stdout
    assert "'Hello, my name is' ->" in out and "'The capital of France is' ->" in out


@pytest.mark.parametrize("args", [["--num-requests", "200", "--rate", "50"]])
def test_simulate_speed_small(args: list[str]) -> None:
    """The simulator speed example runs end to end on a small workload."""
    assert run_example("simulate_speed.py", *args).stdout.strip()


def doc_blocks(name: str) -> list[str]:
    """The Python blocks of docs/NAME, in order."""
    return FENCE.findall((ROOT / "docs" / name).read_text())


def run_code(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter, checked to exit 0 without a traceback."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


def test_drive_the_scheduler_doc_blocks_run_in_order() -> None:
    """docs/drive-the-scheduler.md's blocks (build, loop, own policy) run in order, and the loop runs again after
    the policy block restores the executor."""
    build, loop, policy = doc_blocks("drive-the-scheduler.md")
    lines = run_code("\n".join([build, loop, policy, loop])).stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("r0 ") for line in lines)
    assert lines[0] == lines[1]  # greedy: the same text under either policy


def test_test_your_policy_doc_blocks_run_in_order() -> None:
    """docs/test-your-policy.md's blocks define a policy, a state machine and a property; both checks pass."""
    checks = """
from hypothesis.stateful import run_state_machine_as_test
run_state_machine_as_test(ShortestJobMachine, settings=TestShortestJobMachine.settings)
test_policy_does_not_change_outputs()
print("ok")
"""
    assert run_code("\n".join([*doc_blocks("test-your-policy.md"), checks])).stdout.strip() == "ok"
