"""Environment variables: the two parsers (``fnvllm.env``) refuse what a variable does not take, naming it, and
docs/environment.md lists exactly the FNVLLM_* variables the package, the tests and the benchmarks read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fnvllm.env import env_choice, env_switch

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "environment.md"
NAME = re.compile(r"\bFNVLLM_[A-Z0-9_]*[A-Z0-9]\b")


@pytest.mark.parametrize(("value", "default", "expected"), [("1", False, True), ("0", True, False), (None, True, True),
                                                           (None, False, False)])  # fmt: skip
def test_switch_takes_zero_and_one_and_defaults_when_unset(
    monkeypatch: pytest.MonkeyPatch, value: str | None, default: bool, expected: bool
) -> None:
    """ "1" on, "0" off, unset: the default."""
    if value is None:
        monkeypatch.delenv("FNVLLM_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("FNVLLM_TEST_SWITCH", value)
    assert env_switch("FNVLLM_TEST_SWITCH", default) is expected


@pytest.mark.parametrize("value", ["true", "", "2", " 1"])
def test_switch_refuses_other_values_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """Anything but 0 or 1 is a ValueError that names the variable and quotes the value."""
    monkeypatch.setenv("FNVLLM_TEST_SWITCH", value)
    with pytest.raises(ValueError, match=rf"FNVLLM_TEST_SWITCH must be 0 or 1, got {re.escape(repr(value))}"):
        env_switch("FNVLLM_TEST_SWITCH", True)


def test_choice_takes_a_listed_value_and_refuses_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """A listed value is returned, unset gives the default, anything else is a ValueError naming the choices; a
    default outside the choices is a programming error, refused too."""
    choices = ("auto", "token", "head")
    monkeypatch.delenv("FNVLLM_TEST_CHOICE", raising=False)
    assert env_choice("FNVLLM_TEST_CHOICE", choices, "auto") == "auto"
    monkeypatch.setenv("FNVLLM_TEST_CHOICE", "head")
    assert env_choice("FNVLLM_TEST_CHOICE", choices, "auto") == "head"
    monkeypatch.setenv("FNVLLM_TEST_CHOICE", "rows")
    with pytest.raises(ValueError, match=r"FNVLLM_TEST_CHOICE must be one of \('auto', 'token', 'head'\), got 'rows'"):
        env_choice("FNVLLM_TEST_CHOICE", choices, "auto")
    with pytest.raises(ValueError, match="default 'rows'"):
        env_choice("FNVLLM_TEST_CHOICE", choices, "rows")


def _read_in_code() -> set[str]:
    """FNVLLM_* names in the package, the tests (but this file and the parsers' own examples) and the benchmarks."""
    names: set[str] = set()
    for folder in ("fnvllm", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != Path(__file__).name:
                names |= set(NAME.findall(path.read_text()))
    return {name for name in names if not name.startswith(("FNVLLM_TEST_", "FNVLLM_UNSET_"))}


def test_the_page_lists_every_variable_the_code_reads_and_no_other() -> None:
    """docs/environment.md's tables name each FNVLLM_* variable that appears in the code, and only those."""
    documented = set(re.findall(r"^\| `(FNVLLM_[A-Z0-9_]+)`", DOC.read_text(), flags=re.M))
    code = _read_in_code()
    assert code - documented == set(), f"read in the code but not documented: {sorted(code - documented)}"
    assert documented - code == set(), f"documented but read nowhere: {sorted(documented - code)}"
