"""Decode attention with the first K/V tile read before the launch wait (``preload_kv``) and with partitions inside
one block (one block-table read per partition): both against the float32 reference, under Triton's interpreter
without a GPU (tiny shapes, NaN outside every sequence's slots)."""

from __future__ import annotations

import pytest
import torch
from test_kernels_triton import TOLERANCE, rel_err, run_decode

from fnvllm.kernels import decode_attention

# Lengths: one token (only this step's token, read after the wait), a full tile, one past it, a padding row, a
# sequence whose last token is in its first tile's middle, and long ones spanning partitions.
LENGTHS = [1, 16, 17, 0, 9, 70, 33]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "knobs",
    [
        {"partition_size": 32, "tile_size": 16, "fused_reduce": True},
        {"partition_size": 32, "tile_size": 16, "fused_reduce": False},
        {"partition_size": 128, "tile_size": 16, "prefetch": True, "num_stages": 1},
        {"partition_size": 16, "tile_size": 16, "heads_inner": False},
        {"partition_size": 32, "tile_size": 16, "gqa_mode": "kq"},
    ],
    ids=["split-merged", "split-reduce", "one-partition-prefetch", "tile-partitions", "transposed"],
)
def test_preloaded_first_tile_matches_reference(dtype: torch.dtype, knobs: dict[str, object]) -> None:
    """With the first tile preloaded (all but the last token) and the last token read after the wait, every row
    matches the reference, and the padding row is zeros."""
    out, ref = run_decode(LENGTHS, 4, 2, 16, dtype, width=6, preload_kv=True, **knobs)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert torch.all(out[3] == 0)


@pytest.mark.parametrize("block_size,partition_size", [(64, 32), (64, 64), (48, 16)])
def test_partitions_inside_one_block_match_reference(block_size: int, partition_size: int) -> None:
    """Partitions that divide the block (one block id read per partition, later tiles shifted from the first),
    including a block size that is not a power of two, give the reference's output, preloaded or not."""
    lengths = [5, 130, 64, 0, 97]
    for preload in (False, True):
        out, ref = run_decode(
            lengths, 4, 2, block_size, torch.float32, partition_size=partition_size, tile_size=16, preload_kv=preload
        )
        assert rel_err(out, ref) < TOLERANCE[torch.float32], f"preload={preload}"


def test_preload_is_off_by_default_and_a_config_field() -> None:
    """The default configs keep the plain order (wait first); preload_kv is a knob of DecodeKernelConfig."""
    assert decode_attention.DEFAULT_DECODE_CONFIG.preload_kv is False
    assert decode_attention.DEFAULT_FP8_DECODE_CONFIG.preload_kv is False
    cfg = decode_attention.DecodeKernelConfig(preload_kv=True)
    decode_attention._check_config(cfg)


def test_single_pass_merge_weights_partials_by_their_lse() -> None:
    """The one-pass merge (running max) over many partials with very different maxima equals the reference:
    19 live 16-token partitions of one sequence, merged in-kernel and by the reduce kernel."""
    gen_lengths = [300, 2]
    for fused in (True, False):
        out, ref = run_decode(
            gen_lengths, 4, 1, 16, torch.float32, width=20, seed=3, partition_size=16, tile_size=16, fused_reduce=fused
        )
        assert rel_err(out, ref) < TOLERANCE[torch.float32], f"fused={fused}"
