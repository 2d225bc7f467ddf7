"""Host µs per page-allocator call (hicache/allocator.py) at the page counts a request moves: alloc,
publish (give_to_tree) and evict (free_from_tree) of one consecutive run, and of the same number of
scattered pages. Every L2 hit makes several of these calls on the loop thread.

    python scripts/bench_allocator.py [--pages 22] [--repeats 2000] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cli import positive_int  # noqa: E402
from hicache.allocator import PageAllocator  # noqa: E402


def measure(pages: int, repeats: int, scattered: bool) -> dict[str, float]:
    alloc = PageAllocator(64 * pages, "bench")
    claim = alloc.new_claim("bench")
    if scattered:  # every other page taken: each allocation is `pages` runs of one page
        hold = alloc.new_claim("hold")
        for p in alloc.alloc(64 * pages, hold)[1::2]:
            alloc.free([p], hold)
    times: dict[str, list[int]] = {"alloc": [], "give_to_tree": [], "free_from_tree": []}
    for _ in range(repeats):
        t = time.perf_counter_ns()
        got = alloc.alloc(pages, claim)
        times["alloc"].append(time.perf_counter_ns() - t)
        t = time.perf_counter_ns()
        alloc.give_to_tree(got, claim)
        times["give_to_tree"].append(time.perf_counter_ns() - t)
        t = time.perf_counter_ns()
        alloc.free_from_tree(got)
        times["free_from_tree"].append(time.perf_counter_ns() - t)
    return {k: statistics.median(v) / 1e3 for k, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=positive_int, default=22, help="pages per call (a 350-token prefix at page 16: 22)")
    p.add_argument("--repeats", type=positive_int, default=2000, help="calls timed of each (median)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = {layout: measure(args.pages, args.repeats, layout == "scattered") for layout in ("run", "scattered")}
    if args.json:
        print(json.dumps({"pages": args.pages, "us_per_call": out}))
    else:
        print(f"{'pages':>5s} {'layout':10s} {'alloc':>8s} {'publish':>8s} {'evict':>8s}  (median us per call)")
        for layout, r in out.items():
            print(f"{args.pages:5d} {layout:10s} {r['alloc']:8.1f} {r['give_to_tree']:8.1f} {r['free_from_tree']:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
