"""Host cost of routing one committed step's tokens to their requests (``OutputProcessor.process``), per step.

    PYTHONPATH=TREE python3 benchmarks/bench_output_routing.py [--rows 256] [--number 200] [--repeats 7]

One decode step of ``--rows`` requests, none finishing, each tracker without a detokenizer and with
``discard_delta`` (``LLM.generate`` on token ids): the per-row routing the engine loop pays on the host every step,
alone. Prints the best of ``--repeats`` timings of ``--number`` calls, in microseconds a step. To compare two
commits, run it with PYTHONPATH set to each tree, alternated, in one session (CPU timings are ratios).
"""

from __future__ import annotations

import argparse
import timeit

from fnvllm.engine.core import EngineOutput
from fnvllm.engine.output import OutputProcessor, RequestTracker, discard_delta
from fnvllm.state import SamplingParams
from fnvllm.state.request import StepOutput


def routing_us(rows: int, number: int, repeats: int) -> float:
    """Best microseconds of one ``process`` call over ``rows`` running requests."""
    processor = OutputProcessor()
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    ids = tuple(str(i) for i in range(rows))
    for index, rid in enumerate(ids):
        processor.add(RequestTracker(index, rid, None, (1, 2, 3), params, None, discard_delta))
    step = EngineOutput(StepOutput(0, ids, tuple(range(rows)), ()))
    # no request finishes, so the state is never read (the loop passes its EngineState)
    best = min(timeit.repeat(lambda: processor.process(None, step), number=number, repeat=repeats))  # type: ignore[arg-type]
    return 1e6 * best / number


def main() -> None:
    """Parse the flags, time, print."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256, help="requests in the step (default 256)")
    parser.add_argument("--number", type=int, default=200, help="calls per timing (default 200)")
    parser.add_argument("--repeats", type=int, default=7, help="timings; the best is printed (default 7)")
    args = parser.parse_args()
    print(f"{routing_us(args.rows, args.number, args.repeats):.1f} us a step ({args.rows} rows)")


if __name__ == "__main__":
    main()
