"""Timeline of a hicache structured log: tables, Chrome trace JSON and a Gantt PNG.

    python scripts/timeline.py LOG [--chrome OUT.json] [--png OUT.png]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without the editable install
from scheduler.timeline import build_timeline, read_events  # noqa: E402
from scheduler.timeline_views import print_tables, render_png, write_chrome  # noqa: E402


def write_output(parser: argparse.ArgumentParser, path: str, write) -> None:
    """`write(path)` into `path`, its directory created; a path that cannot be written is a usage error."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write(path)
    except OSError as exc:
        parser.error(f"cannot write {path}: {exc.strerror or exc}")
    print(f"wrote {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="JSON-lines event log written with --log-json")
    parser.add_argument("--chrome", metavar="OUT.json",
                        help="write Chrome trace-event JSON (Perfetto, chrome://tracing)")
    parser.add_argument("--png", metavar="OUT.png", help="write a Gantt chart")
    parser.add_argument("--no-tables", action="store_true", help="do not print the tables")
    args = parser.parse_args(argv)

    bad_lines: list[int] = []
    try:
        events = read_events(args.log, bad_lines=bad_lines)
    except OSError as exc:
        parser.error(f"cannot read {args.log}: {exc.strerror or exc}")
    timeline = build_timeline(events, num_bad_lines=len(bad_lines))
    if not args.no_tables:
        print_tables(timeline, sys.stdout)
    if args.chrome:
        write_output(parser, args.chrome, lambda path: write_chrome(timeline, path))
    if args.png:
        write_output(parser, args.png, lambda path: render_png(timeline, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
