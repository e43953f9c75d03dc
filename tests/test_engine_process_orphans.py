"""The server's engine process dies with the server (``engine_process._die_with_parent``): a server killed while
the model loads, before it can stop its engine by the pipe, must not leave the engine loading (and holding the GPU)
as an orphan. Checked on a real process tree: a parent whose child set the death signal, then sleeps; killing
the parent (SIGKILL: no handler runs) ends the child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

PARENT = """
import multiprocessing, sys, time
from fnvllm.serve.engine_process import _die_with_parent

def child(marker):
    _die_with_parent()
    open(marker, "w").close()  # the death signal is set
    time.sleep(120)

if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(target=child, args=(sys.argv[1],))
    process.start()
    print(process.pid, flush=True)
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_engine_process_dies_with_its_server(tmp_path: Path) -> None:
    pytest.importorskip("fastapi", reason="the engine process module belongs to the [serve] extra")
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    marker = tmp_path / "armed"
    parent = subprocess.Popen([sys.executable, str(script), str(marker)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:  # the child imports fnvllm first
            time.sleep(0.05)
        assert marker.exists() and _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the child outlived its killed parent"
    finally:
        parent.kill()
