"""The small-batch decode paths at the Qwen3-0.6B sizes on a GPU (skipped elsewhere): the decode kernel reading its
first K/V tile before the launch wait (``preload_kv``) and the gate/up projection with SiLU-and-mul in its epilogue
(``glu_out``), each captured in a CUDA graph (behind the kernel that writes its inputs, programmatic dependent
launch on) and replayed with new inputs, against the references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fnvllm.kernels import store_kv
from fnvllm.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from fnvllm.kernels.fused_ops import silu_and_mul
from fnvllm.kernels.skinny_gemm import SkinnyConfig, skinny_linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HQ, HKV, D, BLOCK, WIDTH = 16, 8, 128, 256, 16


def decode_batch(b: int, seed: int) -> dict[str, torch.Tensor]:
    """b sequences of contexts U(100, 1024) over 256-token blocks (tables 16 wide), random bf16 caches and the
    slots of each sequence's last token."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(100, 1025, (b,), generator=gen)
    lens[0] = 1  # a sequence of one token: only this step's
    blocks = (lens + BLOCK - 1) // BLOCK
    ids = torch.randperm(int(blocks.sum()) + 1, generator=gen) + 1
    table = torch.zeros(b, WIDTH, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks.tolist()):
        table[i, :n] = ids[used : used + n]
        used += n
    shape = (int(ids.max()) + 1, BLOCK, HKV, D)
    last = lens - 1
    slots = table[torch.arange(b), last // BLOCK].long() * BLOCK + last % BLOCK
    return {
        "k": torch.randn(shape, generator=gen).bfloat16().cuda(),
        "v": torch.randn(shape, generator=gen).bfloat16().cuda(),
        "table": table.cuda(),
        "lens": lens.int().cuda(),
        "slots": slots.cuda(),
    }


def close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """bf16 output within 2e-2 of the float32 reference."""
    return (out.float() - ref.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("b,partition", [(1, 64), (16, 4096), (64, 512)])
def test_preload_behind_the_store_over_graph_replays(b: int, partition: int) -> None:
    """store_kv (this step's k, v) then preloaded decode attention in one graph: every replay with new k, v and q
    attends the new token (the store's write is seen, the preload does not read it early)."""
    batch = decode_batch(b, b)
    q = torch.randn(b, HQ, D, device="cuda").bfloat16()
    new_k, new_v = (torch.randn(b, HKV, D, device="cuda").bfloat16() for _ in range(2))
    knobs = {"partition_size": partition, "tile_size": 64, "preload_kv": True, "fused_reduce": b > 1}

    def step() -> torch.Tensor:
        store_kv.store_kv(new_k, new_v, batch["k"], batch["v"], batch["slots"])
        return paged_decode_attention(q, batch["k"], batch["v"], batch["table"], batch["lens"], D**-0.5, **knobs)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        for t in (q, new_k, new_v):
            t.copy_(torch.randn_like(t, dtype=torch.float32).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_decode_attention_ref(
            q.float(), batch["k"].float(), batch["v"].float(), batch["table"], batch["lens"], D**-0.5
        )
        assert close(out, ref)


@pytest.mark.parametrize(
    "m,cfg", [(16, SkinnyConfig(16, 32, 256, 1, 4, 1, preload=True)), (64, SkinnyConfig(64, 64, 128, 2, 4, 3))]
)
def test_glu_epilogue_at_gate_up_over_graph_replays(m: int, cfg: SkinnyConfig) -> None:
    """Qwen3-0.6B's gate/up (6144 x 1024) with SiLU-and-mul in the epilogue: within a bf16 unit of the projection
    then silu_and_mul, and bit-identical over graph replays (split-K sum in-kernel)."""
    x = torch.randn(m, 1024, device="cuda").bfloat16()
    w = (torch.randn(6144, 1024, device="cuda") / 32).bfloat16()
    unfused = silu_and_mul(F.linear(x, w)).float()
    eager = skinny_linear(x, w, config=cfg, glu_out=True)
    assert (eager.float() - unfused).abs().max().item() <= unfused.abs().max().item() * 2**-7
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = skinny_linear(x, w, config=cfg, glu_out=True)
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, eager)
