#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), then replays the bundled sample trace on the CPU with the tiny
# preset and all three cache tiers on, printing hit tokens per tier. Extra arguments go to the replay.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python scripts/replay_trace.py "$@"
