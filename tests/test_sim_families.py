"""The simulator's model of the newer families: experts (Qwen3-MoE, Qwen2-MoE's shared expert, Mixtral's
num_local_experts), sliding windows (Mistral / Mixtral / Phi-3 on every layer, Qwen2's use_sliding_window, Gemma
3's local layers), Gemma 3's text_config and transformers' defaults, FP8 experts (one byte a weight, multiplied at
the bf16 rate), and the published named shapes. Expected values come from the engine's ModelConfig, its meta-built
parameters, or the published configs by hand."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import pytest

from fnvllm.model.config import ModelConfig
from fnvllm.model.loader import build_on_meta
from fnvllm.sim import NAMED_SHAPES, CostModel, ModelShape, load_shape
from fnvllm.sim.families import expected_experts_touched
from fnvllm.sim.hardware import H200
from fnvllm.sim.model import SimInputError
from fnvllm.state.plan import StepShape
from fnvllm.testing.checkpoints import _QWEN3_COMMON, OTHER_SHAPES, QWEN3_MOE_SHAPES

NEW_NAMED = ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-8x7b", "gemma-3-1b", "gemma-3-4b", "phi-4")
# the bench's published configs (fnvllm.testing.checkpoints), which the named shapes must equal
PUBLISHED = {"qwen3-30b-a3b": {**_QWEN3_COMMON, **QWEN3_MOE_SHAPES["qwen3-30b-a3b"]}, **OTHER_SHAPES}
# a rate so high (bytes / s or FLOP / s) that its side of a roofline vanishes
FREE_COMPUTE = attrs.evolve(H200, matmul_tflops=1e7, fp8_matmul_tflops=1e7)
FREE_BYTES = attrs.evolve(H200, mem_bandwidth_gbs=1e7, matmul_bandwidth_gbs=1e7)


def _engine_numbers(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The shape's numbers as the engine reads the config (ModelConfig), in ModelShape's field names."""
    c = ModelConfig.from_dict(hf)
    moe = c.moe
    windows = [c.layer_window(i) for i in range(c.num_hidden_layers)]
    windowed = [w for w in windows if w is not None]
    return {
        "hidden": c.hidden_size,
        "layers": c.num_hidden_layers,
        "q_heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate": c.intermediate_size,
        "vocab": c.vocab_size,
        "tied": c.tie_word_embeddings,
        "max_len": c.max_position_embeddings,
        "experts": moe.num_experts if moe else 0,
        "experts_per_tok": moe.num_experts_per_tok if moe else 0,
        "expert_intermediate": moe.moe_intermediate_size if moe else 0,
        "shared_intermediate": (moe.shared_expert_intermediate_size or 0) if moe else 0,
        "dense_layers": sum(not c.is_sparse_layer(i) for i in range(c.num_hidden_layers)) if moe else 0,
        "window": windowed[0] if windowed else None,
        "window_layers": len(windowed),
    }


def _sim_numbers(shape: ModelShape) -> dict[str, Any]:
    """The same numbers from the simulator's shape."""
    return {
        k: v
        for k, v in attrs.asdict(shape).items()
        if k not in ("name", "dtype_bytes", "kv_cache_dtype", "quantization")
    }


@pytest.mark.parametrize("name", NEW_NAMED)
def test_named_shapes_read_as_the_engine_reads_them(name: str) -> None:
    """Each new named shape reads in the simulator as the engine reads its config.json: sizes, experts, dense
    layers, shared expert, window and windowed layers (gemma-3-4b: 29 of 34 layers at 1,024 tokens)."""
    assert _sim_numbers(load_shape(name)) == _engine_numbers(NAMED_SHAPES[name])


FAMILY_CONFIGS: Mapping[str, Mapping[str, Any]] = {
    # Gemma3ForCausalLM: the fields at the top level, an explicit layer_types, untied
    "gemma3-causal": {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 1000,
        "max_position_embeddings": 32768,
        "sliding_window": 512,
        "layer_types": ["sliding_attention", "full_attention"] * 3,
        "tie_word_embeddings": False,
        "rope_local_base_freq": 10000.0,
    },
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32064,
        "max_position_embeddings": 4096,
        "sliding_window": 2047,
    },
    "phi3-no-window": {
        "architectures": ["Phi3ForCausalLM"],
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 4,
        "num_attention_heads": 32,
        "vocab_size": 32064,
        "max_position_embeddings": 4096,
        "sliding_window": 262144,  # no shorter than the context: full attention
    },
    "qwen2-window": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 32768,
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 4,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
    },
    "qwen3-moe-dense-layers": {
        **PUBLISHED["qwen3-30b-a3b"],
        "num_hidden_layers": 6,
        "mlp_only_layers": [0],
        "decoder_sparse_step": 2,
    },
}


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_family_configs_read_as_the_engine_reads_them(name: str) -> None:
    """Gemma3ForCausalLM (top-level fields, layer_types), Phi-3 (a window on every layer; none when it covers the
    context), Qwen2's use_sliding_window from max_window_layers on, Mistral, and a Qwen3-MoE with dense layers
    (mlp_only_layers, decoder_sparse_step) read as the engine reads them."""
    assert _sim_numbers(ModelShape.from_config(FAMILY_CONFIGS[name])) == _engine_numbers(FAMILY_CONFIGS[name])


@pytest.mark.parametrize("name", [*NEW_NAMED, "qwen3-moe-dense-layers", "qwen2-window"])
def test_to_config_round_trips(name: str) -> None:
    """to_config writes experts, dense layers and windows so that from_config reads the same shape back."""
    shape = load_shape(name) if name in NAMED_SHAPES else ModelShape.from_config(FAMILY_CONFIGS[name], name=name)
    assert ModelShape.from_config(shape.to_config(), name=shape.name) == shape


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("name", NEW_NAMED)
def test_weight_bytes_are_the_engines_parameters(name: str, quantization: str | None) -> None:
    """The memory the simulator reserves for weights is the engine's parameters (every expert, the routers, the
    shared expert; FP8 scales as a 1 / 4,096 share) up to the norms and biases it leaves out."""
    if quantization and name.startswith("gemma"):
        pytest.skip("FP8 weights are refused for Gemma 3")
    config = ModelConfig.from_dict({**NAMED_SHAPES[name], "torch_dtype": "bfloat16"}, quantization=quantization)
    engine = sum(p.numel() * p.element_size() for p in build_on_meta(config).parameters())
    shape = load_shape(name).with_precision(quantization=quantization)
    assert shape.weight_bytes == pytest.approx(engine, rel=2e-4)


def test_experts_touched_is_the_engines_rule() -> None:
    """The simulator's expected-experts rule is the engine's (fnvllm.model.moe) and E (1 - (1 - k/E)^n)."""
    from fnvllm.model.moe import expected_experts_touched as engine_rule

    for e, k, n in ((128, 8, 1), (128, 8, 16), (60, 4, 7), (8, 2, 256)):
        assert expected_experts_touched(e, k, n) == engine_rule(e, k, n) == e * (1 - (1 - k / e) ** n)


def test_a_decode_step_reads_the_experts_it_touches() -> None:
    """Qwen3-30B-A3B at free compute: one decoding sequence's experts part streams its 8 experts (3 x 2,048 x 768
    weights each, bf16) and the 8 routed rows' activations; 256 sequences stream ~all 128 experts; in FP8, one
    byte a weight plus a 1 / 4,096 share of float32 scales."""
    model = load_shape("qwen3-30b-a3b")
    bw = H200.matmul_bandwidth_gbs * 1e9
    expert = 3 * 2048 * 768

    def experts_s(shape: ModelShape, seqs: int) -> float:
        step = StepShape(seqs, seqs, seqs, 0, seqs * 100, seqs * 100, seqs, True)
        return dict(CostModel(shape, FREE_COMPUTE).layer_parts_s(step))["experts"]

    acts = 2 * 8 * 2 * (2048 + 2 * 768)  # bf16 rows in and out of gate_up and down, 8 rows
    assert experts_s(model, 1) == pytest.approx((2 * 8 * expert + acts) / bw, rel=1e-6)
    touched = 128 * (1 - (120 / 128) ** 256)
    assert experts_s(model, 256) == pytest.approx((2 * touched * expert + 256 * acts) / bw, rel=1e-6)
    fp8 = (1 + 4 / 128**2) * touched * expert + 256 * acts
    assert experts_s(model.with_precision(quantization="fp8"), 256) == pytest.approx(fp8 / bw, rel=1e-6)


def test_fp8_experts_multiply_at_the_bf16_rate() -> None:
    """At free bandwidth an 8,192-token prefill's experts take 2 FLOPs a weight for 8 experts a token at the bf16
    rate, FP8 weights or not (weight-only FP8), while the FP8 attention projections run at the FP8 rate."""
    model = load_shape("qwen3-30b-a3b")
    prefill = StepShape(1, 8192, 0, 8192, 8192, 8192 * 4096, 1, False)
    bf16 = dict(CostModel(model, FREE_BYTES).layer_parts_s(prefill))
    fp8 = dict(CostModel(model.with_precision(quantization="fp8"), FREE_BYTES).layer_parts_s(prefill))
    compute = 2 * 8192 * 8 * 3 * 2048 * 768 / (H200.matmul_tflops * 1e12)
    assert bf16["experts"] == pytest.approx(compute, rel=1e-3) and fp8["experts"] == pytest.approx(compute, rel=1e-3)
    assert fp8["qkv"] == pytest.approx(bf16["qkv"] * H200.matmul_tflops / H200.fp8_matmul_tflops, rel=1e-3)


def test_shared_expert_and_router_are_priced() -> None:
    """Qwen1.5-MoE-A2.7B's sparse layer has a router (60 experts + the shared gate, hidden 2,048, bf16) and a
    shared expert of 5,632 (a dense MLP: gate_up and down), each at its bytes for one decoding sequence."""
    model = load_shape("qwen1.5-moe-a2.7b")
    bw = H200.matmul_bandwidth_gbs * 1e9
    one = StepShape(1, 1, 1, 0, 100, 100, 1, True)
    parts = dict(CostModel(model, FREE_COMPUTE).layer_parts_s(one))
    assert parts["router"] == pytest.approx(2 * (61 * 2048 + 2048 + 61) / bw, rel=1e-6)
    shared = 2 * (3 * 2048 * 5632 + (2048 + 2 * 5632) + (5632 + 2048))  # weights, gate_up and down activations
    assert parts["shared_expert"] == pytest.approx(shared / bw, rel=1e-6)
    assert "gate_up" not in parts  # every layer is sparse


def test_windowed_layers_read_at_most_the_window() -> None:
    """gemma-3-4b at free compute: a decode step of 4 sequences at context 5,000 reads 5,000 keys a sequence in
    its 5 global layers and 1,024 in its 29 local ones; with every context inside the window the local layers read
    what the global ones do."""
    model = load_shape("gemma-3-4b")
    bw = H200.mem_bandwidth_gbs * 1e9
    kv, q = 4 * 256, 8 * 256

    def layer(context: int) -> float:  # K and V read and written, q read and out written, bf16
        return (2 * 2 * kv * (context + 4) + 2 * 2 * q * 4) / bw

    long = StepShape(4, 4, 4, 0, 4 * 5000, 4 * 5000, 4, True)
    expected = 5 * layer(4 * 5000) + 29 * layer(4 * 1024)
    assert CostModel(model, FREE_COMPUTE).attention_s(long) == pytest.approx(expected, rel=1e-12)
    short = StepShape(4, 4, 4, 0, 4 * 600, 4 * 600, 4, True)
    assert CostModel(model, FREE_COMPUTE).attention_s(short) == pytest.approx(34 * layer(4 * 600), rel=1e-12)


def test_windowed_prefill_pairs_are_bounded() -> None:
    """gemma-3-4b at free bandwidth: a 4,096-token prefill chunk from position 10,000 on computes its causal
    pairs (4,096 x 10,000 + 4,096 x 4,097 / 2) in a global layer but 4,096 x 1,024 in a local one (every query is
    past the window; 4 FLOPs a head dimension a pair, 8 heads of 256)."""
    model = load_shape("gemma-3-4b")
    t, start = 4096, 10_000
    pairs = t * start + t * (t + 1) // 2
    step = StepShape(1, t, 0, t, start + t, pairs, 1, False)
    flops = 4 * 8 * 256 * (5 * pairs + 29 * t * 1024)
    assert CostModel(model, FREE_BYTES).attention_s(step) == pytest.approx(
        flops / (H200.matmul_tflops * 1e12), rel=1e-6
    )


def test_bad_expert_and_window_fields_are_refused_by_name() -> None:
    """Expert fields on a dense shape, top-k above the experts, windowed layers without a window are SimInputErrors
    naming the field."""
    dense = load_shape("qwen3-0.6b")
    with pytest.raises(SimInputError, match="experts_per_tok"):
        attrs.evolve(dense, experts_per_tok=2)
    with pytest.raises(SimInputError, match="experts_per_tok"):
        attrs.evolve(load_shape("mixtral-8x7b"), experts_per_tok=9)
    with pytest.raises(SimInputError, match="window_layers"):
        attrs.evolve(dense, window_layers=3)
    with pytest.raises(SimInputError, match="num_experts_per_tok"):
        ModelShape.from_config({**NAMED_SHAPES["mixtral-8x7b"], "num_experts_per_tok": None})


def test_bench_steps_roofline_prices_moe_and_gemma(tmp_path: Any) -> None:
    """The bench's roofline of the steps run covers a mixture of experts (once reported as nothing) and a Gemma 3
    config.json (text_config), and FP8 weights make a Qwen3-30B-A3B decode step cheaper at free compute."""
    import json

    from fnvllm.bench import Ceilings, _steps_roofline

    record = {"num_seqs": 64, "num_tokens": 64, "num_decode_seqs": 64, "num_prefill_tokens": 0,
              "context_tokens": 64 * 500, "graph": True}  # fmt: skip
    ceilings = Ceilings(4.16, 1e6, "given")
    for name in ("qwen3-30b-a3b", "gemma-3-4b"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(NAMED_SHAPES[name]))
        assert _steps_roofline(folder, [record], ceilings, 0.05, 64)["fraction_of_steps_roofline"] > 0
    moe = tmp_path / "qwen3-30b-a3b"
    bf16 = _steps_roofline(moe, [record], ceilings, 0.05, 64)["fraction_of_steps_roofline"]
    fp8 = _steps_roofline(moe, [record], ceilings, 0.05, 64, quantization="fp8")["fraction_of_steps_roofline"]
    assert 0.4 * bf16 < fp8 < 0.6 * bf16  # the experts and projections stream half the bytes


@pytest.mark.parametrize(("name", "low", "high"), [("gemma-3-1b", 0.99e9, 1.01e9), ("phi-4", 14.6e9, 14.8e9)])
def test_published_dense_shapes_have_their_published_sizes(name: str, low: float, high: float) -> None:
    """gemma-3-1b holds ~1.0 B parameters (26 x (2.95 M attention + 23.9 M GeGLU) + a tied 262,144 x 1,152
    embedding) and phi-4 ~14.7 B (40 x (65.5 M + 275.3 M) + two 100,352 x 5,120 tables), as the engine builds them."""
    config = ModelConfig.from_dict(NAMED_SHAPES[name])
    assert low < sum(p.numel() for p in build_on_meta(config).parameters()) < high


def test_simulate_help_names_every_named_shape() -> None:
    """``fnvllm simulate --model-shape``'s help lists every named shape (it is written out so that the CLI's
    startup imports no simulator)."""
    from fnvllm.cli.simulate import _SPEC_FLAGS

    help_text = _SPEC_FLAGS["model"][1]
    assert all(f"{name} " in help_text for name in NAMED_SHAPES)


@pytest.mark.parametrize("name", [*NEW_NAMED, *FAMILY_CONFIGS])
def test_engine_timeline_header_reads_as_its_config(name: str) -> None:
    """The engine's timeline header (``timeline_model``, what ``fnvllm simulate calibrate`` prices a logged run by)
    reads in the simulator as the config the engine was built from: experts, dense layers, the shared expert and
    each family's windowed layers survive the engine's resolution, so a MoE or windowed GPU log is not priced as a
    dense model."""
    from fnvllm.executor.model_executor import timeline_model

    hf = NAMED_SHAPES[name] if name in NAMED_SHAPES else FAMILY_CONFIGS[name]
    config = ModelConfig.from_dict({**hf, "torch_dtype": "bfloat16"})
    header = timeline_model(config, config.torch_dtype, "auto")
    assert _sim_numbers(ModelShape.from_config(header)) == _engine_numbers(hf)
