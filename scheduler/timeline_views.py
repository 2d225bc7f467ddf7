"""What a Timeline (scheduler/timeline.py) looks like to a reader: plain and rich tables, Chrome
trace-event JSON (Perfetto, chrome://tracing) and a Gantt PNG (matplotlib)."""
from __future__ import annotations

import heapq
import json
import sys
from pathlib import Path
from typing import TextIO

from scheduler.timeline import Timeline

# Chrome trace processes (one track group each)
PID_SCHEDULER, PID_REQUESTS, PID_TRANSFERS, PID_OCCUPANCY = 1, 2, 3, 4


# ---------------------------------------------------------------- tables

def _fmt_ms(ns: int | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.2f}"


REQUEST_COLUMNS = ("rid", "arrival_ms", "queue_ms", "restore", "restore_ms", "prefill_ms",
                   "first_token_ms", "preemptions", "preempted_ms", "finish_ms", "output_tokens", "state", "reason")
OP_COLUMNS = ("op", "kind", "request", "states (ms in each)", "bytes", "outcome")


def request_rows(tl: Timeline) -> list[tuple[str, ...]]:
    return [(r.key, f"{tl.rel_ms(r.arrival_ns):.2f}", _fmt_ms(r.queue_wait_ns), r.restore_tier or "-",
             _fmt_ms(r.restore_wait_ns), _fmt_ms(r.prefill_ns), _fmt_ms(r.first_token_ns), str(r.preemptions),
             _fmt_ms(r.preempted_ns(tl.open_end_ns(r.run))), _fmt_ms(r.finish_ns),
             "-" if r.output_tokens is None else str(r.output_tokens), r.final_state, r.end_reason or "")
            for r in tl.requests.values()]


def op_rows(tl: Timeline) -> list[tuple[str, ...]]:
    rows = []
    for op in tl.ops.values():
        parts = [op.initial_state] + [f"{s} {_fmt_ms(b - a)}" for s, a, b in op.state_spans(tl.open_end_ns(op.run))]
        if op.ended:
            parts.append(op.transitions[-1][0])
        outcome = op.outcome + (f": {op.error}" if op.error else "")
        rows.append((str(op.key), op.kind, op.request_id or "-", " > ".join(parts),
                     "-" if op.num_bytes is None else str(op.num_bytes), outcome))
    return rows


def summary_line(tl: Timeline) -> str:
    kinds = sorted({b.kind for b in tl.batches})
    per_kind = ", ".join(f"{sum(b.kind == k for b in tl.batches)} {k}" for k in kinds) or "0"
    runs = f" in {tl.num_runs} runs" if tl.num_runs > 1 else ""
    return (f"{len(tl.requests)} requests, {len(tl.ops)} ops, batches: {per_kind}{runs}; span "
            f"{tl.rel_ms(tl.last_ns):.2f} ms; skipped: {tl.num_bad_lines} non-JSON lines, "
            f"{tl.num_unknown_events} unknown events, {tl.num_malformed_events} malformed events")


def _plain_table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def format_tables(tl: Timeline) -> str:
    """Plain-text request and operation tables."""
    return "\n\n".join([summary_line(tl), _plain_table("Requests", REQUEST_COLUMNS, request_rows(tl)),
                        _plain_table("Operations", OP_COLUMNS, op_rows(tl))]) + "\n"


def print_tables(tl: Timeline, file: TextIO = sys.stdout) -> None:
    """Rich tables on a terminal, `format_tables` text otherwise."""
    if not file.isatty():
        file.write(format_tables(tl))
        return
    from rich.console import Console
    from rich.table import Table

    # the cells as logged: a request id is a client's (any printable ASCII), an error any text (regression: read as
    # rich markup, "[/x]" in one raised MarkupError, "[bold]" vanished, ":smile:" became an emoji)
    console = Console(file=file, markup=False, emoji=False)
    console.print(summary_line(tl))
    tables = (("Requests", REQUEST_COLUMNS, request_rows(tl)), ("Operations", OP_COLUMNS, op_rows(tl)))
    for title, header, rows in tables:
        table = Table(title=title)
        for h in header:
            table.add_column(h, overflow="fold")
        for r in rows:
            table.add_row(*r)
        console.print(table)


# ---------------------------------------------------------------- chrome trace

def _async_slices(name: str, cat: str, slice_id: object, pid: int, tid: int, start_us: float, end_us: float,
                  nested: list[tuple[str, float, float]], args_b: dict, args_e: dict) -> list[dict]:
    common = {"cat": cat, "id": slice_id, "pid": pid, "tid": tid}
    out = [{"name": name, "ph": "b", "ts": start_us, "args": args_b, **common}]
    for sub, a, b in nested:
        out += [{"name": sub, "ph": "b", "ts": a, **common}, {"name": sub, "ph": "e", "ts": b, **common}]
    out.append({"name": name, "ph": "e", "ts": end_us, "args": args_e, **common})
    return out


def to_chrome(tl: Timeline) -> dict:
    """Chrome trace-event JSON: batches are "X" slices on pid 1, tid 1 unless they overlap one before
    them (a chained decode step is launched before the step before it ends), then on the next tid free
    at their start; requests (cat "request", id = its key) and ops (cat = op kind, id = its key) are
    async "b"/"e" slices with one nested slice per state; occupancy is one "C" counter per tier.
    Timestamps in µs from the first event."""
    us = lambda ns: (ns - tl.base_ns) / 1e3  # noqa: E731
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "ts": 0, "args": {"name": name}}
            for pid, name in ((PID_SCHEDULER, "scheduler"), (PID_REQUESTS, "requests"),
                              (PID_TRANSFERS, "transfers"), (PID_OCCUPANCY, "occupancy"))]
    # regression: every batch was on tid 1, where chained decode steps overlap; "X" slices of one
    # thread must nest, and Perfetto drops those that overlap (its import error list says so)
    lanes = _pack_lanes([(b.start_ns, b.end_ns) for b in tl.batches])
    meta += [{"name": "thread_name", "ph": "M", "pid": PID_SCHEDULER, "tid": 1 + lane, "ts": 0,
              "args": {"name": "batches" if lane == 0 else f"batches (overlapping, {lane})"}}
             for lane in range(max(lanes, default=0) + 1)]
    ev: list[dict] = []
    for b, lane in zip(tl.batches, lanes):
        ev.append({"name": f"{b.kind} #{b.batch_id}", "cat": "batch", "ph": "X", "pid": PID_SCHEDULER,
                   "tid": 1 + lane, "ts": us(b.start_ns), "dur": (b.end_ns - b.start_ns) / 1e3,
                   "args": {"batch_id": b.batch_id, "num_seqs": b.num_seqs, "num_tokens": b.num_tokens}})
    for r in tl.requests.values():
        nested = [(phase, us(a), us(b)) for phase, a, b in r.phase_spans(tl.open_end_ns(r.run))]
        args_b = {"rid": r.rid, "run": r.run, "prompt_tokens": r.prompt_tokens, "restore_tier": r.restore_tier,
                  "restore_tokens": r.restore_tokens, **{f"hit_{t}_tokens": n for t, n in r.hit_tokens.items()}}
        args_e = {"final_state": r.final_state, "output_tokens": r.output_tokens, "reason": r.end_reason,
                  "preemptions": r.preemptions}
        if r.end_ns is None:
            args_e["incomplete"] = True
        ev += _async_slices(f"request {r.key}", "request", r.key, PID_REQUESTS, 1, us(r.arrival_ns),
                            us(r.close_ns(tl.open_end_ns(r.run))), nested, args_b, args_e)
    for op in tl.ops.values():
        nested = [(s, us(a), us(b)) for s, a, b in op.state_spans(tl.open_end_ns(op.run))]
        args_b = {"op_id": op.op_id, "run": op.run, "initial_state": op.initial_state,
                  "request_id": op.request_id, "bytes": op.num_bytes, "pages": op.num_pages}
        args_e = {"outcome": op.outcome, "final_state": op.transitions[-1][0], "error": op.error}
        if not op.ended:
            args_e["incomplete"] = True
        ev += _async_slices(f"{op.kind} op {op.key}", op.kind, op.key, PID_TRANSFERS, 1, us(op.start_ns),
                            us(op.end_ns(tl.open_end_ns(op.run))), nested, args_b, args_e)
    for tier, samples in tl.occupancy.items():
        for s in samples:
            ev.append({"name": f"{tier} pages", "ph": "C", "pid": PID_OCCUPANCY, "tid": 0, "ts": us(s.ts_ns),
                       "args": {"used_pages": s.used_pages, "free_pages": max(0, s.capacity_pages - s.used_pages)}})
    ev.sort(key=lambda e: e["ts"])  # stable: a slice's "e" stays before the next "b" at the same ts
    return {"traceEvents": meta + ev, "displayTimeUnit": "ms",
            "otherData": {"base_monotonic_ns": tl.base_ns, "source": "hicache structured log"}}


def write_chrome(tl: Timeline, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_chrome(tl)))


# ---------------------------------------------------------------- png

def _pack_lanes(spans: list[tuple[float, float]]) -> list[int]:
    """Greedy interval packing: a lane index for each (start, end), spans given in start order: the lowest lane
    whose last span ended by its start, else a new one. The lanes sit in heaps, busy ones by their end and free
    ones by index (regression: each span scanned every lane, O(spans x lanes): 6 s for 8,000 requests open at
    once); a lane free at a start stays free for every later one."""
    busy: list[tuple[float, int]] = []  # (end of its last span, lane)
    free: list[int] = []
    lanes = []
    num_lanes = 0
    for a, b in spans:
        while busy and busy[0][0] <= a:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lane = heapq.heappop(free)
        else:
            lane, num_lanes = num_lanes, num_lanes + 1
        heapq.heappush(busy, (b, lane))
        lanes.append(lane)
    return lanes


def _by_lane(lanes: list[int], items: list) -> list[list]:
    """`items` grouped by their lane, in their order: one pass (regression: a pass over all of them per lane)."""
    grouped: list[list] = [[] for _ in range(max(lanes, default=-1) + 1)]
    for lane, item in zip(lanes, items):
        grouped[lane].append(item)
    return grouped


def png_ms(tl: Timeline):
    """`ms(ts_ns, run)`: where the PNG draws a time of a run, in ms. Runs follow one another in file
    order with the time between them cut. (Regression: drawn at their own times, two runs an hour
    apart were two slivers at the ends of an hour-wide axis, and a run whose clock restarted, after a
    reboot, was drawn over the runs before it.)"""
    shifts_ns, origin_ns, drawn_end_ns = [], None, None
    for first, last in zip(tl.run_first_ns, tl.run_last_ns):
        if first is None:  # a run with no event drawn
            shifts_ns.append(0)
            continue
        shift = 0 if drawn_end_ns is None else first - drawn_end_ns
        origin_ns = first if origin_ns is None else origin_ns
        shifts_ns.append(shift)
        drawn_end_ns = last - shift
    origin_ns = tl.base_ns if origin_ns is None else origin_ns
    return lambda ts_ns, run: (ts_ns - (shifts_ns[run] if run < len(shifts_ns) else 0) - origin_ns) / 1e6


def render_png(tl: Timeline, path: str | Path, *, max_request_rows: int = 40) -> None:
    """A Gantt chart (requests by phase, batches, transfers by state) over per-tier occupancy; runs
    one after the other (`png_ms`), a dashed line where one starts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    rows: list[tuple[str, list[tuple[float, float, str]]]] = []  # (label, [(start_ms, width_ms, color_key)])
    ms = png_ms(tl)
    reqs = list(tl.requests.values())
    req_spans = [[(ms(a, r.run), (b - a) / 1e6, phase) for phase, a, b in r.phase_spans(tl.open_end_ns(r.run))]
                 for r in reqs]
    if len(reqs) <= max_request_rows:
        rows += [(f"req {r.key}", spans) for r, spans in zip(reqs, req_spans)]
    else:
        reqs_at = sorted(range(len(reqs)), key=lambda i: ms(reqs[i].arrival_ns, reqs[i].run))  # (drawn order)
        lanes = _pack_lanes([(ms(reqs[i].arrival_ns, reqs[i].run),
                              ms(reqs[i].close_ns(tl.open_end_ns(reqs[i].run)), reqs[i].run)) for i in reqs_at])
        for lane, of_lane in enumerate(_by_lane(lanes, reqs_at)):
            rows.append((f"requests {lane}", [s for i in of_lane for s in req_spans[i]]))
    for kind in sorted({b.kind for b in tl.batches}):
        rows.append((f"batch {kind}", [(ms(b.start_ns, b.run), (b.end_ns - b.start_ns) / 1e6, f"batch {kind}")
                                       for b in tl.batches if b.kind == kind]))
    ops = sorted(tl.ops.values(), key=lambda o: ms(o.start_ns, o.run))
    op_lanes = _pack_lanes([(ms(o.start_ns, o.run), ms(o.end_ns(tl.open_end_ns(o.run)), o.run)) for o in ops])
    for lane, of_lane in enumerate(_by_lane(op_lanes, ops)):
        rows.append((f"transfers {lane}", [(ms(a, o.run), (b - a) / 1e6, s) for o in of_lane
                                           for s, a, b in o.state_spans(tl.open_end_ns(o.run))]))
    run_starts_ms = [ms(first, run) for run, first in enumerate(tl.run_first_ns) if first is not None]
    end_ms = max([ms(last, run) for run, last in enumerate(tl.run_last_ns) if last is not None], default=0.0)
    keys = list(dict.fromkeys(k for _, spans in rows for *_, k in spans))
    cmap = plt.get_cmap("tab20")
    colors = {k: cmap(i % 20) for i, k in enumerate(keys)}
    fig, (ax, ax_occ) = plt.subplots(2, 1, figsize=(14, min(60, 3 + 0.3 * len(rows))), sharex=True,
                                     gridspec_kw={"height_ratios": [max(3, len(rows)), 3]})
    min_width_ms = max(end_ms, 1e-3) / 2000  # keep instant spans visible
    boxes, box_colors = [], []  # one PolyCollection: thousands of broken_barh calls take minutes
    for y, (_, spans) in enumerate(rows):
        for start, width, key in spans:
            x0, x1 = start, start + max(width, min_width_ms)
            boxes.append([(x0, y - 0.4), (x1, y - 0.4), (x1, y + 0.4), (x0, y + 0.4)])
            box_colors.append(colors[key])
    ax.add_collection(PolyCollection(boxes, facecolors=box_colors, edgecolors="none"))
    ax.set_xlim(0, max(end_ms, 1e-3) * 1.01)
    for x in run_starts_ms[1:]:
        for a in (ax, ax_occ):
            a.axvline(x, color="grey", linestyle="--", linewidth=0.8)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    # (labels hold request ids, a client's text: not mathtext, regression: "$a^$" in one raised ValueError)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=7, parse_math=False)
    ax.invert_yaxis()
    if keys:
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in keys], labels=keys,
                  fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(summary_line(tl), fontsize=8)
    for tier, samples in sorted(tl.occupancy.items()):
        xs, ys = [], []  # each run's levels, the last held to the run's end; a gap (NaN) between runs
        by_run: dict[int, list] = {}  # (grouped once: a scan of every sample per run was runs x samples)
        for s in samples:
            by_run.setdefault(s.run, []).append(s)
        for run, of_run in sorted(by_run.items()):
            fractions = [s.used_pages / max(1, s.capacity_pages) for s in of_run]
            xs += [ms(s.ts_ns, run) for s in of_run] + [ms(tl.open_end_ns(run), run), float("nan")]
            ys += fractions + fractions[-1:] + [float("nan")]
        ax_occ.step(xs, ys, where="post", label=tier)
    ax_occ.set_ylabel("used / capacity")
    ax_occ.set_xlabel("ms since first event" + (f" ({tl.num_runs} runs, the time between them cut)"
                                                if tl.num_runs > 1 else ""))
    if tl.occupancy:
        ax_occ.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    # a PNG unless the name asks for another format matplotlib writes, and at `path` itself
    # (regression: a name without one got ".png" added; an unknown one raised ValueError)
    suffix_format = Path(path).suffix[1:].lower()
    fig.savefig(path, dpi=100,
                format=suffix_format if suffix_format in fig.canvas.get_supported_filetypes() else "png")
    plt.close(fig)
