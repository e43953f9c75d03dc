"""Run an ``fnvllm`` command (the latency bench) with the kernel tables replaced by those a sweep pickled.

    PYTHONPATH=$PWD python3 benchmarks/sweep_small.py ... --tables-out /tmp/tables.pkl
    PYTHONPATH=$PWD python3 benchmarks/latency_tables.py --tables /tmp/tables.pkl \\
        bench --model-shape qwen3-0.6b --latency 1,16,64 --profile

The pickle holds TUNED_CONFIGS, FUSED_TIMES and SMALL_BATCH_DECODE (``sweep_small.verified_tables``); they replace
skinny_gemm's and decode_attention's tables in this process before the engine is built, so its CUDA graphs capture
the swept launches: the end-to-end measure of tables not yet pasted into the code. A missing or unreadable file
keeps the checkout's tables (said on the first line).
"""

from __future__ import annotations

import argparse
import pickle
import sys


def install_tables(path: str) -> str:
    """Replace the three tables by the pickled ones; returns what was done, for the log."""
    from fnvllm.kernels import decode_attention, skinny_gemm

    try:
        with open(path, "rb") as f:
            saved = pickle.load(f)
    except (OSError, pickle.UnpicklingError, ValueError) as e:
        return f"tables: {path} unreadable ({type(e).__name__}: {e}); the checkout's tables"
    tuned, fused, decode = saved["tuned"], saved["fused"], saved["decode"]
    for table, new in ((skinny_gemm.TUNED_CONFIGS, tuned), (skinny_gemm.FUSED_TIMES, fused),
                       (decode_attention.SMALL_BATCH_DECODE, decode)):  # fmt: skip
        table.clear()
        table.update(new)
    skinny_gemm.skinny_config.cache_clear()
    glu = sorted(key for key, v in fused.items() if key[0] == "glu" and v.fused_us < v.unfused_us)
    return f"tables: {path}: SMALL_BATCH_DECODE {decode}; faster GLU epilogues {glu}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", required=True, help="the pickle written by sweep_small.py --tables-out")
    args, rest = parser.parse_known_args()
    print(install_tables(args.tables), flush=True)
    from fnvllm.cli import main as cli_main

    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main())
