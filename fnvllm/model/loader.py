"""Load a Hugging Face safetensors checkpoint (one file or shards with an index) into our model.

The model is built on the meta device (no random init, so 8B shapes build instantly), materialised empty on
the target device, then every parameter is filled from the checkpoint. Before any tensor is read, the checkpoint's
names are checked against the model's: a missing or unexpected tensor is an error that lists them, so nothing
is ever left at its uninitialised value.

Name mapping (HF -> ours): `<p>.q_proj|k_proj|v_proj.<w>` -> rows of `<p>.qkv_proj.<w>`,
`<p>.gate_proj|up_proj.weight` -> rows of `<p>.gate_up_proj.weight`, MoE experts' per-expert tensors
`<p>.experts.<e>.gate_proj|up_proj|down_proj.weight` -> expert e of the stacked `<p>.experts.gate_up_proj` (E, 2I, H)
and `<p>.experts.down_proj` (E, H, I), each copied straight into its slot of the preallocated stack (host memory
holds one expert at a time, never a second copy of the model), everything else unchanged. With tied
embeddings a stored `lm_head.weight` is ignored (it equals the embedding); so is any `rotary_emb.inv_freq`.

Mixtral names its MoE layer otherwise (``checkpoint_names``): ``<l>.block_sparse_moe.gate.weight`` is the router
``<l>.mlp.gate.weight`` and ``<l>.block_sparse_moe.experts.<e>.w1|w3|w2.weight`` are expert e's gate, up and down
projections, so the same stacked experts, kernels and sharding serve Qwen3-MoE and Mixtral. Mistral's names are
Llama's; its folders often hold ``consolidated.safetensors`` too (the same weights in Mistral's own naming), which
is never read: the index's shards or ``model.safetensors`` come first, and the last-resort glob skips it.
Qwen2-MoE's names need no mapping: its router and experts are Qwen3-MoE's, and its shared expert is
``<l>.mlp.shared_expert.gate_proj|up_proj|down_proj.weight`` (a dense MLP's, fused as above) beside
``<l>.mlp.shared_expert_gate.weight`` (1, H), read whole on every rank.
Phi-3 stores each layer's q/k/v stacked in one ``<l>.self_attn.qkv_proj.weight`` (q rows, then k, then v) and its
gate/up in ``<l>.mlp.gate_up_proj.weight`` (gate rows, then up): each is read as its parts (``checkpoint_names``,
``sharding.fuse_targets``), so a rank reads its rows of q, of k and of v, and a missing or misshapen one is named
as stored.

Gemma 3's multimodal checkpoints hold the text decoder under ``language_model.model.`` (or ``model.language_model.``)
beside the vision tower's tensors, which are skipped by name (``gemma_config.language_model_names``).

Under tensor parallelism each rank reads only its slice of every split tensor (safetensors ``get_slice``); the
rules for which slice are ``sharding.weight_targets``.

FP8 weights (``quant.py``): from an FP8 checkpoint, ``<p>.weight`` (e4m3) and ``<p>.weight_scale_inv`` are copied
like any other tensor (the scales' slices are in 128 x 128 blocks); with ``quantization="fp8"`` on a 16/32-bit
checkpoint, each linear's slice is moved to the target device, quantized there in 128-row groups
(``quant.quantize_fp8_row_groups``: one scale per 128 rows of the slice, all its columns) and written into the e4m3
weight and its block scales, one tensor at a time as before (host memory never holds more than one tensor); a fused
layer's parts are quantized one by one. After the last tensor, each such linear's (1, N) row scale is set from its
block scales (``quant.set_row_scales``). MoE experts take the same two ways, one expert's tensor at a time: an FP8
checkpoint's ``<p>.experts.<e>.<proj>.weight`` / ``.weight_scale_inv`` fill expert e of the e4m3 stacks and of their
scales (``<p>.experts.gate_up_proj_scale_inv``, ``down_proj_scale_inv``); quantized at load, expert e's slice is
quantized in 128-row groups into its slot (no row scale: the fused-MoE kernels read the block scales).

Dummy weights (``load_format="dummy"``, as vLLM's): no safetensors are read. The model built from the config alone is
filled on the device with seeded random values shaped like the random checkpoints' (``testing.checkpoints``): matrices
and embeddings N(0, DUMMY_STD), norm weights 1, biases 0; FP8 linears get such a matrix quantized in 128-row groups, and
their row scales (FP8 experts: one such matrix per expert). Each parameter draws from its own generator seeded by
(seed, its index), so a replicated parameter (the router) is equal on every tensor-parallel rank. Used to benchmark
shapes whose checkpoint is too large to write and read back (Qwen3-30B-A3B: 61 GB).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from fnvllm.model.config import CheckpointError, ModelConfig, normalize_dtype, read_json
from fnvllm.model.gemma_config import GEMMA3_MULTIMODAL, language_model_names
from fnvllm.model.kv_scales import is_kv_scale_name
from fnvllm.model.models import DecoderForCausalLM, build_model
from fnvllm.model.ops import TORCH_OPS, ModelOps
from fnvllm.model.quant import quantize_fp8_row_groups, row_group_amax, scale_blocks, set_row_scales
from fnvllm.model.sharding import (
    SINGLE,
    CheckpointTarget,
    FusedTarget,
    TensorParallel,
    WeightTarget,
    fuse_targets,
    max_over_ranks,
    weight_targets,
    zero_vocab_padding,
)

_MAX_LISTED = 50  # names listed in a mismatch error before "(+N more)"
LOAD_FORMATS = ("auto", "dummy")
DUMMY_STD = 0.02  # the random checkpoints' std (testing.checkpoints.write_random_checkpoint)


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's tensors do not match the model's parameters (names or shapes)."""


def load_model(
    path: str | Path,
    model_config: ModelConfig,
    device: str | torch.device,
    dtype: str | torch.dtype | None = None,
    ops: ModelOps = TORCH_OPS,
    tp: TensorParallel = SINGLE,
    load_format: str = "auto",
    seed: int = 0,
) -> DecoderForCausalLM:
    """Build the model for `model_config` on `device` in `dtype` (default: the config's) with the checkpoint's
    weights, computing its small ops with `ops` (this rank's slice under `tp`); raises CheckpointMismatchError
    listing any missing or unexpected tensors. ``load_format="dummy"``: no checkpoint is read; the weights are
    seeded random values (``seed``; see the module docstring)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    config = model_config if dtype is None else attrs.evolve(model_config, dtype=normalize_dtype(dtype))
    if load_format == "dummy":
        return _materialise(build_on_meta(config, ops, tp), device, dummy_seed=seed)
    files = checkpoint_files(Path(path))
    model = build_on_meta(config, ops, tp)
    names = _names_by_file(files)
    targets, ignored = checkpoint_names(weight_targets(model), config), _ignored_names(config)
    if config.architecture == GEMMA3_MULTIMODAL:  # the text decoder under its prefix; the vision tower skipped
        targets, ignored = language_model_names(targets, names, config.tie_word_embeddings)
    check_names(names, targets, ignored=ignored)
    model = _materialise(model, device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        zero_vocab_padding(model)
        quiet = not tp.is_first or len(files) == 1  # a bar for one shard says nothing
        for file in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=quiet):
            _load_file(file, targets, params, tp)
        set_row_scales(model)
    return model.requires_grad_(False).eval()


def build_on_meta(config: ModelConfig, ops: ModelOps = TORCH_OPS, tp: TensorParallel = SINGLE) -> DecoderForCausalLM:
    """The model's modules on the meta device (no init, no memory); building them runs the layers' shape checks
    (e.g. FP8 shards on scale blocks), so it also checks a rank's slice cheaply."""
    with torch.device("meta"):
        return build_model(config, ops, tp)


def _materialise(
    model: DecoderForCausalLM, device: str | torch.device, dummy_seed: int | None = None
) -> DecoderForCausalLM:
    """The meta model's tensors allocated empty on ``device``, ties and buffers set; with ``dummy_seed``, every
    parameter filled with dummy weights and the model returned ready (eval, no grad)."""
    # = model.to_empty(device=device), whose empty_like on meta tensors costs a second of imports per process
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()
    model.init_buffers()
    if dummy_seed is None:
        return model
    with torch.no_grad():
        fill_dummy_weights(model, dummy_seed)
        zero_vocab_padding(model)
    return model.requires_grad_(False).eval()


def fill_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter of ``model`` in place with dummy weights (see the module docstring), then the FP8
    linears' row scales."""
    params = dict(model.named_parameters())
    for index, (name, param) in enumerate(params.items()):
        if name.endswith("_scale_inv"):
            continue  # filled with its FP8 weight
        data = param.data
        if name.endswith("norm.weight"):
            data.fill_(1.0)
        elif name.endswith(".bias"):
            data.zero_()
        else:
            gen = torch.Generator(device=data.device).manual_seed(seed * 1_000_003 + index)
            scale = params.get(name + "_scale_inv")  # <m>.weight_scale_inv; stacked experts: <m>.<stack>_scale_inv
            if data.is_floating_point() and data.element_size() > 1:
                data.normal_(0.0, DUMMY_STD, generator=gen)
            elif scale is not None and data.dim() == 2:
                _copy_quantized(_normal(data.shape, data.device, gen), data, scale.data, None)
            elif scale is not None and data.dim() == 3:  # FP8 experts, one expert at a time
                for expert, expert_scale in zip(data, scale.data, strict=True):
                    _copy_quantized(_normal(expert.shape, data.device, gen), expert, expert_scale, None)
            else:
                raise ValueError(f"dummy weights: parameter {name!r} of dtype {data.dtype} has no fill rule")
    set_row_scales(model)


def _normal(shape: torch.Size, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """A float32 tensor of ``shape`` drawn from N(0, DUMMY_STD)."""
    return torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, DUMMY_STD, generator=gen)


def checkpoint_files(path: Path) -> list[Path]:
    """A checkpoint folder's safetensors files: the index's shards, else model.safetensors, else *.safetensors but
    Mistral's consolidated*.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [path / name for name in sorted(set(_weight_map(index).values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards named in {index} do not exist: {missing}")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    stored = sorted(path.glob("*.safetensors"))
    files = [f for f in stored if not f.name.startswith("consolidated")]  # Mistral's own format: other names
    if not files:
        native = " (only Mistral's consolidated*.safetensors, which fnvllm does not read)" if stored else ""
        raise FileNotFoundError(f"no *.safetensors files in checkpoint folder {str(path)!r}{native}")
    return files


def _weight_map(index: Path) -> Mapping[str, str]:
    """The index's tensor name -> shard file name map; CheckpointError naming the index when it is malformed."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f'{index}: expected a non-empty "weight_map" object, got {weight_map!r:.80}')
    bad = [f for f in weight_map.values() if not isinstance(f, str) or not f or "/" in f or f.startswith(".")]
    if bad:
        raise CheckpointError(f"{index}: weight_map values must be shard file names in the folder, got {bad[0]!r}")
    return weight_map


def check_names(
    names_by_file: Mapping[Path, list[str]], targets: Mapping[str, CheckpointTarget], ignored: Iterable[str] = ()
) -> None:
    """Raise CheckpointMismatchError when a needed tensor is missing, unexpected, or stored twice."""
    seen: dict[str, Path] = {}
    for file, names in names_by_file.items():
        for name in names:
            if name in seen:
                raise CheckpointMismatchError(f"tensor {name!r} is stored in both {seen[name]} and {file}")
            seen[name] = file
    ignored = set(ignored)
    missing = sorted(set(targets) - set(seen))
    extra = {n for n in seen if _is_rope_buffer(n) or is_kv_scale_name(n)}  # KV scales: kv_scales.py reads them
    unexpected = sorted(n for n in seen if n not in targets and n not in ignored and n not in extra)
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"checkpoint does not match the model: missing tensors {_listing(missing)}; "
            f"unexpected tensors {_listing(unexpected)}"
        )


def _open(file: Path) -> Any:
    """``safe_open`` of one shard; CheckpointError naming the file when it is not a readable safetensors file."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError (a bad header), OSError: both mean the file is broken
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def _load_file(
    file: Path, targets: Mapping[str, CheckpointTarget], params: Mapping[str, torch.Tensor], tp: TensorParallel
) -> None:
    """Copy every needed tensor (or this rank's slice) of one safetensors file into its parameter (rows),
    converting dtype/device; a tensor quantized at load whose columns are split over the ranks (``tp``) takes the
    whole rows' scales."""
    with _open(file) as f:
        for name, target in _stored_targets(f.keys(), targets):
            dest = params[target.param].data
            dest = dest if target.expert is None else dest[target.expert]  # one expert of a stacked parameter
            dest = dest if target.rows is None else dest[target.rows[0] : target.rows[1]]
            tensor = _read(f, name, target, tuple(dest.shape))
            if target.fp8_scale is None:
                dest.copy_(tensor)
            else:
                column_slice = target.dim == 1 and target.source is not None
                group = tp if column_slice else SINGLE
                scale = params[target.fp8_scale].data
                scale = scale if target.expert is None else scale[target.expert]  # that expert's block scales
                _copy_quantized(tensor.to(dest.device), dest, scale, target.rows, group)


def _stored_targets(
    names: Iterable[str], targets: Mapping[str, CheckpointTarget]
) -> Iterator[tuple[str, WeightTarget]]:
    """(name, target) for each stored tensor the model needs, once per part of a fused one (``FusedTarget``)."""
    for name in names:
        target = targets.get(name)
        parts = target.parts if isinstance(target, FusedTarget) else () if target is None else (target,)
        for part in parts:
            yield name, part


def _copy_quantized(
    tensor: torch.Tensor,
    dest: torch.Tensor,
    scale: torch.Tensor,
    rows: tuple[int, int] | None,
    columns_split: TensorParallel = SINGLE,
) -> None:
    """Quantize ``tensor`` to e4m3 in 128-row groups into ``dest``, its scales into the blocks of ``scale`` that
    cover ``rows`` (all of it when None). columns_split: the ranks that hold the other column slices of the same
    rows; their row-block amaxes are joined (a max over the ranks, a collective every rank calls in the same
    order) so that the scales are the whole rows'."""
    amax = max_over_ranks(row_group_amax(tensor), columns_split)
    q, block_scales = quantize_fp8_row_groups(tensor, amax)
    dest.copy_(q)
    scale = scale if rows is None else scale[slice(*scale_blocks(*rows))]
    scale.copy_(block_scales)


def _read(f: Any, name: str, target: WeightTarget, dest_shape: tuple[int, ...]) -> torch.Tensor:
    """The part of checkpoint tensor ``name`` that ``target`` asks for (only that part is read from disk), after
    checking the stored shape against the model's."""
    expected = list(dest_shape)
    if target.source is not None and target.full_size is not None:
        expected[target.dim] = target.full_size
    stored = f.get_slice(name)
    shape = tuple(stored.get_shape())
    if shape != tuple(expected):
        raise CheckpointMismatchError(f"tensor {name!r} has shape {shape}; the model expects {tuple(expected)}")
    if target.source is None:
        return f.get_tensor(name)
    start, end = target.source
    return stored[start:end] if target.dim == 0 else stored[:, start:end]


_MIXTRAL_EXPERT_NAMES: Mapping[str, str] = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# Phi-3's stacked tensors and their parts, in row order (transformers' Phi3Attention / Phi3MLP split them so).
_PHI3_FUSED: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_names(targets: Mapping[str, WeightTarget], config: ModelConfig) -> dict[str, CheckpointTarget]:
    """``targets`` (``sharding.weight_targets``: Qwen3-MoE's names for the MoE tensors) keyed by the names this
    architecture's checkpoints use: Mixtral's for its MoE layers, Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` (each
    read as its parts), the same names for every other model (Qwen2-MoE's included, its shared expert's too)."""
    if config.architecture == "Phi3ForCausalLM":
        return fuse_targets(targets, _PHI3_FUSED)
    if config.architecture != "MixtralForCausalLM":
        return dict(targets)
    return {_mixtral_name(name): target for name, target in targets.items()}


def _mixtral_name(name: str) -> str:
    """``L.mlp.gate.weight`` -> ``L.block_sparse_moe.gate.weight``; ``L.mlp.experts.E.gate_proj|up_proj|down_proj.
    weight`` -> ``L.block_sparse_moe.experts.E.w1|w3|w2.weight``; other names unchanged (every Mixtral layer is
    sparse, so every ``.mlp.`` name is the MoE block's)."""
    prefix, found, rest = name.partition(".mlp.")
    if not found:
        return name
    parts = rest.split(".")  # ["gate", "weight"] or ["experts", E, projection, "weight"]
    if parts[0] == "experts":
        parts[2] = _MIXTRAL_EXPERT_NAMES[parts[2]]
    return f"{prefix}.block_sparse_moe.{'.'.join(parts)}"


def _names_by_file(files: list[Path]) -> dict[Path, list[str]]:
    """Tensor names stored in each file (reads only the headers)."""
    names: dict[Path, list[str]] = {}
    for file in files:
        with _open(file) as f:
            names[file] = list(f.keys())
    return names


def _ignored_names(config: ModelConfig) -> set[str]:
    """Checkpoint tensors that may be present but are not loaded."""
    return {"lm_head.weight"} if config.tie_word_embeddings else set()


def _is_rope_buffer(name: str) -> bool:
    """True for rope tables some old checkpoints store (we recompute them)."""
    return name.endswith("rotary_emb.inv_freq")


def _listing(names: list[str]) -> str:
    """'[a, b, ...] (+N more)' or 'none'."""
    if not names:
        return "none"
    more = f" (+{len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return f"{names[:_MAX_LISTED]}{more}"
