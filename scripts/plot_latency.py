"""Plot forced-tier latency against prefix length from bench_hicache.py JSON files.

    python scripts/plot_latency.py docs/results/latency_*.json --out docs/latency.png
"""
from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default="docs/latency.png")
    args = ap.parse_args(argv)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    recompute: dict[str, dict[int, float]] = {}
    for path in args.files:
        rows = json.load(open(path))
        rows = rows if isinstance(rows, list) else [rows]
        label = os.path.basename(path).removesuffix(".json").removeprefix("latency_")
        xs = [r["prefix_tokens"] for r in rows]
        ax.plot(xs, [r["latency_ms"]["p50"] for r in rows], marker="o", label=label)
        for r in rows:
            rc = r.get("recompute") or {}
            if rc.get("latency_ms"):
                recompute.setdefault(r["model"], {})[r["prefix_tokens"]] = rc["latency_ms"]["p50"]
    for model, pts in recompute.items():
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], linestyle="--", marker="x", label=f"recompute {model}")
    ax.set_xlabel("prefix tokens")
    ax.set_ylabel("latency p50 (ms)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Forced-tier restore latency, H200, bf16")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
