#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), then replays the bundled sample trace on the CPU with the tiny
# preset and all three cache tiers on, printing hit tokens per tier. Extra arguments go to the replay.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# .venv's python first on PATH (not through bin/activate, which names the directory the venv was made in)
export PATH="$PWD/.venv/bin:$PATH"
exec python scripts/replay_trace.py "$@"
