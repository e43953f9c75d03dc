#!/usr/bin/env bash
# The GPU test suite on the GPU machine, the server's GPU tests included: what that machine lacks of the [serve]
# extra and the server tests' client (openai, xgrammar) is unpacked first from the wheels in $SERVE_WHEELS
# (default .serve_wheels, git-ignored: carry it; benchmarks/serve_wheels.py says how to make it) into a temp folder
# on PYTHONPATH.
#
#   bash benchmarks/gpu_suite.sh                    # every test marked gpu, 4 workers, a file per worker
#   bash benchmarks/gpu_suite.sh tests/test_server.py -x    # arguments replace the default test paths
set -euo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SITE=$(mktemp -d /tmp/fnvllm-gpu-suite.XXXXXX)
trap 'rm -rf "$SITE"' EXIT
python3 benchmarks/serve_wheels.py "${SERVE_WHEELS:-.serve_wheels}" "$SITE"
export PYTHONPATH=$SITE:$PYTHONPATH
python3 -m pytest -q -m gpu -n "${GPU_SUITE_WORKERS:-4}" --dist loadfile -rfEs "${@:-tests/}"
