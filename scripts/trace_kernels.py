"""Where a forward's device time goes, from a chrome trace of torch.profiler (bench_hicache_stress.py
--trace DIR writes one per tier): GPU kernels are grouped into forwards (runs of work on one stream
with no idle stretch longer than --gap-us), and each forward's span is split into kernel time per
kernel family and the idle time between kernels. Kernels on other streams (a restore's copy
kernel, transfers) are listed by how long they overlap the forwards.

    python scripts/trace_kernels.py out/trace/l2.json.gz [--gap-us 200] [--min-kernels 100] [--split-skinny]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cli import non_negative_float, positive_int, trace_events  # noqa: E402

# a kernel name -> its family: Triton kernels by function name, the rest by a short prefix
FAMILIES = [("skinny", r"_skinny_kernel"), ("attention split", r"_split_kernel"),
            ("attention merge", r"_merge_kernel"), ("add_rms_norm", r"_add_rms_norm_kernel"),
            ("qk_norm_rope_kv", r"_qk_norm_rope_kv_kernel"), ("attention (SDPA)", r"sdpa|flash|fmha"),
            ("gemm (cuBLAS)", r"gemm|gemv|cutlass|nvjet|sm90"),
            ("copy kernel", r"h2d|d2h|_copy|gather|scatter"), ("embedding", r"index|embedding")]


def family(name: str) -> str:
    for label, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return name[:40]


def load(path: str, ap: argparse.ArgumentParser | None = None) -> list[dict]:
    """The trace's device work; a file that is no chrome trace: `ap`'s one-line error, exit 2."""
    events = trace_events(ap or argparse.ArgumentParser(prog="trace_kernels.py"), path)
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def forwards(kernels: list[dict], gap_us: float, min_kernels: int) -> list[list[dict]]:
    """Runs of kernels on the busiest stream separated by idle stretches longer than gap_us."""
    by_stream = defaultdict(list)
    for k in kernels:
        by_stream[(k.get("pid"), k.get("tid"))].append(k)
    main = max(by_stream.values(), key=lambda ks: sum(k["dur"] for k in ks))
    main.sort(key=lambda k: k["ts"])
    runs, current = [], [main[0]]
    for k in main[1:]:
        end = max(c["ts"] + c["dur"] for c in current[-4:])
        if k["ts"] - end > gap_us:
            runs.append(current)
            current = []
        current.append(k)
    runs.append(current)
    return [r for r in runs if len(r) >= min_kernels]


# the skinny projections of a layer, in the order a layer launches them (scheduler/model.py)
SKINNY_ORDER = ("qkv", "o_proj", "gate_up", "down")


def summarize(run: list[dict], others: list[dict], split_skinny: bool = False) -> dict:
    """split_skinny: the skinny family split into the layer's four projections by their order."""
    start, end = run[0]["ts"], max(k["ts"] + k["dur"] for k in run)
    busy = defaultdict(float)
    calls = defaultdict(int)
    covered, last_end = 0.0, start
    skinny_seen = 0
    for k in run:
        fam = family(k["name"])
        if split_skinny and fam == "skinny":
            fam = f"skinny {SKINNY_ORDER[skinny_seen % len(SKINNY_ORDER)]}"
            skinny_seen += 1
        busy[fam] += k["dur"]
        calls[fam] += 1
        k_end = k["ts"] + k["dur"]
        covered += max(0.0, k_end - max(k["ts"], last_end))
        last_end = max(last_end, k_end)
    overlap = defaultdict(float)
    for k in others:
        lo, hi = max(k["ts"], start), min(k["ts"] + k["dur"], end)
        if hi > lo:
            overlap[family(k["name"])] += hi - lo
    return {"span_us": end - start, "kernels": len(run), "busy_us": covered, "idle_us": end - start - covered,
            "by_family_us": dict(busy), "calls": dict(calls), "other_streams_us": dict(overlap)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--gap-us", type=non_negative_float, default=200.0, help="idle stretch that ends a forward")
    ap.add_argument("--min-kernels", type=positive_int, default=100, help="shorter runs are not forwards")
    ap.add_argument("--split-skinny", action="store_true",
                    help="the skinny projections by their place in a layer (qkv, o_proj, gate_up, down)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    kernels = load(args.trace, ap)
    if not kernels:
        print(f"{args.trace}: no GPU kernels in the trace", file=sys.stderr)
        return 1
    runs = forwards(kernels, args.gap_us, args.min_kernels)
    if not runs:
        print(f"{args.trace}: no run of >= {args.min_kernels} kernels", file=sys.stderr)
        return 1
    main_ids = {id(k) for r in runs for k in r}
    main_stream = (runs[0][0].get("pid"), runs[0][0].get("tid"))
    others = [k for k in kernels if id(k) not in main_ids and (k.get("pid"), k.get("tid")) != main_stream]
    rows = [summarize(r, others, args.split_skinny) for r in runs]
    if args.json:
        print(json.dumps(rows))
        return 0

    def med(values) -> float:
        values = list(values)
        return statistics.median(values) if values else 0.0

    print(f"{args.trace}: {len(rows)} forwards, median us")
    print(f"  span {med(r['span_us'] for r in rows):9.1f}   kernels {med(r['kernels'] for r in rows):5.0f}   "
          f"busy {med(r['busy_us'] for r in rows):9.1f}   idle between kernels {med(r['idle_us'] for r in rows):7.1f}")
    fams = sorted({f for r in rows for f in r["by_family_us"]},
                  key=lambda f: -med(r["by_family_us"].get(f, 0) for r in rows))
    print(f"  {'family':24s} {'us':>9s} {'calls':>6s} {'us/call':>8s}")
    for f in fams:
        us = med(r["by_family_us"].get(f, 0.0) for r in rows)
        n = med(r["calls"].get(f, 0) for r in rows)
        print(f"  {f:24s} {us:9.1f} {n:6.0f} {us / n if n else 0:8.2f}")
    other = sorted({f for r in rows for f in r["other_streams_us"]})
    for f in other:
        print(f"  other stream: {f:24s} {med(r['other_streams_us'].get(f, 0.0) for r in rows):9.1f} us overlapping")
    streams = defaultdict(lambda: [0, 0.0])
    for k in others:
        streams[(k.get("tid"), family(k["name"]))][0] += 1
        streams[(k.get("tid"), family(k["name"]))][1] += k["dur"]
    for (tid, fam), (n, us) in sorted(streams.items(), key=lambda kv: -kv[1][1]):
        print(f"  stream {tid}: {n} x {fam} ({us:.1f} us in all, overlapping a forward or not)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
