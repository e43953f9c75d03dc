"""Broken checkpoint folders: every missing or malformed file is an error naming the file and what is wrong with
it (never a bare JSONDecodeError / KeyError, never a placeholder tokenizer, never a network lookup); the CLI
reports them in one line with exit status 1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
from tiny_models import write_family

from fnvllm.config import EngineConfig
from fnvllm.engine.build import check_kv_cache_fits
from fnvllm.llm import LLM
from fnvllm.model.config import CheckpointError, ModelConfig
from fnvllm.state import InvalidConfigError, SamplingParams

OPTIONS: dict[str, Any] = dict(dtype="float32", num_blocks=32, block_size=8, device="cpu")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(tmp_path_factory.mktemp("ckpt"), "qwen3")


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of a working checkpoint folder, for one test to break."""
    return Path(shutil.copytree(pristine, tmp_path / "model"))


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_the_pristine_copy_loads(ckpt: Path) -> None:
    """The copy every other test breaks loads and generates (so each failure below is the breakage's)."""
    out = LLM(ckpt, **OPTIONS).generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].token_ids) == 2


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda c: c.update(hidden_size="64"), "hidden_size must be a positive int, got '64'"),
        (lambda c: c.update(hidden_size=True), "hidden_size must be a positive int, got True"),
        (lambda c: c.update(num_attention_heads=0), "num_attention_heads must be a positive int"),
        (lambda c: c.update(tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
        (lambda c: c.update(rms_norm_eps="1e-6"), "rms_norm_eps must be a positive number"),
        (lambda c: c.update(rope_parameters=[1]), "rope_parameters must be an object"),
        (lambda c: c.update(architectures="Qwen3ForCausalLM"), "architectures"),
        (lambda c: c.pop("vocab_size"), "missing required field 'vocab_size'"),
    ],
)
def test_malformed_config_json_names_file_and_field(ckpt: Path, edit: Callable[[Any], Any], needle: str) -> None:
    """A mistyped or missing config.json field is a CheckpointError naming config.json and the field."""
    _edit_json(ckpt / "config.json", edit)
    with pytest.raises(CheckpointError, match=r"config\.json") as error:
        LLM(ckpt, **OPTIONS)
    assert needle in str(error.value)


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("config.json", "{not json", "not valid JSON"),
        ("config.json", "[1, 2]", "expected a JSON object, got a JSON list"),
        ("generation_config.json", '{"eos_token_id": ', "not valid JSON"),
        ("generation_config.json", '{"eos_token_id": "x"}', "eos_token_id must be an int >= 0"),
        ("generation_config.json", '{"eos_token_id": [1, true]}', "eos_token_id must be an int >= 0"),
        ("model.safetensors.index.json", "{", "not valid JSON"),
        ("model.safetensors.index.json", '{"metadata": {}}', '"weight_map"'),
        ("model.safetensors.index.json", '{"weight_map": {"a": "../x"}}', "shard file names"),
        ("model.safetensors", "garbage", "not a readable safetensors file"),
    ],
)
def test_malformed_files_name_the_file(ckpt: Path, name: str, content: str, needle: str) -> None:
    """Unparseable config, generation config, shard index or weights are CheckpointErrors naming the file."""
    (ckpt / name).write_text(content)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as error:
        LLM(ckpt, **OPTIONS)
    assert needle in str(error.value)


def test_a_truncated_shard_is_named(ckpt: Path) -> None:
    """Weights cut short (a partial download) are a CheckpointError naming the shard."""
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        LLM(ckpt, **OPTIONS)


def test_no_tokenizer_files_is_an_error_not_a_placeholder(ckpt: Path) -> None:
    """Without tokenizer files the LLM refuses to guess (transformers would build a placeholder tokenizer with a
    different EOS id); load_tokenizer=False is the explicit token-id-only mode, with the checkpoint's EOS ids."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (ckpt / name).unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match=r"no tokenizer files.*load_tokenizer=False"):
        LLM(ckpt, **OPTIONS)
    llm = LLM(ckpt, load_tokenizer=False, **OPTIONS)
    assert llm.tokenizer is None
    assert llm.engine.config.eos_token_ids == {
        json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"]
    }


def test_a_tokenizer_name_that_is_not_a_folder_fails_fast(ckpt: Path) -> None:
    """A hub name is not looked up (offline by default): it is a FileNotFoundError at once, not a minute of
    network retries."""
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=r"tokenizer folder 'Qwen/Qwen3-0\.6B' does not exist"):
        LLM(ckpt, tokenizer="Qwen/Qwen3-0.6B", **OPTIONS)
    assert time.perf_counter() - start < 10
    with pytest.raises(TypeError, match="tokenizer must be a folder path"):
        LLM(ckpt, tokenizer=3, **OPTIONS)  # type: ignore[arg-type]


def test_a_kv_cache_larger_than_memory_is_refused_before_allocating(ckpt: Path) -> None:
    """num_blocks or cpu_kv_cache_gib beyond the machine's memory is an InvalidConfigError naming the option."""
    with pytest.raises(InvalidConfigError, match=r"cpu_kv_cache_gib=1048576.*does not fit"):
        LLM(ckpt, dtype="float32", device="cpu", cpu_kv_cache_gib=2**20)
    with pytest.raises(InvalidConfigError, match=r"num_blocks=16777216.*does not fit"):
        LLM(ckpt, dtype="float32", device="cpu", num_blocks=2**24, block_size=4096)


def test_a_cpu_kv_cache_below_one_block_is_refused(ckpt: Path) -> None:
    """cpu_kv_cache_gib smaller than one KV block is an InvalidConfigError at build (it made a 1-block pool that
    refused every real request)."""
    with pytest.raises(InvalidConfigError, match=r"^EngineConfig\.cpu_kv_cache_gib=1e-09: less than one KV block"):
        LLM(ckpt, dtype="float32", device="cpu", cpu_kv_cache_gib=1e-9)


def test_tensor_parallel_ranks_share_the_hosts_memory(ckpt: Path) -> None:
    """On the CPU each rank takes cpu_kv_cache_gib in the one host's memory: three quarters of it fits one rank but
    not two, refused before any worker starts."""
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    config = EngineConfig(device="cpu", tensor_parallel_size=2, cpu_kv_cache_gib=0.75 * ram_gib, dtype="float32")
    model = ModelConfig.from_pretrained(ckpt, dtype="float32")
    with pytest.raises(InvalidConfigError, match=r"cpu_kv_cache_gib=.*does not fit"):
        check_kv_cache_fits(config, model)
    check_kv_cache_fits(attrs.evolve(config, tensor_parallel_size=1), model)  # one rank fits


def test_cli_reports_a_broken_checkpoint_in_one_line(ckpt: Path) -> None:
    """``fnvllm generate`` on a broken checkpoint prints one line naming the file and exits 1; ``--debug`` after
    the subcommand shows the traceback instead."""
    (ckpt / "config.json").write_text("{oops")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "fnvllm.cli", "generate", str(ckpt), "hello"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, check=False)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, result.stderr
    assert len(lines) == 1 and "config.json" in lines[0] and "not valid JSON" in lines[0], result.stderr
    debug = subprocess.run([*command, "--debug"], capture_output=True, text=True, timeout=180, env=env, check=False)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_a_penalty_buffer_larger_than_memory_is_refused_at_build(tmp_path: Path) -> None:
    """max_num_seqs x max_model_len int32 tokens (the penalties' per-slot buffer, made at the first penalised
    request on the CPU) beyond the host's memory is refused when the LLM is built, naming both options."""
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "long", "qwen3", max_position_embeddings=2**21, config_only=True)
    with pytest.raises(InvalidConfigError, match=r"^EngineConfig\.max_num_seqs x max_model_len: .* 512\.0 GiB"):
        LLM(path, load_format="dummy", load_tokenizer=False, device="cpu", max_num_seqs=65536, num_blocks=64)
