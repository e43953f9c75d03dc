"""The layers' arrows point one way: what a module may import is checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    """The names in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    script = f"{code}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    return set(done.stdout.split())


def test_engine_config_imports_no_torch() -> None:
    """Building and validating an ``EngineConfig`` (attention backend names included) imports no torch, as its
    docstring promises: a simulator or a config tool need not pay for it."""
    loaded = _modules_after(
        "from fnvllm.config import EngineConfig\nEngineConfig()\nEngineConfig(attention_backend='triton')"
    )
    assert "torch" not in loaded
    assert "fnvllm.config" in loaded


def test_pure_core_imports_nothing_of_the_shell() -> None:
    """``import fnvllm.state`` loads no torch and no fnvllm module outside ``fnvllm.state``."""
    loaded = _modules_after("import fnvllm.state")
    assert "torch" not in loaded
    assert {m for m in loaded if m.startswith("fnvllm.")} <= {m for m in loaded if m.startswith("fnvllm.state")}
