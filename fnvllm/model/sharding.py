"""Tensor-parallel sharding: every rule for which slice of a weight a rank holds, and the collectives that join
the slices. At world size 1 every layer here computes exactly what its plain torch counterpart does.

Megatron's layout: in each block the first projection is column-parallel (output features split over the ranks)
and the second row-parallel (input features split), so a block costs one all-reduce of its output, called where
it happens in ``models.py``:

    attention   qkv_proj column-parallel by heads -> attention over the local heads -> o_proj row-parallel -> all-reduce
    mlp         gate_up_proj column-parallel (gate and up split alike) -> SiLU-and-mul -> down_proj -> all-reduce
    embedding   vocab-parallel: a rank looks up its vocab range, zeros elsewhere -> all-reduce
    lm_head     vocab-parallel: each rank's logit columns -> gathered on the first rank, which samples
    experts     (MoE) every expert split on its intermediate dim like the MLP: gate/up rows and down columns of
                each expert -> fused MoE over the local slices -> all-reduce; the router is replicated
    shared      (Qwen2-MoE) the shared expert splits like the MLP and its partial sum, scaled by the replicated
    expert      sigmoid(shared_expert_gate(x)) (a (1, hidden) weight reading the full hidden state every rank holds,
                so each rank computes the same per-token scale), joins the experts' before their one all-reduce

Worked example, the tiny Qwen2 (2 q heads, 1 KV head, head_dim 64, intermediate 96, vocab 256) at world size 2:
rank r holds q head r (q_proj rows 64r:64r+64) and the single KV head (k_proj/v_proj rows 0:64, replicated
because there are fewer KV heads than ranks; each rank's KV cache holds that head), gate/up rows 48r:48r+48,
o_proj columns 64r:64r+64, down_proj columns 48r:48r+48 and vocab rows 128r:128r+128. With more KV heads than
ranks they split like q heads. A vocab that does not divide is padded: every rank holds ceil(V / world) rows,
the last rank's extra rows are zeros, and the gathered logits are cut back to V. A checkpoint that stacks q/k/v (or
gate/up) in one tensor, as Phi-3's ``qkv_proj`` / ``gate_up_proj``, is read as its parts (``fuse_targets``): the
example's rank 1 reads q rows 64:128, k rows 0:64 and v rows 0:64 of a stacked (256, hidden) qkv_proj at offsets
0, 128 and 192: its rows 64:128, 128:192 and 192:256.

The tensor-parallel group is the whole ``torch.distributed`` world (no pipeline or data parallelism), so a
group rank is a global rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fnvllm.model.config import Fp8Config, ModelConfig
from fnvllm.model.quant import FP8_DTYPE, check_block_aligned, linear_forward, make_fp8, scale_blocks
from fnvllm.state import InvalidConfigError

# x (T, in), weight (out, in), bias (out,) or None -> (T, out): F.linear, or a kernel with its signature.
Matmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@attrs.frozen(eq=False)
class TensorParallel:
    """This process's place in a tensor-parallel group.

    rank / world_size: position in the group and its size. local_rank: the CUDA device index on this host.
    group: the process group of the model's collectives (None = the default group; unused at world size 1).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Any = None

    @property
    def is_parallel(self) -> bool:
        """True when more than one rank shares the model."""
        return self.world_size > 1

    @property
    def is_first(self) -> bool:
        """True on rank 0, the rank that samples."""
        return self.rank == 0


SINGLE = TensorParallel()


@attrs.frozen
class WeightTarget:
    """Where one checkpoint tensor, or this rank's slice of it, goes.

    param: our parameter's name. expert: the index along dim 0 of a stacked-experts parameter it fills (None =
    not stacked). rows: (start, end) output rows of the parameter (of that expert) it fills (None = all of it).
    source: (start, end) along ``dim`` of the checkpoint tensor to read (None = the whole tensor).
    full_size: the checkpoint tensor's size along ``dim`` (checked before slicing; None when not sliced).
    fp8_scale: quantize at load (``quantization="fp8"`` on a 16/32-bit checkpoint): the slice read is quantized
        to e4m3 in 128-row groups (``quant.quantize_fp8_row_groups``) and its scales fill the matching blocks of
        this parameter (of the same expert, for stacked experts; None = copy as is).
    """

    param: str
    rows: tuple[int, int] | None = None
    source: tuple[int, int] | None = None
    dim: int = 0
    full_size: int | None = None
    expert: int | None = None
    fp8_scale: str | None = None


@attrs.frozen
class FusedTarget:
    """One checkpoint tensor that stacks several projections' rows (Phi-3's ``self_attn.qkv_proj``: q, k then v
    rows; ``mlp.gate_up_proj``: gate then up rows), read as its parts: each a WeightTarget over its own rows of it,
    so under tensor parallelism a rank reads its slice of q, of k and of v (three row ranges), not a slice of the
    stacked rows (``fuse_targets``)."""

    parts: tuple[WeightTarget, ...]


CheckpointTarget = WeightTarget | FusedTarget
"""Where a checkpoint tensor goes: one target, or the parts of a fused tensor."""


# ---- the rules ----------------------------------------------------------------------------------------------


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """InvalidConfigError naming ``tensor_parallel_size`` and the model field when the model cannot be split over
    ``world_size`` ranks (checked before any worker starts)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % world_size:
        _unshardable(f"num_attention_heads ({heads}) must be a multiple of tensor_parallel_size ({world_size})")
    if kv_heads % world_size and world_size % kv_heads:
        _unshardable(
            f"num_key_value_heads ({kv_heads}) and tensor_parallel_size ({world_size}) must divide one another"
        )
    if config.intermediate_size % world_size:
        _unshardable(
            f"intermediate_size ({config.intermediate_size}) must be a multiple of tensor_parallel_size ({world_size})"
        )
    if config.moe is None:
        return
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        size = getattr(config.moe, name)
        if size is not None and size % world_size:
            _unshardable(f"{name} ({size}) must be a multiple of tensor_parallel_size ({world_size})")


def _unshardable(reason: str) -> None:
    raise InvalidConfigError(f"EngineConfig.tensor_parallel_size: {reason}")


def shard_range(size: int, tp: TensorParallel) -> tuple[int, int]:
    """This rank's (start, end) of ``size`` items split evenly (``size`` must divide)."""
    per_rank = size // tp.world_size
    return tp.rank * per_rank, (tp.rank + 1) * per_rank


def local_heads(config: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """(query heads, KV heads) this rank computes; KV heads are replicated when fewer than the ranks."""
    return config.num_attention_heads // tp.world_size, max(1, config.num_key_value_heads // tp.world_size)


def kv_head_range(config: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """This rank's (first, end) KV head: its own slice, or the one head its query heads read when replicated."""
    kv_heads = config.num_key_value_heads
    if kv_heads >= tp.world_size:
        return shard_range(kv_heads, tp)
    head = tp.rank * kv_heads // tp.world_size  # e.g. 2 KV heads, 4 ranks: ranks 0,1 -> head 0; 2,3 -> head 1
    return head, head + 1


def vocab_range(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(start, end, rows per rank) of this rank's vocab slice; the last slice may be short (padded)."""
    per_rank = math.ceil(vocab_size / tp.world_size)
    start = min(tp.rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size), per_rank


# ---- collectives ----------------------------------------------------------------------------------------------


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place (nothing at world size 1); returns ``x``."""
    if tp.is_parallel:
        dist.all_reduce(x, group=tp.group)
    return x


def gather_vocab(local: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor | None:
    """Join each rank's logit columns (N, ceil(V / world)) into (N, V) on the first rank; None on the others."""
    if not tp.is_parallel:
        return local
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(tp.world_size)] if tp.is_first else None
    dist.gather(local, parts, dst=0, group=tp.group)
    if parts is None:
        return None
    return torch.cat(parts, dim=-1)[:, :vocab_size]  # (N, world * ceil(V / world)) -> (N, V)


def broadcast_from_first(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """``x`` of the first rank, on every rank, in place (nothing at world size 1); returns ``x``."""
    if tp.is_parallel:
        dist.broadcast(x, src=0, group=tp.group)
    return x


def max_over_ranks(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The elementwise largest ``x`` over the ranks, in place (nothing at world size 1); returns ``x``."""
    if tp.is_parallel:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=tp.group)
    return x


def min_over_ranks(value: int, tp: TensorParallel, device: torch.device) -> int:
    """The smallest ``value`` any rank holds (every rank gets it)."""
    if not tp.is_parallel:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return int(t.item())


# ---- sharded layers -------------------------------------------------------------------------------------------


@attrs.frozen
class RowSlice:
    """One checkpoint projection inside a column-parallel weight: its rows ``source`` (of ``full_size``) land in
    output rows ``rows``."""

    rows: tuple[int, int]
    source: tuple[int, int]
    full_size: int


def stack(parts: Mapping[str, tuple[tuple[int, int], int]]) -> dict[str, RowSlice]:
    """Lay projections' (source range, full size) one after another in output rows, in the mapping's order."""
    out, end = {}, 0
    for name, (source, full_size) in parts.items():
        start, end = end, end + source[1] - source[0]
        out[name] = RowSlice((start, end), source, full_size)
    return out


class ColumnParallelLinear(nn.Linear):
    """This rank's output rows of one or more stacked checkpoint projections (q/k/v, gate/up). No collective:
    the output stays split, each rank holding the features of its own heads or its own intermediate slice.

    parts: checkpoint module name (e.g. "q_proj") -> where its rows come from and go.
    quant: FP8 weights (``quant.py``; each part's rows must start a 128-row scale block) or None.
    """

    weight_scale_inv: torch.Tensor | None  # FP8: (ceil(out / 128), ceil(in / 128)) float32 block scales
    weight_row_scale: torch.Tensor | None  # FP8 quantized at load: (1, out) float32 per-row scales (quant.py)

    def __init__(
        self,
        in_features: int,
        parts: Mapping[str, RowSlice],
        bias: bool,
        dtype: torch.dtype | None,
        quant: Fp8Config | None = None,
        matmul: Matmul = F.linear,
    ) -> None:
        super().__init__(in_features, max(p.rows[1] for p in parts.values()), bias=bias, dtype=dtype)
        self.parts = MappingProxyType(dict(parts))
        self.quant = quant
        self.matmul = matmul
        self.weight_scale_inv = None
        self.register_buffer("weight_row_scale", None, persistent=False)
        if quant is not None:
            for name, part in self.parts.items():
                check_block_aligned(f"{name} rows in the fused layer", *part.rows, self.out_features)
                if quant.is_checkpoint_fp8:
                    check_block_aligned(f"{name} rows read from the checkpoint", *part.source, part.full_size)
            make_fp8(self, row_groups=not quant.is_checkpoint_fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) -> (T, this rank's out rows): the FP8 GEMMs for FP8 weights, else ``matmul``."""
        if self.weight_scale_inv is not None:
            return linear_forward(x, self.weight, self.weight_scale_inv, self.bias, self.weight_row_scale)
        return self.matmul(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """This rank's input columns of a projection. ``forward`` gives a partial sum (the full product summed over
    the ranks, by the caller's all-reduce); the bias is added once, by the first rank. quant: FP8 weights (from a
    checkpoint, a rank's columns must start on a 128-column scale block) or None."""

    weight_scale_inv: torch.Tensor | None  # FP8: (ceil(out / 128), ceil(in / world / 128)) float32 block scales
    weight_row_scale: torch.Tensor | None  # FP8 quantized at load: (1, out) float32 per-row scales (quant.py)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype | None,
        tp: TensorParallel,
        quant: Fp8Config | None = None,
        matmul: Matmul = F.linear,
    ) -> None:
        super().__init__(in_features // tp.world_size, out_features, bias=bias, dtype=dtype)
        self.source = shard_range(in_features, tp)
        self.full_in_features = in_features
        self.adds_bias = tp.is_first
        self.quant = quant
        self.matmul = matmul
        self.weight_scale_inv = None
        self.register_buffer("weight_row_scale", None, persistent=False)
        if quant is not None:
            if quant.is_checkpoint_fp8:
                check_block_aligned("a rank's input columns of a row-parallel layer", *self.source, in_features)
            make_fp8(self, row_groups=not quant.is_checkpoint_fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in / world) -> partial (T, out): the FP8 GEMMs for FP8 weights, else ``matmul``."""
        bias = self.bias if self.adds_bias else None
        if self.weight_scale_inv is not None:
            return linear_forward(x, self.weight, self.weight_scale_inv, bias, self.weight_row_scale)
        return self.matmul(x, self.weight, bias)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table; ids outside its vocab range look up zeros (the caller
    all-reduces, so each id's row comes from the one rank that holds it)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.start, self.end, per_rank = vocab_range(vocab_size, tp)
        self.is_parallel = tp.is_parallel
        self.weight = nn.Parameter(_normal(torch.empty(per_rank, hidden_size, dtype=dtype), std=1.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) -> (T, hidden_size): the rows this rank holds, zeros for the others.

        Rows are gathered by indexing (``weight[ids]``), not ``F.embedding``: on CUDA, F.embedding's index_select
        takes a "small index" kernel for <= 16 ids whose few blocks walk the ids one after another (12.0 us for
        the 16 ids of a 16-request decode step on the H200, against ~2 us for the elementwise gather)."""
        if not self.is_parallel:
            return self.weight[ids]
        local = ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        rows = self.weight[local.masked_fill(outside, 0)]  # (T, hidden_size)
        return rows.masked_fill(outside[:, None], 0)


class ParallelLMHead(nn.Module):
    """This rank's vocab rows of the output projection (its weight may be the embedding's, when tied)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.start, self.end, per_rank = vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(_normal(torch.empty(per_rank, hidden_size, dtype=dtype), std=0.02))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's logit columns (N, ceil(V / world)) in the activation dtype for hidden (N, hidden_size)."""
        return F.linear(hidden, self.weight)


class ParallelExperts(nn.Module):
    """This rank's slice of every expert's intermediate dim, stacked as the fused-MoE kernel reads them:
    gate_up_proj (E, 2 * I / world, H) = [gate rows | up rows] per expert, down_proj (E, H, I / world).
    Like RowParallelLinear, what it computes is a partial sum (the caller all-reduces).

    quant: FP8 experts (``quant.py``) or None. Both stacks are then e4m3, each expert's block scales beside them in
    ``gate_up_proj_scale_inv`` (E, 2 * I / world / 128, ceil(H / 128)) and ``down_proj_scale_inv`` (E, ceil(H / 128),
    ceil(I / world / 128)), float32: an expert's stacked gate/up is one fused layer of two parts, so its up rows
    must start a 128-row scale block, i.e. I / world must be a multiple of 128 (Qwen3-30B-A3B's 768: up to 6 ranks
    that divide it; 4 gives 192, refused by name). From an FP8 checkpoint a rank's slice of the intermediate dim
    must also start on a block (the scales' rows of gate/up, columns of down); quantized at load, each expert's
    gate/up slice and down slice take 128-row-group scales (the dense layers' format), down's joined over the
    ranks that hold its other columns, as a row-parallel layer's are."""

    gate_up_proj_scale_inv: nn.Parameter | None
    down_proj_scale_inv: nn.Parameter | None

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype | None,
        tp: TensorParallel,
        quant: Fp8Config | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.source = shard_range(intermediate_size, tp)
        self.full_intermediate_size = intermediate_size
        self.quant = quant
        local = intermediate_size // tp.world_size
        self.gate_up_proj = nn.Parameter(_normal(torch.empty(num_experts, 2 * local, hidden_size, dtype=dtype), 0.02))
        self.down_proj = nn.Parameter(_normal(torch.empty(num_experts, hidden_size, local, dtype=dtype), 0.02))
        self.gate_up_proj_scale_inv = self.down_proj_scale_inv = None
        if quant is not None:
            self._make_fp8(quant)

    def _make_fp8(self, quant: Fp8Config) -> None:
        """Turn both stacks into e4m3 (uninitialised: the loader fills them) with their block scales, after checking
        that the up rows (and, from a checkpoint, this rank's slice) start on 128 blocks."""
        local, full = self.source[1] - self.source[0], self.full_intermediate_size
        what = f"each expert's up_proj rows (moe_intermediate_size {full}, {local} per rank)"
        check_block_aligned(what, local, 2 * local, 2 * local)
        if quant.is_checkpoint_fp8:
            check_block_aligned("a rank's slice of each expert's intermediate dim", *self.source, full)
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            num_experts, n, k = weight.shape
            blocks = (num_experts, scale_blocks(0, n)[1], scale_blocks(0, k)[1])
            fp8 = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
            setattr(self, name, nn.Parameter(fp8, requires_grad=False))
            scale = torch.empty(blocks, dtype=torch.float32, device=weight.device)
            setattr(self, f"{name}_scale_inv", nn.Parameter(scale, requires_grad=False))

    def fp8_scales(self) -> dict[str, torch.Tensor]:
        """The fused-MoE op's keyword arguments for FP8 experts (``w_gate_up_scale``, ``w_down_scale``), or none."""
        if self.gate_up_proj_scale_inv is None or self.down_proj_scale_inv is None:
            return {}
        return {"w_gate_up_scale": self.gate_up_proj_scale_inv, "w_down_scale": self.down_proj_scale_inv}

    def targets(self, parent: str, leaf: str) -> dict[str, WeightTarget]:
        """HF's per-expert tensors (``<parent>.<e>.gate_proj|up_proj|down_proj.weight``, Qwen3-MoE's names; the
        loader renames them for Mixtral's ``w1|w3|w2``) that fill ``leaf``; for FP8 experts also their
        ``.weight_scale_inv`` (from an FP8 checkpoint, in 128 blocks), or the weights are quantized at load into
        ``<leaf>_scale_inv`` too (which then no tensor fills)."""
        proj, is_scale = leaf.removesuffix("_scale_inv"), leaf.endswith("_scale_inv")
        quantize_at_load = self.quant is not None and not self.quant.is_checkpoint_fp8
        if is_scale and quantize_at_load:
            return {}
        name, local, full = f"{parent}.{leaf}", self.source[1] - self.source[0], self.full_intermediate_size
        suffix = "weight_scale_inv" if is_scale else "weight"
        fp8_scale = f"{parent}.{proj}_scale_inv" if quantize_at_load else None

        def target(rows: tuple[int, int] | None, dim: int, e: int) -> WeightTarget:
            if not is_scale:
                return WeightTarget(name, rows, self.source, dim, full, expert=e, fp8_scale=fp8_scale)
            block_rows = None if rows is None else scale_blocks(*rows)
            return WeightTarget(name, block_rows, scale_blocks(*self.source), dim, scale_blocks(0, full)[1], expert=e)

        out: dict[str, WeightTarget] = {}
        for e in range(self.num_experts):
            p = f"{parent}.{e}."
            if proj == "gate_up_proj":
                out[f"{p}gate_proj.{suffix}"] = target((0, local), 0, e)
                out[f"{p}up_proj.{suffix}"] = target((local, 2 * local), 0, e)
            else:
                out[f"{p}down_proj.{suffix}"] = target(None, 1, e)
        return out


def _normal(weight: torch.Tensor, std: float) -> torch.Tensor:
    """Fill with N(0, std), except on the meta device (the loader fills it; meta normal_ imports torch._dynamo,
    seconds per process)."""
    return weight if weight.is_meta else weight.normal_(std=std)


def qkv_parallel(config: ModelConfig, tp: TensorParallel, matmul: Matmul = F.linear) -> ColumnParallelLinear:
    """Fused q/k/v projection: output rows [this rank's q heads | its KV head(s) of k | of v]."""
    d = config.head_dim
    q_start, q_end = shard_range(config.num_attention_heads, tp)
    kv_start, kv_end = kv_head_range(config, tp)
    kv_rows = ((kv_start * d, kv_end * d), config.kv_size)
    parts = stack({"q_proj": ((q_start * d, q_end * d), config.q_size), "k_proj": kv_rows, "v_proj": kv_rows})
    return ColumnParallelLinear(
        config.hidden_size, parts, config.attention_bias, config.torch_dtype, config.quantization, matmul
    )


def gate_up_parallel(
    config: ModelConfig, tp: TensorParallel, matmul: Matmul = F.linear, intermediate_size: int | None = None
) -> ColumnParallelLinear:
    """Fused gate/up projection of the gated MLP: output rows [this rank's gate slice | its up slice] of
    ``intermediate_size`` (None: the config's; Qwen2-MoE's shared expert passes its own)."""
    size = config.intermediate_size if intermediate_size is None else intermediate_size
    rows = (shard_range(size, tp), size)
    parts = stack({"gate_proj": rows, "up_proj": rows})
    return ColumnParallelLinear(config.hidden_size, parts, False, config.torch_dtype, config.quantization, matmul)


# ---- checkpoint slices ----------------------------------------------------------------------------------------


def weight_targets(model: nn.Module) -> dict[str, WeightTarget]:
    """HF checkpoint name -> where this rank's slice of it goes in ``model``, for every tensor the model needs.

    Names (HF -> ours): ``<p>.q_proj|k_proj|v_proj.<w>`` -> rows of ``<p>.qkv_proj.<w>``, ``<p>.gate_proj|up_proj``
    -> rows of ``<p>.gate_up_proj``, ``<p>.experts.<e>.gate_proj|up_proj|down_proj.weight`` -> expert e of the
    stacked ``<p>.experts.gate_up_proj`` / ``down_proj``; everything else keeps its name."""
    targets: dict[str, WeightTarget] = {}
    for name, _ in model.named_parameters():  # a tied lm_head is deduplicated away here
        parent, _, leaf = name.rpartition(".")
        targets.update(_module_targets(model.get_submodule(parent), parent, leaf, name))
    return targets


def _module_targets(module: nn.Module, parent: str, leaf: str, name: str) -> dict[str, WeightTarget]:
    """The checkpoint tensors that fill parameter ``name`` (= ``parent.leaf``) of ``module``."""
    quant: Fp8Config | None = getattr(module, "quant", None)
    if quant is not None and leaf in ("weight", "weight_scale_inv"):
        return _fp8_targets(module, quant, parent, leaf, name)
    if isinstance(module, ColumnParallelLinear):
        prefix = parent.rpartition(".")[0]
        return {
            f"{prefix}.{part}.{leaf}": WeightTarget(name, s.rows, s.source, 0, s.full_size)
            for part, s in module.parts.items()
        }
    if isinstance(module, ParallelExperts):
        return module.targets(parent, leaf)
    if isinstance(module, RowParallelLinear) and leaf == "weight":
        return {name: WeightTarget(name, None, module.source, 1, module.full_in_features)}
    if isinstance(module, VocabParallelEmbedding | ParallelLMHead):
        rows = (0, module.end - module.start)
        return {name: WeightTarget(name, rows, (module.start, module.end), 0, module.vocab_size)}
    return {name: WeightTarget(name)}


def _fp8_targets(module: nn.Module, quant: Fp8Config, parent: str, leaf: str, name: str) -> dict[str, WeightTarget]:
    """The checkpoint tensors of an FP8 linear's ``weight`` or ``weight_scale_inv``: the stored e4m3 weight and
    its scales (their block rows / columns) from an FP8 checkpoint; else the 16/32-bit weight, quantized at load
    into both parameters (so no tensor fills ``weight_scale_inv`` directly)."""
    scale = None if quant.is_checkpoint_fp8 else f"{parent}.weight_scale_inv"
    if leaf == "weight_scale_inv" and scale is not None:
        return {}
    blocks = leaf == "weight_scale_inv"

    def span(start: int, end: int) -> tuple[int, int]:
        return scale_blocks(start, end) if blocks else (start, end)

    def size(full: int) -> int:
        return scale_blocks(0, full)[1] if blocks else full

    if isinstance(module, ColumnParallelLinear):
        prefix = parent.rpartition(".")[0]
        return {
            f"{prefix}.{part}.{leaf}": WeightTarget(
                name, span(*s.rows), span(*s.source), 0, size(s.full_size), fp8_scale=scale
            )
            for part, s in module.parts.items()
        }
    if isinstance(module, RowParallelLinear):
        full = module.full_in_features
        return {name: WeightTarget(name, None, span(*module.source), 1, size(full), fp8_scale=scale)}
    raise TypeError(f"{name}: FP8 weights are only supported on the tensor-parallel linears, not {type(module)}")


def fuse_targets(
    targets: Mapping[str, WeightTarget], fused: Mapping[str, tuple[str, ...]]
) -> dict[str, CheckpointTarget]:
    """``targets`` (``weight_targets``) for a checkpoint that stores some projections stacked in one tensor:
    ``fused`` maps such a tensor's module name to its parts' names in row order (Phi-3: {"qkv_proj": ("q_proj",
    "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}). Every ``<m>.<part>.<leaf>`` target becomes a
    part of one FusedTarget under ``<m>.<fused>.<leaf>``, its source rows shifted past the parts before it and its
    full size the stacked tensor's. Worked example, q_size 256 and kv_size 64 at world size 2, rank 1: q rows
    128:256, k rows 256 + 32:64 = 288:320, v rows 320 + 32:64 = 352:384, of a (384, hidden) qkv_proj."""
    part_of = {part: (name, index) for name, parts in fused.items() for index, part in enumerate(parts)}
    out: dict[str, CheckpointTarget] = {}
    groups: dict[str, list[tuple[int, WeightTarget]]] = {}
    for name, target in targets.items():
        module, _, leaf = name.rpartition(".")
        prefix, _, part = module.rpartition(".")
        if part not in part_of:
            out[name] = target
            continue
        fused_name, index = part_of[part]
        groups.setdefault(f"{prefix}.{fused_name}.{leaf}", []).append((index, target))
    for name, indexed in groups.items():
        out[name] = _stacked(name, [target for _, target in sorted(indexed, key=lambda item: item[0])])
    return out


def _stacked(name: str, parts: list[WeightTarget]) -> FusedTarget:
    """The FusedTarget of checkpoint tensor ``name`` whose rows are ``parts``' own tensors one after another."""
    rows = [_row_slice(name, part) for part in parts]  # each part's (source rows, full size) in its own tensor
    total = sum(size for _, size in rows)
    shifted, offset = [], 0
    for part, ((start, end), size) in zip(parts, rows, strict=True):
        shifted.append(attrs.evolve(part, source=(offset + start, offset + end), full_size=total))
        offset += size
    return FusedTarget(tuple(shifted))


def _row_slice(name: str, part: WeightTarget) -> tuple[tuple[int, int], int]:
    """(source rows, full size) of a part of fused tensor ``name``; TypeError unless it reads a row slice."""
    if part.dim != 0 or part.source is None or part.full_size is None:
        raise TypeError(f"{name}: only row slices can be read from a fused tensor, got {part}")
    return part.source, part.full_size


def zero_vocab_padding(model: nn.Module) -> None:
    """Zero the padding rows of vocab-parallel weights (the loader fills only the real rows)."""
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding | ParallelLMHead):
            module.weight.data[module.end - module.start :].zero_()
