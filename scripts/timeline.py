"""Timeline of a hicache structured log: tables, Chrome trace JSON and a Gantt PNG.

    python scripts/timeline.py LOG [--chrome OUT.json] [--png OUT.png]
"""
from __future__ import annotations

import argparse
import sys

from scheduler.timeline import build_timeline, print_tables, read_events, render_png, write_chrome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="JSON-lines event log written with --log-json")
    parser.add_argument("--chrome", metavar="OUT.json",
                        help="write Chrome trace-event JSON (Perfetto, chrome://tracing)")
    parser.add_argument("--png", metavar="OUT.png", help="write a Gantt chart")
    parser.add_argument("--no-tables", action="store_true", help="do not print the tables")
    args = parser.parse_args(argv)

    bad_lines: list[int] = []
    timeline = build_timeline(read_events(args.log, bad_lines=bad_lines), num_bad_lines=len(bad_lines))
    if not args.no_tables:
        print_tables(timeline, sys.stdout)
    if args.chrome:
        write_chrome(timeline, args.chrome)
        print(f"wrote {args.chrome}", file=sys.stderr)
    if args.png:
        render_png(timeline, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
