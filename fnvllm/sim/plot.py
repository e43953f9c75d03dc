"""Plots of a simulation and of a sweep (matplotlib, an optional extra: ``pip install 'fnvllm[sim]'``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fnvllm.sim.metrics import request_latencies
from fnvllm.sim.recorder import Recorder

_MAX_POINTS = 20_000  # longer series are strided down before plotting


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend; ValueError with the install hint if it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'fnvllm[sim]'") from None
    return plt


def _strided(values: Sequence[float]) -> list[float]:
    stride = max(len(values) // _MAX_POINTS, 1)
    return list(values[::stride])


def _cdf(ax: Any, values: list[float], label: str) -> None:
    clean = sorted(v * 1e3 for v in values if not math.isnan(v))
    if clean:
        ax.plot(clean, [(i + 1) / len(clean) for i in range(len(clean))], label=label)


def plot_run(rec: Recorder, path: str | Path, title: str = "") -> None:
    """Four panels over simulated time: KV usage, running / waiting requests, tokens per step; and the latency
    CDFs (TTFT, TPOT, end-to-end)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    t = _strided(rec.step_end)
    (kv, queues), (tokens, cdf) = axes
    kv.plot(t, [b / rec.num_blocks * 100 for b in _strided(rec.kv_blocks)])
    kv.set(xlabel="simulated time (s)", ylabel="KV blocks in use (%)", title="KV cache usage")
    queues.plot(t, _strided(rec.num_running), label="running")
    queues.plot(t, _strided(rec.num_waiting), label="waiting")
    queues.set(xlabel="simulated time (s)", ylabel="requests", title="requests")
    queues.legend()
    tokens.plot(t, _strided(rec.num_tokens), linewidth=0.5)
    tokens.set(xlabel="simulated time (s)", ylabel="tokens", title="tokens per step")
    latencies = request_latencies(rec)
    for name in ("ttft", "tpot", "e2e"):
        _cdf(cdf, latencies[name], name.upper())
    cdf.set(xscale="log", xlabel="latency (ms)", ylabel="fraction of requests", title="latency CDFs")
    cdf.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(rows: Sequence[Mapping[str, Any]], axes: Sequence[str], metric: str, x: str, path: str | Path) -> None:
    """``metric`` against axis ``x``, one line per combination of the other axes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    others = [a for a in axes if a != x]
    lines: dict[tuple[Any, ...], list[tuple[Any, float]]] = {}
    for row in rows:
        if metric in row:
            lines.setdefault(tuple(row[a] for a in others), []).append((row[x], row[metric]))
    for key, points in lines.items():
        label = ", ".join(f"{a}={v}" for a, v in zip(others, key, strict=True)) or metric
        xs, ys = zip(*sorted(points, key=lambda p: p[0]), strict=True)
        ax.plot(xs, ys, marker="o", label=label)
    ax.set(xlabel=x, ylabel=metric, title=f"{metric} across the grid")
    if lines:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
