"""Plot forced-tier latency against prefix length from bench_hicache.py JSON files (each a row or a list of rows
with prefix_tokens and latency_ms.p50). The title names the model(s), device(s) and dtype(s) the rows record.

    python scripts/plot_latency.py docs/results/latency_*.json --out docs/latency.png
"""
from __future__ import annotations

import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cli import read_json  # noqa: E402


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_rows(ap: argparse.ArgumentParser, path: str) -> list[dict]:
    """The file's rows, or the parser's one-line error naming it (regression: a KeyError or TypeError traceback)."""
    data = read_json(ap, path)
    rows = data if isinstance(data, list) else [data]
    for r in rows:
        if not (isinstance(r, dict) and _number(r.get("prefix_tokens")) and isinstance(r.get("latency_ms"), dict)
                and _number(r["latency_ms"].get("p50"))):
            ap.error(f"{path}: not bench_hicache.py's JSON (each row needs prefix_tokens and latency_ms.p50)")
    if not rows:
        ap.error(f"{path}: no rows")
    return rows


def title(rows: list[dict]) -> str:
    """What the rows record of their model, device and dtype (each where present; several joined by '/')."""
    parts = []
    for key in ("model", "device", "dtype"):
        seen = sorted({str(r[key]) for r in rows if r.get(key) is not None})
        if seen:
            parts.append("/".join(seen))
    return "Forced-tier restore latency" + (f", {', '.join(parts)}" if parts else "")


def out_path(ap: argparse.ArgumentParser, fig, out: str) -> str:
    """The file savefig writes: `out`, with .png where it names no format (matplotlib adds it)."""
    if os.path.isdir(out):
        ap.error(f"--out {out}: is a directory; give the image's file path")
    ext = os.path.splitext(out)[1].lstrip(".").lower()
    if not ext:
        out += ".png"
    elif ext not in fig.canvas.get_supported_filetypes():
        ap.error(f"--out {out}: .{ext} is no image format matplotlib writes")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        ap.error(f"--out {out}: its directory does not exist")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default="docs/latency.png", help="the image (.png where no extension is given)")
    args = ap.parse_args(argv)
    data = {path: read_rows(ap, path) for path in args.files}  # (every file checked before anything is drawn)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    out = out_path(ap, fig, args.out)
    recompute: dict[str, dict[int, float]] = {}
    for path, rows in data.items():
        label = os.path.basename(path).removesuffix(".json").removeprefix("latency_")
        xs = [r["prefix_tokens"] for r in rows]
        ax.plot(xs, [r["latency_ms"]["p50"] for r in rows], marker="o", label=label)
        for r in rows:
            rc = r.get("recompute") or {}
            if isinstance(rc, dict) and isinstance(rc.get("latency_ms"), dict) and _number(rc["latency_ms"].get("p50")):
                recompute.setdefault(str(r.get("model")), {})[r["prefix_tokens"]] = rc["latency_ms"]["p50"]
    for model, pts in recompute.items():
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], linestyle="--", marker="x", label=f"recompute {model}")
    ax.set_xlabel("prefix tokens")
    ax.set_ylabel("latency p50 (ms)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title([r for rows in data.values() for r in rows]))  # (regression: "H200, bf16" whatever ran)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as exc:  # (a directory it may not write)
        ap.error(f"--out {out}: {exc.strerror or exc}")
    print(out)  # (regression: --out adir printed adir; matplotlib wrote adir.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
