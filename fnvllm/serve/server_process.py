"""``fnvllm serve`` as a child process on a free loopback port: for tests, benchmarks and notebooks.

with ServerProcess(["path/to/model", "--max-num-seqs", "64"], log_path="serve.log") as server:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    ...
# leaving the block sends SIGTERM and waits for a clean exit
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

_LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


class ServerProcess:
    """Runs ``python -m fnvllm.cli serve *args --host 127.0.0.1 --port 0``; stdout and stderr go to ``log_path``.

    ``start()`` returns once ``/health`` answers 200 (or raises RuntimeError with the log's tail).
    """

    def __init__(
        self,
        args: Sequence[str],
        log_path: str | Path,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 180.0,
    ) -> None:
        self.args, self.log_path, self.startup_timeout = list(args), Path(log_path), startup_timeout
        self.env = dict(os.environ if env is None else env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` once started."""
        if self.port is None:
            raise RuntimeError("the server has not started")
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> ServerProcess:
        """Spawn the server and wait until it answers /health."""
        cmd = [sys.executable, "-m", "fnvllm.cli", "serve", *self.args, "--host", "127.0.0.1", "--port", "0"]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.startup_timeout
        while self.port is None:
            match = _LISTENING.search(self.log())
            if match:
                self.port = int(match.group(1))
            else:
                self._wait_a_moment(deadline, "to listen")
        while not self._healthy():
            self._wait_a_moment(deadline, "to answer /health")
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _wait_a_moment(self, deadline: float, what: str) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"fnvllm serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
        if time.monotonic() > deadline:
            self.kill()
            raise RuntimeError(f"fnvllm serve did not start {what} in {self.startup_timeout} s:\n{self.log()[-4000:]}")
        time.sleep(0.1)

    def terminate(self, timeout: float = 60.0) -> int:
        """Send SIGTERM and wait for the exit; returns the exit code (raises TimeoutExpired if it hangs)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """Kill the process (no clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.terminate()
        except subprocess.TimeoutExpired:
            self.kill()
