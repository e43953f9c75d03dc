"""Attention backends and kernels, each kernel beside its pure-torch reference.

`attention.py` holds the metadata contract, the KV layout and the torch reference; `backends/` the plug-ins
(torch, triton, flash). The write-then-attend entry point is `fnvllm.kernels.attention.attention`; it is not
re-exported here because the package attribute `attention` must stay the submodule.
"""

from fnvllm.kernels.attention import AttentionMetadata, build_attention_metadata, paged_attention_ref, write_kv

__all__ = ["AttentionMetadata", "build_attention_metadata", "paged_attention_ref", "write_kv"]
