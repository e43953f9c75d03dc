"""The embedded demo model: a tiny Qwen3 that writes Python, shipped inside the package.

``model_path()`` is its folder, an ordinary Hugging Face checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), so ``LLM(model_path())`` loads it through the same loader as any other checkpoint. It was
trained by ``python -m fnvllm.demo.train`` on Python's standard-library sources; ``fnvllm/demo/README.md`` has the
recipe, the loss curve and the held-out loss.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

CHECKPOINT_DIR = "checkpoint"


def model_path(must_exist: bool = True) -> Path:
    """The folder of the shipped demo checkpoint.

    Raises FileNotFoundError when ``must_exist`` and the package was installed without its data (no config.json).
    """
    path = Path(str(resources.files(__package__).joinpath(CHECKPOINT_DIR)))
    if must_exist and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo model is missing from {path}: reinstall fnvllm with its package data, "
            "or retrain it with `python -m fnvllm.demo.train`"
        )
    return path
