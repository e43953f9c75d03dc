"""Serving load benchmark: a thin wrapper over ``python -m fnvllm.serve.bench`` (same flags), run against a
server that is already up. The whole offline-vs-served comparison on one machine is benchmarks/serve_check.sh.

fnvllm serve MODEL --port 8000 &
python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --num-requests 256           # all at once
python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --request-rate 20 --json     # Poisson arrivals
"""

from __future__ import annotations

import sys

from fnvllm.serve.bench import main

if __name__ == "__main__":
    main(sys.argv[1:])
