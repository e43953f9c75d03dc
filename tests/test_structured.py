"""Structured outputs offline: StructuredOutput validation, the sampler's grammar mask, and LLM.generate under a
JSON schema, a choice, a regex and an EBNF grammar, with overlapped steps on and off (the demo model: a
constrained decode must follow its grammar whatever the model prefers)."""

from __future__ import annotations

import json
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import write_family

import fnvllm.demo
from fnvllm.engine.loop import EngineLoop
from fnvllm.executor.model_executor import ModelExecutor
from fnvllm.executor.sampler import GrammarMask, Sampler, apply_grammar_mask, prepare_sampling
from fnvllm.executor.structured import Grammars, check_structured
from fnvllm.llm import LLM
from fnvllm.state import InvalidRequestError, SamplingParams, StructuredOutput

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the serve extra)")

DEMO = Path(fnvllm.demo.__file__).parent / "checkpoint"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def check_schema(value: Any) -> None:
    """Assert that ``value`` satisfies SCHEMA (the properties it uses)."""
    assert isinstance(value, dict) and set(value) == {"name", "age", "tags"}, value
    assert re.fullmatch("[a-z ]{1,6}", value["name"]), value
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 2 and set(value["tags"]) <= {"a", "b"}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEMO, dtype="float32", block_size=8, num_blocks=256, max_num_seqs=8)


def _params(seed: int) -> list[SamplingParams]:
    """A mixed batch: schema, choice, regex, grammar and unconstrained rows, seeded."""
    return [
        SamplingParams(max_tokens=80, seed=seed, structured=StructuredOutput.json_schema(SCHEMA)),
        SamplingParams(max_tokens=80, seed=seed + 1, structured=StructuredOutput.json_schema(SCHEMA)),
        SamplingParams(max_tokens=10, seed=seed, structured=StructuredOutput.choice(["red", "green", "blue"])),
        SamplingParams(max_tokens=12, seed=seed, structured=StructuredOutput.regex(r"[0-9]{3}-[a-z]{2}")),
        SamplingParams(max_tokens=12, seed=seed, structured=StructuredOutput.grammar('root ::= "x" [yz] [yz]? "."')),
        SamplingParams(max_tokens=12, seed=seed),
        SamplingParams(max_tokens=80, seed=seed, structured=StructuredOutput.json_object()),
    ]


def _check(outs: list[Any]) -> None:
    """Assert each constrained output of ``_params`` follows its grammar and finished by EOS."""
    schema_a, schema_b, choice, regex, grammar, _, obj = outs
    for out in (schema_a, schema_b):
        assert out.finish_reason == "stop", out
        check_schema(json.loads(out.text))
    assert choice.text in {"red", "green", "blue"}
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.text), regex.text
    assert re.fullmatch(r"x[yz]{1,2}\.", grammar.text), grammar.text
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)


def test_structured_output_validates_kind_and_text() -> None:
    """A bad kind, non-JSON schema, a non-list choice and ignore_eos with a grammar are refused by name."""
    with pytest.raises(InvalidRequestError, match=r"structured\.kind"):
        StructuredOutput("xml", "<a/>")
    with pytest.raises(InvalidRequestError, match="JSON schema"):
        StructuredOutput("json_schema", "{not json")
    with pytest.raises(InvalidRequestError, match="array of strs"):
        StructuredOutput("choice", '"one"')
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput.regex("a+"))
    with pytest.raises(InvalidRequestError, match=r"SamplingParams\.structured"):
        SamplingParams(structured={"kind": "regex"})


def test_structured_params_pickle_and_hash() -> None:
    """SamplingParams with a constraint survive pickling (tensor parallelism) and hash equal."""
    params = SamplingParams(structured=StructuredOutput.json_schema(SCHEMA))
    copy = pickle.loads(pickle.dumps(params))
    assert copy == params and hash(copy) == hash(params)


def test_bad_regex_and_grammar_are_refused_when_added(llm: LLM) -> None:
    """A regex or EBNF that does not compile raises InvalidRequestError naming the kind, and nothing is queued."""
    with pytest.raises(InvalidRequestError, match=r"structured \(regex\)"):
        llm.generate("x", SamplingParams(structured=StructuredOutput.regex("(unclosed")))
    with pytest.raises(InvalidRequestError, match=r"structured \(grammar\)"):
        llm.generate("x", SamplingParams(structured=StructuredOutput.grammar("root ::= ")))
    assert not llm.state.has_unfinished


def test_missing_xgrammar_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without xgrammar installed, a constrained request is refused naming the package; others are not."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    check_structured(SamplingParams())
    with pytest.raises(InvalidRequestError, match="xgrammar"):
        check_structured(SamplingParams(structured=StructuredOutput.regex("a+")))


def test_generate_follows_every_kind_of_grammar(llm: LLM) -> None:
    """LLM.generate with a mixed batch: every constrained output parses / matches its grammar."""
    _check(llm.generate(["The story"] * 7, _params(3)))


@pytest.fixture
def overlapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelExecutor reports that it supports overlap (as on a GPU)."""
    monkeypatch.setattr(ModelExecutor, "supports_overlap", property(lambda self: True))


@pytest.mark.usefixtures("overlapping")
@pytest.mark.parametrize("where", ["launch", "collect"])
def test_overlapped_steps_give_the_plain_outputs(llm: LLM, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """With overlapped steps (constrained steps sampling after the grammar thread accepted the previous tokens and
    filled their masks), seeded constrained and unconstrained rows produce exactly plain stepping's tokens, whether
    a deferred step samples at the next launch or at the collect that accepted its tokens."""
    monkeypatch.setattr(llm.engine.executor, "sample_deferred_at", where)
    waits, advances = [], []
    original = ModelExecutor._waits_for_tokens
    monkeypatch.setattr(ModelExecutor, "_waits_for_tokens", lambda _, *a: waits.append(original(*a)) or waits[-1])
    advance = Grammars.advance
    monkeypatch.setattr(Grammars, "advance", lambda self, *a: advances.append(advance(self, *a)) or advances[-1])
    prompts = ["The story", "def f", "Once", "A", "import", "x", "The"]
    llm.loop = EngineLoop(llm.engine, state=llm.loop.state, overlap=False)
    plain = llm.generate(prompts, _params(11))
    llm.loop = EngineLoop(llm.engine, state=llm.loop.state, overlap=True)
    assert llm.loop.overlap
    overlapped = llm.generate(prompts, _params(11))
    assert llm.loop.overlap_stats.kept > 0 and any(waits)  # speculative steps ran, some deferred their sampling
    assert any(advances) == (where == "launch")  # ... their masks filled on the grammar thread, or at collect
    llm.loop.drain()
    llm.loop = EngineLoop(llm.engine, state=llm.loop.state, overlap=False)
    _check(overlapped)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in plain]


@pytest.mark.usefixtures("overlapping")
@pytest.mark.parametrize("where", ["collect", "launch"])
def test_a_forward_never_waits_for_its_masks(llm: LLM, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Overlapped steps with constrained rows: a step whose masks need the previous step's tokens has its forward
    queued before those tokens are collected, and samples only after (its masks filled at that collect, or on the
    grammar thread started there and waited for at the next launch): the rule of docs/structured_outputs.md."""
    monkeypatch.setattr(llm.engine.executor, "sample_deferred_at", where)
    events: list[tuple[str, int]] = []
    hidden, sample, accept = ModelExecutor._hidden_at_samples, ModelExecutor._sample, ModelExecutor._accept

    def forward(self: ModelExecutor, plan: Any, feed: Any) -> Any:
        events.append(("forward", plan.step))
        return hidden(self, plan, feed)

    def sampled(self: ModelExecutor, launched: Any, logits: Any) -> None:
        events.append(("sample", launched.plan.step))
        sample(self, launched, logits)

    def accepted(self: ModelExecutor, collected: Any, tokens: list[int]) -> None:
        events.append(("collect", collected.plan.step))
        accept(self, collected, tokens)
        if self._deferred is not None and self._deferred.pending is not None:
            events.append(("fill", self._deferred.plan.step))

    monkeypatch.setattr(ModelExecutor, "_hidden_at_samples", forward)
    monkeypatch.setattr(ModelExecutor, "_sample", sampled)
    monkeypatch.setattr(ModelExecutor, "_accept", accepted)
    llm.loop = EngineLoop(llm.engine, state=llm.loop.state, overlap=True)
    _check(llm.generate(["The story"] * 7, _params(5)))
    llm.loop.drain()
    llm.loop = EngineLoop(llm.engine, state=llm.loop.state, overlap=False)
    deferred = 0
    for k, (kind, step) in enumerate(events):
        if kind != "sample":
            continue
        queued = max(i for i, event in enumerate(events[:k]) if event == ("forward", step))  # this run of the step
        if ("collect", step - 1) in events[queued:k]:  # it waited for the previous step's tokens
            deferred += 1
            assert where == "collect" or ("fill", step) in events[queued:k]
    assert deferred > 0
    assert any(kind == "fill" for kind, _ in events) == (where == "launch")


@pytest.mark.parametrize("kernels", [False, True], ids=["references", "kernels"])
def test_masked_tokens_are_never_sampled(kernels: bool) -> None:
    """Randomised: for random logits, masks and settings, a masked row's token is always an allowed one (torch
    references, and the Triton kernels: on the GPU, or in Triton's interpreter)."""
    if kernels:
        pytest.importorskip("triton", reason="the kernel path needs Triton")
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 70, 6
    sampler = Sampler(seed=1, kernels=kernels)
    device = "cuda" if kernels and torch.cuda.is_available() else "cpu"
    for trial in range(8 if kernels else 40):
        logits = torch.randn(rows, vocab, generator=generator) * 5
        allowed = torch.rand(rows, vocab, generator=generator) < 0.1
        allowed[:, trial % vocab] = True  # at least one allowed token per row
        words = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int64)
        for t in range(vocab):
            words[:, t // 32] |= allowed[:, t].long() << (t % 32)
        constrained = [r for r in range(rows) if (r + trial) % 2 == 0]
        mask = GrammarMask(words[constrained].to(torch.int32), torch.tensor(constrained))
        params = [
            SamplingParams(temperature=[0.0, 0.7, 1.5][(r + trial) % 3], top_k=[None, 5][r % 2], seed=trial * rows + r)
            for r in range(rows)
        ]
        batch = prepare_sampling(params, [0] * rows, [None] * rows, vocab, device)
        batch = attrs.evolve(batch, grammar_mask=GrammarMask.upload(mask.bitmask, constrained, device))
        tokens = sampler.sample(logits.to(device), batch).token_ids.tolist()
        for r in constrained:
            assert allowed[r, tokens[r]], (trial, r, tokens[r])


def test_apply_grammar_mask_leaves_other_rows_and_the_input_alone() -> None:
    """The mask changes only the constrained rows' disallowed logits, on a copy."""
    logits = torch.arange(2 * 40, dtype=torch.float32).view(2, 40)
    before = logits.clone()
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = 1 << 3  # token 35 only
    out = apply_grammar_mask(logits, GrammarMask(bitmask, torch.tensor([1])))
    assert torch.equal(logits, before) and torch.equal(out[0], before[0])
    assert out[1].argmax().item() == 35 and out[1, 35] == before[1, 35] and (out[1] < -1e29).sum() == 39


def test_matchers_of_ended_requests_are_released(llm: LLM) -> None:
    """Matchers of requests cut by max_tokens or a stop string, or finished by EOS, are not kept."""
    params = [
        SamplingParams(max_tokens=3, structured=StructuredOutput.json_schema(SCHEMA)),
        SamplingParams(max_tokens=40, stop=['"'], structured=StructuredOutput.json_schema(SCHEMA)),
        SamplingParams(max_tokens=10, structured=StructuredOutput.choice(["red", "green"])),
    ]
    outs = llm.generate(["The story"] * 3, params)
    assert [o.finish_reason for o in outs] == ["length", "stop", "stop"]
    grammars = llm.engine.executor.grammars
    assert grammars is not None and grammars.num_live == 0


def test_a_choice_outside_the_basic_plane_comes_out_whole(llm: LLM) -> None:
    """A choice with an emoji (a surrogate pair in JSON) is generated as that text, valid UTF-8."""
    choices = ["ok 🙂", "né 𝄞"]
    params = SamplingParams(temperature=0, max_tokens=20, structured=StructuredOutput.choice(choices))
    for prompt in ("x = ", "The story"):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.finish_reason == "stop" and out.text in choices, out.text


def test_cli_structured_flag_builds_the_constraint(tmp_path: Path) -> None:
    """``--structured KIND:TEXT`` (inline or @FILE) becomes SamplingParams.structured; a bad kind is a usage
    error naming the field."""
    from fnvllm.cli import build_parser
    from fnvllm.cli._common import sampling_params

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    parser = build_parser()
    args = parser.parse_args(["generate", "--structured", f"json_schema:@{schema}", "x"])
    assert sampling_params(args).structured == StructuredOutput.json_schema(schema.read_text())
    args = parser.parse_args(["generate", "--structured", "regex:[0-9]+", "x"])
    assert sampling_params(args).structured == StructuredOutput.regex("[0-9]+")
    assert sampling_params(parser.parse_args(["generate", "x"])).structured is None
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--structured", "xml:<a/>", "x"])


# ----- generated schemas ------------------------------------------------------------------------------------------

KEYS = st.sampled_from(["a", "b", "id", "name", "x_1"])
LEAVES = st.one_of(
    st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.one_of(st.text("abc xyz", min_size=1, max_size=4), st.integers(-9, 99)), min_size=1, max_size=4,
             unique=True).map(lambda values: {"enum": values}),
    st.integers(1, 5).map(lambda n: {"type": "string", "pattern": f"^[a-z0-9]{{1,{n}}}$"}),
)  # fmt: skip


def _array(items: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.tuples(items, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )


def _object(values: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(KEYS, values, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}
    )


SCHEMAS = _object(st.recursive(LEAVES, lambda inner: st.one_of(_array(inner), _object(inner)), max_leaves=4))


def validates(value: Any, schema: dict[str, Any]) -> bool:
    """Whether ``value`` satisfies ``schema`` (the subset SCHEMAS generates)."""
    if "enum" in schema:
        return any(value == v and type(value) is type(v) for v in schema["enum"])
    kind = schema["type"]
    if kind == "integer":
        return type(value) is int and schema["minimum"] <= value <= schema["maximum"]
    if kind == "boolean":
        return type(value) is bool
    if kind == "null":
        return value is None
    if kind == "string":
        return type(value) is str and re.fullmatch(schema["pattern"].strip("^$"), value) is not None
    if kind == "array":
        size_ok = type(value) is list and schema["minItems"] <= len(value) <= schema["maxItems"]
        return size_ok and all(validates(v, schema["items"]) for v in value)
    props = schema["properties"]
    return type(value) is dict and set(value) == set(props) and all(validates(value[k], props[k]) for k in props)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 1000))
def test_generated_schemas_always_give_valid_json(llm: LLM, schema: dict[str, Any], seed: int) -> None:
    """Property: for any generated (bounded) schema, the demo model's constrained output parses and validates."""
    spec = StructuredOutput.json_schema(schema)
    params = [SamplingParams(max_tokens=500, temperature=t, seed=seed, structured=spec) for t in (0.0, 1.0, 2.0)]
    for out in llm.generate(["The story", "{", "def f"], params, use_tqdm=False):
        assert out.finish_reason == "stop", (schema, out.text)
        assert validates(json.loads(out.text), schema), (schema, out.text)


def test_an_engine_without_a_tokenizer_refuses_constraints() -> None:
    """LLM(load_tokenizer=False) refuses a constrained request when it is added, naming the tokenizer."""
    bare = LLM(DEMO, dtype="float32", block_size=8, num_blocks=64, load_tokenizer=False)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        bare.generate([[5, 6, 7]], SamplingParams(structured=StructuredOutput.regex("a+")))
    assert len(bare.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids) == 2


def test_tensor_parallel_rank0_enforces_the_grammar(tmp_path: Path) -> None:
    """Under tensor_parallel_size=2 (CPU workers), rank 0's matchers constrain the output as in one process."""
    path = write_family(tmp_path, "qwen3")
    options = {"device": "cpu", "dtype": "float32", "attention_backend": "torch", "block_size": 8, "num_blocks": 64}
    pattern = r"[a-c]{2}-[0-9]{3}"
    params = [SamplingParams(max_tokens=20, seed=s, structured=StructuredOutput.regex(pattern)) for s in range(3)]
    with LLM(path, tensor_parallel_size=2, **options) as llm:
        outs = llm.generate(["x", "y z", "w"], params, use_tqdm=False)
    for out in outs:
        assert re.fullmatch(pattern, out.text.removesuffix("en")), out.text  # the tiny config's EOS id 255 is "en"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (real overlapped steps, CUDA graphs)")
def test_gpu_overlapped_constrained_rows_match_plain_steps() -> None:
    """On a GPU (overlap on by default, CUDA graphs, the Triton sampler, the grammar process with its pinned
    shared masks), constrained and unconstrained seeded rows give plain stepping's tokens, and the constrained
    outputs follow their grammars."""
    llm = LLM(DEMO, dtype="bfloat16", device="cuda", max_num_seqs=16, enable_prefix_caching=False)
    assert llm.loop.overlap
    prompts = ["The story", "def f", "Once", "A", "import", "x", "The"]
    overlapped = llm.generate(prompts, _params(7), use_tqdm=False)
    assert llm.loop.overlap_stats.kept > 0
    grammars = llm.engine.executor.grammars
    assert grammars is not None and grammars._remote is not None and not grammars._remote.pin_failed
    llm.loop.drain()
    llm.loop = EngineLoop(llm.engine, state=llm.loop.state, overlap=False)
    plain = llm.generate(prompts, _params(7), use_tqdm=False)
    _check(overlapped)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in plain]
