"""Triton's interpreter without its repeated module scans: the CPU suite runs every kernel in it, and nested
``@triton.jit`` helpers dominate its overhead.

Each call of a ``@triton.jit`` helper inside an interpreted kernel re-runs ``_patch_lang``, which walks every member
of ``triton.language`` (``inspect.getmembers``: a ``dir``, a ``getattr`` per name and a sort) to find the builtins
it must route to the interpreter. Inside a launch those builtins are already routed, so the walk finds nothing to
do, yet it cost about a quarter of the time of the interpreter-heavy tests (a profile of
``test_split_partials.py``'s bitwise model test: 67.7 of 249 s in ``_patch_lang``, 98,207 module walks).

Measured on the two-core CPU VM, the two trees side by side: ``tests/test_topk_parallel.py`` 307.8 s without, 273.5 s
with (-11 %); the bitwise model test above 88.5 s without, 83.5 s with.

``speed_up_nested_jit_calls`` replaces the walk with the list of builtin names, taken once before any launch; the
patch applied is the same (each listed name still patched only while it holds a builtin), so the kernels compute
exactly what they computed before. Any module not listed, or a Triton without these internals, keeps Triton's own
code.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def speed_up_nested_jit_calls() -> bool:
    """Install the cached builtin walk in Triton's interpreter; False (and nothing changed) when this Triton has no
    ``_patch_builtin`` / ``_patch_attr`` to replace."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    walk: Callable[..., None] | None = getattr(interpreter, "_patch_builtin", None)
    patch_attr: Callable[..., None] | None = getattr(interpreter, "_patch_attr", None)
    is_builtin: Callable[[Any], bool] | None = getattr(tl.core, "is_builtin", None)
    if walk is None or patch_attr is None or is_builtin is None or hasattr(walk, "builtin_names"):
        return False
    modules = [tl, tl.core, tl.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None)]
    # id -> (the module or class, the names of its builtins), taken now, before any launch has patched them
    builtins = {
        id(module): (module, tuple(name for name, member in inspect.getmembers(module) if is_builtin(member)))
        for module in modules
        if module is not None
    }

    def cached_walk(module: Any, builder: Any, scope: Any) -> None:
        known = builtins.get(id(module))
        if known is None or known[0] is not module:
            walk(module, builder, scope)
            return
        for name in known[1]:
            member = getattr(module, name)
            if is_builtin(member):
                patch_attr(module, name, member, builder, scope)

    cached_walk.builtin_names = {module: names for module, names in builtins.values()}  # type: ignore[attr-defined]
    interpreter._patch_builtin = cached_walk
    return True
