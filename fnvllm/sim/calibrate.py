"""Calibration: fit a hardware profile's overheads to a measured per-step timeline.

For each kind of step (graph, eager) three linear models are fitted by box-constrained least squares
(``fit_bounded``): the roofline scales in [1, 1 / MIN_EFFICIENCY] (the kernels reach 30-100 % of the ceilings, so
device time stays a physical function of the work and carries to other model shapes), every other coefficient
>= 0 (host and gap costs are never negative):

    device:  gpu_us ~ scale * matmul_roofline_us + attn_scale * attention_roofline_us + step_us + seq_us * seqs
                      + log_seq_us * log2(seqs) + token_us * tokens   (relative error, overlapped steps; an
                                                         eager kind also gets a launch floor: device = max(that,
                                                         launch_us))
    host:    cpu_us ~ host_us + host_seq_us * seqs + host_new_seq_us * new_seqs + host_token_us * tokens
                      + host_sample_us * sampled        (on steps of an overlapped loop; where the device waited
                                                         for the host, the step's wall time instead of cpu_us)
    gap:     gap_us ~ gap_us + gap_seq_us * seqs + gap_new_seq_us * new_seqs + gap_token_us * tokens
                                                        (on steps of a plain loop)

With ``context_terms`` (off by default: see ``fit_profile``) host and gap also get a column per context token
(``host_context_us``, ``gap_context_us``).

A record says its loop mode with ``overlap`` (the run recorder and the simulator write it); a log that never says
fits host and gap on every step. Columns the log cannot tell apart keep the base profile's value (device) or
fold into the column before them (host, gap): in decode-only steps num_tokens == num_seqs (their cost lands on
seq_us) and the matmul roofline is affine in num_seqs (``scale`` stays the base's). The roofline uses the base
profile's ceilings, so calibrating for another GPU means: put its measured read bandwidth and matmul rate in a
profile JSON, run the engine there with FNVLLM_TIMELINE set, and fit with ``--base`` that JSON.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from fnvllm.sim.cost import CostModel, StepShape
from fnvllm.sim.hardware import SMALL_BATCHES, HardwareProfile, Overheads, Serving
from fnvllm.sim.model import ModelShape
from fnvllm.sim.timeline import record_new_seqs, record_overlap, record_shape

MIN_ROWS = 8  # fewer steps of one kind than this: keep the base profile's overheads for that kind
# The kernels reach between MIN_EFFICIENCY and all of the base profile's ceilings: the roofline scales are fitted in
# [1, 1 / MIN_EFFICIENCY], so device time stays a physical function of the work and carries to other shapes (an
# unbounded fit can zero a scale and price every step at a constant, which fits one model's steps and no other's).
MIN_EFFICIENCY = 0.3
MAX_ROOFLINE_SCALE = 1 / MIN_EFFICIENCY

__all__ = [
    "CPU_BASE",
    "MIN_ROWS",
    "base_for",
    "device_profile_name",
    "fit_bounded",
    "fit_nonnegative",
    "fit_profile",
    "fit_relative",
    "fit_serving",
    "prediction_error",
]


def _independent_columns(x: np.ndarray) -> list[int]:
    """Indices of columns kept in order, skipping any that adds no rank to those kept before it."""
    norms = np.linalg.norm(x, axis=0)
    scaled = x / np.where(norms > 0, norms, 1)
    kept: list[int] = []
    for j in range(x.shape[1]):
        if norms[j] > 0 and np.linalg.matrix_rank(scaled[:, [*kept, j]], tol=1e-9) == len(kept) + 1:
            kept.append(j)
    return kept


def fit_nonnegative(x: np.ndarray, y: np.ndarray, prior: np.ndarray | None = None) -> np.ndarray:
    """Least-squares coefficients of ``y ~ x`` constrained >= 0 (``fit_bounded`` with no upper bounds). A column
    the data cannot tell apart from the columns before it keeps its ``prior`` coefficient (default 0)."""
    n = x.shape[1]
    return fit_bounded(x, y, np.zeros(n), np.full(n, np.inf), prior)


def fit_bounded(
    x: np.ndarray,
    y: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    prior: np.ndarray | None = None,
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """Weighted least-squares coefficients of ``y ~ x`` with ``lower <= coef <= upper`` (box constraints).

    A column the data cannot tell apart from the columns before it is not fitted: it keeps its ``prior``
    coefficient (default the lower bound), clipped into its bounds. The rest is solved exactly, by a primal
    active-set method on the normal equations (``_box_least_squares``). ``weights``: per-row weights (e.g. 1/y
    for relative error).
    """
    prior = lower.astype(float).copy() if prior is None else np.clip(prior.astype(float), lower, upper)
    w = np.ones(len(y)) if weights is None else weights
    active = _independent_columns(x)
    fixed = [j for j in range(x.shape[1]) if j not in active]
    target = (y - x[:, fixed] @ prior[fixed]) * w
    a = x[:, active] * w[:, None]
    norms = np.linalg.norm(a, axis=0)  # solved on unit columns: the normal equations stay well conditioned
    norms = np.where(norms > 0, norms, 1.0)
    unit = a / norms
    coef = _box_least_squares(unit.T @ unit, unit.T @ target, lower[active] * norms, upper[active] * norms)
    out = prior.copy()
    out[active] = np.clip(coef / norms, lower[active], upper[active])
    return out


def _box_least_squares(gram: np.ndarray, moment: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """argmin of c @ gram @ c - 2 c @ moment over lo <= c <= hi (gram positive definite), by the primal
    active-set method: solve for the free coefficients with the others held at their bounds, step towards that
    solution until a coefficient meets a bound (it joins the bounds), and when the step is whole, release the
    bound coefficient whose gradient points most into the box; stop when none does (the optimum's conditions)."""
    n = len(moment)
    c = np.clip(np.zeros(n), lo, hi)
    at = (c == lo) & np.isfinite(lo) | (c == hi) & np.isfinite(hi)  # the working set: coefficients on a bound
    for _ in range(50 * (n + 1)):
        free = np.flatnonzero(~at)
        target = c.copy()
        if len(free):
            bound = np.flatnonzero(at)
            rhs = moment[free] - gram[np.ix_(free, bound)] @ c[bound]
            target[free] = np.linalg.lstsq(gram[np.ix_(free, free)], rhs, rcond=None)[0]
        step = target - c
        if np.abs(step).max(initial=0.0) > 1e-12 * (1.0 + np.abs(c).max(initial=0.0)):
            with np.errstate(divide="ignore", invalid="ignore"):
                room = np.where(step < 0, (lo - c) / step, np.where(step > 0, (hi - c) / step, np.inf))
            room[at] = np.inf
            j = int(np.argmin(room))
            alpha = min(1.0, float(room[j]))
            c = c + alpha * step
            if alpha < 1.0:
                c[j] = lo[j] if step[j] < 0 else hi[j]
                at[j] = True
                continue
        gradient = gram @ c - moment  # half the loss's gradient
        pull = np.where(np.isclose(c, lo) & at, -gradient, np.where(np.isclose(c, hi) & at, gradient, 0.0))
        pull[lo == hi] = 0.0
        j = int(np.argmax(pull))
        if pull[j] <= 1e-12 * (1.0 + np.abs(moment).max(initial=0.0)):
            return c
        at[j] = False
    return c


WEIGHT_POWER = 1.0  # fits weigh a step's squared error by 1 / its time ** this (0: absolute, 1: relative error)


def fit_relative(
    x: np.ndarray,
    y: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    prior: np.ndarray | None = None,
    scale: np.ndarray | None = None,
    shift: bool = True,
) -> np.ndarray:
    """``fit_bounded`` on relative error (row weights 1 / ``scale``, default ``y``: a 1 ms step counts as much as
    a 40 ms one), then column 0 (the constant) moved by the mean residual, within its bounds: the shape of the
    fit is the relative one, its total the absolute one (noisy steps whose errors lean one way would otherwise
    pull the sum under the measured total)."""
    weights = 1.0 / np.maximum(y if scale is None else scale, 1.0) ** WEIGHT_POWER
    coef = fit_bounded(x, y, lower, upper, prior, weights)
    if shift:
        coef[0] = float(np.clip(coef[0] + np.mean(y - x @ coef), lower[0], upper[0]))
    return coef


def _fit_kind(
    cost: CostModel,
    shapes: Sequence[StepShape],
    records: Sequence[Mapping[str, Any]],
    base: Overheads,
    launched: bool = False,
    context: bool = False,
) -> Overheads:
    """The overheads of one kind of step. An eager kind (``launched``): device with a launch floor
    (``_fit_launched_device``), then the plain gap on what the device model leaves of each plain step's wall time.
    A graph kind: device and plain gap in one fit (``_fit_device_and_gap``). Then the host cycle (``_fit_host``).
    ``context``: fit the host and gap terms per context token too (``fit_profile``'s ``context_terms``)."""
    if launched:
        device = _fit_launched_device(cost, shapes, records, base)
        gap = _fit_gap(shapes, records, base, _priced(cost, device), context)
    else:
        device, gap = _fit_device_and_gap(cost, shapes, records, base, context)
    return attrs.evolve(device, **gap, **_fit_host(shapes, records, base, context))


def _priced(cost: CostModel, device: Overheads) -> CostModel:
    """``cost``'s model and ceilings with ``device`` as the overheads of every kind of step."""
    return CostModel(cost.model, attrs.evolve(cost.hardware, eager=device, graph=device))


FLOOR_QUANTILES = (0, 5, 10, 15, 20, 25, 30, 40, 50, 60)  # launch floors tried: these percentiles of device times
FLOOR_MARGIN = 1.15  # steps under this many times a tried floor are left to it, not to the kernel fit
FLOOR_GAIN = 0.05  # a launch floor is kept only when it cuts the eager steps' squared relative error by this share


def _fit_launched_device(
    cost: CostModel, shapes: Sequence[StepShape], records: Sequence[Mapping[str, Any]], base: Overheads
) -> Overheads:
    """The device model of an eager kind: max(kernels, launch - the launch hidden behind the step before, the
    record's HIDDEN: its device time in an overlapped loop, 0 in a plain one or after an idle device). Each launch
    tried (none, then FLOOR_QUANTILES of the device times of the steps that hide none, and of all steps) leaves to
    the launch the steps within FLOOR_MARGIN of their exposed launch; the kernel model (``_fit_device``) is fitted
    on the rest; the pair with the least relative squared error over every step wins (a run's first step included:
    a small eager step shows the launch as any other)."""
    times = np.array([float(r["gpu_ms"]) * 1e3 for r in records])
    hidden = np.array([float(r.get(HIDDEN, 0.0)) * 1e3 for r in records])
    exposed_times = times[hidden == 0] if (hidden == 0).any() else times
    tried = {0.0, *np.percentile(exposed_times, FLOOR_QUANTILES[1:]), *np.percentile(times, FLOOR_QUANTILES[1:])}
    best, best_loss, no_floor_loss = _fit_device(cost, shapes, records, base), np.inf, np.inf
    for floor in sorted(float(f) for f in tried):
        exposed = np.maximum(floor - hidden, 0.0)
        rest = [i for i, t in enumerate(times) if t > FLOOR_MARGIN * exposed[i]]
        if len(rest) < MIN_ROWS:
            continue
        kernels = _fit_device(cost, [shapes[i] for i in rest], [records[i] for i in rest], base)
        device = attrs.evolve(kernels, launch_us=floor)
        priced = _priced(cost, device)
        predicted = np.maximum([priced.compute_s(shape) * 1e6 for shape in shapes], exposed)
        loss = float(np.sum(((predicted - times) / np.maximum(times, 1.0)) ** 2))
        if floor == 0.0:
            no_floor_loss = loss
        if loss < best_loss and (floor == 0.0 or loss < (1 - FLOOR_GAIN) * no_floor_loss):
            best, best_loss = device, loss
    return best


HIDDEN = "hidden_ms"  # a key fit_profile adds: the device time of the step before, when it hides this one's launch


def hidden_launch_ms(records: Sequence[Mapping[str, Any]]) -> list[float]:
    """Per record of a timeline, the device time of the record before it when the loop overlapped them (the host
    launched this step while the device ran that one: so much of its launch is hidden); 0 for a plain step, a
    run's first step, a step after an idle device longer than that (the log's gap_ms), and a step whose
    predecessor is not the record before (another run, a gap in the log)."""
    out, before = [], None
    for record in records:
        consecutive = (
            before is not None
            and "step" in record
            and "step" in before
            and int(record["step"]) == int(before["step"]) + 1
        )
        # a plain loop launches a step only after the one before it finished: nothing hides its launch
        hides = consecutive and not record.get("first_in_run") and record_overlap(record) is not False
        if hides and before is not None and float(record.get("gap_ms", 0.0)) < float(before["gpu_ms"]):
            out.append(float(before["gpu_ms"]))
        else:
            out.append(0.0)
        before = record
    return out


def _fit_device(
    cost: CostModel,
    shapes: Sequence[StepShape],
    records: Sequence[Mapping[str, Any]],
    base: Overheads,
    per_row_cap: bool = False,
) -> Overheads:
    """The device model, by least squares on relative error (each step weighs 1 / its time, so a one-request
    step counts as much as a 256-request one) with the roofline scales bounded to [1, MAX_ROOFLINE_SCALE] and the
    constant terms >= 0. Fitted on overlapped steps when the log has at least MIN_ROWS of them: a plain loop's
    step starts on an idle device, whose timer then also holds the host's input preparation and launch (that
    share goes to the plain gap model). The matmul roofline column comes last: in decode-only steps it is an
    affine function of the batch size, so those cannot separate ``scale`` from ``step_us`` / ``seq_us`` and keep
    ``base.scale`` (the caller passes the eager fit's: graphs replay the same matmul kernels). A run's first step
    is left out (its device time can hold a compile of a new shape). ``per_row_cap``: the terms that grow with
    the batch's rows (roofline scales, per-row and log2-row terms: ``_GROWING``) may not exceed ``base``'s: a fit
    on a narrow range of batch sizes (a served run's) would read the step-to-step spread as a steep slope and
    overprice larger batches (fitted at 50 requests/s on the H200, ~20 rows, it priced the 36-row decodes of a
    75/s run at 1.93 ms against 1.68 measured). The per-token term stays free (the served run's mixed graph steps,
    prefills of a few hundred tokens, tell it; the offline regimes hold few of those), and the constants take what
    the batch size does not explain."""
    steady = [i for i, r in enumerate(records) if not r.get("first_in_run")] or list(range(len(records)))
    overlapped = [i for i in steady if record_overlap(records[i]) is not False]
    rows = overlapped if len(overlapped) >= MIN_ROWS else steady
    x = _device_columns(cost, [shapes[i] for i in rows])
    y = np.array([float(records[i]["gpu_ms"]) * 1e3 for i in rows])
    lower, upper, prior = _device_bounds(base)
    if per_row_cap:
        for j, name in _GROWING:
            upper[j] = max(getattr(base, name), lower[j])
    return _device_overheads(fit_relative(x, y, lower, upper, prior), x)


_DEVICE = ("step_us", "attn_scale", "seq_us", "log_seq_us", "token_us")  # the device columns before small_us
# the device columns that grow with the batch's rows (attention, rows, log2 rows, matmul roofline): (index, field)
_GROWING = ((1, "attn_scale"), (2, "seq_us"), (3, "log_seq_us"), (-1, "scale"))


def _device_columns(cost: CostModel, shapes: Sequence[StepShape]) -> np.ndarray:
    """The device model's columns (``CostModel.compute_s``), one row per step: 1 (step_us), attention roofline
    us (attn_scale), rows (seq_us), log2 rows (log_seq_us), tokens (token_us), one indicator per SMALL_BATCHES
    graph (small_us: such a step has no step_us and log term), matmul roofline us (scale). Rows and tokens of a
    decode graph are its graph's (padding included)."""
    out = np.zeros((len(shapes), len(_DEVICE) + len(SMALL_BATCHES) + 1))
    for i, shape in enumerate(shapes):
        t = cost.device_terms(shape)
        out[i, 1:5] = t.attention_s * 1e6, t.rows, math.log2(t.rows), t.tokens
        out[i, -1] = t.linear_s * 1e6
        if t.small is None:
            out[i, 0] = 1.0
        else:
            out[i, len(_DEVICE) + t.small], out[i, 3] = 1.0, 0.0
    return out


def _device_bounds(base: Overheads) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lower and upper bounds and priors of the device columns (``_device_columns``)."""
    n = len(_DEVICE) + len(SMALL_BATCHES) + 1
    lower, upper, prior = np.zeros(n), np.full(n, np.inf), np.zeros(n)
    for j in (1, n - 1):  # the roofline scales
        lower[j], upper[j] = 1.0, MAX_ROOFLINE_SCALE
    prior[1], prior[-1] = base.attn_scale, base.scale
    return lower, upper, prior


def _device_overheads(coef: np.ndarray, x: np.ndarray) -> Overheads:
    """Overheads from fitted device coefficients; a SMALL_BATCHES graph the data holds no step of takes the
    constant of the curve (step_us + log_seq_us * log2(rows)); no small graph at all: small_us stays empty."""
    values = dict(zip(_DEVICE, map(float, coef), strict=False))
    seen = np.abs(x[:, len(_DEVICE) : len(_DEVICE) + len(SMALL_BATCHES)]).sum(axis=0) > 0
    small: tuple[float, ...] = ()
    if seen.any():
        curve = [values["step_us"] + values["log_seq_us"] * math.log2(b) for b in SMALL_BATCHES]
        small = tuple(float(coef[len(_DEVICE) + k]) if seen[k] else curve[k] for k in range(len(SMALL_BATCHES)))
    return Overheads(scale=float(coef[-1]), small_us=small, **values)


DEVICE_BOUND_MARGIN = 0.05  # an overlapped step whose device time exceeds its host cycle by this share set the pace


def _device_bound(record: Mapping[str, Any]) -> bool:
    """True when an overlapped step's device time was its kernels': the host's cycle (cpu_ms) ended more than
    DEVICE_BOUND_MARGIN of it earlier and the device did not idle before it. Otherwise the host set the pace, and
    the device timer (which starts when the host begins the step) also holds the host's share."""
    gpu, cpu = float(record["gpu_ms"]), float(record.get("cpu_ms", 0.0))
    return gpu - cpu > DEVICE_BOUND_MARGIN * gpu and float(record.get("gap_ms", 0.0)) <= HOST_BOUND_GAP_MS


def _fit_device_and_gap(
    cost: CostModel,
    shapes: Sequence[StepShape],
    records: Sequence[Mapping[str, Any]],
    base: Overheads,
    context: bool = False,
) -> tuple[Overheads, dict[str, float]]:
    """The device model and the plain loop's gap of a graph kind, in one least-squares fit (relative error, a
    run's first step left out) of two kinds of rows: overlapped steps whose device set the pace (``_device_bound``:
    gpu_ms is the kernels' time), on the device columns; and plain steps, whose wall time (gpu_ms + gap_ms) is
    device + gap, on the device and the gap columns. So the plain steps also tell the device model what the
    overlapped ones cannot (a one-row step is host-bound when overlapped, but device + gap when plain), and the gap
    stays a function of the host's work. A host-paced overlapped step bounds its kernels' time by its device timer:
    the fit is redone with those it prices above that bound at the bound (``_over_bound``, a censored fit). The
    matmul scale stays ``base``'s (the eager fit's: the same matmul kernels; decode steps' matmul roofline hardly
    changes with their rows, and the few mixed graph steps of an offline log are no ground to fit it on). Fewer
    than MIN_ROWS device-bound steps: every overlapped step counts; fewer than MIN_ROWS plain steps: the gap stays
    ``base``'s; no overlapped step, or a log that does not say its loop mode: the device on the steps' gpu_ms, then
    the gap on what it leaves of each plain step's wall time (``_fit_device``, ``_fit_gap``)."""
    steady = [i for i, r in enumerate(records) if not r.get("first_in_run")] or list(range(len(records)))
    overlapped = [i for i in steady if record_overlap(records[i]) is not False]
    plain = _rows_of_mode(records, overlap=False) if len(overlapped) < len(steady) else []
    if len(overlapped) < MIN_ROWS or all(record_overlap(r) is None for r in records):  # or the log does not say
        device = _fit_device(cost, shapes, records, base)
        return device, _fit_gap(shapes, records, base, _priced(cost, device), context)
    bound = [i for i in overlapped if _device_bound(records[i])]
    rows = bound if len(bound) >= MIN_ROWS else overlapped
    paced = [i for i in overlapped if i not in set(rows)]  # host-paced: their kernels took at most gpu_ms
    if len(plain) < MIN_ROWS:
        plain = []
    lower, upper, prior = _device_bounds(base)
    lower[-1] = upper[-1] = base.scale  # graphs replay the eager steps' matmuls: decode steps cannot tell the scale
    n = len(_GAP)
    lower, upper = np.concatenate([lower, np.zeros(n)]), np.concatenate([upper, np.full(n, np.inf)])
    prior = np.concatenate([prior, np.zeros(n)])  # a gap column the plain steps cannot tell apart: 0
    for _ in range(CENSORED_ROUNDS):
        k = _device_columns(cost, [shapes[i] for i in [*rows, *plain]])
        gap = np.zeros((len(k), n))
        gap[len(rows) :] = _gap_features(shapes, records, plain, context)
        y = np.array(
            [float(records[i]["gpu_ms"]) * 1e3 for i in rows]
            + [(float(records[i]["gpu_ms"]) + float(records[i].get("gap_ms", 0.0))) * 1e3 for i in plain]
        )
        coef = fit_relative(np.hstack([k, gap]), y, lower, upper, prior, shift=False)
        device = _device_overheads(coef[: k.shape[1]], k)
        over = _over_bound(_priced(cost, device), shapes, records, paced)
        if not over:
            break
        rows, paced = [*rows, *over], [i for i in paced if i not in set(over)]
    gaps = dict(zip(_GAP, map(float, coef[k.shape[1] :]), strict=True)) if plain else _base_gap(base)
    return device, gaps


CENSORED_ROUNDS = 5  # refits that add host-paced steps priced above their device timer (``_over_bound``)


def _over_bound(
    priced: CostModel, shapes: Sequence[StepShape], records: Sequence[Mapping[str, Any]], paced: Sequence[int]
) -> list[int]:
    """The host-paced steps whose predicted kernel time exceeds their device timer by more than 2 %: the timer
    holds the kernels and the wait for the host, so it bounds them; such a step joins the fit at its timer."""
    return [i for i in paced if priced.compute_s(shapes[i]) * 1e3 > 1.02 * float(records[i]["gpu_ms"])]


def _base_gap(base: Overheads) -> dict[str, float]:
    """``base``'s plain-gap coefficients."""
    return {name: getattr(base, name) for name in _GAP}


def _rows_of_mode(records: Sequence[Mapping[str, Any]], overlap: bool) -> list[int]:
    """Indices of the records whose loop ran in ``overlap`` mode (every index when no record says), without a
    run's first step (``first_in_run``: its host time holds the run's start-up, fitted as request_us)."""
    modes = [record_overlap(r) for r in records]
    steady = [i for i, r in enumerate(records) if not r.get("first_in_run")]  # a run's first step holds start-up
    if all(m is None for m in modes):
        return steady
    return [i for i in steady if modes[i] is overlap]


def _features(
    shapes: Sequence[StepShape], records: Sequence[Mapping[str, Any]], rows: Sequence[int], context: bool = False
) -> np.ndarray:
    """Host-side columns of the chosen rows (``_HOST``'s order): 1, rows, new rows, tokens, sampled rows, context
    tokens (the KV the rows read). Without ``context`` the last column is 0, so its coefficient is not fitted
    (``fit_bounded`` keeps a column without rank at its prior, 0): see ``fit_profile``'s ``context_terms``."""
    return np.array(
        [
            [
                1.0,
                shapes[i].num_seqs,
                record_new_seqs(records[i]),
                shapes[i].num_tokens,
                shapes[i].num_samples,
                shapes[i].context_tokens if context else 0,
            ]
            for i in rows
        ]
    ).reshape(len(rows), len(_HOST))


def _gap_features(
    shapes: Sequence[StepShape], records: Sequence[Mapping[str, Any]], rows: Sequence[int], context: bool = False
) -> np.ndarray:
    """The plain gap's columns (``_GAP``'s order): ``_features`` without the sampled rows."""
    return _features(shapes, records, rows, context)[:, _GAP_OF_HOST]


def _fit_gap(
    shapes: Sequence[StepShape],
    records: Sequence[Mapping[str, Any]],
    base: Overheads,
    priced: CostModel,
    context: bool = False,
) -> dict[str, float]:
    """The plain loop's gap coefficients, fitted (>= 0, relative error) on the steps that did not overlap (all
    steps when the log does not say): each step's wall time (gpu_ms + gap_ms) less the device time ``priced``
    predicts for it, so the gap model also carries the host's input preparation that a plain step's device timer
    holds. Fewer than MIN_ROWS such steps keep ``base``'s."""
    rows = _rows_of_mode(records, overlap=False)
    names = _GAP
    if len(rows) < MIN_ROWS:
        return {name: getattr(base, name) for name in names}
    walls = np.array([(float(records[i]["gpu_ms"]) + float(records[i].get("gap_ms", 0.0))) * 1e3 for i in rows])
    hidden = [float(records[i].get(HIDDEN, 0.0)) / 1e3 for i in rows]
    gaps = walls - np.array(
        [priced.step_times(shapes[i], 0, False, h)[0] * 1e6 for i, h in zip(rows, hidden, strict=True)]
    )
    x, n = _gap_features(shapes, records, rows, context), len(_GAP)
    coef = fit_relative(x, gaps, np.zeros(n), np.full(n, np.inf), scale=walls, shift=False)
    return dict(zip(names, map(float, coef), strict=True))


# The untimed part of a host cycle is read from the host-paced steps only when they are at least this share of the
# overlapped ones: in a device-bound log a few stragglers set it for every step (an H100 calibration run of
# 2026-12-07: 29 paced of 2,628 overlapped graph steps, the middle 80 % of their wall - cpu_ms from -3.9 to +2.8 ms,
# gave a median of 1.2 ms, and priced the 0.27 ms host cycle of one-request decode steps as 1.5 ms: +72 % end to end).
PACED_SHARE = 0.1
NEXT_EAGER = "next_eager"  # a key fit_profile adds to a record followed by an eager step in its timeline
HOST_BOUND_GAP_MS = 0.05  # an overlapped step whose device idled longer than this waited for the host


def _fit_host(
    shapes: Sequence[StepShape], records: Sequence[Mapping[str, Any]], base: Overheads, context: bool = False
) -> dict[str, float]:
    """The host-cycle coefficients (>= 0, relative error), fitted on overlapped steps (all steps when the log does
    not say): where the host set the pace (not ``_device_bound``), on the step's wall time (gpu_ms + gap_ms: wall
    = host under the overlap rule); elsewhere on ``cpu_ms`` plus the part of a cycle it does not time (the wait's
    own cost and the step's bookkeeping after it: the median of wall - cpu_ms over the host-paced steps, when at
    least MIN_ROWS and a PACED_SHARE of the steps are host-paced; else 0). Left out: steps followed by an eager
    step (``NEXT_EAGER``: their cycle also launched that step's kernels one by one, which its own device time
    holds). Fewer than MIN_ROWS such steps, or a log without ``cpu_ms``, keep ``base``'s."""
    rows = [
        i for i in _rows_of_mode(records, overlap=True) if "cpu_ms" in records[i] and not records[i].get(NEXT_EAGER)
    ]
    names = _HOST
    if len(rows) < MIN_ROWS:
        return {name: getattr(base, name) for name in names}
    walls = np.array([(float(records[i]["gpu_ms"]) + float(records[i].get("gap_ms", 0.0))) * 1e3 for i in rows])
    cpu = np.array([float(records[i]["cpu_ms"]) * 1e3 for i in rows])
    paced = np.array([not _device_bound(records[i]) for i in rows])
    enough = paced.sum() >= max(MIN_ROWS, PACED_SHARE * len(rows))
    untimed = max(float(np.median((walls - cpu)[paced])), 0.0) if enough else 0.0
    host = np.where(paced, np.maximum(walls, cpu), cpu + untimed)
    n = len(names)
    x = _features(shapes, records, rows, context)
    coef = fit_relative(x, host, np.zeros(n), np.full(n, np.inf), shift=False)
    return dict(zip(names, map(float, coef), strict=True))


def fit_profile(
    records: Sequence[Mapping[str, Any]],
    model: ModelShape,
    base: HardwareProfile,
    source: str = "",
    name: str | None = None,
    context_terms: bool = False,
) -> HardwareProfile:
    """``base`` with its overheads fitted to ``records`` (timeline step records) of ``model``, named ``name``
    (default: the base's name + "-calibrated") and recording ``model`` (simulate's default model with it).

    ``context_terms``: also fit the host cycle and the plain gap per context token (``host_context_us``,
    ``gap_context_us``; 0 when off). Off by default: in the H200 calibration runs of 2026-12-04 the host time of
    steps with equal rows did not grow with their context (256-row plain decode steps: gap 0.71 ms at 95k context
    tokens, 0.74 at 175k), while the column, nearly collinear with the rows in the decode regimes, took their
    growth and priced the bench workload's long contexts 13.2 % slow when that regime was held out of the fit
    (5.7 % without the column).

    The fit prices the records' steps at their model's precision with the overheads it fits: ``base``'s
    ``precisions`` are dropped (from the result too: a profile fitted on FP8 runs holds their overheads as its own).

    Eager steps are fitted first; graph steps, whose matmul scale decode-only data cannot identify, take the
    eager fit's. A kind of step with fewer than MIN_ROWS records keeps ``base``'s overheads; a log without graph
    steps sets graph_max_seqs to 0 (that engine never replays graphs), else to the largest graph batch seen, and
    graph_mixed_tokens to the most tokens of a mixed step that ran as a graph (0 when none did).
    """
    base = attrs.evolve(base, precisions={})  # these records' overheads are fitted here, whatever their precision
    cost = CostModel(model, base)
    kinds = {"eager": base.eager, "graph": base.graph}
    nexts = [*records[1:], None]
    marked = [
        {**r, NEXT_EAGER: n is not None and not bool(n["graph"]), HIDDEN: h}
        for r, n, h in zip(records, nexts, hidden_launch_ms(records), strict=True)
    ]
    for kind, is_graph in (("eager", False), ("graph", True)):
        rows = [r for r in marked if bool(r["graph"]) == is_graph and int(r["num_seqs"]) > 0]
        if len(rows) >= MIN_ROWS:
            prior = attrs.evolve(kinds[kind], scale=kinds["eager"].scale)  # graphs replay the eager matmuls
            shapes = [record_shape(r) for r in rows]
            kinds[kind] = _fit_kind(cost, shapes, rows, prior, launched=not is_graph, context=context_terms)
    graph_seqs = [int(r["num_seqs"]) for r in records if r["graph"]]
    mixed = [int(r["num_tokens"]) for r in records if r["graph"] and int(r["num_prefill_tokens"]) > 0]
    return attrs.evolve(
        base,
        name=name or f"{base.name}-calibrated",
        graph_max_seqs=max(graph_seqs, default=0),
        graph_mixed_tokens=max(mixed, default=0),
        calibrated_from=source,
        eager=kinds["eager"],
        graph=kinds["graph"],
        model={**model.to_config(), "name": model.name},
        serving=None,  # a fit on offline steps says nothing of serving (sim_calibration.py --served fits it)
    )


CPU_BASE = HardwareProfile(
    name="cpu", mem_bandwidth_gbs=10.0, matmul_tflops=0.08, memory_gib=8.0, graph_max_seqs=0
)  # the base for CPU timelines: rough ceilings of one desktop core, so the fit's columns have the work's shape


def device_profile_name(device: str) -> str:
    """A profile name from a device's name: "NVIDIA H200" -> "nvidia-h200", "cuda:0" -> "cuda-0"."""
    return "-".join("".join(c if c.isalnum() else " " for c in device.lower()).split()) or "device"


def base_for(device: str) -> HardwareProfile:
    """The base profile a timeline of ``device`` fits from (its ceilings stay, its overheads are the fit's priors):
    the device's built-in profile (``builtin_for_device``: an H100's, an H200's), else the H200's for other CUDA
    devices, CPU_BASE for a CPU."""
    from fnvllm.sim.hardware import BUILTIN_PROFILES, builtin_for_device

    return CPU_BASE if device.lower().startswith("cpu") else BUILTIN_PROFILES[builtin_for_device(device) or "h200"]


def prediction_error(
    records: Sequence[Mapping[str, Any]], model: ModelShape, profile: HardwareProfile
) -> dict[str, float]:
    """How well ``profile`` predicts ``records``: the relative error of the total wall time (device + gap per
    step, predicted under each record's loop mode: overlapped unless it says otherwise), the mean absolute
    relative error per step, and the measured and predicted totals in seconds."""
    cost = CostModel(model, profile)
    measured, predicted, errors = 0.0, 0.0, []
    for record, hidden in zip(records, hidden_launch_ms(records), strict=True):
        shape = record_shape(record)
        if not shape.num_seqs:
            continue
        m = (float(record["gpu_ms"]) + float(record.get("gap_ms", 0.0))) / 1e3
        p = cost.wall_s(shape, record_new_seqs(record), record_overlap(record), hidden / 1e3)
        measured, predicted = measured + m, predicted + p
        errors.append(abs(p - m) / m if m > 0 else 0.0)
    return {
        "total_error": (predicted - measured) / measured if measured else 0.0,
        "mean_step_error": sum(errors) / len(errors) if errors else 0.0,
        "measured_s": measured,
        "predicted_s": predicted,
        "num_steps": len(errors),
    }


STALL_FACTOR = 10.0  # a served step slower than this many times its kind's median step held a compile: not fitted


def fit_serving(
    records: Sequence[Mapping[str, Any]],
    model: ModelShape,
    base: HardwareProfile,
    source: str = "",
    context_terms: bool = False,
) -> Serving:
    """The ``serving`` section of a profile, fitted to the timeline ``records`` of a served run (``fnvllm serve``
    under load, FNVLLM_TIMELINE set; overlapped steps), with ``base`` (an offline fit) for what they cannot tell.

    The served loop's cycle (``SimExecutor``'s served timing): launch step k, wait for step k-1, commit and report
    it. Per kind of step (graph or eager, as the timeline says: keyed on how the step ran, not on its rows):

    host:   the cycle's host time, on ``cpu_ms`` of the steps followed by a graph step (a replay's launch is
            cheap, so their cycle is the commit, the report and the planning);
    launch: the host time of launching the step beyond that: ``cpu_ms`` of the step before it minus that step's
            host model (an eager step launches kernel by kernel; fitted only where it adds up to something);
    device: the step's device time (gpu_ms: from when the device reached the step, the end of the step before or
            the start of its launch, to its end; a launch-bound step's device time holds its launch, and the idle
            gap before a step is the host's, priced by the cycle); its growth with the rows is capped at
            ``base``'s, fitted over 1 to 512 rows (``_fit_device``'s ``per_row_cap``).

    Left out: a run's first step and steps more than STALL_FACTOR times their kind's median (a compile of a new
    shape). A kind with fewer than MIN_ROWS steps keeps ``base``'s overheads. The latency outside the engine is
    not in a timeline: ``latency_us`` stays 0 (the served check fits it from the clients' TTFT).
    """
    cost = CostModel(model, base)
    steps = [r for r in records if int(r["num_seqs"]) > 0]
    shapes = [record_shape(r) for r in steps]
    kinds = {"eager": base.eager, "graph": base.graph}
    kept: dict[str, list[int]] = {}
    for kind, is_graph in (("eager", False), ("graph", True)):
        chosen = [i for i, r in enumerate(steps) if bool(r["graph"]) == is_graph and i > 0]
        walls = [_served_wall_ms(steps[i]) for i in chosen]
        limit = STALL_FACTOR * float(np.median(walls)) if walls else 0.0
        kept[kind] = [i for i, wall in zip(chosen, walls, strict=True) if wall <= limit]
        if len(kept[kind]) >= MIN_ROWS:
            prior = attrs.evolve(kinds[kind], scale=kinds["eager"].scale)
            rows = [steps[i] for i in kept[kind]]
            device = _fit_device(cost, [shapes[i] for i in kept[kind]], rows, prior, per_row_cap=True)
            host = _fit_served_host(steps, shapes, kept[kind], prior, context_terms)
            kinds[kind] = attrs.evolve(device, **{n: getattr(prior, n) for n in _GAP}, **host)
    host_cost = CostModel(model, attrs.evolve(base, eager=kinds["eager"], graph=kinds["graph"]))
    for kind in kinds:
        kinds[kind] = attrs.evolve(kinds[kind], **_fit_launch(steps, shapes, kept[kind], host_cost))
    return Serving(eager=kinds["eager"], graph=kinds["graph"], calibrated_from=source)


def _served_wall_ms(record: Mapping[str, Any]) -> float:
    """A served step's device time plus the device's idle gap before it (what a stall shows in)."""
    return float(record["gpu_ms"]) + float(record.get("gap_ms", 0.0))


def _fit_served_host(
    steps: Sequence[Mapping[str, Any]],
    shapes: Sequence[StepShape],
    rows: Sequence[int],
    prior: Overheads,
    context: bool = False,
) -> dict[str, float]:
    """The host cycle of a kind of served step, on ``cpu_ms`` of its steps followed by a graph step (fewer than
    MIN_ROWS such steps: ``prior``'s)."""
    clean = [i for i in rows if i + 1 < len(steps) and bool(steps[i + 1]["graph"]) and "cpu_ms" in steps[i]]
    if len(clean) < MIN_ROWS:
        return {name: getattr(prior, name) for name in _HOST}
    cpu = np.array([float(steps[i]["cpu_ms"]) * 1e3 for i in clean])
    coef = fit_nonnegative(_features(shapes, steps, clean, context), cpu)
    return dict(zip(_HOST, map(float, coef), strict=True))


LAUNCH_MIN_US = 1000.0  # a kind of step whose launch adds less than this to the cycle, on average, launches in it


def _fit_launch(
    steps: Sequence[Mapping[str, Any]], shapes: Sequence[StepShape], rows: Sequence[int], host_cost: CostModel
) -> dict[str, float]:
    """The launch model of a kind of served step: ``cpu_ms`` of the step before each minus that step's host
    model, fitted on 1, rows, tokens (>= 0); all 0 when it averages under LAUNCH_MIN_US (a graph replay) or
    fewer than MIN_ROWS steps say."""
    zero = dict.fromkeys(_LAUNCH, 0.0)
    before = [i for i in rows if i > 0 and "cpu_ms" in steps[i - 1]]
    if len(before) < MIN_ROWS:
        return zero
    extra = np.array(
        [
            float(steps[i - 1]["cpu_ms"]) * 1e3 - host_cost.host_s(shapes[i - 1], record_new_seqs(steps[i - 1])) * 1e6
            for i in before
        ]
    )
    if float(np.mean(extra)) < LAUNCH_MIN_US:
        return zero
    x = np.array([[1.0, shapes[i].num_seqs, shapes[i].num_tokens] for i in before])
    return dict(zip(_LAUNCH, map(float, fit_nonnegative(x, np.maximum(extra, 0.0))), strict=True))


_HOST = ("host_us", "host_seq_us", "host_new_seq_us", "host_token_us", "host_sample_us", "host_context_us")
_GAP = ("gap_us", "gap_seq_us", "gap_new_seq_us", "gap_token_us", "gap_context_us")
_GAP_OF_HOST = [0, 1, 2, 3, 5]  # the host columns the gap has (no sampled rows)
_LAUNCH = ("launch_us", "launch_seq_us", "launch_token_us")
