"""Train the embedded demo model: ``python -m fnvllm.demo.train`` (the recipe is ``fnvllm/demo/README.md``).

A Hugging Face ``Qwen3ForCausalLM`` is trained from scratch on the standard-library corpus of
``fnvllm.demo.data`` (random windows of ``context_len`` tokens, AdamW, linear warmup then cosine decay, bf16
autocast) and saved with ``save_pretrained`` in bf16, so the result is an ordinary checkpoint folder: config.json,
model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json. Beside them go ``loss.png`` (the
loss curve) and ``train_log.json`` (the options, every step's loss, the held-out evaluations and the wall time).

Everything is seeded (file split, tokenizer, initialisation, batch sampling); the number of steps is fixed, never a
time budget, so a rerun on the same Python and torch versions retrains the same model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import mean
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from fnvllm.demo import data


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The recipe: data seed, model shape, optimisation. Each field is also a ``--flag`` of the script."""

    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 5
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 640
    context_len: int = 512
    batch_size: int = 16
    steps: int = 2400
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 40
    eval_windows: int = 48
    threads: int = 2
    device: str = "auto"


@dataclasses.dataclass
class TrainLog:
    """What happened: per-step training loss, (step, held-out loss) pairs, tokens per byte, seconds taken."""

    config: dict[str, Any]
    train_loss: list[float] = dataclasses.field(default_factory=list)
    held_out: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    num_train_tokens: int = 0
    num_held_out_tokens: int = 0
    held_out_bytes_per_token: float = 0.0
    seconds: float = 0.0
    versions: dict[str, str] = dataclasses.field(default_factory=dict)


def build_model(cfg: TrainConfig, tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    """A freshly initialised Qwen3 of the recipe's shape, its vocab and EOS taken from ``tokenizer``."""
    eos = tokenizer.eos_token_id
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.context_len,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return Qwen3ForCausalLM(config)


def lr_scale(step: int, cfg: TrainConfig) -> float:
    """Multiplier of ``peak_lr`` at ``step``: linear warmup, then cosine down to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def sample_batch(stream: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """``batch_size`` windows of ``context_len`` tokens at random offsets of the training stream."""
    starts = torch.randint(0, len(stream) - cfg.context_len, (cfg.batch_size,), generator=gen)
    return torch.stack([stream[s : s + cfg.context_len] for s in starts.tolist()])  # (batch, context_len)


def held_out_windows(stream: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """``eval_windows`` non-overlapping windows spread evenly over the held-out stream (the same every time)."""
    num_windows = len(stream) // cfg.context_len
    picks = torch.linspace(0, num_windows - 1, min(cfg.eval_windows, num_windows)).long()
    return stream[: num_windows * cfg.context_len].view(num_windows, cfg.context_len)[picks]


@torch.no_grad()
def evaluate(model: Qwen3ForCausalLM, windows: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean next-token loss (nats) over the held-out windows."""
    model.eval()  # type: ignore[no-untyped-call]
    losses = []
    for chunk in windows.split(cfg.batch_size):  # type: ignore[no-untyped-call]
        chunk = chunk.to(cfg.device)
        with torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16):
            losses.append(float(model(input_ids=chunk, labels=chunk).loss.item()))
    model.train()
    return sum(losses) / len(losses)


def make_optimizer(model: Qwen3ForCausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=(0.9, 0.95), eps=1e-8)


def train_step(model: Qwen3ForCausalLM, opt: torch.optim.AdamW, batch: torch.Tensor, cfg: TrainConfig) -> float:
    """One optimizer step on ``batch``; returns its loss."""
    batch = batch.to(cfg.device)
    with torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


def run_training(model: Qwen3ForCausalLM, train: torch.Tensor, held_out: torch.Tensor, log: TrainLog) -> None:
    """The training loop: ``steps`` steps, held-out evaluation every ``eval_every`` and at the end."""
    cfg = TrainConfig(**log.config)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = make_optimizer(model, cfg)
    windows = held_out_windows(held_out, cfg)
    start = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = cfg.peak_lr * lr_scale(step, cfg)
        log.train_loss.append(train_step(model, opt, sample_batch(train, cfg, gen), cfg))
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            log.held_out.append((step + 1, evaluate(model, windows, cfg)))
            elapsed = time.perf_counter() - start
            print(
                f"step {step + 1}/{cfg.steps}  train {mean(log.train_loss[-10:]):.3f}  "
                f"held-out {log.held_out[-1][1]:.3f}  {elapsed:.0f} s",
                flush=True,
            )
    log.seconds = time.perf_counter() - start


def save(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, log: TrainLog) -> None:
    """Write the checkpoint folder (bf16 safetensors + tokenizer), ``train_log.json`` and ``loss.png``."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)  # type: ignore[arg-type]
    tokenizer.save_pretrained(out)
    make_portable(out)
    (out / "train_log.json").write_text(json.dumps(dataclasses.asdict(log), indent=1) + "\n")
    plot_loss(log, out / "loss.png")


def make_portable(out: Path) -> None:
    """Make the folder readable by transformers 4.x as well as 5.x (``pyproject`` allows both).

    transformers 5 writes ``tokenizer_class: TokenizersBackend``, the chat template in ``chat_template.jinja`` and
    only ``rope_parameters``/``dtype`` in config.json; 4.x knows ``PreTrainedTokenizerFast``, reads the template
    from tokenizer_config.json and wants ``rope_theta``/``torch_dtype``. Both spellings are written."""
    tok_file, jinja = out / "tokenizer_config.json", out / "chat_template.jinja"
    tok_config = json.loads(tok_file.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if jinja.exists():
        tok_config["chat_template"] = jinja.read_text()
        jinja.unlink()
    tok_file.write_text(json.dumps(tok_config, indent=2) + "\n")
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    config.setdefault("torch_dtype", config.get("dtype", "bfloat16"))
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    for file in out.iterdir():
        file.chmod(0o644)  # save_pretrained writes safetensors as 0600; package data must be world-readable


def plot_loss(log: TrainLog, path: Path) -> None:
    """The loss curve: training loss per step (and its 20-step mean) and held-out loss, in nats per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = range(1, len(log.train_loss) + 1)
    ax.plot(steps, log.train_loss, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (per step)")
    smooth = [mean(log.train_loss[max(0, i - 19) : i + 1]) for i in range(len(log.train_loss))]
    ax.plot(steps, smooth, color="tab:blue", label="train (20-step mean)")
    ax.plot(*zip(*log.held_out, strict=True), "o-", color="tab:orange", label="held-out files")
    ax.set(xlabel="step", ylabel="loss (nats/token)", ylim=(0, 9), title="fnvllm demo model on the Python stdlib")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> tuple[TrainConfig, Path, Path | None]:
    """The recipe from ``--flags`` (one per ``TrainConfig`` field), the output folder and the corpus folder."""
    from fnvllm.demo import model_path

    parser = argparse.ArgumentParser(prog="python -m fnvllm.demo.train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the shipped checkpoint)")
    parser.add_argument(
        "--corpus-dir", type=Path, default=None, help="folder of the *.py corpus (default: this Python's stdlib)"
    )
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(field.default), default=field.default, help=f"default {field.default}")
    args = vars(parser.parse_args(argv))
    out = args.pop("out") or model_path(must_exist=False)
    corpus = args.pop("corpus_dir")
    return TrainConfig(**args), out, corpus


def main(argv: Sequence[str] | None = None) -> None:
    """Prepare the data, train, evaluate, save."""
    cfg, out, corpus = parse_args(argv)
    if cfg.device == "auto":
        cfg = dataclasses.replace(cfg, device="cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    train_files, held_out_files = data.split_files(cfg.seed, corpus)
    train_texts, held_out_texts = data.read_texts(train_files), data.read_texts(held_out_files)
    tokenizer = data.train_tokenizer(train_texts, cfg.vocab_size)
    train = torch.tensor(data.encode_documents(tokenizer, train_texts))
    held_out = torch.tensor(data.encode_documents(tokenizer, held_out_texts))
    log = TrainLog(config=dataclasses.asdict(cfg), num_train_tokens=len(train), num_held_out_tokens=len(held_out))
    log.held_out_bytes_per_token = sum(len(t.encode()) for t in held_out_texts) / len(held_out)
    log.versions = {"python": platform.python_version(), "torch": torch.__version__, "corpus": str(corpus or "stdlib")}
    print(f"{len(train_files)} train files ({len(train)} tokens), {len(held_out_files)} held out ({len(held_out)})")
    model = build_model(cfg, tokenizer).to(cfg.device)  # type: ignore[arg-type]
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; writing to {out}", flush=True)
    run_training(model, train, held_out, log)
    save(model.cpu(), tokenizer, out, log)
    print(f"done in {log.seconds:.0f} s: final held-out loss {log.held_out[-1][1]:.3f} nats/token")


if __name__ == "__main__":
    main()
