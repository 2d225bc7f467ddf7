#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the test suite on the CPU (Triton in its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# .venv's python first on PATH (not through bin/activate, which names the directory the venv was made in)
export PATH="$PWD/.venv/bin:$PATH"
export TRITON_INTERPRET=1
# a worker per core (CI's two), at most 4 (each holds its own torch); tests taken one by one by whichever worker is
# free (worksteal), so the slowest files (the interpreted sampling kernels) spread over all; `-n 0` after it runs
# them in this process
workers=$(python -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")
python -m pytest -q -p no:cacheprovider -n "$workers" --dist worksteal "$@"
