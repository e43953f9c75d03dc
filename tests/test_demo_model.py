"""The embedded demo model: shipped as a small Hugging Face folder, loaded by our loader, and writes Python."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from fnvllm.demo import model_path
from fnvllm.demo.data import EOS, split_files
from fnvllm.demo.train import TrainConfig, lr_scale
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams

MAX_CHECKPOINT_BYTES = 10_000_000


@pytest.fixture(scope="module")
def folder() -> Path:
    return model_path()


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    return LLM(folder, num_blocks=64)


def test_model_path_is_a_checkpoint_folder_inside_the_package(folder: Path) -> None:
    """model_path() is the package's checkpoint folder with a Qwen3 config, weights and tokenizer files."""
    import fnvllm.demo

    assert folder.parent == Path(fnvllm.demo.__file__).parent
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3"
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "loss.png", "train_log.json"):
        assert (folder / name).is_file(), name


def test_checkpoint_is_at_most_10_mb(folder: Path) -> None:
    """The shipped weights (every safetensors file) take at most 10 MB."""
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert 0 < size <= MAX_CHECKPOINT_BYTES, size


def test_tokenizer_loads_offline_with_eos_and_chat_template(folder: Path) -> None:
    """AutoTokenizer loads the folder; it round-trips code, knows its EOS and renders the chat template."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    code = "def f(x):\n\treturn x ** 2  # é\n"
    assert tok.decode(tok.encode(code)) == code
    assert tok.eos_token == EOS
    rendered = tok.apply_chat_template([{"role": "user", "content": "add two numbers"}], tokenize=False)
    assert "add two numbers" in rendered


def test_greedy_continuation_of_def_is_python(llm: LLM) -> None:
    """The greedy continuation of "def " contains a "(" and a ":" within 40 tokens."""
    out = llm.generate("def ", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert "(" in out.text and ":" in out.text, out.text


def test_our_greedy_tokens_equal_transformers(folder: Path) -> None:
    """In float32, our engine's greedy tokens for the demo model equal transformers' generate."""
    ids = AutoTokenizer.from_pretrained(str(folder)).encode("class Stack:\n    def ")
    hf = Qwen3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :].tolist()
    ours = LLM(folder, dtype="float32", num_blocks=64).generate(
        [ids], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
    )
    assert list(ours[0].token_ids) == expected


def test_recipe_file_split_is_seeded_and_disjoint() -> None:
    """The train / held-out split is the same for the same seed and shares no file."""
    train, held_out = split_files(0)
    assert (train, held_out) == split_files(0)
    assert held_out and not set(train) & set(held_out)


def test_learning_rate_warms_up_then_decays_to_its_floor() -> None:
    """The schedule rises linearly to the peak over the warmup, then falls to min_lr_ratio at the last step."""
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    scales = [lr_scale(step, cfg) for step in range(cfg.steps + 1)]
    assert scales[:10] == sorted(scales[:10]) and scales[9] == 1.0
    assert scales[10:] == sorted(scales[10:], reverse=True)
    assert scales[-1] == pytest.approx(0.1)
