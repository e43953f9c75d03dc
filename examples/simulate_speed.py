"""How fast the simulator runs: N Poisson requests end to end, and where the time goes.

    OMP_NUM_THREADS=1 python examples/simulate_speed.py --num-requests 100000 --rate 200 --block-size 256

Prints the wall time (and the process's CPU time: on a shared machine wall time includes waiting for a core),
the steps simulated, microseconds per step, and the share spent in the pure core
(``schedule`` + ``commit``) versus the simulator's own work (cost model, arrivals, recording).
"""

from __future__ import annotations

import argparse
import time

from fnvllm.engine import core as engine_core
from fnvllm.engine import loop as engine_loop
from fnvllm.sim import SimSpec, format_table, run_spec


class CoreTimer:
    """Wraps the engine loop's ``schedule`` and ``commit`` (which the simulator drives) to add up the seconds spent
    in the pure core."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.schedule, self.commit = engine_loop.schedule, engine_core.commit

    def install(self) -> None:
        """Route the loop's calls through the timers."""
        engine_loop.schedule = self._timed(self.schedule)  # type: ignore[assignment]
        engine_core.commit = self._timed(self.commit)  # type: ignore[assignment]

    def _timed(self, func):  # type: ignore[no-untyped-def]
        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def main() -> None:
    """Run one timed simulation and print the numbers."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--model-shape", default="qwen3-0.6b")
    parser.add_argument("--no-core-timer", action="store_true", help="skip the schedule/commit timer (less overhead)")
    args = parser.parse_args()
    spec = SimSpec(
        workload="poisson",
        num_requests=args.num_requests,
        rate=args.rate,
        block_size=args.block_size,
        model=args.model_shape,
    )
    timer = CoreTimer()
    if not args.no_core_timer:
        timer.install()
    start, cpu_start = time.perf_counter(), time.process_time()
    result, summary = run_spec(spec)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(format_table(summary))
    core = f", pure core {timer.seconds:.1f} s ({timer.seconds / wall:.0%})" if not args.no_core_timer else ""
    print(
        f"simulated {args.num_requests} requests in {wall:.1f} s wall ({cpu:.1f} s CPU): {result.num_steps} steps, "
        f"{wall / result.num_steps * 1e6:.0f} us/step{core}"
    )


if __name__ == "__main__":
    main()
