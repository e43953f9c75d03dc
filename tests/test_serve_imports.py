"""``fnvllm.serve`` without the [serve] extra: its framework-free modules import, and its public names load
their modules on first use (so a missing web framework surfaces only where it is needed, by name)."""

from __future__ import annotations

import subprocess
import sys

BLOCK_FASTAPI = """
import sys

class Block:  # as if fastapi and uvicorn were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fastapi", "uvicorn"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Block())
"""


def run_without_fastapi(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_FASTAPI + code], capture_output=True, text=True, timeout=120)


def test_framework_free_modules_import_without_the_serve_extra() -> None:
    """The response formats and the test/benchmark server launcher need no web framework."""
    done = run_without_fastapi(
        "import fnvllm.serve, fnvllm.serve.formats, fnvllm.serve.server_process\n"
        "assert 'fastapi' not in sys.modules\n"
        "print(sorted(fnvllm.serve.__all__)[:2])"
    )
    assert done.returncode == 0, done.stderr
    assert "['AsyncEngine', 'EngineFailure']" in done.stdout


def test_public_names_load_on_use_and_a_missing_framework_is_named() -> None:
    """A public name that needs the framework raises ModuleNotFoundError naming it; unknown names raise
    AttributeError; with the framework present every public name resolves to its defining module's object."""
    done = run_without_fastapi(
        "import fnvllm.serve\n"
        "try:\n    fnvllm.serve.build_app\nexcept ModuleNotFoundError as e:\n    print('missing', e.name)\n"
        "try:\n    fnvllm.serve.no_such_name\nexcept AttributeError as e:\n    print('attr', e)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "missing fastapi" in done.stdout and "no_such_name" in done.stdout


def test_every_public_name_resolves_to_its_module() -> None:
    import importlib

    import pytest

    pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
    import fnvllm.serve as serve

    for name in serve.__all__:
        obj = getattr(serve, name)
        module = importlib.import_module(f"fnvllm.serve.{serve._EXPORTS[name]}")
        assert obj is getattr(module, name), name
    assert set(serve.__all__) == set(serve._EXPORTS)
