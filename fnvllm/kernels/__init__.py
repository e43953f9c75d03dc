"""Attention backends and kernels, each beside its pure-torch reference.

The write-then-attend entry point is `fnvllm.kernels.attention.attention`; it is not re-exported here because
the package attribute `attention` must stay the submodule.
"""

from fnvllm.kernels.attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionMetadata,
    build_attention_metadata,
    get_attention_backend,
    paged_attention_ref,
    write_kv,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "build_attention_metadata",
    "get_attention_backend",
    "paged_attention_ref",
    "write_kv",
]
