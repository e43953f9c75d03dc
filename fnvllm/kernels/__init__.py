"""Attention backends and kernels, each kernel beside its pure-torch reference.

`attention.py` holds the metadata contract, the KV layout and the torch reference; `backends/` the plug-ins
(torch, triton, flash). The write-then-attend entry point is `fnvllm.kernels.attention.attention`; it is not
re-exported here because the package attribute `attention` must stay the submodule.

The re-exports below are resolved on first use (PEP 562), so importing the package, e.g. to list the attention
backends while an ``EngineConfig`` is validated, imports no torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AttentionMetadata", "paged_attention_ref", "write_kv"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fnvllm.kernels import attention

        return getattr(attention, name)
    raise AttributeError(f"module 'fnvllm.kernels' has no attribute {name!r}")
