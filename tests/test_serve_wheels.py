"""benchmarks/serve_wheels.py: which wheels it unpacks, what it refuses, and that an unpacked wheel imports."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks import serve_wheels


def make_wheel(folder: Path, dist: str, files: dict[str, str]) -> Path:
    """A wheel-shaped zip: the given files plus the dist-info folder every wheel has."""
    wheel = folder / f"{dist}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{dist}-1.0.dist-info/METADATA", f"Name: {dist}\n")
    return wheel


def has_all_but(*missing: str) -> Callable[[str], bool]:
    """A stand-in for ``importable``: every module but these."""
    return lambda module: module not in missing


def stack_folder(tmp_path: Path) -> Path:
    """Wheels for the fastapi stack's triggers, pydantic's core, uvicorn and a single module, ``httpx``."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    for name in ("fastapi", "starlette", "pydantic", "pydantic_core", "uvicorn", "httpx"):
        make_wheel(folder, name, {f"{name}/__init__.py": ""})
    make_wheel(folder, "typing_extensions", {"typing_extensions.py": ""})
    make_wheel(folder, "pyyaml", {"yaml/__init__.py": "", "_yaml.cpython-312-x86_64-linux-gnu.so": ""})
    return folder


def test_a_wheels_modules_are_its_top_folders_less_metadata(tmp_path: Path) -> None:
    folder = stack_folder(tmp_path)
    assert serve_wheels.wheel_modules(folder / "pyyaml-1.0-py3-none-any.whl") == {"yaml", "_yaml"}
    assert serve_wheels.wheel_modules(folder / "typing_extensions-1.0-py3-none-any.whl") == {"typing_extensions"}


def test_only_missing_modules_when_the_stack_is_whole(tmp_path: Path) -> None:
    folder = stack_folder(tmp_path)
    chosen = serve_wheels.wheels_to_install(folder.glob("*.whl"), has_all_but("httpx", "yaml"))
    assert [w.name.split("-")[0] for w in chosen] == ["httpx", "pyyaml"]


def test_a_missing_trigger_brings_the_whole_fastapi_stack(tmp_path: Path) -> None:
    """pydantic is importable but fastapi is not: pydantic, its core and typing_extensions come too (tight pins);
    httpx and yaml, outside the stack and importable, do not."""
    folder = stack_folder(tmp_path)
    chosen = serve_wheels.wheels_to_install(folder.glob("*.whl"), has_all_but("fastapi"))
    names = [w.name.split("-")[0] for w in chosen]
    assert names == ["fastapi", "pydantic", "pydantic_core", "starlette", "typing_extensions"]


def test_a_needed_module_without_a_wheel_is_refused_before_anything_is_unpacked(tmp_path: Path) -> None:
    folder = stack_folder(tmp_path)
    target = tmp_path / "site"
    with pytest.raises(ValueError, match=r"missing \['openai', 'xgrammar'\] and no wheel"):
        serve_wheels.install(folder, target, has_all_but("openai", "xgrammar", "httpx"))
    assert not target.exists()


def test_an_unpacked_wheel_imports_from_the_target(tmp_path: Path) -> None:
    """The real predicate: a module nobody has is unpacked, and a fresh interpreter imports it from the target;
    the command line says what it installed, and installs nothing the second time round."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    make_wheel(folder, "fnvllm_wheel_probe", {"fnvllm_wheel_probe/__init__.py": "VALUE = 41 + 1\n"})
    target = tmp_path / "site"
    script = Path(serve_wheels.__file__)
    first = subprocess.run([sys.executable, str(script), str(folder), str(target)], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert "installed fnvllm_wheel_probe" in first.stdout
    probe = "import fnvllm_wheel_probe; print(fnvllm_wheel_probe.VALUE)"
    imported = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env={"PYTHONPATH": str(target)}
    )
    assert imported.stdout.strip() == "42", imported.stderr
    again = serve_wheels.install(folder, tmp_path / "other", lambda m: m != "nothing")
    assert again == []


def test_the_command_line_exits_1_naming_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_wheels, "importable", has_all_but("xgrammar"))
    assert serve_wheels.main([str(tmp_path / "no_such_folder"), str(tmp_path / "site")]) == 1
