"""The fused embedding + rotary-table gather (``fnvllm.kernels.embed``) equals its two torch gathers."""

from __future__ import annotations

import os

import pytest
import torch

from fnvllm.kernels.embed import embed_rope, embed_rope_ref

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tables(vocab: int, hidden: int, positions: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random bf16 embedding (vocab, hidden) and float32 table (positions, width)."""
    gen = torch.Generator().manual_seed(vocab * 31 + hidden)
    weight = torch.randn(vocab, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    return weight, torch.randn(positions, width, generator=gen).to(DEVICE)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(("hidden", "width"), [(64, 16), (48, 12)])  # a power of two, and not (masked lanes)
def test_embed_rope_equals_the_two_gathers(index_dtype: torch.dtype, hidden: int, width: int) -> None:
    """Rows, cos and sin are the torch gathers' bit for bit, repeated ids and positions included."""
    weight, table = _tables(50, hidden, 40, width)
    ids = torch.tensor([5, 2, 49, 0, 5, 17], dtype=index_dtype, device=DEVICE)
    positions = torch.tensor([7, 8, 39, 0, 7, 21], dtype=index_dtype, device=DEVICE)
    got = embed_rope(weight, ids, table, positions)
    want = embed_rope_ref(weight, ids.long(), table, positions.long())
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w)


def test_embed_rope_of_no_tokens() -> None:
    """An empty step gives empty (0, H) rows and (0, D/2) angles."""
    weight, table = _tables(10, 32, 8, 8)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    hidden, cos, sin = embed_rope(weight, empty, table, empty)
    assert hidden.shape == (0, 32) and cos.shape == (0, 4) and sin.shape == (0, 4)


def test_embed_rope_rejects_bad_arguments() -> None:
    """Mismatched lengths, a float index, a bf16 table and an odd table width are ValueErrors naming the field."""
    weight, table = _tables(10, 32, 8, 8)
    ids = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="positions"):
        embed_rope(weight, ids, table, ids[:1])
    with pytest.raises(ValueError, match="ids"):
        embed_rope(weight, ids.float(), table, ids)
    with pytest.raises(ValueError, match="cos_sin"):
        embed_rope(weight, ids, table.bfloat16(), ids)
    with pytest.raises(ValueError, match="cos_sin"):
        embed_rope(weight, ids, table[:, :7].contiguous(), ids)


def test_model_embeds_through_the_fused_op() -> None:
    """A decoder model whose ops have ``embed_rope`` gets the same embeddings and angles as with torch's gathers,
    and calls the op (a model without it takes the two gathers)."""
    import attrs

    from fnvllm.model.config import ModelConfig
    from fnvllm.model.models import DecoderModel
    from fnvllm.model.ops import TORCH_OPS

    config = ModelConfig.from_dict(
        {
            "architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
            "vocab_size": 64, "max_position_embeddings": 32, "torch_dtype": "bfloat16",
        }
    )  # fmt: skip
    calls: list[int] = []

    def counted(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        calls.append(args[1].shape[0])
        return embed_rope(*args)

    fused = DecoderModel(config, attrs.evolve(TORCH_OPS, embed_rope=counted)).to(DEVICE)
    plain = DecoderModel(config, TORCH_OPS).to(DEVICE)
    plain.load_state_dict(fused.state_dict())
    plain.rotary_emb.cos_sin_cache = fused.rotary_emb.cos_sin_cache
    ids = torch.tensor([3, 1, 4, 1, 5], device=DEVICE)
    positions = torch.tensor([0, 1, 2, 3, 4], device=DEVICE)
    got_hidden, got_rope = fused._embed(ids, positions)
    want_hidden, want_rope = plain._embed(ids, positions)
    assert calls == [5]
    assert torch.equal(got_hidden, want_hidden)
    for g, w in zip(got_rope, want_rope, strict=True):
        assert torch.equal(g, w)


def test_embed_rope_writes_zeros_for_a_stray_id() -> None:
    """An id past the vocabulary or a position past the table reads nothing and yields a zero row."""
    weight, table = _tables(10, 32, 8, 8)
    ids = torch.tensor([3, 10], device=DEVICE)
    positions = torch.tensor([8, 2], device=DEVICE)
    hidden, cos, sin = embed_rope(weight, ids, table, positions)
    assert torch.equal(hidden[0], weight[3]) and not hidden[1].any()
    assert not cos[0].any() and not sin[0].any() and torch.equal(cos[1], table[2, :4])
