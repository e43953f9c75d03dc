"""Triton's interpreter without its repeated language patching: the CPU suite runs every kernel in it, and nested
``@triton.jit`` helpers dominate its overhead.

A kernel launch in the interpreter first routes ``triton.language``'s builtins to the interpreter (``_patch_lang``:
it walks every member of ``tl``, ``tl.core``, ``tl.tensor`` and ``tl.math`` with ``inspect.getmembers``, a ``dir``,
a ``getattr`` per name and a sort, and sets the interpreter's ``range``, reductions and tensor methods), runs every
program, then puts the language back. Each call of a ``@triton.jit`` helper inside the kernel runs ``_patch_lang``
again, for the same modules, and never undoes it: the outer launch's patch is already in place, so the repeat
changes nothing, yet it cost about a quarter of the time of the interpreter-heavy tests (a profile of
``test_split_partials.py``'s bitwise model test: 67.7 of 249 s in ``_patch_lang``, 98,207 module walks).

``speed_up_nested_jit_calls`` installs two changes, each leaving what the kernels compute as it was:

- a helper called inside a launch skips ``_patch_lang`` when the launch, or a helper before it, already patched
  every language module the helper sees (``tl`` and/or ``tl.core`` among its globals); otherwise Triton's own code
  runs;
- the launch's own walk uses the names of the builtins, listed once before any launch (each listed name is still
  patched only while it holds a builtin); modules not listed keep Triton's walk.

Measured on the two-core CPU VM, the trees side by side: ``tests/test_topk_parallel.py`` 307.8 s without, 273.5 s
with the cached walk alone (-11 %); then three interpreter-heavy tests (the bitwise model test above, a chi-square
draw through the filter kernel, the top-k grid kernel) 123.1 s with the cached walk alone, 112.7 s with both (-8 %;
the chi-square draw 31.0 against 24.5 s).

A Triton without these internals keeps its own code (the function returns False).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def speed_up_nested_jit_calls() -> bool:
    """Install both changes in Triton's interpreter; False (and nothing changed) when this Triton lacks
    ``_patch_lang`` / ``_patch_builtin`` / ``_patch_attr`` / ``_LangPatchScope`` / ``GridExecutor``, or they are
    installed already."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang: Callable[[Any], Any] | None = getattr(interpreter, "_patch_lang", None)
    walk: Callable[..., None] | None = getattr(interpreter, "_patch_builtin", None)
    patch_attr: Callable[..., None] | None = getattr(interpreter, "_patch_attr", None)
    scope_type: type | None = getattr(interpreter, "_LangPatchScope", None)
    grid_executor: Any = getattr(interpreter, "GridExecutor", None)
    is_builtin: Callable[[Any], bool] | None = getattr(tl.core, "is_builtin", None)
    needed = (patch_lang, walk, patch_attr, scope_type, grid_executor, is_builtin)
    if any(part is None for part in needed) or hasattr(patch_lang, "launch"):
        return False
    assert patch_lang is not None and walk is not None and patch_attr is not None  # (for the type checker)
    assert scope_type is not None and is_builtin is not None

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

    languages = (tl, tl.core)
    # running: inside GridExecutor.__call__; patched: the language modules that launch has patched (None outside a
    # launch and before its own patch)
    launch: dict[str, Any] = {"running": False, "patched": None}
    grid_call = grid_executor.__call__

    def languages_of(fn: Any) -> frozenset[int]:
        return frozenset(id(value) for value in fn.__globals__.values() if any(value is lang for lang in languages))

    def launch_aware_patch_lang(fn: Any) -> Any:
        patched = launch["patched"]
        if patched is None:  # a launch's own patch (or a helper called outside any launch): Triton's
            scope = patch_lang(fn)
            if launch["running"]:
                launch["patched"] = languages_of(fn)
            return scope
        seen = languages_of(fn)
        if seen <= patched:
            return scope_type()  # a helper that sees only modules patched already: nothing to patch or undo
        # Triton's own patch (never undone, as in Triton): from here on the launch has these modules patched too.
        # (Triton's jit helpers, tl.max or tl.sum, see only tl.core, which a kernel importing tl alone leaves to them.)
        launch["patched"] = patched | seen
        return patch_lang(fn)

    def tracked_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        launch.update(running=True, patched=None)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launch.update(running=False, patched=None)

    cached_walk.builtin_names = {module: names for module, names in builtins.values()}  # type: ignore[attr-defined]
    launch_aware_patch_lang.launch = launch  # type: ignore[attr-defined]
    interpreter._patch_builtin = cached_walk
    interpreter._patch_lang = launch_aware_patch_lang
    grid_executor.__call__ = tracked_launch
    return True
