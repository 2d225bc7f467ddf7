#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the test suite on the CPU (Triton in its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TRITON_INTERPRET=1
python -m pytest -q -p no:cacheprovider "$@"
