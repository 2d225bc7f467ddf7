"""How a restore's copies ran on the device, from a chrome trace of torch.profiler
(bench_hicache.py --trace DIR writes one per tier and length): copies of one direction are grouped
into transfers (no idle stretch longer than --gap-us), and each transfer reports its DMAs, bytes,
span, the idle time between its DMAs, and the rate of its DMAs that ran with at most a waiting
attention kernel beside them (< 10 % overlap with any other kernel) against those that ran at least
half beside other kernels (the forward's projections read weights from HBM; a forward waiting for a
layer only spins in its attention kernel).

    python scripts/trace_copies.py out/trace/l2_8000.json.gz [--direction HtoD] [--gap-us 300] [--kernels N] [--json]
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cli import non_negative_float, non_negative_int, trace_events  # noqa: E402

WAITING = ("_split_kernel", "_wait_kernel", "decode_attention", "_attention")  # kernels that may spin on a flag


def load(path: str, ap: argparse.ArgumentParser | None = None) -> tuple[list[dict], list[dict]]:
    """The trace's copies and kernels; a file that is no chrome trace: `ap`'s one-line error, exit 2."""
    events = trace_events(ap or argparse.ArgumentParser(prog="trace_copies.py"), path)
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    return copies, kernels


def overlap_us(start: float, end: float, spans: list[tuple[float, float]], starts: list[float]) -> float:
    """Microseconds of [start, end) covered by the union of `spans` (sorted by start, non-overlapping)."""
    i = max(0, bisect.bisect_right(starts, start) - 1)
    got = 0.0
    while i < len(spans) and spans[i][0] < end:
        got += max(0.0, min(end, spans[i][1]) - max(start, spans[i][0]))
        i += 1
    return got


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _arg(copy: dict, key: str):
    args = copy.get("args")
    return args.get(key) if isinstance(args, dict) else None


def _bytes(copy: dict) -> int:
    value = _arg(copy, "bytes")
    return value if isinstance(value, int) else 0


def _stream_order(stream) -> tuple:
    return (0, stream, "") if isinstance(stream, int) else (1, 0, str(stream))


def transfers(copies: list[dict], direction: str, gap_us: float, min_bytes: int) -> list[list[dict]]:
    mine = sorted((c for c in copies if direction in c["name"] and _bytes(c) >= min_bytes),
                  key=lambda c: c["ts"])
    groups: list[list[dict]] = []
    for c in mine:
        if groups and c["ts"] - (groups[-1][-1]["ts"] + groups[-1][-1]["dur"]) <= gap_us:
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def beside_by_name(group: list[dict], kernels: list[dict], top: int) -> list[tuple[str, float]]:
    """The kernel names that ran beside the transfer's DMAs longest: [(name, microseconds)]."""
    spans = sorted((c["ts"], c["ts"] + c["dur"]) for c in group)
    starts = [s for s, _ in spans]
    by: dict[str, float] = {}
    for k in kernels:
        us = overlap_us(k["ts"], k["ts"] + k["dur"], spans, starts)
        if us > 0:
            by[k["name"][:60]] = by.get(k["name"][:60], 0.0) + us
    return sorted(by.items(), key=lambda kv: -kv[1])[:top]


def report(group: list[dict], busy: list[tuple[float, float]], busy_starts: list[float]) -> dict:
    nbytes = sum(_bytes(c) for c in group)
    span = group[-1]["ts"] + group[-1]["dur"] - group[0]["ts"]
    dma_us = sum(c["dur"] for c in group)
    beside = [(c, overlap_us(c["ts"], c["ts"] + c["dur"], busy, busy_starts) / max(c["dur"], 1e-9)) for c in group]
    alone = [c for c, f in beside if f < 0.1]
    loaded = [c for c, f in beside if f >= 0.5]

    def rate(cs: list[dict]) -> float | None:
        us = sum(c["dur"] for c in cs)
        return sum(_bytes(c) for c in cs) / us / 1e3 if us else None  # GB/s

    return {"dmas": len(group), "bytes": nbytes, "span_us": span, "dma_us": dma_us, "idle_us": span - dma_us,
            "gb_s_span": nbytes / span / 1e3, "gb_s_alone": rate(alone), "gb_s_beside_kernels": rate(loaded),
            "dmas_alone": len(alone), "dmas_beside_kernels": len(loaded),
            "streams": sorted({_arg(c, "stream") for c in group}, key=_stream_order)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--direction", default="HtoD", help="HtoD or DtoH (as the trace names copies)")
    ap.add_argument("--gap-us", type=non_negative_float, default=300.0, help="idle stretch that ends a transfer")
    ap.add_argument("--min-bytes", type=non_negative_int, default=256 << 10,
                    help="smaller copies (page indices) are left out")
    ap.add_argument("--kernels", type=non_negative_int, default=0,
                    help="also list the N kernels that ran beside each transfer longest")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    copies, kernels = load(args.trace, ap)
    if not copies:  # (regression: an empty table, exit 0; trace_kernels says so of no kernels)
        print(f"{args.trace}: no copies in the trace (a CPU run has none)", file=sys.stderr)
        return 1
    # kernels other than those that may spin on a layer flag: what competes with the DMAs for HBM
    busy = union([(k["ts"], k["ts"] + k["dur"]) for k in kernels if not any(w in k["name"] for w in WAITING)])
    starts = [s for s, _ in busy]
    groups = transfers(copies, args.direction, args.gap_us, args.min_bytes)
    if not groups:
        print(f"{args.trace}: no {args.direction} copies of >= {args.min_bytes} bytes "
              f"(of {len(copies)} copies in the trace)", file=sys.stderr)
        return 1
    rows = [report(g, busy, starts) for g in groups]
    for r, g in zip(rows, groups):
        if args.kernels:
            r["beside"] = beside_by_name(g, kernels, args.kernels)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'dmas':>5} {'MB':>8} {'span us':>9} {'idle us':>8} {'GB/s span':>9} {'GB/s alone (n)':>15} "
          f"{'GB/s beside (n)':>16} streams")
    for r in rows:
        fmt = lambda v, n: f"{v:8.1f} ({n:>3})" if v is not None else f"{'-':>8} ({n:>3})"  # noqa: E731
        print(f"{r['dmas']:>5} {r['bytes'] / 1e6:8.1f} {r['span_us']:9.0f} {r['idle_us']:8.0f} {r['gb_s_span']:9.1f} "
              f"{fmt(r['gb_s_alone'], r['dmas_alone']):>15} {fmt(r['gb_s_beside_kernels'], r['dmas_beside_kernels']):>16} "
              f"{r['streams']}")
        for name, us in r.get("beside", []):
            print(f"      {us:9.0f} us beside: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
