"""Run several Python programs one after another in this one interpreter, as ``python SCRIPT ARGS...`` (or
``python -m MODULE ARGS...``, or ``python -c "import MODULE"``) would, each in a fresh interpreter.

Used by tests whose programs each take a second or two to import torch and transformers: one interpreter pays
those imports once. Each program runs as ``__main__`` with its own ``sys.argv`` (a script with its own folder
first on ``sys.path``) and its own stdin; its stdout, stderr and exit status are recorded the way the
interpreter would report them (an uncaught exception prints its traceback to stderr and exits 1;
``SystemExit("text")`` prints the text and exits 1).

Usage: ``python tests/script_batch.py JOBS_JSON RESULTS_JSON``. The first file holds a list of jobs
``{"key": ..., "run": "script" | "module" | "import", "target": PATH_OR_MODULE, "args": [...], "stdin": TEXT}``
(``args`` and ``stdin`` optional); the second receives ``{key: {"returncode", "stdout", "stderr"}}``.
``run_batch`` does both from a test.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import runpy
import subprocess
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

KINDS = ("script", "module", "import")


def text_stream(text: str = "") -> io.TextIOWrapper:
    """An in-memory text stream holding ``text`` that, like the real ``sys.stdout``, accepts ``reconfigure``."""
    return io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8", newline="\n", write_through=True)


def contents(stream: io.TextIOWrapper) -> str:
    """Everything written to a ``text_stream``."""
    stream.flush()
    buffer = stream.buffer
    if not isinstance(buffer, io.BytesIO):
        raise TypeError(f"contents() reads a text_stream, got a stream over {type(buffer).__name__}")
    return buffer.getvalue().decode("utf-8", errors="replace")


def exit_status(code: Any, stderr: io.TextIOWrapper) -> int:
    """The status a ``SystemExit(code)`` gives the interpreter, writing a non-int message to ``stderr`` as it does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=stderr)
    return 1


def _start(run: str, target: str) -> None:
    """Run ``target`` as the job kind ``run`` says."""
    if run == "script":
        runpy.run_path(target, run_name="__main__")
    elif run == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        importlib.import_module(target)


def run_job(run: str, target: str, args: Sequence[str] = (), stdin: str | None = None) -> dict[str, Any]:
    """Run one job (see the module doc); its return code, stdout and stderr."""
    if run not in KINDS:
        raise ValueError(f"run must be one of {KINDS}, got {run!r}")
    stdout, stderr = text_stream(), text_stream()
    saved = sys.argv, list(sys.path), sys.stdin
    sys.argv = [target, *args]
    sys.stdin = text_stream(stdin or "")
    if run == "script":
        sys.path.insert(0, str(Path(target).resolve().parent))
    code = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                _start(run, target)
            except SystemExit as done:
                code = exit_status(done.code, stderr)
            except BaseException:  # reported as the interpreter would, then the next job runs
                traceback.print_exc(file=stderr)
                code = 1
    finally:
        sys.argv, sys.path[:], sys.stdin = saved[0], saved[1], saved[2]
    return {"returncode": code, "stdout": contents(stdout), "stderr": contents(stderr)}


def run_batch(
    jobs: Sequence[Mapping[str, Any]], folder: Path, env: Mapping[str, str] | None = None, timeout: float = 600
) -> dict[str, dict[str, Any]]:
    """Run ``jobs`` in one fresh interpreter (files in ``folder``, environment ``env``); results by key."""
    (folder / "jobs.json").write_text(json.dumps(list(jobs)))
    done = subprocess.run(
        [sys.executable, __file__, str(folder / "jobs.json"), str(folder / "results.json")],
        capture_output=True, text=True, timeout=timeout, env=dict(env or os.environ), check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the batch interpreter failed (exit {done.returncode}): {done.stderr[-3000:]}")
    results: dict[str, dict[str, Any]] = json.loads((folder / "results.json").read_text())
    return results


def main() -> None:
    """Run the jobs of the JSON file named first on the command line; write their results to the second."""
    jobs = json.loads(Path(sys.argv[1]).read_text())
    results = {job["key"]: run_job(job["run"], job["target"], job.get("args", ()), job.get("stdin")) for job in jobs}
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
