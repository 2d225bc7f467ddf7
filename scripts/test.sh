#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the test suite on the CPU (Triton in its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TRITON_INTERPRET=1
# every core (CI's two): tests taken one by one by whichever worker is free (worksteal), so the slowest files
# (the interpreted sampling kernels) spread over both; `-n 0` after it runs them in this process
python -m pytest -q -p no:cacheprovider -n auto --dist worksteal "$@"
