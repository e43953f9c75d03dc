"""GPU check of prompt logprobs and logit_bias (issue 21), one command on the H200, about 2 minutes.

1. Correctness on the demo model (float32, CUDA graphs and overlapped steps on): prompt logprobs of a 300-token
   prompt prefilled in chunks of 128 against the HF model's log-softmax; a +100 logit_bias forces its token in a
   batch of 64 while the unbiased rows keep their greedy tokens.
2. Cost on a random Qwen3-0.6B-shape checkpoint (bf16): 256 requests (prompt 512, 64 tokens, temperature 0.6)
   plain vs. 25 % of rows with a 10-token logit_bias; and scoring 64 prompts of 1024 tokens (max_tokens 1) with
   and without prompt_logprobs=5.

    PYTHONPATH=$PWD python3 benchmarks/logprobs_bias_check.py [--skip-cost]

Exits non-zero when a correctness check fails; prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from fnvllm.bench import write_checkpoint
from fnvllm.demo import model_path
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams

DEVICE = "cuda"


def _free(llm: LLM) -> None:
    llm.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_prompt_logprobs(rows: list[tuple[str, str]]) -> bool:
    """Prompt logprobs of the demo model against HF, chunked prefill, graphs and overlap on."""
    from transformers import AutoModelForCausalLM

    path = model_path()
    llm = LLM(path, dtype="float32", device=DEVICE, max_num_batched_tokens=128, load_tokenizer=False)
    vocab = llm.engine.config.vocab_size or 256
    prompt = [random.Random(0).randrange(3, min(vocab, 256)) for _ in range(300)]
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
    mates = [SamplingParams(temperature=0, max_tokens=16)] * 7
    outs = llm.generate([prompt] + [prompt[: 50 + i] for i in range(7)], [params, *mates], use_tqdm=False)
    entries = outs[0].prompt_logprobs or ()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(DEVICE).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device=DEVICE)).logits[0].double().log_softmax(-1).cpu()
    worst = max(abs(e.logprob - ref[p - 1, prompt[p]].item()) for p, e in enumerate(entries) if e is not None)
    ok = len(entries) == len(prompt) and entries[0] is None and all(e is not None for e in entries[1:])
    ok = ok and worst < 2e-3
    rows.append(
        ("prompt logprobs vs HF (300 tokens, chunks of 128)", f"max |diff| {worst:.2e} {'OK' if ok else 'FAIL'}")
    )
    _free(llm)
    return ok


def check_logit_bias(rows: list[tuple[str, str]]) -> bool:
    """A +100 bias forces its token on one row; the other rows of the batch keep their greedy tokens."""
    llm = LLM(model_path(), dtype="float32", device=DEVICE, load_tokenizer=False)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(8, 64))] for _ in range(64)]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    forced = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={77: 100.0})
    base = llm.generate(prompts, plain, use_tqdm=False)
    mixed = llm.generate(prompts, [forced if i % 4 == 0 else plain for i in range(64)], use_tqdm=False)
    ok = all(m.token_ids == (77,) * 16 for m in mixed[::4])
    ok = ok and all(m.token_ids == b.token_ids for i, (m, b) in enumerate(zip(mixed, base, strict=True)) if i % 4)
    rows.append(("logit_bias +100 on 16 of 64 rows (others unchanged)", "OK" if ok else "FAIL"))
    _free(llm)
    return ok


def _timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)  # returns once every token is on the host
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def cost(rows: list[tuple[str, str]]) -> None:
    """Throughput with a logit_bias mix, and prefill time with prompt logprobs, on a 0.6B-shape checkpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_checkpoint("qwen3-0.6b", Path(tmp) / "ckpt")
        llm = LLM(folder, load_tokenizer=False, max_model_len=2048)
        rng = random.Random(0)
        prompts = [[rng.randrange(0, 10000) for _ in range(512)] for _ in range(256)]
        plain = SamplingParams(temperature=0.6, max_tokens=64, ignore_eos=True)
        bias = {rng.randrange(0, 10000): rng.uniform(-5, 5) for _ in range(10)}
        biased = SamplingParams(temperature=0.6, max_tokens=64, ignore_eos=True, logit_bias=bias)
        _timed(llm, prompts[:16], [plain] * 16)  # warm-up
        for name, params in (
            ("plain", [plain] * 256),
            ("25% logit_bias", [biased if i % 4 == 0 else plain for i in range(256)]),
        ):
            seconds, tokens = _timed(llm, prompts, params)
            rows.append((f"0.6B, 256 x (512 + 64), {name}", f"{tokens / seconds:,.0f} output tok/s"))
        long = [[rng.randrange(0, 10000) for _ in range(1024)] for _ in range(64)]
        for name, k in (("no prompt logprobs", None), ("prompt_logprobs=5", 5)):
            params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
            seconds, _ = _timed(llm, long, [params] * 64)
            rows.append((f"0.6B, score 64 x 1024-token prompts, {name}", f"{64 * 1024 / seconds:,.0f} prompt tok/s"))
        _free(llm)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-cost", action="store_true", help="only the correctness checks")
    parser.add_argument("--device", default="cuda", help="cuda (the check), or cpu to try the script")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu --skip-cost)")
        return 2
    rows: list[tuple[str, str]] = []
    ok = check_prompt_logprobs(rows) & check_logit_bias(rows)
    if not args.skip_cost:
        cost(rows)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
