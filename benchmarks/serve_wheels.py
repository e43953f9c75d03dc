"""Put the [serve] extra on a machine that reaches no package registry (the GPU machine), from a folder of wheels.

    python3 benchmarks/serve_wheels.py WHEELS TARGET     # then: export PYTHONPATH=TARGET:$PYTHONPATH

Unpacks into TARGET each wheel in WHEELS whose modules this python3 cannot import (a wheel is a zip of the
site-packages tree, so unpacking it is the install: no pip, no network). fastapi's stack goes in as a unit when any
of fastapi, starlette, pydantic or uvicorn is missing, because its pins are tight (a machine's own older pydantic
would break the fastapi we test with). Exit 1, naming them, when a missing module of the [serve] extra or of the
server tests' client (the official openai client, xgrammar for structured outputs) has no wheel in WHEELS, or when
one of them fails to import (or the client to be made) afterwards: a dependency of a wheel missing from WHEELS.

Make WHEELS once on a machine with network, for the GPU machine's Python 3.12 on x86-64, the versions we test with
(``.serve_wheels`` at the repository root: git ignores it, so a device call names it in ``carry``):

    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .serve_wheels \\
      fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \\
      annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.3 \\
      uvicorn==0.55.0 h11==0.16.0 click==8.5.1 prometheus-client==0.26.0 httpx==0.29.0 httpcore==1.0.9 \\
      anyio==4.16.0 idna==3.21 certifi==2026.10.19.post1 sniffio==1.3.1 \\
      openai==3.63.0 jiter==0.19.0 distro==1.9.0 httpx2==2.17.0 httpcore2==2.17.0 \\
      truststore==0.10.5 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pyyaml==6.0.4

(about 12 MB). ``benchmarks/gpu_suite.sh`` and ``benchmarks/serve_check.sh`` call this first.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

# Installed together when any of STACK_TRIGGERS is missing (fastapi pins the rest tightly).
FASTAPI_STACK = (
    "fastapi", "starlette", "pydantic", "pydantic_core", "annotated_types", "annotated_doc", "typing_inspection",
    "typing_extensions", "opentelemetry",
)  # fmt: skip
STACK_TRIGGERS = ("fastapi", "starlette", "pydantic", "uvicorn")
# What the server and its tests import (``--need``'s default): a missing one with no wheel is an error, not a
# silent skip. SERVER: what ``fnvllm serve`` and the load client alone need (serve_check.sh).
SERVER = (*STACK_TRIGGERS, "prometheus_client", "httpx")
NEEDED = (*SERVER, "openai", "xgrammar")


def wheel_modules(wheel: Path) -> set[str]:
    """The top-level modules a wheel installs: its zip's first path parts, less metadata and file suffixes
    (``typing_extensions.py`` gives ``typing_extensions``, ``_foo.cpython-312-x86_64-linux-gnu.so`` ``_foo``;
    ``pyyaml`` gives ``yaml`` and ``_yaml``)."""
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    return {top.split(".")[0] for top in tops if not top.endswith((".dist-info", ".data"))}


def importable(module: str) -> bool:
    """Whether this interpreter can import ``module`` (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-installed package counts as missing
        return False


def wheels_to_install(wheels: Iterable[Path], has: Callable[[str], bool] = importable) -> list[Path]:
    """The wheels whose modules are not all importable, plus the whole fastapi stack when a trigger is missing."""
    whole_stack = not all(has(m) for m in STACK_TRIGGERS)
    chosen = []
    for wheel in sorted(wheels):
        modules = wheel_modules(wheel)
        if not all(has(m) for m in modules) or (whole_stack and modules & set(FASTAPI_STACK)):
            chosen.append(wheel)
    return chosen


def missing_without_wheel(
    wheels: Iterable[Path], has: Callable[[str], bool] = importable, needed: Iterable[str] = NEEDED
) -> list[str]:
    """The ``needed`` modules this interpreter lacks and no wheel in ``wheels`` provides."""
    provided = set().union(*(wheel_modules(w) for w in wheels))
    return sorted({m for m in needed if not has(m) and m not in provided})


def install(
    wheels_dir: Path, target: Path, has: Callable[[str], bool] = importable, needed: Iterable[str] = NEEDED
) -> list[Path]:
    """Unpack the wheels ``wheels_to_install`` picks into ``target``; ValueError naming the ``needed`` modules
    that are missing with no wheel (nothing is unpacked then)."""
    wheels = list(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
    lost = missing_without_wheel(wheels, has, needed)
    if lost:
        raise ValueError(f"missing {lost} and no wheel for them in {wheels_dir} (see benchmarks/serve_wheels.py)")
    chosen = wheels_to_install(wheels, has)
    for wheel in chosen:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    return chosen


# What a needed module must do once unpacked, beyond ``import``: the client makes one (httpx2, under it, imports its
# own dependencies, such as truststore, only when a client is made).
PROBES = {"openai": "import openai; openai.OpenAI(api_key='probe', base_url='http://127.0.0.1:9/v1')"}


def probes_for(needed: Iterable[str]) -> dict[str, str]:
    """module -> the code that checks it: its PROBES entry, else its import."""
    return {m: PROBES.get(m, f"import {m}") for m in needed}


def failed_probes(target: Path, probes: Mapping[str, str]) -> list[str]:
    """Run each probe in a fresh interpreter with ``target`` first on its path: a line for each that fails (a
    wheel's own dependency missing from the folder shows here, e.g. the openai client's ``truststore``)."""
    path = os.pathsep.join([str(target), *filter(None, [os.environ.get("PYTHONPATH")])])
    failed = []
    for module, code in probes.items():
        env = {**os.environ, "PYTHONPATH": path}
        probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        if probe.returncode != 0:
            failed.append(f"{module}: {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheels", type=Path, help="a folder of wheels (see this script's docstring)")
    parser.add_argument("target", type=Path, help="the folder to unpack into (put it first on PYTHONPATH)")
    parser.add_argument(
        "--need",
        default=",".join(NEEDED),
        help=f"comma-separated modules that must import afterwards (default: the server and its tests'; the server "
        f"alone: {','.join(SERVER)})",
    )
    args = parser.parse_args(argv)
    needed = [m for m in args.need.split(",") if m]
    try:
        chosen = install(args.wheels, args.target, importable, needed)
    except ValueError as err:
        print(f"serve wheels: {err}", file=sys.stderr)
        return 1
    names = ", ".join(w.name.split("-")[0] for w in chosen) or "nothing (all importable)"
    print(f"serve wheels: installed {names}")
    failed = failed_probes(args.target, probes_for(needed))
    for line in failed:
        print(f"serve wheels: import failed: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
