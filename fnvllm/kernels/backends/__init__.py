"""Attention backends as plug-ins: one module per backend in this package, each exporting ``BACKEND``.

A backend is the pair the model needs per layer: ``store_kv`` (write this step's K/V into the paged caches by
slot mapping) and ``attend`` (paged attention of the step's queries over the caches, which already hold this
step's K/V). Adding a backend = adding a module here; its name is the module's name, so ``EngineConfig`` can
list the choices without importing torch, triton or flash-attn.

``resolve_backend("auto", device)`` picks the available backend with the highest ``priority``; asking for an
unavailable backend by name is a clear error that says what to install. An FP8 KV cache (``kv_cache_dtype="fp8"``)
also passes each layer's (Hkv,) float32 ``k_scale`` and ``v_scale`` to both operations, as two more positional
arguments; only backends with ``supports_fp8_kv`` take them, and "auto" picks among those. A layer with a sliding
window (``attention.py``'s module docstring) passes ``window=w`` (an int >= 1, a keyword) to ``attend``, and only
then: only backends with ``supports_sliding_window`` take it, "auto" picks among those for such a model
(``resolve_backend(..., sliding_window=True)``), and naming another is refused.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

# store_kv(k, v, k_cache, v_cache, slot_mapping[, k_scale, v_scale]) -> None, in place; k, v (T, Hkv, D).
StoreKV = Callable[..., None]
# attend(q, k_cache, v_cache, meta, scale[, k_scale, v_scale][, window=w]) -> (T, Hq, D) in q's dtype.
Attend = Callable[..., Any]


def token_major(kv_cache_dtype: str) -> str:
    """``AttentionBackend.auto_kv_layout``'s default: token-major ("NHD") caches of any dtype."""
    return "NHD"


@attrs.frozen
class AttentionBackend:
    """One attention implementation.

    name: the module's name under ``fnvllm.kernels.backends`` (what ``attention_backend=`` takes).
    store_kv / attend: the two operations (see the module docstring for their signatures).
    priority: ``auto`` picks the available backend with the highest priority (measured speed decides it).
    unavailable_reason: ``f(device) -> str | None``; a message naming what is missing, or None when usable.
    supports_cuda_graphs: decode steps may be captured (no host syncs, grid from shapes only).
    supports_fp8_kv: reads and writes float8_e4m3fn caches with their scales (``kv_cache_dtype="fp8"``).
    kv_layouts: the caches' memory orders it reads and writes (``attention.KV_LAYOUTS``).
    auto_kv_layout: ``f(kv_cache_dtype) -> layout``, the one of kv_layouts that ``kv_layout="auto"`` allocates for
        a cache of that dtype ("auto" or "fp8"; measured speed decides it).
    supports_sliding_window: ``attend`` takes ``window=w`` and attends within it, prefill and decode (and, with
        supports_cuda_graphs, in captured steps).
    """

    name: str
    store_kv: StoreKV
    attend: Attend
    priority: int
    unavailable_reason: Callable[[torch.device], str | None]
    supports_cuda_graphs: bool = False
    supports_fp8_kv: bool = False
    kv_layouts: tuple[str, ...] = ("NHD",)
    auto_kv_layout: Callable[[str], str] = token_major
    supports_sliding_window: bool = False


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


def available_backends(
    device: torch.device, kv_cache_dtype: str = "auto", kv_layout: str = "auto", sliding_window: bool = False
) -> list[AttentionBackend]:
    """Backends usable on ``device`` (with a ``kv_cache_dtype`` cache in a ``kv_layout`` memory order, and sliding
    windows where ``sliding_window``), fastest first."""
    usable = []
    for name in backend_names():
        try:
            backend = get_backend(name)
        except BackendUnavailableError:
            continue
        fits = (kv_cache_dtype != "fp8" or backend.supports_fp8_kv) and kv_layout in ("auto", *backend.kv_layouts)
        fits = fits and (backend.supports_sliding_window or not sliding_window)
        if backend.unavailable_reason(device) is None and fits:
            usable.append(backend)
    return sorted(usable, key=lambda b: -b.priority)


def resolve_backend(
    name: str, device: torch.device, kv_cache_dtype: str = "auto", kv_layout: str = "auto", sliding_window: bool = False
) -> AttentionBackend:
    """The backend for ``name`` on ``device``: "auto" = the fastest available; a named one must be usable, and
    support the FP8 cache when ``kv_cache_dtype`` is "fp8", the memory order ``kv_layout`` unless "auto", and
    sliding windows when ``sliding_window`` (the model has a layer with one)."""
    if name == "auto":  # torch is always available (any layout, FP8, windows)
        return available_backends(device, kv_cache_dtype, kv_layout, sliding_window)[0]
    backend = get_backend(name)
    reason = backend.unavailable_reason(device)
    if reason is not None:
        raise BackendUnavailableError(f"attention_backend={name!r} is not available on {device}: {reason}")
    if kv_cache_dtype == "fp8" and not backend.supports_fp8_kv:
        fp8_names = [b for b in backend_names() if _supports_fp8(b)]
        raise BackendUnavailableError(
            f"attention_backend={name!r} cannot read an FP8 KV cache (kv_cache_dtype='fp8'); use one of "
            f"{fp8_names} or kv_cache_dtype='auto'"
        )
    if sliding_window and not backend.supports_sliding_window:
        raise BackendUnavailableError(
            f"attention_backend={name!r} has no sliding-window attention, which this model's layers need; use one of "
            f"{sliding_window_backends()}"
        )
    resolve_kv_layout(kv_layout, backend, kv_cache_dtype)
    return backend


def sliding_window_backends() -> list[str]:
    """Names of the registered backends that import here and attend within a sliding window."""
    names = []
    for name in backend_names():
        try:
            if get_backend(name).supports_sliding_window:
                names.append(name)
        except BackendUnavailableError:
            continue
    return names


def resolve_kv_layout(kv_layout: str, backend: AttentionBackend, kv_cache_dtype: str = "auto") -> str:
    """The caches' memory order for ``backend``: "auto" = its ``auto_kv_layout`` for ``kv_cache_dtype``; a named
    one it must read (BackendUnavailableError naming the choices otherwise)."""
    if kv_layout == "auto":
        return backend.auto_kv_layout(kv_cache_dtype)
    if kv_layout not in backend.kv_layouts:
        raise BackendUnavailableError(
            f"attention_backend={backend.name!r} cannot read a {kv_layout} KV cache (kv_layout={kv_layout!r}); it "
            f"reads {list(backend.kv_layouts)}: use one of those or kv_layout='auto'"
        )
    return kv_layout


def _supports_fp8(name: str) -> bool:
    """Whether backend ``name`` imports here and takes FP8 caches."""
    try:
        return get_backend(name).supports_fp8_kv
    except BackendUnavailableError:
        return False
