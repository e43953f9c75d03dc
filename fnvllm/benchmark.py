"""The throughput benchmark behind ``fnvllm bench``: the nano-vllm workload on a random-weight checkpoint.

Workload (nano-vllm's bench.py, same draw order): ``random.seed(0)``; 256 requests; prompt ids randint(0, 10000)
of length randint(100, 1024); max_tokens randint(100, 1024); temperature 0.6; ignore_eos. Throughput does not
depend on weight values when EOS is ignored, so a locally written random checkpoint of the real shape stands in
for the real model.

The bandwidth floor: the fewest bytes any engine must read from device memory for this workload, over the read
ceiling. Each request's n-th output token reads the KV of its whole context (prompt + n tokens, all layers), and
each decode step reads the weights once; with every request in one batch there are max(max_tokens) decode steps.
For Qwen3-0.6B on the full workload: 13.87 TB of KV + 1.22 TB of weights = 15.09 TB; at 4.16 TB/s that is 3.63 s,
i.e. ~36,900 output tok/s at most. A mixture of experts reads, per sparse layer and decode step, the experts its
running sequences touch (``moe.expected_experts_touched``: all 128 of Qwen3-30B-A3B at 256 sequences, ~61 GB a
step; fewer as the batch drains).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fnvllm.state import SamplingParams
from fnvllm.workloads import bench_workload

H200_READ_TB_S = 4.16  # measured on the lent H200 (sum over a 2 GiB bf16 tensor)
SHAPES = ("tiny", "qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b")


def weight_bytes(config: Any, dtype_bytes: int = 2, num_seqs: int | None = None) -> int:
    """Bytes of weights one decode step reads: every layer, the final norm and the LM head (not the embedding
    table, of which only the batch's rows are read — unless tied, when the LM head reads all of it). A sparse
    layer reads its router and the experts ``num_seqs`` sequences touch on average (None: all of them)."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    attention = h * (q + 2 * kv) + q * h + 2 * h
    layers = sum(attention + _mlp_weights(config, i, num_seqs) for i in range(config.num_hidden_layers))
    return int(layers + config.vocab_size * h + h) * dtype_bytes


def _mlp_weights(config: Any, layer: int, num_seqs: int | None) -> float:
    """Weights of layer ``layer``'s MLP a decode step of ``num_seqs`` sequences reads (see weight_bytes)."""
    from fnvllm.model.moe import expected_experts_touched

    moe, h = getattr(config, "moe", None), config.hidden_size
    if moe is None or not moe.is_sparse(layer):
        return float(3 * h * config.intermediate_size)
    e, k = moe.num_experts, moe.num_experts_per_tok
    touched = e if num_seqs is None else expected_experts_touched(e, k, num_seqs)
    return float(h * e + touched * 3 * h * moe.moe_intermediate_size)


def kv_bytes_per_token(config: Any, dtype_bytes: int = 2) -> int:
    """Bytes of K and V of one token over all layers."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes


def floor_seconds(config: Any, prompt_lens: Sequence[int], output_lens: Sequence[int], read_tb_s: float) -> float:
    """The workload's bandwidth floor in seconds (see the module docstring)."""
    kv_tokens = sum(p * o + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens, strict=True))
    if getattr(config, "moe", None) is None:
        weights = max(output_lens) * weight_bytes(config)
    else:  # decode step s runs the sequences with more than s outputs; the experts they touch shrink with them
        weights = sum(weight_bytes(config, num_seqs=sum(o > s for o in output_lens)) for s in range(max(output_lens)))
    total = kv_tokens * kv_bytes_per_token(config) + weights
    return total / (read_tb_s * 1e12)


def write_checkpoint(shape: str, folder: Path) -> Path:
    """A random checkpoint of ``shape`` ("tiny", "qwen3-0.6b", "qwen3-8b") in ``folder``."""
    from fnvllm.testing.checkpoints import write_random_checkpoint, write_tiny_checkpoint

    if shape == "tiny":
        return write_tiny_checkpoint(folder, "qwen3", vocab_size=10240, hidden_size=128, num_layers=2)
    return write_random_checkpoint(folder, shape)


def run_bench(
    model: str | Path | None,
    model_shape: str,
    num_requests: int,
    max_input_len: int = 1024,
    max_output_len: int = 1024,
    read_tb_s: float = H200_READ_TB_S,
    use_tqdm: bool = False,
    **engine_options: Any,
) -> dict[str, Any]:
    """Run the workload once to warm up (4 requests), then time it; returns the result record."""
    from fnvllm.llm import LLM

    folder = Path(model) if model else write_checkpoint(model_shape, Path(tempfile.mkdtemp(prefix="fnvllm-bench-")))
    if engine_options.get("max_model_len") is None:  # the workload needs <= 2048; a short cap keeps graphs narrow
        from fnvllm.model.config import ModelConfig

        model_max = ModelConfig.from_pretrained(folder).max_position_embeddings
        engine_options["max_model_len"] = min(model_max, max(4096, max_input_len + max_output_len))
    llm = LLM(folder, load_tokenizer=False, **engine_options)
    prompts, params = bench_workload(num_requests, max_input_len, max_output_len)
    llm.generate(prompts[:4], [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=8)] * 4, use_tqdm=False)
    start_stats, start_overlap, start = llm.stats, llm.loop.overlap_stats, time.perf_counter()
    if llm.executor.timeline is not None:
        llm.executor.timeline.records.clear()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    floor = floor_seconds(llm.model_config, [len(p) for p in prompts], [p.max_tokens for p in params], read_tb_s)
    return {
        "model": str(model) if model else model_shape,
        "device": str(llm.executor.device),
        "backend": llm.executor.backend.name,
        "cuda_graphs": llm.executor.graphs is not None,
        "num_blocks": llm.executor.num_blocks,
        "requests": num_requests,
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 1),
        "floor_tok_per_s": round(tokens / floor, 1),
        "fraction_of_floor": round(floor / seconds, 3),
        "steps": llm.stats.num_steps - start_stats.num_steps,
        "preemptions": llm.stats.num_preemptions - start_stats.num_preemptions,
        "overlap": llm.loop.overlap,
        "speculative_steps_kept": llm.loop.overlap_stats.kept - start_overlap.kept,
        "speculative_steps_dropped": llm.loop.overlap_stats.dropped - start_overlap.dropped,
        "timeline": llm.executor.timeline.summary() if llm.executor.timeline is not None else None,
    }
