#!/usr/bin/env bash
# Creates .venv with the CPU build of torch (from local disk on these machines) and the project.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then pip install -q torch; else pip install -q "torch==2.13.0"; fi
fi
# the project once per pyproject.toml (each editable install reprinted setuptools' warnings): a stamp in
# .venv names the file's hash; remove .venv/.setup-* to install again
stamp=".venv/.setup-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  pip install -q -e ".[test]"
  rm -f .venv/.setup-*
  touch "$stamp"
fi
