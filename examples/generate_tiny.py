"""Write a tiny random Qwen3 checkpoint (with a tokenizer) and generate from it with the public LLM API.

python examples/generate_tiny.py
"""

import tempfile
from pathlib import Path

from fnvllm.llm import LLM
from fnvllm.state import SamplingParams
from fnvllm.testing.checkpoints import write_tiny_checkpoint
from fnvllm.testing.tokenizer import build_test_tokenizer

with tempfile.TemporaryDirectory(prefix="fnvllm-example-") as tmp:  # removed at the end
    folder = Path(tmp)
    write_tiny_checkpoint(folder, "qwen3", hidden_size=64, num_layers=2, vocab_size=256)
    build_test_tokenizer(folder, vocab_size=256)

    llm = LLM(folder, block_size=16, num_blocks=256)
    outputs = llm.generate(
        ["Hello, my name is", "The capital of France is"],
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, seed=0),
    )
    for out in outputs:
        print(f"{out.prompt!r} -> {out.text!r} ({out.finish_reason})")
