"""The table ``tp_profile.py`` prints last: the link, the per-step breakdown at TP=1 and TP=2, the agreement
diagnosis (margins at the first difference) and the bench pair. Reads the stages' JSON files from ``out_dir``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

PROFILE_ROWS = (  # (label, where in a profile record)
    ("step wall (rank 0, host)", ("wall_ms",)),
    ("  outside execute: schedule+commit+routing", ("host_ms", "outside")),
    ("  send: pickle + post the plan", ("host_ms", "send")),
    ("  forward: prepare + copies + graph launch", ("host_ms", "forward")),
    ("  logits: LM head + gather launch", ("host_ms", "logits")),
    ("  sample: sampling inputs + launch", ("host_ms", "sample")),
    ("  wait: until the tokens are computed", ("host_ms", "wait")),
    ("  rest: token copy, logprobs", ("host_ms", "rest")),
    ("GPU forward (graph replay, incl. all-reduces)", ("gpu_ms", "replay")),
    ("GPU logits (LM head + gather + concat)", ("gpu_ms", "logits")),
    ("GPU sampling", ("gpu_ms", "sample")),
    ("GPU step (forward start -> sample end)", ("gpu_ms", "step")),
    ("device idle per step (wall - GPU step)", ("gpu_ms", "idle")),
    ("rank 0: post -> logits launched", ("rank0_post_to_launched_ms",)),
    ("worker: post -> plan unpickled", ("worker", "delivery")),
    ("worker: post -> logits launched", ("worker", "launched")),
)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (None when equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def compare(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """How ``other``'s greedy run differs from the reference's (both with top-2 logprobs per position)."""
    margins, to_second, max_diff = [], 0, 0.0
    for r_ids, r_top, o_ids, o_top in zip(ref["tokens"], ref["top"], other["tokens"], other["top"], strict=True):
        j = first_difference(r_ids, o_ids)
        for k in range(len(r_ids) if j is None else j):  # same context so far: compare the numbers themselves
            max_diff = max(max_diff, abs(r_top[k][0][1] - o_top[k][0][1]))
        if j is not None:
            margins.append(r_top[j][0][1] - r_top[j][1][1])
            to_second += o_ids[j] == r_top[j][1][0]
    return {
        "prompts": len(ref["tokens"]),
        "identical": len(ref["tokens"]) - len(margins),
        "margins": margins,
        "to_second": to_second,
        "max_logprob_diff": max_diff,
    }


def explained(c: dict[str, Any], tolerance: float) -> float:
    """Fraction of prompts identical, or first differing where the reference's top-2 margin < ``tolerance``."""
    return (c["identical"] + sum(m < tolerance for m in c["margins"])) / c["prompts"]


def _margin_text(c: dict[str, Any]) -> str:
    m = sorted(c["margins"])
    if not m:
        return "no differences"
    p90 = m[min(len(m) - 1, int(0.9 * len(m)))]
    return f"margin at 1st difference: median {statistics.median(m):.4f}, p90 {p90:.4f}, max {m[-1]:.4f} nats"


def _agreement_rows(tp1: dict[str, Any] | None, tp2: dict[str, Any] | None, tolerance: float) -> list[tuple[str, str]]:
    if tp1 is None:
        return [("agreement", "no TP=1 reference")]
    rows, self_c = [], compare(tp1["greedy"], tp1["greedy_by_8"])
    calibrated = max(self_c["margins"], default=0.0)
    rows.append(
        (
            "TP=1 vs itself, 8 prompts per batch",
            f"{self_c['identical']}/{self_c['prompts']} identical; "
            f"{_margin_text(self_c)}; max |d top-1 logprob| before it {self_c['max_logprob_diff']:.4f}",
        )
    )
    if tp2 is None:
        return rows
    c = compare(tp1["greedy"], tp2["greedy"])
    shape = f"{c['prompts']} prompts x {len(tp1['greedy']['tokens'][0])} tokens"
    share = c["identical"] / c["prompts"]
    rows.append((f"TP=2 vs TP=1 ({shape})", f"{c['identical']}/{c['prompts']} identical ({share:.1%}; target 95 %)"))
    rows.append(("  where they differ", f"{_margin_text(c)}; TP=2 took TP=1's 2nd choice in {c['to_second']}"))
    rows.append(
        (
            "  max |d top-1 logprob| before the difference",
            f"{c['max_logprob_diff']:.4f} nats (TP=1 vs itself: {self_c['max_logprob_diff']:.4f})",
        )
    )
    rows.append((f"  identical or near-tie < {tolerance} nats (fixed)", f"{explained(c, tolerance):.1%}"))
    if calibrated > 0:
        label = f"  identical or near-tie < {calibrated:.4f} (TP=1 vs itself: largest flipping margin)"
        rows.append((label, f"{explained(c, calibrated):.1%}"))
    return rows


def _lookup(record: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = record
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _with_workers(profile: dict[str, Any]) -> dict[str, Any]:
    """The profile with the first worker's sums turned into ms per step."""
    workers = profile.get("workers")
    if not workers or not workers[0]["steps"]:
        return profile
    w = workers[0]
    per = 1e3 / w["steps"]
    launched = (w["delivery_s"] + w["execute_s"]) * per
    return {**profile, "worker": {"delivery": round(w["delivery_s"] * per, 3), "launched": round(launched, 3)}}


def _profile_rows(tp1: dict[str, Any] | None, tp2: dict[str, Any] | None) -> list[tuple[str, str]]:
    runs = {tp: {p["batch"]: _with_workers(p) for p in r["profiles"]} for tp, r in ((1, tp1), (2, tp2)) if r}
    rows = []
    for batch in sorted({b for profiles in runs.values() for b in profiles}):
        rows.append((f"-- decode step, batch {batch} (ms/step)", "TP=1 | TP=2"))
        for label, path in PROFILE_ROWS:
            cells = [_lookup(runs.get(tp, {}).get(batch, {}), path) for tp in (1, 2)]
            if any(c is not None for c in cells):
                rows.append((label, " | ".join("-" if c is None else f"{c:.3f}" for c in cells)))
        walls = [_lookup(runs.get(tp, {}).get(batch, {}), ("wall_ms",)) for tp in (1, 2)]
        if all(walls):
            rows.append(("TP=1 / TP=2 step time", f"{walls[0] / walls[1]:.2f}x (1.7x target; 2x ideal)"))
    workers = [p.get("workers") for r in runs.values() for p in r.values() if p.get("workers")]
    if workers:
        rows.append(("worker replays CUDA graphs", str(workers[0][0].get("graphs"))))
    return rows


def _comm_rows(comm: dict[str, Any] | None) -> list[tuple[str, str]]:
    if comm is None:
        return []
    rows = [("peer access GPU0 <-> GPU1", str(comm["peer_access"]))]
    n = comm["all_reduces_per_step"]
    for r in comm["rows"]:
        graph = r.get("graph_all_reduce_us")
        in_graph = f", in a graph {graph:.1f} us (x{n} = {graph * n / 1e3:.2f} ms/step)" if graph else ""
        rows.append((f"all-reduce ({r['batch']}, hidden)", f"eager {r['all_reduce_us']:.1f} us{in_graph}"))
        rows.append(
            (
                f"logits to rank 0 ({r['batch']}, V/2) = {r['logits_mb']} MB",
                f"gather {r['gather_logits_us']:.1f} us, all-gather {r['all_gather_logits_us']:.1f} us",
            )
        )
    return rows


def _bench_rows(out_dir: Path) -> list[tuple[str, str]]:
    rates = {}
    for tp in (1, 2):
        log = out_dir / f"bench_tp{tp}.log"
        lines = (
            [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("{")] if log.exists() else []
        )
        if lines:
            rates[tp] = json.loads(lines[-1])["tok_per_s"]
    rows = [(f"bench qwen3 TP={tp}", f"{rate:,.1f} tok/s") for tp, rate in rates.items()]
    if len(rates) == 2:
        rows.append(("bench TP=2 / TP=1", f"{rates[2] / rates[1]:.2f}x (target >= 1.7x)"))
    return rows


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def report(out_dir: Path, notes: dict[str, str | None], tolerance: float) -> int:
    """Print the table; 0 when every stage ran."""
    comm, tp1, tp2 = (_load(out_dir / f"{name}.json") for name in ("comm", "tp1", "tp2"))
    rows = [(f"stage {k}", v) for k, v in notes.items() if v is not None]
    for tp, r in ((1, tp1), (2, tp2)):
        if r:
            rows.append((f"TP={tp} LLM", f"built in {r['build_s']} s, backend {r['backend']}, graphs={r['graphs']}"))
    rows += _comm_rows(comm) + _profile_rows(tp1, tp2) + _agreement_rows(tp1, tp2, tolerance) + _bench_rows(out_dir)
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}} | {value}")
    failed = [k for k, v in notes.items() if k in ("comm", "tp1", "tp2", "bench1", "bench2") and v is not None]
    return 1 if failed else 0
