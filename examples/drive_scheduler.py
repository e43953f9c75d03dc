"""Drive the scheduler yourself: the engine loop written out, on the embedded demo model (CPU, a few seconds).

    python examples/drive_scheduler.py

It builds the pieces ``LLM`` builds (``build_engine``: the tokenizer, a ModelExecutor with the model's weights and
KV cache, the pure core's settings sized for it), then runs ``schedule`` / ``execute`` / ``commit`` until every
request has finished, with a policy of its own: shortest prompt first. docs/drive-the-scheduler.md walks through
it.
"""

from __future__ import annotations

from typing import Any

from fnvllm.config import EngineConfig
from fnvllm.demo import model_path
from fnvllm.engine.build import build_engine
from fnvllm.state import Policy, Request, SamplingParams, add_request, commit, initial_state, schedule

PROMPTS = ["import os\nimport sys\n\n\ndef", "def fib(n):", "class Stack:\n    def __init__(self"]


def shortest_prompt_first(request: Request) -> tuple[int, ...]:
    """Policy key: fewer prompt tokens first, arrival order among equals (module-level, so states pickle)."""
    return (len(request.prompt), request.arrival)


SHORTEST_FIRST = Policy("shortest-prompt-first", shortest_prompt_first)


def main() -> dict[str, str]:
    """Run the loop; print each request's text when it finishes; return the texts by request id."""
    options = EngineConfig(device="cpu", block_size=16, num_blocks=64, max_num_seqs=2)  # 2: requests must queue
    parts = build_engine(model_path(), options)  # what LLM builds: tokenizer, executor, core settings
    executor = parts.executor
    tokenizer: Any = parts.tokenizer  # the demo model ships one: never None here
    state = initial_state(parts.engine.config, SHORTEST_FIRST)  # a CoreConfig sized for the executor's KV cache
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.1, max_tokens=24)
    for i, prompt in enumerate(PROMPTS):
        state = add_request(state, f"r{i}", tokenizer.encode(prompt), greedy)
    texts: dict[str, str] = {}
    while state.has_unfinished:
        state, plan = schedule(state)  # pure: which rows run, which blocks they use
        tokens = executor.execute(plan).token_ids  # the model runs the plan: one sampled id per sampling row
        state, out = commit(state, plan, tokens)  # pure: append, stop, free blocks
        for done in out.finished:
            texts[done.request_id] = tokenizer.decode(done.output)
            print(f"step {plan.step:3d}  {done.request_id} ({done.reason}): {texts[done.request_id]!r}")
    parts.close()
    return texts


if __name__ == "__main__":
    main()
