"""KV-cache scales a checkpoint may carry for an FP8 KV cache, read for this rank's KV heads.

Names accepted (vLLM's, layer N): ``model.layers.N.self_attn.k_scale`` / ``v_scale`` (also under
``self_attn.attn.``) and the older ``model.layers.N.self_attn.k_proj.output_scale`` / ``v_proj.output_scale``.
Each is a dequantization scale (stored = x / scale), a scalar (shape () or (1,)) shared by the layer's KV heads
or one per KV head (Hkv,). A layer without one gets 1.0 (``fp8.default_kv_scales``). The loader accepts these
names in any checkpoint (``is_kv_scale_name``) and ignores them unless the KV cache is FP8.

Worked example (Hkv 8, tensor parallel 2): a per-head ``k_scale`` of 8 values gives rank 0 values 0..3 and rank 1
values 4..7 (``sharding.kv_head_range``); a scalar 0.5 gives each rank four 0.5s.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from fnvllm.kernels.fp8 import default_kv_scales
from fnvllm.model.config import CheckpointError, ModelConfig
from fnvllm.model.sharding import SINGLE, TensorParallel, kv_head_range

_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:(?:attn\.)?([kv])_scale|([kv])_proj\.output_scale)")


def is_kv_scale_name(name: str) -> bool:
    """True for a checkpoint tensor that is a layer's K or V cache scale (see the module docstring)."""
    return _KV_SCALE.fullmatch(name) is not None


def read_kv_scales(
    files: list[Path], config: ModelConfig, device: torch.device, tp: TensorParallel = SINGLE
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(k_scale, v_scale) per layer, each (local KV heads,) float32 on ``device``: the checkpoint's where
    ``files`` carry them, else 1.0. CheckpointError naming the tensor for a bad shape or a value that is not a
    finite number > 0."""
    first, end = kv_head_range(config, tp)
    scales = [
        {"k": default_kv_scales(end - first, device), "v": default_kv_scales(end - first, device)}
        for _ in range(config.num_hidden_layers)
    ]
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                match = _KV_SCALE.fullmatch(name)
                if match is None:
                    continue
                layer, which = int(match.group(1)), match.group(2) or match.group(3)
                if layer >= config.num_hidden_layers:
                    raise CheckpointError(f"{file}: {name!r} names layer {layer}; the model has {len(scales)}")
                values = _per_head(name, f.get_tensor(name), config.num_key_value_heads)
                scales[layer][which] = values[first:end].to(device)
    return [(s["k"], s["v"]) for s in scales]


def _per_head(name: str, value: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """A stored scale as (Hkv,) float32: a scalar is repeated per head; CheckpointError when it cannot be used."""
    value = value.float().reshape(-1)
    if value.numel() == 1:
        value = value.expand(num_kv_heads)
    if value.numel() != num_kv_heads:
        raise CheckpointError(
            f"KV-cache scale {name!r} must be a scalar or one value per KV head ({num_kv_heads}), got "
            f"{value.numel()} values"
        )
    if not all(math.isfinite(x) and x > 0 for x in value.tolist()):
        raise CheckpointError(f"KV-cache scale {name!r} must be finite and > 0, got {value.tolist()}")
    return value.contiguous()
