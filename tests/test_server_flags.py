"""`fnvllm serve`'s engine flags come from ``EngineConfig`` (the same mechanism as generate and demo): every field
is a flag, validated once by ``EngineConfig``; and ``--tensor-parallel-size 2`` really serves (the engine process
may start its tensor-parallel workers)."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("uvicorn", reason="the server needs the [serve] extra")
httpx = pytest.importorskip("httpx", reason="installed with openai")

from tiny_models import write_family  # noqa: E402

from fnvllm.cli import build_parser, main  # noqa: E402
from fnvllm.cli._common import engine_options  # noqa: E402
from fnvllm.config import EngineConfig  # noqa: E402
from fnvllm.llm import LLM  # noqa: E402
from fnvllm.serve.server_process import ServerProcess  # noqa: E402
from fnvllm.state import SamplingParams  # noqa: E402

ENGINE = ["--dtype", "float32", "--device", "cpu", "--attention-backend", "torch", "--num-blocks", "64"]


def test_every_engine_config_field_is_a_serve_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """`fnvllm serve --help` lists a flag for every EngineConfig field, tensor parallelism included."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    renamed = {"seed": "--engine-seed", "enable_prefix_caching": "--no-prefix-caching"}
    renamed["overlap_steps"] = "--no-overlap-steps"
    for field in attrs.fields(EngineConfig):
        assert renamed.get(field.name, "--" + field.name.replace("_", "-")) in text, field.name
    assert "--tensor-parallel-size" in text and "--model-ops" in text and "--distributed-timeout-s" in text


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--tensor-parallel-size", "0"], "tensor_parallel_size"),
        (["--distributed-timeout-s", "-1"], "distributed_timeout_s"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    ],
)
def test_a_bad_engine_flag_exits_2_naming_the_field(
    flags: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An out-of-range engine flag is refused by EngineConfig's own check: exit 2, one line naming the field."""
    code = main(["serve", str(tmp_path / "no-such-model"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and named in err, err


def test_a_bad_choice_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    """A value outside an EngineConfig Literal's choices (``--device tpu``) exits 2 with one line."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "--device", "tpu"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--device" in err and err.count("\n") == 1


def test_older_flag_spellings_still_work() -> None:
    """``--seed`` and ``--no-overlap`` (the serve flags before they were derived) set the same fields."""
    args = build_parser().parse_args(["serve", "--seed", "7", "--no-overlap"])
    options = engine_options(args)
    assert options["seed"] == 7 and options["overlap_steps"] is False
    defaults = engine_options(build_parser().parse_args(["serve"]))
    assert defaults["seed"] == 0 and defaults["overlap_steps"] is True


def test_serve_with_tensor_parallelism_matches_offline(tmp_path: Path) -> None:
    """`fnvllm serve --tensor-parallel-size 2` (CPU, gloo) answers a greedy completion equal to offline generation."""
    checkpoint = write_family(tmp_path, "qwen3")
    prompt = [5, 9, 13, 200, 7, 42, 42, 11]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(checkpoint, dtype="float32", device="cpu", attention_backend="torch", num_blocks=64) as llm:
        ids = llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids
        expected = [llm.tokenizer.decode([token]) for token in ids]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    args = [str(checkpoint), *ENGINE, "--tensor-parallel-size", "2"]
    with ServerProcess(args, tmp_path / "server.log", env=env) as server:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        tokens = response.json()["choices"][0]["logprobs"]["tokens"]
        assert server.terminate() == 0, server.log()[-3000:]
    assert tokens == expected
