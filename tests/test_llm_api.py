"""The LLM facade and Engine: sampling contracts, stop strings, logprobs, chat, snapshots and input errors."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import hf_model, write_family

from fnvllm.engine import Engine
from fnvllm.executor.base import StalePlanError
from fnvllm.llm import LLM
from fnvllm.state import InvalidConfigError, InvalidRequestError, SamplingParams, add_request, schedule

PROMPTS = [[5, 9, 13, 200, 7], [42] * 12, list(range(3, 40)), [250, 3]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(tmp_path_factory.mktemp("api"), "qwen3")


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    return LLM(ckpt, dtype="float32", block_size=8, num_blocks=256)


def test_top_k_1_equals_greedy(llm: LLM) -> None:
    """top_k=1 at a high temperature gives exactly the greedy tokens."""
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    top1 = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=10), use_tqdm=False)
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]


def test_seeded_request_independent_of_batch_mates(llm: LLM) -> None:
    """A seeded request yields the same tokens alone and among different, differently ordered batch mates."""
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].token_ids
    mates = [SamplingParams(temperature=0.9, max_tokens=n) for n in (3, 20, 7)]
    batch = llm.generate(
        [PROMPTS[2], PROMPTS[1], PROMPTS[0], PROMPTS[3]], [mates[0], mates[1], seeded, mates[2]], use_tqdm=False
    )
    assert batch[2].token_ids == alone
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=99, max_tokens=12), use_tqdm=False)
    assert other_seed[0].token_ids != alone  # the seed matters (vanishingly unlikely to collide over 12 tokens)


def test_outputs_in_input_order_with_lengths(llm: LLM) -> None:
    """Outputs come back in input order with their own max_tokens and finish reason 'length'."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 1, 9, 2)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [4, 1, 9, 2]
    assert [o.prompt_token_ids for o in outs] == [tuple(p) for p in PROMPTS]
    assert all(o.finish_reason == "length" for o in outs)


def test_stop_string_truncates_text(llm: LLM) -> None:
    """A stop string taken from the greedy text ends generation there, excluded unless asked to include it."""
    full = llm.generate("The engine", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = llm.generate("The engine", SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert len(cut.token_ids) < len(full.token_ids)
    kept = llm.generate(
        "The engine",
        SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids(llm: LLM) -> None:
    """A stop token id ends the request with reason 'stop' and is the last token id."""
    full = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    target = full.token_ids[5]
    out = llm.generate(
        [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: full.token_ids.index(target) + 1]


def test_a_stop_token_ids_text_is_left_out_unless_asked(llm: LLM) -> None:
    """The id that ends a request stays in token_ids; its text is not in the text unless
    include_stop_str_in_output (vLLM's rule), streamed or whole."""
    full = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    decode = llm.tokenizer.decode
    k = next(k for k in range(2, 12) if decode(full.token_ids[: k + 1]) != decode(full.token_ids[:k]))
    target = full.token_ids[k]  # a token with text of its own
    for include in (False, True):
        params = SamplingParams(
            temperature=0, max_tokens=12, stop_token_ids=[target], include_stop_str_in_output=include
        )
        out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0]
        stop_at = full.token_ids.index(target)
        assert out.token_ids == full.token_ids[: stop_at + 1] and out.finish_reason == "stop"
        assert out.text == decode(out.token_ids if include else out.token_ids[:-1])


def test_logprobs_match_transformers(llm: LLM, ckpt: Path) -> None:
    """Top-3 logprobs of the first generated token equal log_softmax of transformers' logits."""
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=2, logprobs=3), use_tqdm=False)[0]
    assert out.logprobs is not None and len(out.logprobs) == 2
    first = out.logprobs[0]
    with torch.no_grad():
        ref = hf_model(ckpt)(torch.tensor([PROMPTS[2]])).logits[0, -1].log_softmax(-1)
    top = ref.topk(3)
    assert [i for i, _ in first.top] == top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert first.token_id == out.token_ids[0] == top.indices[0].item()
    assert first.logprob == pytest.approx(top.values[0].item(), abs=1e-4)


def test_chat_applies_template(llm: LLM) -> None:
    """chat() feeds the tokenizer's chat template with the generation prompt, encoded without a second BOS."""
    messages = [{"role": "user", "content": "hello there"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<s>")  # the template writes the BOS itself
    assert out.prompt_token_ids == tuple(llm.tokenizer.encode(text, add_special_tokens=False))
    assert out.prompt_token_ids[:2] != (llm.tokenizer.bos_token_id,) * 2
    assert len(out.token_ids) == 3


@pytest.mark.parametrize("options", [{"add_generation_prompt": False}, {"continue_final_message": True}])
def test_chat_passes_the_turn_options_to_the_template(llm: LLM, options: dict[str, bool]) -> None:
    """add_generation_prompt=False and continue_final_message=True (vLLM's chat options) reach the template as
    given; the prompt is what transformers renders with them."""
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "I am"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, **options)[0]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, **options)
    assert out.prompt == text and out.prompt_token_ids == tuple(llm.tokenizer.encode(text, add_special_tokens=False))


def test_stream_concatenates_to_generate(llm: LLM) -> None:
    """Streamed deltas, concatenated per request, equal generate()'s text and ids."""
    params = SamplingParams(temperature=0, max_tokens=8)
    ref = llm.generate(["abc", "hello world"], params, use_tqdm=False)
    texts, ids = ["", ""], [[], []]
    for d in llm.stream(["abc", "hello world"], params):
        texts[d.index] += d.new_text
        ids[d.index] += d.new_token_ids
    assert texts == [o.text for o in ref]
    assert [tuple(i) for i in ids] == [o.token_ids for o in ref]


def test_snapshot_restore_continues_identically(ckpt: Path) -> None:
    """A pickled mid-run state restored on a fresh engine finishes with the uninterrupted run's tokens."""
    options: dict[str, Any] = dict(dtype="float32", block_size=4, num_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=10)

    def start(llm: LLM) -> Any:
        state = llm.engine.initial_state()
        for i, p in enumerate(PROMPTS):
            state = add_request(state, f"r{i}", p, params)
        return state

    def run(engine: Engine, state: Any, max_steps: int | None = None) -> tuple[Any, dict[str, tuple[int, ...]]]:
        done: dict[str, tuple[int, ...]] = {}
        steps = 0
        while state.has_unfinished and (max_steps is None or steps < max_steps):
            state, plan = schedule(state)
            state, out = engine.step(state, plan)
            done.update({f.request_id: f.output for f in out.output.finished})
            steps += 1
        return state, done

    first = LLM(ckpt, **options)
    _, uninterrupted = run(first.engine, start(first))
    second = LLM(ckpt, **options)
    mid, before = run(second.engine, start(second), max_steps=5)
    snapshot = pickle.dumps(mid)
    fresh = LLM(ckpt, **options)
    _, after = run(fresh.engine, fresh.engine.restore(pickle.loads(snapshot)))
    assert {**before, **after} == uninterrupted


def test_executor_rejects_stale_plan(ckpt: Path) -> None:
    """Running the same plan twice is refused with a clear error naming the expected step."""
    llm = LLM(ckpt, dtype="float32", block_size=4, num_blocks=64)
    state = add_request(llm.engine.initial_state(), "a", [5, 6, 7], SamplingParams(max_tokens=3))
    state, plan = schedule(state)
    llm.executor.execute(plan)
    with pytest.raises(StalePlanError, match=r"expected plan\.step 1, got 0"):
        llm.executor.execute(plan)


def test_a_fresh_state_on_a_used_engine_says_to_restore_it_and_then_runs(ckpt: Path) -> None:
    """initial_state() on an engine that has run steps: stepping it is refused with the way out (restore), and
    after restore it runs to the end."""
    llm = LLM(ckpt, dtype="float32", block_size=4, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    expected = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
    state = add_request(llm.engine.initial_state(), "a", [5, 6, 7], params)
    stepped, plan = schedule(state)
    with pytest.raises(StalePlanError, match=r"got 0 .*adopt it with restore\(\) first"):
        llm.engine.step(stepped, plan)
    state, tokens = llm.engine.restore(state), []
    while state.has_unfinished:
        state, plan = schedule(state)
        state, out = llm.engine.step(state, plan)
        tokens += [t for rid, t in zip(out.output.seq_ids, out.output.new_tokens, strict=True) if rid == "a"]
    assert tuple(tokens) == expected


@pytest.mark.parametrize(
    ("prompts", "params", "error", "match"),
    [
        ([[]], None, InvalidRequestError, "prompt"),
        ([[5] * 5000], None, InvalidRequestError, "max_model_len"),
        ([[300]], None, InvalidRequestError, "prompt"),
        ([[5, 6], [7]], [SamplingParams()], ValueError, "sampling_params has 1 entries but there are 2 prompts"),
        ([[5, 6]], SamplingParams(max_tokens=10**6), InvalidRequestError, "max_tokens"),
        ([3.5], None, TypeError, r"prompts\[0\]"),
    ],
)
def test_bad_inputs_raise_and_leave_state(llm: LLM, prompts: Any, params: Any, error: type, match: str) -> None:
    """Each bad input raises its documented error and leaves the engine state and usability unchanged."""
    before = pickle.dumps(llm.state)
    with pytest.raises(error, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert pickle.dumps(llm.state) == before
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids) == 2


def test_bad_sampling_values_name_the_field() -> None:
    """Out-of-range sampling values raise InvalidRequestError naming the field and its range."""
    for kwargs, field in [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
    ]:
        with pytest.raises(InvalidRequestError, match=f"SamplingParams.{field} must be"):
            SamplingParams(**kwargs)


def test_unknown_engine_option_is_an_error(ckpt: Path) -> None:
    """An unknown LLM option raises TypeError listing the known ones; a bad value names its field."""
    with pytest.raises(TypeError, match=r"unknown engine option.*block_sizee"):
        LLM(ckpt, block_sizee=16)
    with pytest.raises(InvalidConfigError, match="block_size must be"):
        LLM(ckpt, block_size=0)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        LLM(ckpt / "missing")


def test_text_prompt_without_tokenizer_is_an_error(ckpt: Path) -> None:
    """With load_tokenizer=False, token-id prompts work and a text prompt raises naming the cause."""
    llm = LLM(ckpt, load_tokenizer=False, dtype="float32", num_blocks=64)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].text == ""
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate("hi", use_tqdm=False)


def test_every_generation_config_eos_id_stops(tmp_path: Path) -> None:
    """Each id of generation_config.json's eos_token_id list ends a request with reason 'stop'."""
    import json

    path = write_family(tmp_path, "qwen2")
    free = LLM(path, dtype="float32", num_blocks=64).generate(
        [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    first, second = free.token_ids[2], free.token_ids[6]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [second, first]}))
    llm = LLM(path, dtype="float32", num_blocks=64)
    assert {first, second} <= llm.engine.config.eos_token_ids
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    stop_at = next(i for i, t in enumerate(free.token_ids) if t in (first, second))
    assert out.token_ids == free.token_ids[: stop_at + 1]
    ignoring = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert ignoring[0].token_ids == free.token_ids


def test_building_an_engine_freezes_its_startup_heap(ckpt: Path) -> None:
    """After an engine is built its objects sit in the collector's permanent generation (a full collection during
    a run does not walk them); an engine dropped before the next build, even one held in a reference cycle, is
    freed by that build, not kept frozen."""
    import gc
    import weakref

    from fnvllm.config import EngineConfig
    from fnvllm.engine.build import build_engine

    config = EngineConfig(dtype="float32", num_blocks=64)

    def build_in_a_cycle() -> weakref.ref[torch.nn.Module]:
        box: list[object] = []
        parts = build_engine(ckpt, config, load_tokenizer=False, on_step=lambda *_: box)
        box.append(parts)  # a cycle (parts -> loop -> hook -> box -> parts) among objects frozen by the build
        assert gc.get_freeze_count() > 0
        assert not any(obj is parts.executor.model for obj in gc.get_objects())  # frozen: in no generation
        parts.close()
        return weakref.ref(parts.executor.model)

    dropped = build_in_a_cycle()
    assert dropped() is not None  # held by the cycle, which no collection reaches while it is frozen
    gc.collect()
    assert dropped() is not None
    build_engine(ckpt, config, load_tokenizer=False).close()  # unfreezes, collects, then freezes again
    assert dropped() is None


def test_building_an_engine_raises_the_young_gc_threshold_only(ckpt: Path) -> None:
    """A build raises the collector's first threshold to YOUNG_GC_THRESHOLD, keeps the older ones, and keeps a
    larger first threshold the user set."""
    import gc

    from fnvllm.config import EngineConfig
    from fnvllm.engine.build import YOUNG_GC_THRESHOLD, build_engine

    config = EngineConfig(dtype="float32", num_blocks=64)
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 7, 9)
        build_engine(ckpt, config, load_tokenizer=False).close()
        assert gc.get_threshold() == (YOUNG_GC_THRESHOLD, 7, 9)
        gc.set_threshold(4 * YOUNG_GC_THRESHOLD, 3, 4)
        build_engine(ckpt, config, load_tokenizer=False).close()
        assert gc.get_threshold() == (4 * YOUNG_GC_THRESHOLD, 3, 4)
    finally:
        gc.set_threshold(*saved)


def test_stop_strings_without_a_tokenizer_are_refused_by_name(ckpt: Path) -> None:
    """With load_tokenizer=False there is no text to find a stop string in: InvalidRequestError naming the field,
    and the LLM keeps serving (stop_token_ids still work)."""
    ids_only = LLM(ckpt, dtype="float32", block_size=8, num_blocks=64, load_tokenizer=False)
    with pytest.raises(InvalidRequestError, match=r"^SamplingParams\.stop: .*stop_token_ids"):
        ids_only.generate([PROMPTS[0]], SamplingParams(max_tokens=4, stop=["x"]), use_tqdm=False)
    out = ids_only.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.text == ""


def test_a_request_too_long_names_the_field_to_change(ckpt: Path) -> None:
    """A prompt that leaves no room for an output token names the prompt; one that fits with fewer output tokens
    names max_tokens and how many this prompt allows; the KV pool likewise."""
    small = LLM(ckpt, dtype="float32", block_size=8, num_blocks=8, max_model_len=32)
    with pytest.raises(InvalidRequestError, match=r"^prompt: 32 tokens .* at most 31 prompt tokens"):
        small.generate([[5] * 32], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"^max_tokens: .* at most 12 for this prompt"):
        small.generate([[5] * 20], SamplingParams(max_tokens=13), use_tqdm=False)
    tiny_pool = LLM(ckpt, dtype="float32", block_size=8, num_blocks=2, max_model_len=64)
    with pytest.raises(InvalidRequestError, match=r"^prompt: .* the pool has 2"):
        tiny_pool.generate([[5] * 20], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"^max_tokens: .* the pool has 2"):
        tiny_pool.generate([[5] * 10], SamplingParams(max_tokens=20), use_tqdm=False)
    assert len(small.generate([[5] * 20], SamplingParams(max_tokens=12), use_tqdm=False)[0].token_ids) <= 12


def test_triton_model_ops_off_cuda_are_refused_at_build(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """model_ops='triton' on the CPU without Triton's interpreter fails when the LLM is built, naming the option
    (it failed at the first generate, with Triton's "0 active drivers")."""
    from fnvllm.kernels.backends import BackendUnavailableError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match=r"model_ops='triton' needs a CUDA device, got cpu"):
        LLM(ckpt, dtype="float32", num_blocks=16, device="cpu", model_ops="triton")
