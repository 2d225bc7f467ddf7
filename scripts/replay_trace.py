"""Replay a Mooncake JSONL request trace against the in-process engine and print hit tokens per tier.

    python scripts/replay_trace.py [--trace T.jsonl] [engine flags] [--simulate] [--json-out OUT.json]

With no arguments: the bundled sample (scheduler/sample_trace.jsonl) on the CPU with the tiny preset and
all three cache tiers small enough that L2 and L3 hits happen. See scheduler/replay.py and --help.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without the editable install

from scheduler.replay import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
