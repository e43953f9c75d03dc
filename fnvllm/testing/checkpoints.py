"""Checkpoints written locally for tests and benchmarks (no model hub needed).

- `write_tiny_checkpoint`: a tiny Qwen3 / Qwen3-MoE / Qwen2 / Llama written by transformers' own classes, so
  tests can compare our model against Hugging Face's on the very same weights.
- `write_random_checkpoint`: real Qwen3-0.6B / Qwen3-8B / Qwen3-30B-A3B / Qwen1.5-MoE-A2.7B / Mixtral-8x7B shapes
  with random weights, written straight to safetensors without building the HF model (seconds, not minutes), for
  GPU throughput benchmarks. Qwen3-30B-A3B is ~61 GB in bf16, Mixtral-8x7B ~93 GB: streamed like the others,
  after checking the disk has room.
  Both take ``config_only=True``: only config.json and generation_config.json, for ``load_format="dummy"``
  (random weights filled on the device, no safetensors).
- `write_fp8_checkpoint`: a copy of a (small) checkpoint in the official block-quantized FP8 layout (Qwen3-8B-FP8's):
  every decoder-layer linear as e4m3 ``weight`` + float32 ``weight_scale_inv`` per 128 x 128 block; and
  `write_dequantized_checkpoint`, the float32 checkpoint of what an FP8 one means (the tests' reference).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Literal

import torch

from fnvllm.published import OTHER_SHAPES, QWEN3_COMMON, QWEN3_MOE_SHAPES, QWEN3_SHAPES

Family = Literal["qwen3", "qwen3_moe", "qwen2", "llama"]
ShapeName = Literal["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-8x7b"]

_HF_CLASSES: Mapping[str, tuple[str, str]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}

_QWEN3_COMMON = QWEN3_COMMON  # (the tests' and benchmarks' name)
_OTHER_GENERATION_CONFIGS: Mapping[str, Mapping[str, Any]] = {
    "qwen1.5-moe-a2.7b": {"bos_token_id": 151643, "eos_token_id": 151643, "do_sample": False},
    "mixtral-8x7b": {"bos_token_id": 1, "eos_token_id": 2},
}
_SAFETENSORS_DTYPES: Mapping[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
}
_QWEN3_GENERATION_CONFIG: Mapping[str, Any] = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}


def write_tiny_checkpoint(
    path: str | Path,
    family: Family,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int = 256,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int = 2048,
    eos_token_id: int | None = None,
    init_std: float = 0.1,
    seed: int = 0,
    dtype: str = "float32",
    shard: bool = False,
    moe: Mapping[str, Any] | None = None,
    config_only: bool = False,
) -> Path:
    """Write a random tiny HF checkpoint (config, safetensors, generation_config) to `path`; returns the path.

    rope_scaling is HF's dict, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}. Weights are drawn with std `init_std`
    (larger than HF's 0.02 so tiny models give varied logits) and norm weights / biases are randomised too, so
    every tensor matters. eos_token_id defaults to vocab_size - 1. shard=True splits into several files.
    moe: the Qwen3MoeConfig fields of family "qwen3_moe" (required there, refused elsewhere), e.g.
    {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
    "mlp_only_layers": [1]}; the router and experts are drawn with std `init_std` too.
    config_only: write config.json and generation_config.json only (for ``load_format="dummy"``).
    """
    import transformers

    if family not in _HF_CLASSES:
        raise ValueError(f"family {family!r} is not supported; supported: {tuple(_HF_CLASSES)}")
    if (family == "qwen3_moe") != (moe is not None):
        raise ValueError(f"moe options are required for family 'qwen3_moe' and only for it (family {family!r})")
    config_name, model_name = _HF_CLASSES[family]
    eos = vocab_size - 1 if eos_token_id is None else eos_token_id
    rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
    extra = {**({} if head_dim is None else {"head_dim": head_dim}), **(moe or {})}
    config = getattr(transformers, config_name)(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        bos_token_id=0,
        eos_token_id=eos,
        **extra,
    )
    out = Path(path)
    if config_only:
        config.architectures = [model_name]  # what save_pretrained of the model records
        config.dtype = getattr(torch, dtype)
        config.save_pretrained(out)
        transformers.GenerationConfig(bos_token_id=0, eos_token_id=eos).save_pretrained(out)
        return out
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config)
        _randomize_norms_and_biases(model)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, max_shard_size=_tiny_shard_size(model) if shard else "50GB")
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=eos).save_pretrained(out)
    return out


def _randomize_norms_and_biases(model: torch.nn.Module) -> None:
    """Norm weights ~ U(0.5, 1.5) and biases ~ N(0, 0.1), in place (HF initialises them to 1 and 0)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(std=0.1)


def _tiny_shard_size(model: torch.nn.Module) -> int:
    """A shard size in bytes that splits `model` into about four files."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(1, total // 4)


def write_random_checkpoint(
    path: str | Path,
    shape_name: ShapeName,
    dtype: str = "bfloat16",
    *,
    num_layers: int | None = None,
    seed: int = 0,
    max_shard_bytes: int = 4 * 1024**3,
    config_only: bool = False,
) -> Path:
    """Write a checkpoint of a real shape (Qwen3, Qwen3-MoE, Qwen2-MoE or Mixtral; ``ShapeName``) with random
    weights (std 0.02; norms 1) to `path`; returns it.

    num_layers overrides the layer count (a shrunk copy for quick tests). The config.json mirrors the real
    model's; generation_config.json mirrors its own (Qwen3's for the Qwen3 shapes). Tensors are tiled from one
    random pool, streamed to disk without materialising any tensor, so 8B writes at disk speed; they are not
    independent draws (fine for throughput work). OSError before writing when the disk lacks the room.
    config_only: write the two json files only (for ``load_format="dummy"``: no disk room needed).
    """
    qwen3_shapes = {**QWEN3_SHAPES, **QWEN3_MOE_SHAPES}
    if shape_name not in qwen3_shapes and shape_name not in OTHER_SHAPES:
        raise ValueError(f"shape_name {shape_name!r} is not supported; supported: {(*qwen3_shapes, *OTHER_SHAPES)}")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype {dtype!r} is not supported; supported: ('bfloat16', 'float16', 'float32')")
    if shape_name in OTHER_SHAPES:
        config = {**OTHER_SHAPES[shape_name], "torch_dtype": dtype}
        generation = _OTHER_GENERATION_CONFIGS[shape_name]
    else:
        config = {**_QWEN3_COMMON, **qwen3_shapes[shape_name], "torch_dtype": dtype}
        generation = _QWEN3_GENERATION_CONFIG
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    if config["model_type"].startswith("qwen3"):
        config["max_window_layers"] = config["num_hidden_layers"]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if not config_only:
        nbytes = sum(math.prod(s) for s in tensor_shapes(config).values()) * getattr(torch, dtype).itemsize
        _check_room(out, nbytes)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if config_only:
        return out
    _write_shards(out, tensor_shapes(config), getattr(torch, dtype), seed, max_shard_bytes)
    return out


def _check_room(folder: Path, nbytes: int) -> None:
    """OSError naming the folder when its file system has less than ``nbytes`` (+1 GiB) free."""
    free = shutil.disk_usage(folder).free
    if free < nbytes + 1024**3:
        raise OSError(
            f"writing the checkpoint needs {nbytes / 1e9:.1f} GB but {folder} has {free / 1e9:.1f} GB free "
            "(point TMPDIR, or --model with a written checkpoint, at a larger disk)"
        )


def tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a config dict of any ``write_random_checkpoint`` family (by its model_type),
    in the order HF stores them."""
    model_type = config["model_type"]
    if model_type in ("qwen3", "qwen3_moe"):
        return qwen3_tensor_shapes(config)
    if model_type in ("qwen2_moe", "mixtral"):
        return _moe_tensor_shapes(config)
    raise ValueError(f"model_type {model_type!r} has no random-checkpoint layout; supported: qwen3, qwen3_moe, "
                     "qwen2_moe, mixtral")  # fmt: skip


def _moe_tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a Qwen2-MoE or Mixtral config dict: Qwen2's q/k/v biases and no q/k norms,
    Qwen2-MoE's shared expert and its one-unit gate beside the routed experts; Mixtral's ``block_sparse_moe``
    router and w1 (gate) / w3 (up) / w2 (down) experts. Every layer is sparse (decoder_sparse_step 1, as both
    published shapes are)."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, vocab = config.get("head_dim") or hidden // heads, config["vocab_size"]
    qwen2 = config["model_type"] == "qwen2_moe"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for name, rows in (
            ("q_proj", heads * head_dim),
            ("k_proj", kv_heads * head_dim),
            ("v_proj", kv_heads * head_dim),
        ):
            shapes[f"{p}self_attn.{name}.weight"] = (rows, hidden)
            if qwen2:
                shapes[f"{p}self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        if qwen2:
            inter, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (config["num_experts"], hidden)
            for e in range(config["num_experts"]):
                shapes.update(_glu_shapes(f"{p}mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"), inter, hidden))
            shapes.update(_glu_shapes(p + "mlp.shared_expert.", ("gate_proj", "up_proj", "down_proj"), shared, hidden))
            shapes[p + "mlp.shared_expert_gate.weight"] = (1, hidden)
        else:
            inter = config["intermediate_size"]
            shapes[p + "block_sparse_moe.gate.weight"] = (config["num_local_experts"], hidden)
            for e in range(config["num_local_experts"]):
                shapes.update(_glu_shapes(f"{p}block_sparse_moe.experts.{e}.", ("w1", "w3", "w2"), inter, hidden))
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _glu_shapes(prefix: str, names: tuple[str, str, str], inter: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """One gated MLP's gate, up and down weights under ``prefix``, named ``names`` in that order."""
    gate, up, down = names
    shapes = {prefix + f"{gate}.weight": (inter, hidden), prefix + f"{up}.weight": (inter, hidden),
              prefix + f"{down}.weight": (hidden, inter)}  # fmt: skip
    return shapes


def qwen3_tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a Qwen3 or Qwen3-MoE config dict, in the order HF stores them."""
    hidden, heads, kv_heads = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    head_dim, vocab = config["head_dim"], config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
        shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes.update(_mlp_shapes(config, i, p + "mlp."))
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _mlp_shapes(config: Mapping[str, Any], layer: int, p: str) -> dict[str, tuple[int, ...]]:
    """The MLP tensors of one layer: a router and per-expert projections on a sparse Qwen3-MoE layer (HF's rule:
    not in mlp_only_layers and (layer + 1) divisible by decoder_sparse_step), else gate/up/down."""
    hidden = config["hidden_size"]
    num_experts = config.get("num_experts", 0)
    sparse = layer not in config.get("mlp_only_layers", []) and (layer + 1) % config.get("decoder_sparse_step", 1) == 0
    if not num_experts or not sparse:
        inter = config["intermediate_size"]
        return {p + "gate_proj.weight": (inter, hidden), p + "up_proj.weight": (inter, hidden),
                p + "down_proj.weight": (hidden, inter)}  # fmt: skip
    inter = config["moe_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (num_experts, hidden)}
    for e in range(num_experts):
        shapes[f"{p}experts.{e}.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}experts.{e}.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}experts.{e}.down_proj.weight"] = (hidden, inter)
    return shapes


def _write_shards(
    out: Path, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, seed: int, max_shard_bytes: int
) -> None:
    """Save the tensors as HF-named shards of at most max_shard_bytes (plus an index when more than one)."""
    groups = list(_group_by_bytes(shapes, dtype.itemsize, max_shard_bytes))
    pool = memoryview(_random_pool(seed, dtype).view(torch.uint8).numpy())
    ones = memoryview(torch.ones(max(s[0] for s in shapes.values()), dtype=dtype).view(torch.uint8).numpy())
    weight_map: dict[str, str] = {}
    for i, names in enumerate(groups):
        file = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        with open(out / file, "wb") as f:
            _write_safetensors_header(f, {name: shapes[name] for name in names}, dtype)
            for name in names:
                nbytes = math.prod(shapes[name]) * dtype.itemsize
                if name.endswith("norm.weight"):
                    f.write(ones[:nbytes])
                else:
                    _write_tiled(f, pool, start=(len(weight_map) * 7919 * dtype.itemsize) % len(pool), nbytes=nbytes)
                weight_map[name] = file
    if len(groups) > 1:
        total = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_safetensors_header(f: BinaryIO, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> None:
    """Write the safetensors header (u64 little-endian length + JSON, space-padded to 8 bytes) for tensors
    stored back to back in `shapes` order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    f.write(len(encoded).to_bytes(8, "little"))
    f.write(encoded)


def _write_tiled(f: BinaryIO, pool: memoryview, start: int, nbytes: int) -> None:
    """Write nbytes of the pool repeated end to end, beginning at byte `start` (no tensor is materialised)."""
    while nbytes > 0:
        chunk = pool[start : start + nbytes]
        f.write(chunk)
        nbytes -= len(chunk)
        start = 0


def _group_by_bytes(shapes: Mapping[str, tuple[int, ...]], itemsize: int, max_bytes: int) -> Iterator[list[str]]:
    """Consecutive groups of names whose tensors total at most max_bytes (a bigger tensor is alone)."""
    group: list[str] = []
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if group and size + nbytes > max_bytes:
            yield group
            group, size = [], 0
        group.append(name)
        size += nbytes
    if group:
        yield group


def _random_pool(seed: int, dtype: torch.dtype) -> torch.Tensor:
    """A pool of N(0, 0.02) values whose length (a prime) does not divide any weight row length."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(4_194_301, generator=generator) * 0.02).to(dtype)


FP8_QUANTIZATION_CONFIG: Mapping[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
_FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def is_fp8_linear(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a decoder-layer linear's weight (quantized in FP8 checkpoints)."""
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in _FP8_LINEARS


def write_fp8_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Copy the small checkpoint ``src`` (one safetensors file or shards, read whole) to ``dst`` in the official
    FP8 layout: each decoder-layer linear ``X.weight`` quantized to e4m3 with 128 x 128 block scales in
    ``X.weight_scale_inv``, everything else unchanged, and config.json's ``quantization_config`` set."""
    from safetensors.torch import load_file, save_file

    from fnvllm.model.loader import checkpoint_files
    from fnvllm.model.quant import quantize_fp8_blocks

    src, out = Path(src), Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(src):
        for name, tensor in load_file(str(file)).items():
            if is_fp8_linear(name):
                tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(tensor)
            else:
                tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _copy_side_files(src, out)
    return out


def write_dequantized_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """The float32 checkpoint of the FP8 checkpoint ``src``: every e4m3 weight times its block scales."""
    from safetensors.torch import load_file, save_file

    from fnvllm.model.quant import dequantize_fp8_blocks

    src, out = Path(src), Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    stored = load_file(str(src / "model.safetensors"))
    tensors = {
        name: dequantize_fp8_blocks(t, stored[name + "_scale_inv"], torch.float32) if is_fp8_linear(name) else t.float()
        for name, t in stored.items()
        if not name.endswith("_scale_inv")
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    config["torch_dtype"] = config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _copy_side_files(src, out)
    return out


def _copy_side_files(src: Path, dst: Path) -> None:
    """Copy the generation config and tokenizer files that ``src`` has into ``dst``."""
    for name in _SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
