"""The composition root: ``build_engine(model_folder, EngineConfig)`` assembles the running engine.

Every front end is a thin client of this one function: ``LLM`` (offline; through it ``fnvllm bench`` and the
profilers) and the server's engine process (``fnvllm serve``). It reads the checkpoint's config, loads the
tokenizer (local folders only), checks the KV cache fits, builds the executor (one process, or rank 0 of a
tensor-parallel group), sizes the pure core from what the executor allocated, and binds them in an ``Engine``
driven by one ``EngineLoop``. What the front ends need besides the loop comes with it, defined once: each request's
incremental detokenizer (``EngineParts.detokenizer``), chat templating (``render_chat``) and the model facts a
client may ask for (``EngineParts.info``).

    parts = build_engine("path/to/Qwen3-0.6B", EngineConfig(max_num_seqs=64))
    parts.loop.add("r0", ids, SamplingParams(max_tokens=32), tracker)
    while parts.loop.has_unfinished:
        parts.loop.step()
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
from pathlib import Path
from typing import Any

import attrs

from fnvllm.config import EngineConfig
from fnvllm.detokenizer import IncrementalDetokenizer
from fnvllm.engine.core import Engine
from fnvllm.engine.loop import EngineLoop, StepHook
from fnvllm.engine.text import detokenizer_for, load_local_tokenizer
from fnvllm.executor.model_executor import ModelExecutor, resolve_device
from fnvllm.executor.structured import Grammars
from fnvllm.executor.tp import TensorParallelExecutor
from fnvllm.model.config import CheckpointError, ModelConfig, read_json
from fnvllm.state import InvalidConfigError, SamplingParams
from fnvllm.state.checks import show

_GIB = 1 << 30


@attrs.frozen
class ModelInfo:
    """What a client may ask of the served model: its vocabulary size, the longest request (prompt + output)
    the engine accepts, and its EOS ids."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]


class EngineParts:
    """The assembled engine: options, checkpoint facts, tokenizer (None in token-id mode), executor, engine and
    the loop that drives it. Resource owner (the executor holds the weights and the KV cache): ``close()``."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        model_config: ModelConfig,
        tokenizer: Any | None,
        executor: ModelExecutor | TensorParallelExecutor,
        loop: EngineLoop,
    ) -> None:
        self.config, self.model_path, self.model_config = config, model_path, model_config
        self.tokenizer, self.executor, self.loop = tokenizer, executor, loop

    @property
    def engine(self) -> Engine:
        """The executor bound to the core settings."""
        return self.loop.engine

    @property
    def info(self) -> ModelInfo:
        """Vocabulary size, max_model_len and EOS ids, as the core enforces them."""
        core = self.engine.config
        return ModelInfo(self.model_config.vocab_size, core.max_model_len, core.eos_token_ids)

    def detokenizer(self, prompt_ids: tuple[int, ...], params: SamplingParams) -> IncrementalDetokenizer | None:
        """A request's incremental detokenizer (special tokens skipped, its stop strings applied); None without a
        tokenizer (token ids only)."""
        return detokenizer_for(self.tokenizer, prompt_ids, params)

    def close(self) -> None:
        """Release the executor (and stop tensor-parallel workers)."""
        self.executor.close()


def build_engine(
    model: str | os.PathLike[str],
    config: EngineConfig,
    tokenizer: str | os.PathLike[str] | None = None,
    load_tokenizer: bool = True,
    on_step: StepHook | None = None,
) -> EngineParts:
    """Assemble the engine for the checkpoint folder ``model`` under ``config`` (see the module docstring).

    tokenizer: a folder to load the tokenizer from (default: ``model``); load_tokenizer=False skips it.
    on_step: the loop's step hook. Raises InvalidConfigError (a device torch cannot use, a KV cache that cannot
    fit) before any weight is read, FileNotFoundError / CheckpointError for a missing or malformed checkpoint."""
    resolve_device(config.device)  # a device torch cannot use is refused before anything loads
    model_path = as_folder(model, "model")
    if not (model_path / "config.json").exists():
        raise FileNotFoundError(f"{model_path} is not a checkpoint folder (no config.json)")
    model_config = ModelConfig.from_pretrained(
        model_path, dtype=config.dtype, quantization=config.quantization, max_model_len=config.max_model_len
    )
    folder = model_path if tokenizer is None else as_folder(tokenizer, "tokenizer")
    loaded = load_local_tokenizer(folder) if load_tokenizer else None
    check_kv_cache_fits(config, model_config)
    executor = build_executor(model_path, config, model_config)
    core = config.core_config(
        executor.num_blocks,
        model_config.max_seq_len,
        read_eos_token_ids(model_path, loaded),
        model_config.vocab_size,
    )
    local = executor.local if isinstance(executor, TensorParallelExecutor) else executor
    local.eos_token_ids = core.eos_token_ids  # rows short of their min_tokens may not draw them (the sampler)
    if loaded is not None:  # grammar-constrained requests need the tokenizer's vocabulary (structured.py)
        local.grammars = Grammars(loaded, model_config.vocab_size, core.eos_token_ids)
    loop = EngineLoop(Engine(executor, core), on_step=on_step, decode_steps=config.num_decode_steps)
    _freeze_startup_heap()
    return EngineParts(config, model_path, model_config, loaded, executor, loop)


def _freeze_startup_heap() -> None:
    """Move every object alive now (the model's modules, the CUDA graphs, the tokenizer: they live as long as the
    engine) out of the garbage collector's generations. A long run allocates many short-lived objects per step
    (plans, outputs, logprob rows), which trigger full collections; without this each one walks the whole startup
    heap too, a pause the device sees as idle time between steps. Process-wide, as in vLLM's start-up; cycles
    among frozen objects are only collected after ``gc.unfreeze()``, which runs at exit (so that extension types
    are finalized at shutdown as usual) and first here: an engine dropped before this one was built is collected
    now, so a process that builds many engines (tests, notebooks) keeps at most the dropped ones of the latest
    build frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _raise_young_threshold()
    _unfreeze_at_exit()


YOUNG_GC_THRESHOLD = 10_000
"""The least first-generation threshold an engine build leaves (Python's default is 700)."""


def _raise_young_threshold() -> None:
    """Raise the collector's first threshold to ``YOUNG_GC_THRESHOLD`` (a larger one set by the user is kept).

    The first threshold counts container objects allocated and not yet freed; a step whose outputs are kept (a
    stream's queued deltas, logprob rows, output chunks) crosses 700 about once a step at 256 rows. Measured on the
    H200's host with `benchmarks/gc_probe.py` (256 rows whose deltas queue up): 0.77 young passes a step and 0.166 ms of
    collection per step at 700, 0.075 ms at 10,000 (BENCHMARKS.md). A pass over 10,000 young objects takes about a
    millisecond, which a large step hides behind the device."""
    first, *older = gc.get_threshold()
    if first < YOUNG_GC_THRESHOLD:
        gc.set_threshold(YOUNG_GC_THRESHOLD, *older)


@functools.cache
def _unfreeze_at_exit() -> None:
    """Register ``gc.unfreeze`` to run at interpreter exit, once per process."""
    atexit.register(gc.unfreeze)


def build_executor(
    model_path: Path, config: EngineConfig, model_config: ModelConfig
) -> ModelExecutor | TensorParallelExecutor:
    """One ModelExecutor, or rank 0 of a tensor-parallel group when tensor_parallel_size > 1."""
    if config.tensor_parallel_size > 1:
        return TensorParallelExecutor(model_path, config, model_config)
    return ModelExecutor(model_path, config, model_config)


def as_folder(path: object, what: str) -> Path:
    """``path`` (a str or Path) as a Path; a TypeError naming ``what`` for anything else."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise TypeError(f"{what} must be a folder path (str or Path), got {show(path)}")
    return Path(path)


def read_eos_token_ids(model_path: Path, tokenizer: Any | None) -> frozenset[int]:
    """Every EOS id: generation_config.json's (int or list), else config.json's, plus the tokenizer's.
    A malformed file or an ``eos_token_id`` that is not an int or a list of ints is a CheckpointError naming it."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = model_path / name
        if file.exists():
            ids.update(_eos_ids(file, read_json(file).get("eos_token_id")))
            if ids:
                break
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _eos_ids(file: Path, value: object) -> list[int]:
    items = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in items):
        raise CheckpointError(f"{file}: eos_token_id must be an int >= 0 or a list of them, got {show(value)}")
    return items  # type: ignore[return-value]


def check_kv_cache_fits(config: EngineConfig, model: ModelConfig) -> None:
    """InvalidConfigError when the KV cache the options ask for cannot fit the device's memory (checked before
    anything is allocated, so an absurd ``num_blocks`` or ``cpu_kv_cache_gib`` is not an allocator crash), or when
    ``cpu_kv_cache_gib`` holds not even one block. Blocks are counted in the cache's dtype (``kv_cache_dtype``: one
    byte an element for "fp8"); on the CPU every tensor-parallel rank's share counts against the one host's memory
    (``cpu_kv_cache_gib`` is each rank's)."""
    import torch

    from fnvllm.executor.model_executor import kv_bytes_per_block
    from fnvllm.executor.threads import host_memory_bytes
    from fnvllm.kernels.fp8 import kv_cache_torch_dtype

    kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, model.torch_dtype)
    per_block = kv_bytes_per_block(model, config.block_size, kv_dtype) // config.tensor_parallel_size
    on_cuda = resolve_device(config.device).type == "cuda"
    if on_cuda:
        if config.num_blocks is None:
            return  # sized from free memory by the executor
        memory = torch.cuda.get_device_properties(0).total_memory * config.gpu_memory_utilization
        wanted, field = float(config.num_blocks * per_block), f"num_blocks={config.num_blocks}"
    else:  # every rank of a tensor-parallel CPU run holds its share of each block in the one host's memory
        memory = float(host_memory_bytes())
        ranks = config.tensor_parallel_size
        if config.num_blocks is None:
            if config.cpu_kv_cache_gib * _GIB < per_block:
                raise InvalidConfigError(
                    f"EngineConfig.cpu_kv_cache_gib={config.cpu_kv_cache_gib}: less than one KV block ({per_block} "
                    f"bytes of {config.block_size} tokens{' on each rank' if ranks > 1 else ''}); give at least "
                    f"{per_block / _GIB:.3g} GiB, or num_blocks"
                )
            wanted, field = config.cpu_kv_cache_gib * _GIB * ranks, f"cpu_kv_cache_gib={config.cpu_kv_cache_gib}"
        else:
            wanted, field = float(config.num_blocks * per_block * ranks), f"num_blocks={config.num_blocks}"
    if wanted > memory:
        raise InvalidConfigError(
            f"EngineConfig.{field}: a KV cache of {wanted / _GIB:.1f} GiB ({per_block} bytes per block of "
            f"{config.block_size} tokens) does not fit the {memory / _GIB:.1f} GiB of {'GPU' if on_cuda else 'CPU'} "
            "memory"
        )
