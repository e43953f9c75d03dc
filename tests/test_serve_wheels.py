"""benchmarks/serve_wheels.py: which wheels it unpacks, what it refuses, and that an unpacked wheel imports."""

from __future__ import annotations

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
    """The real predicate: a module nobody has is unpacked, and the probe (a fresh interpreter) imports it from the
    target; the command line says what it installed, and nothing is installed the second time round."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    make_wheel(folder, "fnvllm_wheel_probe", {"fnvllm_wheel_probe/__init__.py": "assert 41 + 1 == 42\n"})
    target = tmp_path / "site"
    assert serve_wheels.main([str(folder), str(target), "--need", "fnvllm_wheel_probe"]) == 0
    assert (target / "fnvllm_wheel_probe" / "__init__.py").is_file()
    assert serve_wheels.failed_probes(tmp_path / "empty", {"fnvllm_wheel_probe": "import fnvllm_wheel_probe"}) == [
        "fnvllm_wheel_probe: ModuleNotFoundError: No module named 'fnvllm_wheel_probe'"
    ]
    again = serve_wheels.install(folder, tmp_path / "other", lambda m: True)
    assert again == []


def test_a_dependency_missing_from_the_folder_fails_the_probe(tmp_path: Path) -> None:
    """A wheel unpacks, but what it imports is in no wheel: the command line exits 1 and names it."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    make_wheel(folder, "fnvllm_wheel_top", {"fnvllm_wheel_top/__init__.py": "import fnvllm_wheel_absent_dep\n"})
    assert serve_wheels.main([str(folder), str(tmp_path / "site"), "--need", "fnvllm_wheel_top"]) == 1
    failed = serve_wheels.failed_probes(tmp_path / "site", serve_wheels.probes_for(["fnvllm_wheel_top"]))
    assert failed == ["fnvllm_wheel_top: ModuleNotFoundError: No module named 'fnvllm_wheel_absent_dep'"]


def test_the_command_line_exits_1_naming_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """xgrammar missing and no wheel: exit 1 naming it by default; ``--need`` without it (the server alone) does
    not ask for it."""
    monkeypatch.setattr(serve_wheels, "importable", has_all_but("xgrammar"))
    assert serve_wheels.main([str(tmp_path / "no_such_folder"), str(tmp_path / "site")]) == 1
    assert "missing ['xgrammar']" in capsys.readouterr().err
    monkeypatch.setattr(serve_wheels, "PROBES", {"fastapi": "pass"})
    assert serve_wheels.main([str(tmp_path / "no_such_folder"), str(tmp_path / "site"), "--need", "fastapi"]) == 0
    assert "installed nothing" in capsys.readouterr().out
