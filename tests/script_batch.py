"""Run several Python scripts one after another in this one interpreter, as ``python SCRIPT ARGS...`` would.

Used by tests/test_benchmarks_smoke.py: a fresh interpreter per ``--help`` costs about two seconds of imports
(torch, transformers), so the quick checks share one. Each script runs as ``__main__`` with its own ``sys.argv``
and its own folder first on ``sys.path``; its stdout, stderr and exit status are recorded the way the interpreter
would report them (an uncaught exception prints its traceback to stderr and exits 1; ``SystemExit("text")``
prints the text and exits 1). A job whose script is ``-m`` imports the module named by its one argument instead,
as ``python -c "import NAME"`` would. Usage: ``python tests/script_batch.py JOBS_JSON RESULTS_JSON`` where the
first file holds a list of ``[key, script_path, [args...]]``; the second receives one JSON object
``{key: {"returncode", "stdout", "stderr"}}``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import runpy
import sys
import traceback
from pathlib import Path
from typing import Any


def text_stream() -> io.TextIOWrapper:
    """An in-memory text stream that, like the real ``sys.stdout``, accepts ``reconfigure``."""
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", newline="\n", write_through=True)


def contents(stream: io.TextIOWrapper) -> str:
    """Everything written to a ``text_stream``."""
    stream.flush()
    buffer = stream.buffer
    assert isinstance(buffer, io.BytesIO)
    return buffer.getvalue().decode("utf-8", errors="replace")


def exit_status(code: Any, stderr: io.TextIOWrapper) -> int:
    """The status a ``SystemExit(code)`` gives the interpreter, writing a non-int message to ``stderr`` as it does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=stderr)
    return 1


def run_script(script: str, args: list[str]) -> dict[str, Any]:
    """Run ``script`` with ``args`` as ``__main__`` (or import module ``args[0]`` when ``script`` is ``-m``); its
    return code, stdout and stderr."""
    stdout, stderr = text_stream(), text_stream()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    if script != "-m":
        sys.path.insert(0, str(Path(script).resolve().parent))
    code = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                if script == "-m":
                    importlib.import_module(args[0])
                else:
                    runpy.run_path(script, run_name="__main__")
            except SystemExit as done:
                code = exit_status(done.code, stderr)
            except BaseException:  # reported as the interpreter would, then the next script runs
                traceback.print_exc(file=stderr)
                code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return {"returncode": code, "stdout": contents(stdout), "stderr": contents(stderr)}


def main() -> None:
    """Run the jobs of the JSON file named first on the command line; write their results to the second."""
    jobs = json.loads(Path(sys.argv[1]).read_text())
    results = {key: run_script(script, args) for key, script, args in jobs}
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
