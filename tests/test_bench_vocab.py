"""`fnvllm bench` on a checkpoint whose vocabulary is smaller than the workloads' id range (the demo model's 4,096):
ids are taken modulo the vocabulary, the draws are unchanged, and a workload longer than the model's context is
refused before anything runs, naming the flags."""

from __future__ import annotations

import pytest

import fnvllm.demo
from fnvllm.bench import run_bench, run_latency
from fnvllm.model.config import ModelConfig
from fnvllm.workloads import bench_workload

DEMO = fnvllm.demo.model_path()
ENGINE = {"device": "cpu", "attention_backend": "torch", "num_blocks": 256, "block_size": 8}


def test_ids_are_taken_modulo_a_small_vocabulary_and_unchanged_for_a_large_one() -> None:
    plain, params = bench_workload(16)
    assert bench_workload(16, vocab_size=151_936) == (plain, params)
    small, small_params = bench_workload(16, vocab_size=4096)
    assert small_params == params and [len(p) for p in small] == [len(p) for p in plain]
    assert small == [[t % 4096 for t in p] for p in plain] and max(map(max, plain)) >= 4096
    with pytest.raises(ValueError, match="vocab_size"):
        bench_workload(4, vocab_size=0)


def test_the_demo_model_runs_both_bench_modes() -> None:
    vocab = ModelConfig.from_pretrained(DEMO).vocab_size
    assert vocab <= 10000  # the case this covers
    result = run_bench(DEMO, "tiny", 4, max_input_len=100, max_output_len=100, **ENGINE)
    _, params = bench_workload(4, 100, 100)
    assert result["output_tokens"] == sum(p.max_tokens for p in params)
    rows = run_latency(DEMO, "tiny", batches=(2,), output_tokens=4, **ENGINE)["latency"]
    assert [r["requests"] for r in rows] == [2]


def test_a_workload_longer_than_the_context_is_refused_naming_the_flags() -> None:
    with pytest.raises(ValueError, match=r"max_input_len 1024.*--max-input-len"):
        run_bench(DEMO, "tiny", 4, max_input_len=1024, max_output_len=100, **ENGINE)
