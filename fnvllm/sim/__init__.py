"""The simulator: the engine's own pure scheduler driven by a cost-model executor. Imports no torch.

    from fnvllm.sim import SimSpec, run_spec, format_table
    result, summary = run_spec(SimSpec(workload="poisson", rate=50, num_requests=2000))
    print(format_table(summary))

Pieces, each usable alone: ``ModelShape`` / ``load_shape`` (model dimensions), ``HardwareProfile`` /
``load_profile`` (ceilings + fitted overheads; built in: ``H200``, ``H100``; overheads per precision:
``PrecisionOverheads``), ``CostModel`` (roofline per layer part), ``SimExecutor`` (the
executor protocol on a simulated clock), workloads (``poisson_requests``, ``shared_prefix_requests``,
``bench_requests``, ``read_trace``), ``simulate`` (the clock-driven engine loop), ``summarize`` (metrics),
``fit_profile`` (calibration from a GPU timeline), ``RunRecorder`` / ``check_run`` (record an engine run, replay
it and report the error) and ``run_sweep`` (grids, local processes or Ray). Bad inputs raise ``SimInputError``
(a ValueError) naming the field and its range. docs/simulator.md has the file formats.
"""

from fnvllm.sim.calibrate import fit_profile, prediction_error
from fnvllm.sim.check import CheckResult, check_run, read_run
from fnvllm.sim.checks import SimInputError
from fnvllm.sim.cost import CostModel, StepShape, step_shape
from fnvllm.sim.executor import FillerTokens, ReplayTokens, SimExecutor, TokenSource
from fnvllm.sim.hardware import H100, H200, HardwareProfile, Overheads, PrecisionOverheads, load_profile, save_profile
from fnvllm.sim.loop import SimResult, SimulationStalledError, simulate
from fnvllm.sim.metrics import format_table, percentile, summarize, weighted_percentile
from fnvllm.sim.model import NAMED_SHAPES, ModelShape, load_shape
from fnvllm.sim.policies import POLICIES, get_policy
from fnvllm.sim.recorder import RunRecorder, run_path
from fnvllm.sim.spec import SimSpec, run_spec
from fnvllm.sim.sweep import run_sweep
from fnvllm.sim.timeline import read_timeline
from fnvllm.sim.workloads import (
    SimRequest,
    bench_requests,
    poisson_requests,
    prompt_tokens,
    read_trace,
    shared_prefix_requests,
    write_trace,
)

__all__ = [
    "H100",
    "H200",
    "NAMED_SHAPES",
    "POLICIES",
    "CheckResult",
    "CostModel",
    "FillerTokens",
    "HardwareProfile",
    "ModelShape",
    "Overheads",
    "PrecisionOverheads",
    "ReplayTokens",
    "RunRecorder",
    "SimExecutor",
    "SimInputError",
    "SimRequest",
    "SimResult",
    "SimSpec",
    "SimulationStalledError",
    "StepShape",
    "TokenSource",
    "bench_requests",
    "check_run",
    "fit_profile",
    "format_table",
    "get_policy",
    "load_profile",
    "load_shape",
    "percentile",
    "poisson_requests",
    "prediction_error",
    "prompt_tokens",
    "read_run",
    "read_timeline",
    "read_trace",
    "run_path",
    "run_spec",
    "run_sweep",
    "save_profile",
    "shared_prefix_requests",
    "simulate",
    "step_shape",
    "summarize",
    "weighted_percentile",
    "write_trace",
]
