"""Attention backends as plug-ins: one module per backend in this package, each exporting ``BACKEND``.

A backend is the pair the model needs per layer: ``store_kv`` (write this step's K/V into the paged caches by
slot mapping) and ``attend`` (paged attention of the step's queries over the caches, which already hold this
step's K/V). Adding a backend = adding a module here; its name is the module's name, so ``EngineConfig`` can
list the choices without importing torch, triton or flash-attn.

``resolve_backend("auto", device)`` picks the available backend with the highest ``priority``; asking for an
unavailable backend by name is a clear error that says what to install.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

# store_kv(k, v, k_cache, v_cache, slot_mapping) -> None, in place; k, v (T, Hkv, D).
StoreKV = Callable[..., None]
# attend(q, k_cache, v_cache, meta, scale) -> (T, Hq, D) in q's dtype.
Attend = Callable[..., Any]


@attrs.frozen
class AttentionBackend:
    """One attention implementation.

    name: the module's name under ``fnvllm.kernels.backends`` (what ``attention_backend=`` takes).
    store_kv / attend: the two operations (see the module docstring for their signatures).
    priority: ``auto`` picks the available backend with the highest priority (measured speed decides it).
    unavailable_reason: ``f(device) -> str | None``; a message naming what is missing, or None when usable.
    supports_cuda_graphs: decode steps may be captured (no host syncs, grid from shapes only).
    """

    name: str
    store_kv: StoreKV
    attend: Attend
    priority: int
    unavailable_reason: Callable[[torch.device], str | None]
    supports_cuda_graphs: bool = False


class BackendUnavailableError(RuntimeError):
    """An attention backend was asked for by name but cannot run here (the message says what to install)."""


def backend_names() -> tuple[str, ...]:
    """Names of all registered backends (this package's public modules), without importing them."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


def get_backend(name: str) -> AttentionBackend:
    """The backend registered as ``name``; ValueError naming the choices for an unknown name.

    Importing its module may fail when an optional dependency is missing: that is a BackendUnavailableError.
    """
    if name not in backend_names():
        raise ValueError(f"attention_backend {name!r} is unknown; choose one of {('auto', *backend_names())}")
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ImportError as e:
        raise BackendUnavailableError(f"attention backend {name!r} cannot be imported here: {e}") from e
    backend: AttentionBackend = module.BACKEND
    return backend


def available_backends(device: torch.device) -> list[AttentionBackend]:
    """Backends usable on ``device``, fastest first."""
    usable = []
    for name in backend_names():
        try:
            backend = get_backend(name)
        except BackendUnavailableError:
            continue
        if backend.unavailable_reason(device) is None:
            usable.append(backend)
    return sorted(usable, key=lambda b: -b.priority)


def resolve_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend for ``name`` on ``device``: "auto" = the fastest available; a named one must be usable."""
    if name == "auto":
        return available_backends(device)[0]  # torch is always available
    backend = get_backend(name)
    reason = backend.unavailable_reason(device)
    if reason is not None:
        raise BackendUnavailableError(f"attention_backend={name!r} is not available on {device}: {reason}")
    return backend
