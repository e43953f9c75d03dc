"""EngineConfig: the user-facing engine options (frozen, validated), and how they become a CoreConfig.

Model facts come from the checkpoint's config.json (``fnvllm.model.config.ModelConfig``); this file holds what
the user chooses. Nothing here is written after construction: derived values (the KV block count chosen from
free memory, the model's max length) are computed into a new CoreConfig, never patched into this one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import attrs

from fnvllm.state import CoreConfig, InvalidConfigError
from fnvllm.state.checks import CONFIG, check_bool, check_choice, check_int, check_optional_int, check_real
from fnvllm.state.config import MAX_MODEL_LEN, MAX_NUM_BLOCKS, MAX_NUM_SEQS

DeviceName = Literal["auto", "cpu", "cuda"]
KVCacheDtype = Literal["auto", "fp8"]
KVLayout = Literal["auto", "NHD", "HND"]
LoadFormat = Literal["auto", "dummy"]

# Upper ends of EngineConfig's ranges (see each field): beyond them an option only ever fails later, deep in an
# allocator or a kernel launch, so they are refused here with the field named.
MAX_BLOCK_SIZE = 4096
MAX_BATCHED_TOKENS = 1 << 24
MAX_TENSOR_PARALLEL = 1024
MAX_CPU_KV_CACHE_GIB = 1 << 20
MAX_MIXED_GRAPH_TOKENS = 4096  # captured mixed-step buckets grow memory and start-up time with this
MAX_DECODE_STEPS = 64  # decode steps one plan may cover (EngineConfig.num_decode_steps)
SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed takes
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float", "fp32", "bf16", "half", "fp16")


def _int(name: str, low: int, high: int, *, optional: bool = False) -> Callable[[Any], Any]:
    """The check of an int option in [low, high] (numpy integers accepted; bools, floats, strs refused)."""
    if optional:
        return lambda value: check_optional_int(value, "EngineConfig." + name, CONFIG, low, high)
    return lambda value: check_int(value, "EngineConfig." + name, CONFIG, low, high)


def _real(name: str, low: float, high: float) -> Callable[[Any], Any]:
    """The check of a finite number option in (low, high]."""
    return lambda value: check_real(value, "EngineConfig." + name, CONFIG, low, high, low_open=True)


def _choice(name: str, *choices: str) -> Callable[[Any], Any]:
    return lambda value: check_choice(value, "EngineConfig." + name, CONFIG, choices)


def _backend_name(value: Any) -> str:
    from fnvllm.kernels.backends import backend_names  # lists module names without importing them

    return check_choice(value, "EngineConfig.attention_backend", CONFIG, ("auto", *backend_names()))


def _dtype(value: Any) -> str | None:
    """None or "auto" (vLLM's spelling: both the checkpoint's dtype, stored as None), a dtype name (or alias) of
    DTYPE_NAMES, or a torch dtype (kept as its name, e.g. "bfloat16")."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return None
    text = str(value).removeprefix("torch.") if type(value).__name__ == "dtype" else value
    return check_choice(text, "EngineConfig.dtype", CONFIG, ("auto", *DTYPE_NAMES))  # "auto" named in the refusal


# Each option's check, which also normalises it (numpy scalars to int/float, a torch dtype to its name).
_CHECKS: dict[str, Callable[[Any], Any]] = {
    "dtype": _dtype,
    "device": _choice("device", "auto", "cpu", "cuda"),
    "block_size": _int("block_size", 1, MAX_BLOCK_SIZE),
    "num_blocks": _int("num_blocks", 1, MAX_NUM_BLOCKS, optional=True),
    "gpu_memory_utilization": _real("gpu_memory_utilization", 0, 1),
    "cpu_kv_cache_gib": _real("cpu_kv_cache_gib", 0, MAX_CPU_KV_CACHE_GIB),
    "max_num_batched_tokens": _int("max_num_batched_tokens", 1, MAX_BATCHED_TOKENS),
    "max_num_seqs": _int("max_num_seqs", 1, MAX_NUM_SEQS),
    "max_model_len": _int("max_model_len", 1, MAX_MODEL_LEN, optional=True),
    "enable_prefix_caching": lambda value: check_bool(value, "EngineConfig.enable_prefix_caching", CONFIG),
    "attention_backend": _backend_name,
    "seed": _int("seed", *SEED_RANGE),
    "enforce_eager": lambda value: check_bool(value, "EngineConfig.enforce_eager", CONFIG),
    "mixed_graph_tokens": _int("mixed_graph_tokens", 0, MAX_MIXED_GRAPH_TOKENS),
    "overlap_steps": lambda value: check_bool(value, "EngineConfig.overlap_steps", CONFIG),
    "num_decode_steps": _int("num_decode_steps", 1, MAX_DECODE_STEPS),
    "model_ops": _choice("model_ops", "auto", "torch", "compile", "triton"),
    "kv_cache_dtype": _choice("kv_cache_dtype", "auto", "fp8"),
    "kv_layout": _choice("kv_layout", "auto", "NHD", "HND"),
    "tensor_parallel_size": _int("tensor_parallel_size", 1, MAX_TENSOR_PARALLEL),
    "distributed_timeout_s": _real("distributed_timeout_s", 0, 7 * 24 * 3600),
    "quantization": lambda value: (
        None if value is None else check_choice(value, "EngineConfig.quantization", CONFIG, ("fp8",))
    ),
    "load_format": _choice("load_format", "auto", "dummy"),
}


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Engine options (``LLM(path, **options)`` takes these names).

    Every field is checked strictly when constructed (InvalidConfigError, ConfigTypeError for a wrong type,
    naming the field, the range and the value): a bool is not a count, a str is not a number. Whether the KV
    cache fits the machine's memory is checked by ``LLM`` once the model's size is known.

    dtype: weights/activations dtype ("float32", "bfloat16", "float16" or an alias such as "bf16", or a torch
        dtype); None or "auto" = the checkpoint's (``torch_dtype`` in config.json).
    device: "auto" picks CUDA when available, else the CPU.
    block_size: tokens per KV block, in [1, 4096].
    num_blocks: KV blocks, in [1, 2**24]; None = sized from memory (``gpu_memory_utilization`` on GPU,
        ``cpu_kv_cache_gib`` on CPU).
    gpu_memory_utilization: fraction of GPU memory the engine may use (weights + KV cache + activations), (0, 1].
    cpu_kv_cache_gib: KV cache size on the CPU when ``num_blocks`` is None, GiB > 0 (at least one block), per
        tensor-parallel rank.
    max_num_batched_tokens: token budget of one step, in [1, 2**24].
    max_num_seqs: cap on running sequences, in [1, 65536].
    max_model_len: cap on prompt + output tokens, in [1, 2**21]; None = the model's longest sequence
        (``ModelConfig.max_seq_len``: max_position_embeddings, or as far as a yarn / linear rope scaling reaches).
    enable_prefix_caching: reuse KV of shared prompt prefixes.
    attention_backend: "auto" (the fastest backend available on the device) or a module name of
        ``fnvllm.kernels.backends`` ("torch", "triton", "flash"); a named backend that cannot run here is an
        error when the LLM is built, naming what to install.
    enforce_eager: never capture CUDA graphs (decode steps run eagerly).
    mixed_graph_tokens: also capture CUDA graphs for mixed steps (prompt chunks beside decode rows) of up to this
        many tokens, in [0, 4096] (0: mixed steps run eagerly). Such steps are launch-bound when run eagerly
        (a served Poisson load makes many of them); the Triton attention backend only (``executor.mixed_graphs``).
    overlap_steps: on a GPU, plan and launch each decode step while the previous one still runs, feeding it the
        previous step's tokens on the device (``fnvllm.state.overlap``); False runs one step at a time.
    num_decode_steps: plan up to this many decode steps at once, in [1, 64], where every running request decodes
        and nothing waits (``fnvllm.state.multistep``): the host schedules and commits once per plan while the
        device runs the steps back to back; 1 (the default) plans one step at a time.
    model_ops: implementation of the small fused ops (norms, rotary, SiLU-and-mul): "torch", "compile"
        (torch.compile), "triton"; "auto" = triton on CUDA when importable, else torch.
    kv_cache_dtype: KV cache storage: "auto" = the model's dtype; "fp8" = float8_e4m3fn with a float32 scale per
        layer and KV head (the checkpoint's k_scale / v_scale, else 1.0): half the bytes, about twice the blocks.
    kv_layout: the KV caches' memory order (``fnvllm.kernels.attention``): "NHD" (a token's heads side by side),
        "HND" (one KV head's tokens of a block in one run); "auto" = the attention backend's own choice. The
        tokens are the same either way; a backend takes only the orders it reads ("flash": "NHD").
    seed: seed of the sampler's shared generator (unseeded requests), an int in [0, 2**64).
    tensor_parallel_size: processes (one per GPU) the model is split over; > 1 starts worker processes
        (``fnvllm.executor.tp``) or joins the ``torchrun`` group this process was launched in.
    distributed_timeout_s: longest wait on another tensor-parallel rank (start-up, one step's collectives)
        before rank 0 reports it as failed (seconds, at most a week).
    quantization: None or "fp8": quantize a 16/32-bit checkpoint's decoder linears to e4m3 at load, one scale per
        128 output rows (docs/fp8_weights.md); an FP8 checkpoint is loaded in FP8 (its 128 x 128 block scales)
        whichever is given.
    load_format: "auto" reads the checkpoint's safetensors; "dummy" builds the model from config.json alone and
        fills its weights on the device with seeded random values (matrices N(0, 0.02), norms 1; no weight files
        needed: benchmarks of large shapes, docs/moe.md). Their seed is fixed (not ``seed``), and each rank
        fills its own shard, so the weights differ with tensor_parallel_size.
    """

    dtype: str | None = None
    device: DeviceName = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    mixed_graph_tokens: int = 2048
    overlap_steps: bool = True
    num_decode_steps: int = 1
    model_ops: str = "auto"
    kv_cache_dtype: KVCacheDtype = "auto"
    kv_layout: KVLayout = "auto"
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 300.0
    quantization: Literal["fp8"] | None = None
    load_format: LoadFormat = "auto"

    def __attrs_post_init__(self) -> None:
        """Check every option (see ``_CHECKS``) and store its normalised value."""
        for name, check in _CHECKS.items():
            object.__setattr__(self, name, check(getattr(self, name)))

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> EngineConfig:
        """Build from keyword options; an unknown name is an error listing the known ones (never dropped)."""
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(**options)

    def core_config(
        self, num_blocks: int, model_max_len: int, eos_token_ids: frozenset[int], vocab_size: int
    ) -> CoreConfig:
        """The pure core's settings for a model with these facts and a pool of ``num_blocks``."""
        max_len = self.max_model_len or min(model_max_len, MAX_MODEL_LEN)
        if max_len > model_max_len:
            raise InvalidConfigError(
                f"EngineConfig.max_model_len must be <= the model's longest sequence ({model_max_len}: its "
                "max_position_embeddings, or as far as its rope scaling reaches), "
                f"got {max_len}"
            )
        return CoreConfig(
            block_size=self.block_size,
            num_blocks=min(num_blocks, MAX_NUM_BLOCKS),  # a pool sized from memory may exceed what the core takes
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_len,
            enable_prefix_caching=self.enable_prefix_caching,
            eos_token_ids=eos_token_ids,
            vocab_size=vocab_size,
        )
