"""Where an engine's start and shutdown go: the engine of a replay command line (the replay's
flags: `--model`, `--l2-gib`, `--l3-gib`, ...) made under cProfile, its top functions by
cumulative time, then its shutdown timed. Nothing is replayed.

    python3 scripts/probe_start.py --model qwen3-8b --device cuda --l1-tokens 65536 --l2-gib 64 --l3-gib 24
"""
from __future__ import annotations

import asyncio
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler.replay_args import build_parser, check_replay_args, config_from_replay_args, fill_defaults  # noqa: E402


def main() -> int:
    # (its own flag first: regression, --top came last in the usage line, after every replay flag)
    parser = build_parser(__doc__, lambda p: p.add_argument("--top", type=int, default=25, help="functions to list"))
    args = parser.parse_args()
    fill_defaults(args)
    check_replay_args(parser, args)
    config = config_from_replay_args(args)
    from scheduler.engine import Engine  # (after the flags: --help stays quick)

    profile = cProfile.Profile()
    t = time.perf_counter()
    engine = profile.runcall(Engine, config)
    made_s = time.perf_counter() - t
    pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)
    t = time.perf_counter()
    asyncio.run(engine.shutdown())
    print(f"engine made in {made_s:.2f} s, shut down in {time.perf_counter() - t:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
