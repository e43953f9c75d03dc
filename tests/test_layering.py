"""The layers' arrows point one way: what a module may import is checked in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


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


def test_the_cpu_runtime_path_imports_no_triton() -> None:
    """``fnvllm demo`` runs on the runtime dependencies, which have no Triton on a CPU-only machine: building the
    LLM facade, the model (FP8 layers included), the executor and the loop imports no Triton module."""
    loaded = _modules_after(
        "import fnvllm.llm, fnvllm.model.models, fnvllm.model.quant, fnvllm.executor.model_executor, fnvllm.engine"
    )
    assert "fnvllm.llm" in loaded and "fnvllm.model.quant" in loaded
    assert not {name for name in loaded if name == "triton" or name.startswith("triton.")}


def test_pure_core_imports_nothing_of_the_shell() -> None:
    """``import fnvllm.state`` loads no torch and no fnvllm module outside ``fnvllm.state``."""
    loaded = _modules_after("import fnvllm.state")
    assert "torch" not in loaded
    assert {m for m in loaded if m.startswith("fnvllm.")} <= {m for m in loaded if m.startswith("fnvllm.state")}


# package -> the fnvllm packages it must never import (docs/design.md, "Layers")
FORBIDDEN = {
    "state": ("fnvllm.engine", "fnvllm.executor", "fnvllm.model", "fnvllm.kernels", "fnvllm.sim", "fnvllm.serve"),
    "kernels": ("fnvllm.model", "fnvllm.executor", "fnvllm.engine", "fnvllm.llm", "fnvllm.serve", "fnvllm.cli"),
    "model": ("fnvllm.executor", "fnvllm.engine", "fnvllm.llm", "fnvllm.serve", "fnvllm.cli"),
    "executor": ("fnvllm.engine", "fnvllm.llm", "fnvllm.serve", "fnvllm.cli"),
    "engine": ("fnvllm.llm", "fnvllm.serve", "fnvllm.cli"),
    "sim": ("fnvllm.llm", "fnvllm.serve", "fnvllm.cli", "fnvllm.bench", "fnvllm.executor.model_executor"),
}


def _imports(path: Path) -> set[str]:
    """Every module name a file imports (absolute imports, at any depth of the file)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_arrows_point_one_way() -> None:
    """No module of a layer imports a layer above it (the kernels <-> model cycle and friends stay gone); the
    simulator imports no torch."""
    root = Path(__file__).resolve().parent.parent / "fnvllm"
    wrong = []
    for package, banned in FORBIDDEN.items():
        for path in sorted((root / package).rglob("*.py")):
            for name in _imports(path):
                if name.startswith(banned) or (package == "sim" and name.split(".")[0] == "torch"):
                    wrong.append(f"{path.relative_to(root.parent)} imports {name}")
    assert not wrong, "\n".join(wrong)
