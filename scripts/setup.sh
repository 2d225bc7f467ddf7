#!/usr/bin/env bash
# Creates .venv with the CPU build of torch (from local disk on these machines) and the project.
set -euo pipefail
cd "$(dirname "$0")/.."
# everything through .venv/bin/python, not bin/activate: activate names the directory the venv was made in (a moved
# or copied checkout, or a path with a `$`, put another Python first on PATH, and pip installed into that one)
py=.venv/bin/python
# a .venv whose python cannot start (its interpreter since removed) is made again: `python3 -m venv` over it failed,
# run after run; --clear takes the old one's stamp with it
if ! "$py" -c "" >/dev/null 2>&1; then
  python3 -m venv --clear .venv
fi
# a venv without pip (cut short while `python3 -m venv` ran ensurepip) gets the one its Python bundles
if ! "$py" -m pip --version >/dev/null 2>&1; then
  "$py" -m ensurepip >/dev/null
fi
"$py" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then "$py" -m pip install -q torch
  else "$py" -m pip install -q "torch==2.13.0"; fi
fi
# the project once per pyproject.toml and checkout (each editable install reprinted setuptools' warnings; one made
# in a checkout since moved names its old path): a stamp in .venv names their hash; remove .venv/.setup-* to install
# again
stamp=".venv/.setup-$( { pwd -P; cat pyproject.toml; } | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  "$py" -m pip install -q -e ".[test]"
  rm -f .venv/.setup-*
  touch "$stamp"
fi
