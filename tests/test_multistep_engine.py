"""Multi-step decoding through the whole engine (``EngineConfig.num_decode_steps``): the embedded demo model gives
the same tokens, texts and finish reasons planning up to K decode steps at once as one step at a time, with
seeded sampling, penalties, stop strings and EOS; streaming delivers the same text; the option is checked."""

from __future__ import annotations

import pytest

from fnvllm.demo import model_path
from fnvllm.engine import Engine
from fnvllm.llm import LLM
from fnvllm.state import CoreConfig, InvalidConfigError, PlanMismatchError, SamplingParams, add_request, schedule
from fnvllm.state.multistep import schedule_steps
from fnvllm.testing.toy import KVToyExecutor

PROMPTS = ["def fib(n):", "import os\nimport", "class Foo:\n    def", "for i in range(10):"]
SETTINGS = {
    "seeded-top-p": SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30),
    "penalty": SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=30),
    "stop-strings": SamplingParams(temperature=0.0, max_tokens=30, stop=["\n\n", "(self"]),
    "eos": SamplingParams(temperature=1.2, seed=3, max_tokens=60),
}


def _run(num_decode_steps: int) -> dict[str, list[tuple[tuple[int, ...], str, str | None]]]:
    with LLM(model_path(), device="cpu", num_decode_steps=num_decode_steps) as llm:
        out = {}
        for name, params in SETTINGS.items():
            results = llm.generate(PROMPTS, params, use_tqdm=False)
            out[name] = [(tuple(r.token_ids), r.text, r.finish_reason) for r in results]
        streamed: dict[int, list[int]] = {}
        reasons: dict[int, str | None] = {}
        for delta in llm.stream(PROMPTS, SETTINGS["stop-strings"]):
            streamed.setdefault(delta.index, []).extend(delta.new_token_ids)
            reasons[delta.index] = delta.finish_reason or reasons.get(delta.index)
        out["stream"] = [(tuple(streamed[i]), "", reasons[i]) for i in sorted(streamed)]
        return out


def test_multistep_engine_gives_one_step_outputs() -> None:
    """Plans of up to 5 decode steps give every request the tokens, text and finish reason of one-step plans,
    including a request a stop string ends inside a plan."""
    one, five = _run(1), _run(5)
    assert five == one
    assert [tokens for tokens, _, _ in one["stream"]] == [tokens for tokens, _, _ in one["stop-strings"]]
    reasons = {reason for rows in one.values() for *_, reason in rows}
    assert "stop" in reasons and "length" in reasons  # the settings exercise both endings


@pytest.mark.parametrize("bad", [0, 65, 2.0, True])
def test_num_decode_steps_is_checked(bad: object) -> None:
    """num_decode_steps outside [1, 64], or not an int, is refused naming the option."""
    with pytest.raises((InvalidConfigError, TypeError), match="num_decode_steps"):
        LLM(model_path(), device="cpu", num_decode_steps=bad)


def test_engine_runs_multistep_plans_by_step_only() -> None:
    """Engine.step runs a multi-step plan (on an overlapping toy executor: sub-steps fed by launch); Engine.launch
    refuses one, naming Engine.step, and leaves the executor untouched."""
    config = CoreConfig(block_size=4, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)
    engine = Engine(KVToyExecutor(vocab_size=50, overlap=True), config)
    state = add_request(engine.initial_state(), "a", (1, 2, 3), SamplingParams(max_tokens=8, ignore_eos=True))
    state, plan = schedule(state)
    state, _ = engine.step(state, plan)
    pending, plan = schedule_steps(state, 4)
    assert plan.num_steps == 4
    with pytest.raises(PlanMismatchError, match=r"Engine\.step"):
        engine.launch(pending, plan)
    committed, out = engine.step(pending, plan)
    assert len(out.output.new_tokens) == 4 and committed.step == plan.step + 4
