"""Absurd simulator inputs are refused at the boundary: one line on stderr, exit code 2, naming the field and its
allowed range, before anything is allocated (issue 17)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fnvllm.cli import main
from fnvllm.sim import H200, HardwareProfile, SimSpec, load_profile
from fnvllm.sim.checks import SimInputError
from fnvllm.sim.model import ModelShape, load_shape

QUICK = ["--no-progress", "--num-requests", "5", "--num-blocks", "200"]


def _refused(capsys: pytest.CaptureFixture[str], args: list[str], *needles: str) -> str:
    """Run ``fnvllm simulate ARGS``; assert exit 2 and one stderr line holding every needle; return the line."""
    code = main(["simulate", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("fnvllm simulate: error:"), err
    for needle in needles:
        assert needle in err[0], err[0]
    return err[0]


def _trace(tmp_path: Path, **record: object) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"arrival_s": 0.0, "prompt_len": 10, "output_len": 5, **record}) + "\n")
    return str(path)


def _profile(tmp_path: Path, **fields: object) -> str:
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({**H200.to_dict(), **fields}))
    return str(path)


@pytest.mark.parametrize("prompt_len", [10**12, 0, "fast", 10.5, True])
def test_trace_with_an_absurd_prompt_len_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], prompt_len: object
) -> None:
    """A trace line whose prompt_len is huge, zero, a string, fractional or a bool names the line and field."""
    _refused(capsys, ["--workload", _trace(tmp_path, prompt_len=prompt_len), *QUICK], "trace line 1", "prompt_len")


def test_trace_with_a_non_finite_arrival_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An infinite arrival time (JSON Infinity) is refused instead of jumping the clock to infinity."""
    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_s": Infinity, "prompt_len": 10, "output_len": 5}\n')
    _refused(capsys, ["--workload", str(path), *QUICK], "arrival_s", "[0, ")


def test_trace_request_longer_than_max_model_len_fails_before_simulating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A request that can never fit is named with its trace line before the run starts."""
    trace = _trace(tmp_path, prompt_len=900, output_len=200)
    _refused(capsys, ["--workload", trace, "--max-model-len", "1024", *QUICK], "line 1", "exceeds max_model_len (1024)")


def test_a_request_larger_than_the_pool_fails_before_simulating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A request within max_model_len but larger than the KV pool is named, with --num-blocks, before the run: no
    step reaches the timeline (it was refused when it arrived, mid-run, naming neither)."""
    trace = _trace(tmp_path, prompt_len=100, output_len=10)
    timeline = tmp_path / "steps.jsonl"
    args = ["--workload", trace, "--timeline", str(timeline), *QUICK, "--num-blocks", "4"]  # the last one counts
    _refused(capsys, args, "100 prompt + 10 output tokens", "needs 7 KV blocks of 16", "(--num-blocks)")
    assert timeline.read_text() == ""


def test_a_huge_num_requests_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--num-requests 10**12 names the flag and its range instead of running out of memory."""
    _refused(capsys, ["--num-requests", str(10**12), "--no-progress"], "--num-requests", "[1, 10000000]")


@pytest.mark.parametrize("bandwidth", [0, -4000.0, "fast", float("nan"), float("inf"), None])
def test_a_profile_with_a_bad_bandwidth_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bandwidth: object
) -> None:
    """Zero, negative (which used to print a plausible report), NaN, infinite or string bandwidths are refused."""
    _refused(capsys, ["--hardware", _profile(tmp_path, mem_bandwidth_gbs=bandwidth), *QUICK], "mem_bandwidth_gbs")


def test_a_profile_with_a_negative_overhead_or_unknown_nested_key_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A negative fitted overhead, or a misspelt overhead name, is named."""
    eager = {**H200.to_dict()["eager"], "step_us": -1.0}
    _refused(capsys, ["--hardware", _profile(tmp_path, eager=eager), *QUICK], "step_us", "[0, ")
    eager = {**H200.to_dict()["eager"], "stepus": 1.0}
    _refused(capsys, ["--hardware", _profile(tmp_path, eager=eager), *QUICK], "stepus")


def test_a_profile_that_is_not_an_object_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A JSON list where a profile object belongs is one line, not a TypeError."""
    (tmp_path / "hw.json").write_text("[1, 2]")
    _refused(capsys, ["--hardware", str(tmp_path / "hw.json"), *QUICK], "hardware profile")


def test_old_profiles_without_new_fields_still_load(tmp_path: Path) -> None:
    """A profile written before fields were added loads with their defaults."""
    data = H200.to_dict()
    data.pop("calibrated_from")
    del data["eager"]["gap_seq_us"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_profile(tmp_path / "old.json").eager.gap_seq_us == 0.0


@pytest.mark.parametrize(
    ("key", "value"), [("num_attention_heads", 0), ("num_key_value_heads", 0), ("hidden_size", "big")]
)
def test_a_model_config_with_zero_heads_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: object
) -> None:
    """A config.json with 0 heads (a ZeroDivisionError before) or a string size names the key."""
    config = {**load_shape("qwen3-0.6b").to_config(), key: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _refused(capsys, ["--model-shape", str(tmp_path / "config.json"), *QUICK], key)


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--block-size", "0", "--block-size must be an int in [1, "),
        ("--num-blocks", "0", "--num-blocks must be None or an int in [1, "),
        ("--gpu-memory-utilization", "5", "--gpu-memory-utilization must be a number in (0, 1]"),
        ("--len-sigma", "1e6", "--len-sigma must be a number in [0, 10]"),
        ("--rate", "nan", "--rate must be a number in (0, "),
        ("--eos-prob", "1", "--eos-prob must be a number in [0, 1)"),
    ],
)
def test_bad_numeric_flags_are_refused(capsys: pytest.CaptureFixture[str], flag: str, value: str, needle: str) -> None:
    """Each flag out of range (zero block size, 0 blocks read as 'unset' before, 500% memory) names itself."""
    args = ["--no-progress", "--num-requests", "5", flag, value]
    _refused(capsys, args, needle)


def test_a_profile_memory_that_sizes_too_many_blocks_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A profile with 1e6 GiB of memory would size a pool of billions of blocks: refused before allocation."""
    path = _profile(tmp_path, memory_gib=1e6)
    _refused(capsys, ["--hardware", path, "--block-size", "1", "--no-progress", "--num-requests", "5"], "memory_gib")


@pytest.mark.parametrize(
    ("text", "suffix", "needle"),
    [
        ("rate: [1, 2\npolicy: fcfs\n", "yaml", "not valid YAML"),
        ("- 1\n- 2\n", "yaml", "a grid is a mapping"),
        ("{1: [1, 2]}\n", "yaml", "keys"),
        ('{"rate": []}', "json", "empty list"),
        ('{"rate": [1, "fast"]}', "json", "rate='fast'"),
        ('{"rate": [1, 2], "num_requests": {"a": 1}}', "json", "num_requests"),
        (
            '{"seed": ' + json.dumps(list(range(200))) + ', "rate": ' + json.dumps(list(range(1, 101))) + "}",
            "json",
            "10000 points",
        ),
        ('{"rate": 1,', "json", "not valid JSON"),
    ],
)
def test_malformed_sweep_grids_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, suffix: str, needle: str
) -> None:
    """Unparsable YAML/JSON, non-mappings, non-str keys, empty axes, bad values and huge grids are one line."""
    path = tmp_path / f"grid.{suffix}"
    path.write_text(text)
    _refused(capsys, ["sweep", str(path), "--workers", "1"], needle)


def test_sweep_workers_must_be_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--workers -1 names the flag."""
    (tmp_path / "g.json").write_text('{"rate": [1, 2]}')
    _refused(capsys, ["sweep", str(tmp_path / "g.json"), "--workers", "-1"], "--workers")


def test_a_timeline_with_a_string_time_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """calibrate names the line and field of a record whose gpu_ms is not a number."""
    record = {
        "num_seqs": 1,
        "num_tokens": 1,
        "num_decode_seqs": 1,
        "num_prefill_tokens": 0,
        "context_tokens": 5,
        "gpu_ms": "fast",
        "graph": True,
    }
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"model": load_shape("qwen3-0.6b").to_config()}) + "\n" + json.dumps(record) + "\n")
    _refused(capsys, ["calibrate", str(path)], "line 2", "gpu_ms")


def test_value_objects_check_their_fields() -> None:
    """HardwareProfile, ModelShape and SimSpec refuse bad values when built directly, too."""
    with pytest.raises(SimInputError, match="matmul_tflops"):
        HardwareProfile("x", mem_bandwidth_gbs=1.0, matmul_tflops=-1.0, memory_gib=1.0)
    with pytest.raises(SimInputError, match="q_heads"):
        ModelShape("m", hidden=8, layers=1, q_heads=0, kv_heads=1, head_dim=8, intermediate=8, vocab=8)
    with pytest.raises(TypeError, match="num_requests"):
        SimSpec(num_requests="many")  # type: ignore[arg-type]
