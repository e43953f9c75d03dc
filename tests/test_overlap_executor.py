"""Overlapped steps through the real ModelExecutor (tiny checkpoint, CPU): a speculative step fed from the previous
step's sampled ids (``launch(plan, fed_by=...)``) gives the tokens and logprobs plain stepping gives.

On the CPU ``supports_overlap`` is False (launching there is computing); these tests switch it on to run the
device-feed path: the index from the speculative plan's rows into the previous step's samples, the eager
forward with fed ids, trimming the rows that ended, and recovery when a collect fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from tiny_models import write_family

from fnvllm.engine.loop import EngineLoop
from fnvllm.executor.model_executor import ModelExecutor
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams

PROMPTS = [[5, 9, 13, 200, 7], [42] * 12, list(range(3, 40)), [250, 3], [17] * 5, [1, 2, 3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return write_family(tmp_path_factory.mktemp("overlap"), "qwen3")


def _llm(checkpoint: Any, overlap: bool, max_num_seqs: int = 4) -> LLM:
    llm = LLM(checkpoint, dtype="float32", block_size=4, num_blocks=128, max_num_seqs=max_num_seqs)
    llm.loop = EngineLoop(llm.engine, overlap=overlap)
    return llm


@pytest.fixture
def overlapping(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """ModelExecutor reports that it supports overlap (as on a GPU)."""
    monkeypatch.setattr(ModelExecutor, "supports_overlap", property(lambda self: True))
    yield


def _params(stop_ids: list[int]) -> list[SamplingParams]:
    """Greedy rows (some stopping on a token they will sample), seeded sampling with logprobs, and lengths
    that end rows at different steps."""
    return [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=stop_ids[:1]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=10, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=stop_ids[1:2]),
        SamplingParams(temperature=0.7, seed=11, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    ]


@pytest.mark.parametrize("max_num_seqs", [4, 8])
def test_overlapped_generate_equals_plain(checkpoint: Any, overlapping: None, max_num_seqs: int) -> None:
    """With 4 sequences at most, a row that ends lets a waiting one in (the speculative step is dropped); with
    8, every prompt runs at once and rows that end are trimmed from kept speculative steps."""
    plain = _llm(checkpoint, overlap=False, max_num_seqs=max_num_seqs)
    assert not plain.loop.overlap
    probe = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    # Stop ids that rows 0 and 3 sample mid-run, so those rows end while a speculative step holds them.
    stop_ids = [probe[0].token_ids[4], probe[3].token_ids[6]]
    params = _params(stop_ids)
    expected = plain.generate(PROMPTS, params, use_tqdm=False)
    fast = _llm(checkpoint, overlap=True, max_num_seqs=max_num_seqs)
    assert fast.loop.overlap
    actual = fast.generate(PROMPTS, params, use_tqdm=False)
    for want, got in zip(expected, actual, strict=True):
        assert got.token_ids == want.token_ids
        assert got.finish_reason == want.finish_reason
    want_lp, got_lp = expected[2].logprobs, actual[2].logprobs
    assert got_lp is not None and want_lp is not None and len(got_lp) == len(want_lp)
    for w, g in zip(want_lp, got_lp, strict=True):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-5)
    stats = fast.loop.overlap_stats
    assert stats.kept > 5, stats
    assert stats.launched == stats.kept + stats.dropped
    if max_num_seqs == 4:
        assert stats.dropped > 0, stats
    assert fast.state.pool.num_free == fast.engine.config.num_blocks


def test_failed_collect_while_a_speculative_step_is_launched(checkpoint: Any, overlapping: None) -> None:
    """A collect that raises mid-run (with the next step already launched) re-raises, and the engine is in step
    again: a retry finishes with plain stepping's tokens."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [r.token_ids for r in _llm(checkpoint, overlap=False).generate(PROMPTS[:3], params, use_tqdm=False)]
    llm = _llm(checkpoint, overlap=True)
    real_collect = llm.executor.collect
    calls = {"n": 0}

    def flaky(launched: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("device fell over")
        return real_collect(launched)

    llm.executor.collect = flaky  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="device fell over"):
            llm.generate(PROMPTS[:3], params, use_tqdm=False)
    finally:
        del llm.executor.collect
    assert llm.loop.overlap_stats.launched > 0
    assert not llm.loop.has_unfinished
    assert [r.token_ids for r in llm.generate(PROMPTS[:3], params, use_tqdm=False)] == want


def test_a_fed_row_must_feed_one_token(checkpoint: Any) -> None:
    """A row whose sequence the feeding step sampled takes that sample as its one input; a plan that gives such a
    row two tokens is refused before anything runs."""
    llm = _llm(checkpoint, overlap=False)
    from fnvllm.state import add_request, schedule

    state = add_request(llm.state, "a", (5, 6, 7), SamplingParams(max_tokens=4))
    state, plan = schedule(state)
    launched = llm.executor.launch(plan)
    llm.executor.collect(launched)
    two = attrs.evolve(
        plan, step=plan.step + 1, input_tokens=((0, 0),), start_positions=(3,), num_generated=(1,), num_admitted=0
    )
    with pytest.raises(ValueError, match="'a' feeds 2 tokens in step 1; a row fed from the device by step 0"):
        llm.executor.launch(two, fed_by=launched)
    assert llm.executor.next_step == plan.step + 1, "a refused launch leaves the executor where it was"


def test_feed_places_samples_at_the_fed_rows_tokens(checkpoint: Any) -> None:
    """In a mixed plan (a prompt chunk, then a decode the previous step sampled), the sample lands on the decode
    row's token: position 3 of the flat batch, row 1 of the per-row ids."""
    import torch

    from fnvllm.executor.model_executor import Launched
    from fnvllm.state import StepPlan

    executor = _llm(checkpoint, overlap=False).executor
    previous = StepPlan(0, 4, ("a", "b"), ((7,), (8,)), (2, 5), ((0,), (1, 2)), (True, True))
    launched = Launched(previous, (0, 1), torch.tensor([[42, 43], [0, 0]], device=executor.device))
    plan = StepPlan(1, 4, ("x", "b"), ((1, 2, 3), (0,)), (0, 6), ((3,), (1, 2)), (True, True))
    feed = executor._feed(plan, launched)
    on = executor.device
    assert feed is not None
    assert feed.apply(torch.tensor([1, 2, 3, 0], device=on), token_rows=True).tolist() == [1, 2, 3, 43]
    assert feed.apply(torch.tensor([9, 0], device=on), token_rows=False).tolist() == [9, 43]
    every = executor._feed(attrs.evolve(plan, seq_ids=("b", "a"), input_tokens=((0,), (0,))), launched)
    assert every is not None and every.rows is None
    assert every.apply(torch.tensor([0, 0], device=on), token_rows=True).tolist() == [43, 42]


def test_feed_of_the_same_rows_in_order_is_the_samples_themselves(checkpoint: Any) -> None:
    """A decode step over exactly the rows the previous step sampled, in order, feeds that step's sample tensor
    as it is (no index upload, no gather); the same rows reordered still gather."""
    import torch

    from fnvllm.executor.model_executor import Launched
    from fnvllm.state import StepPlan

    executor = _llm(checkpoint, overlap=False).executor
    previous = StepPlan(0, 4, ("a", "b"), ((7,), (8,)), (2, 5), ((0,), (1, 2)), (True, True))
    packed = torch.tensor([[42, 43], [0, 0]], device=executor.device)
    launched = Launched(previous, (0, 1), packed)
    plan = StepPlan(1, 4, ("a", "b"), ((0,), (0,)), (3, 6), ((0,), (1, 2)), (True, True))
    feed = executor._feed(plan, launched)
    assert feed is not None and feed.rows is None and feed.ids.data_ptr() == packed[0].data_ptr()
    assert feed.ids.tolist() == [42, 43]
    swapped = executor._feed(attrs.evolve(plan, seq_ids=("b", "a")), launched)
    assert swapped is not None and swapped.ids.tolist() == [43, 42]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_logits_match_eager(checkpoint: Any) -> None:
    """On a GPU, the small decode buckets compute the lm_head inside their CUDA graph: greedy tokens and their
    logprobs are those of eager steps (float32), for a batch inside those buckets."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = []
    for eager in (True, False):
        llm = LLM(checkpoint, dtype="float32", block_size=4, num_blocks=128, max_num_seqs=4, enforce_eager=eager)
        graphs = llm.executor.graphs
        assert (graphs is None) == eager and (eager or {b for b, _ in graphs.logits} == set(graphs.sizes))
        runs.append(llm.generate(PROMPTS[:4], params, use_tqdm=False))
        llm.close()
    for eager_out, graph_out in zip(*runs, strict=True):
        assert eager_out.token_ids == graph_out.token_ids
        assert eager_out.logprobs is not None and graph_out.logprobs is not None
        for a, b in zip(eager_out.logprobs, graph_out.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4 and [i for i, _ in a.top] == [i for i, _ in b.top]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA graphs need a GPU")
def test_short_table_graphs_match_eager(checkpoint: Any) -> None:
    """On a GPU, 12 short sequences replay the 16-row bucket's short-table capture (its own attention knobs):
    greedy tokens and logprobs are those of eager steps (float32)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = PROMPTS * 2
    runs = []
    for eager in (True, False):
        llm = LLM(checkpoint, dtype="float32", block_size=4, num_blocks=256, max_num_seqs=16, enforce_eager=eager)
        graphs = llm.executor.graphs
        assert eager or (
            graphs is not None and 16 in graphs.short_widths and (16, graphs.short_widths[16]) in graphs.graphs
        )
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        llm.close()
    for eager_out, graph_out in zip(*runs, strict=True):
        assert eager_out.token_ids == graph_out.token_ids
        assert eager_out.logprobs is not None and graph_out.logprobs is not None
        for a, b in zip(eager_out.logprobs, graph_out.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_order_leaves_fp8_tokens_unchanged(checkpoint: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU with an FP8 cache, decode buckets that stage their rows longest first (the threshold lowered so
    the test's batch takes it) give the tokens and logprobs of a run without the order (FNVLLM_DECODE_ORDER=0)."""
    from fnvllm.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "ORDERED_MIN_PROGRAMS", 4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = []
    for order in ("1", "0"):
        monkeypatch.setenv("FNVLLM_DECODE_ORDER", order)
        llm = LLM(checkpoint, block_size=16, num_blocks=64, max_num_seqs=8, kv_cache_dtype="fp8")
        graphs = llm.executor.graphs
        assert graphs is not None and (graphs.order_min_rows is not None) == (order == "1")
        runs.append(llm.generate(PROMPTS, params, use_tqdm=False))
        llm.close()
    for ordered, plain in zip(*runs, strict=True):
        assert ordered.token_ids == plain.token_ids
        assert ordered.logprobs is not None and plain.logprobs is not None
        assert [a.logprob for a in ordered.logprobs] == [b.logprob for b in plain.logprobs]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize(("prompts", "decode_steps"), [(1, 1), (3, 1), (6, 1), (3, 4)])
def test_sampling_in_the_graph_draws_the_eager_samplers_tokens(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, prompts: int, decode_steps: int
) -> None:
    """On a GPU, decode steps whose rows the graphs can sample (greedy, unseeded, seeded; top-k rows with a top-p or
    a min-p) sample inside the CUDA graphs: the same tokens as the eager sampler (FNVLLM_SAMPLE_IN_GRAPH=0), over
    two engine seeds, with overlapped steps; a batch with a top-p row without a top-k samples eagerly in both runs
    and agrees too; also with plans of several decode steps (``num_decode_steps``: sub-steps fed from the device
    one after another). The vocabulary spans 24 of the sampler's 4096-token chunks, so top-k rows up to 24 redraw
    in the graphs (``fused_sampling.graph_top_k_limit``)."""
    from fnvllm.executor.cuda_graphs import DecodeGraphs
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("vocab"), "qwen3", vocab_size=24 * 4096)

    plain = [
        SamplingParams(temperature=0.8, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.3, seed=5, max_tokens=12, ignore_eos=True),
    ] * 2
    top_k = [
        SamplingParams(temperature=0.9, top_k=20, top_p=0.95, max_tokens=13, ignore_eos=True),  # Qwen3's preset
        SamplingParams(temperature=0.7, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=5, min_p=0.05, seed=8, max_tokens=10, ignore_eos=True),
    ] * 2
    logprobs = [
        SamplingParams(temperature=0.8, logprobs=3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.6, top_k=10, top_p=0.9, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, logprobs=0, max_tokens=8, ignore_eos=True),
    ] * 2
    eager_only = [*plain[:-1], SamplingParams(temperature=0.9, top_p=0.8, max_tokens=10, ignore_eos=True)]
    staged = {"sampled": 0, "filtered": 0}
    stage = DecodeGraphs._stage_sample

    def counting(self: DecodeGraphs, host: Any, b: int, sample: Any) -> bool:
        sampled = stage(self, host, b, sample)
        staged["sampled"] += sampled
        staged["filtered"] += sampled and sample.top_k is not None
        return sampled

    monkeypatch.setattr(DecodeGraphs, "_stage_sample", counting)
    for seed in (0, 7):
        runs = []
        for in_graph in ("0", "1"):
            monkeypatch.setenv("FNVLLM_SAMPLE_IN_GRAPH", in_graph)
            llm = LLM(
                checkpoint, block_size=16, num_blocks=64, max_num_seqs=8, seed=seed, load_tokenizer=False,
                num_decode_steps=decode_steps,
            )  # fmt: skip
            graphs = llm.executor.graphs
            assert graphs is not None and (graphs.sampler is not None) == (in_graph == "1")
            before = dict(staged)
            batches = (plain, top_k, logprobs, eager_only)
            outs = [llm.generate(PROMPTS[:prompts], params[:prompts], use_tqdm=False) for params in batches]
            assert (staged["sampled"] > before["sampled"]) == (in_graph == "1"), "the graphs must sample"
            assert (staged["filtered"] > before["filtered"]) == (in_graph == "1"), "top-k rows must redraw there"
            runs.append([(o.token_ids, _logprob_values(o)) for batch in outs for o in batch])
            llm.close()
        assert runs[0] == runs[1]


def _logprob_values(output: Any) -> list[tuple[float, list[tuple[int, float]]]] | None:
    """Each token's (logprob, top (id, logprob) pairs) of a RequestOutput, None when it asked for none."""
    if output.logprobs is None:
        return None
    return [(entry.logprob, list(entry.top)) for entry in output.logprobs]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="pinned host memory and events need a GPU")
def test_pinned_ring_hands_a_buffer_out_once_until_released() -> None:
    """The samples' copy to the host reuses a ring buffer only after its step was read (or discarded): with every
    buffer held, a copy takes a fresh tensor; a second release of an old copy frees nothing that another holds."""
    import torch

    from fnvllm.executor.model_executor import HostCopy, PinnedRing

    ring = PinnedRing(max_rows=4, size=2)
    packed = [torch.tensor([[i, i + 1], [0, 0]], device="cuda") for i in range(4)]
    first, second = HostCopy.start([packed[0]], ring), HostCopy.start([packed[1]], ring)
    third = HostCopy.start([packed[2]], ring)
    assert third.ring_slot is None and first.ring_slot is not None and second.ring_slot is not None
    assert [t.tolist() for t in (*first.wait(), *second.wait(), *third.wait())] == [
        [[0, 1], [0, 0]],
        [[1, 2], [0, 0]],
        [[2, 3], [0, 0]],
    ]
    first.release()
    fourth = HostCopy.start([packed[3]], ring)
    assert fourth.ring_slot == first.ring_slot and fourth.wait()[0].tolist() == [[3, 4], [0, 0]]
    first.release()
    assert ring.owners[fourth.ring_slot[1]] is fourth, "a stale release leaves the new owner's buffer alone"


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="pinned host memory and events need a GPU")
def test_pinned_ring_holds_a_steps_logprobs_in_its_slot() -> None:
    """A step's logprob tensors travel in its ring slot's second buffer (no fresh pinned tensor) and arrive intact;
    tensors too large for it take fresh ones."""
    import torch

    from fnvllm.executor.model_executor import HostCopy, PinnedRing

    ring = PinnedRing(max_rows=4, size=2)
    packed = torch.tensor([[5, 6], [0, 0]], device="cuda")
    values, ids = torch.randn(2, 3, device="cuda"), torch.randint(0, 1000, (2, 3), device="cuda")
    sampled = torch.randn(2, device="cuda")
    copy = HostCopy.start([packed, values, ids, sampled], ring)
    assert copy.ring_slot is not None
    slot = copy.ring_slot[1]
    host = copy.wait()
    extra = ring.extras[slot]
    assert all(extra.data_ptr() <= t.data_ptr() < extra.data_ptr() + extra.numel() for t in host[1:])
    assert [t.cpu().tolist() for t in (values, ids, sampled)] == [t.tolist() for t in host[1:]]
    copy.release()
    big = torch.randn(4, 200, device="cuda")  # 3,200 bytes > the slot's 4 x 256
    other = HostCopy.start([packed, big], ring)
    inside = any(e.data_ptr() <= other.tensors[1].data_ptr() < e.data_ptr() + e.numel() for e in ring.extras)
    assert torch.equal(other.wait()[1], big.cpu()) and not inside
    other.release()


def test_decode_only_means_one_token_and_a_sample_per_row() -> None:
    """``is_decode_only`` (the CUDA-graph test) holds for one-token rows that all sample, and not for a step that
    mixes a zero-token and a two-token row (as many tokens as rows), nor for a row that does not sample."""
    from fnvllm.executor.inputs import is_decode_only
    from fnvllm.state import StepPlan

    plan = StepPlan(0, 4, ("a", "b"), ((7,), (8,)), (2, 5), ((0,), (1, 2)), (True, True))
    assert is_decode_only(plan)
    assert not is_decode_only(attrs.evolve(plan, input_tokens=((), (8, 9))))
    assert not is_decode_only(attrs.evolve(plan, sample=(True, False)))
    assert not is_decode_only(attrs.evolve(plan, input_tokens=((7, 8), (9,))))
