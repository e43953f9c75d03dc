"""ModelExecutor: weights, the paged KV cache and the sampler, on the CPU or one GPU.

``execute(plan)`` = ``prepare_inputs`` (host -> device arrays) -> model forward over the step's tokens ->
logits at each sampling position -> sampler -> host token ids.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from fnvllm.config import EngineConfig
from fnvllm.executor.base import ExecuteResult, TokenLogprobs, check_step
from fnvllm.executor.sampler import Sampler, SamplerOutput, prepare_sampling
from fnvllm.kernels.attention import AttentionMetadata, build_attention_metadata
from fnvllm.model.config import ModelConfig
from fnvllm.model.loader import load_model
from fnvllm.state import StepPlan

_GIB = 1 << 30


@attrs.frozen(eq=False)
class PreparedInputs:
    """Device arrays of one step. input_ids (T,) int64; sample_index (S,) int64 rows of the sampled positions."""

    input_ids: torch.Tensor
    meta: AttentionMetadata
    sample_index: torch.Tensor


def resolve_device(name: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_backend(name: str, device: torch.device) -> str:
    """The attention backend for ``name`` ("auto" picks the fastest one available on ``device``)."""
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    try:
        import flash_attn.cute  # noqa: F401

        if torch.cuda.get_device_capability(device)[0] >= 9:
            return "flash"
    except ImportError:
        pass
    try:
        import fnvllm.kernels.paged_attention  # noqa: F401

        return "triton"
    except ImportError:
        return "torch"


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


class ModelExecutor:
    """Owns the model weights, the KV cache tensors and the sampler's RNG."""

    def __init__(self, model_path: str | Path, config: EngineConfig, model_config: ModelConfig | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config = model_config or ModelConfig.from_pretrained(model_path, dtype=config.dtype)
        self.dtype = self.model_config.torch_dtype
        self.model = load_model(model_path, self.model_config, self.device, self.dtype)
        self.backend = resolve_backend(config.attention_backend, self.device)
        self.num_blocks = config.num_blocks or self._blocks_that_fit()
        self.kv_caches = self._allocate_kv_cache()
        self.sampler = Sampler(config.seed)
        self.next_step = 0

    def _blocks_that_fit(self) -> int:
        per_block = kv_bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        if self.device.type == "cpu":
            return max(int(self.config.cpu_kv_cache_gib * _GIB) // per_block, 1)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        headroom = self._activation_bytes()
        budget = int(total * self.config.gpu_memory_utilization) - used - headroom
        if budget < per_block:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {used / _GIB:.1f} GiB used, gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization} of {total / _GIB:.1f} GiB, {headroom / _GIB:.1f} GiB "
                "reserved for activations"
            )
        return budget // per_block

    def _activation_bytes(self) -> int:
        """A generous bound on one step's transient memory: MLP activations and the sampled rows' logits."""
        m, tokens = self.model_config, self.config.max_num_batched_tokens
        width = max(2 * m.intermediate_size, m.q_size + 2 * m.kv_size, m.hidden_size * 4)
        activations = tokens * width * 4 * 4
        logits = self.config.max_num_seqs * m.vocab_size * 4 * 6
        return activations + logits + _GIB

    def _allocate_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        m = self.model_config
        shape = (self.num_blocks, self.config.block_size, m.num_key_value_heads, m.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(m.num_hidden_layers)
        ]

    def reset(self, next_step: int) -> None:
        """Treat the KV cache as empty and expect ``next_step`` next (contents are simply overwritten later)."""
        self.next_step = next_step

    def prepare_inputs(self, plan: StepPlan) -> PreparedInputs:
        """Flatten the plan into device arrays: token ids, attention metadata and the sampled rows."""
        q_lens = [len(t) for t in plan.input_tokens]
        flat = [token for tokens in plan.input_tokens for token in tokens]
        meta = build_attention_metadata(plan.start_positions, q_lens, plan.block_tables, plan.block_size, self.device)
        ends, total = [], 0
        for q_len, sample in zip(q_lens, plan.sample, strict=True):
            total += q_len
            if sample:
                ends.append(total - 1)
        return PreparedInputs(
            input_ids=torch.tensor(flat, dtype=torch.int64).to(self.device),
            meta=meta,
            sample_index=torch.tensor(ends, dtype=torch.int64).to(self.device),
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> ExecuteResult:
        """Run one step; returns one token per sampling sequence (plan order) and logprobs where asked."""
        check_step(self.next_step, plan)
        self.next_step += 1
        if plan.is_empty:
            return ExecuteResult(())
        inputs = self.prepare_inputs(plan)
        hidden = self.model(inputs.input_ids, inputs.meta.positions, self.kv_caches, inputs.meta, self.backend)
        if not plan.num_samples:
            return ExecuteResult(())
        logits = self.model.compute_logits(hidden[inputs.sample_index])  # (S, vocab)
        rows = [i for i, s in enumerate(plan.sample) if s]
        batch = prepare_sampling(
            [plan.params[i] for i in rows],
            [plan.num_generated[i] for i in rows],
            [plan.histories[i] for i in rows],
            self.model_config.vocab_size,
            self.device,
        )
        out = self.sampler.sample(logits, batch)
        tokens = out.token_ids.tolist()  # the step's one device -> host sync
        return ExecuteResult(tuple(tokens), _host_logprobs(out, tokens, [plan.params[i].logprobs for i in rows]))


def _host_logprobs(out: SamplerOutput, tokens: list[int], asked: list[int | None]) -> tuple[TokenLogprobs | None, ...]:
    if out.logprobs is None:
        return (None,) * len(asked)
    lp = out.logprobs
    sampled = lp.sampled_logprobs.tolist()
    top_ids, top_values = lp.top_ids.tolist(), lp.top_logprobs.tolist()
    return tuple(
        None
        if n is None
        else TokenLogprobs(tokens[i], sampled[i], tuple(zip(top_ids[i][:n], top_values[i][:n], strict=True)))
        for i, n in enumerate(asked)
    )
