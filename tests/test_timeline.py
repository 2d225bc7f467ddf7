"""Timeline reconstruction from the structured event log: tables, Chrome trace JSON, PNG."""
from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import structlog

from hicache.ops import OpEvent, OpKind, apply, new_op
from scheduler.logs import add_monotonic_ns
from scheduler.timeline import OP_END_STATES, build_timeline, read_events
from scheduler.timeline_views import format_tables, print_tables, render_png, to_chrome

REPO = Path(__file__).resolve().parents[1]
T0_NS = 5_000_000_000  # an arbitrary monotonic origin
MS = 1_000_000


def req(t_ms: float, rid: str, state: str, **kw) -> dict:
    return {"event": "request", "ts_ns": T0_NS + int(t_ms * MS), "rid": rid, "state": state, **kw}


def op(t_ms: float, op_id: int, kind: str, frm: str, to: str, *, request_id=None, error=None) -> dict:
    return {"event": "op", "ts_ns": T0_NS + int(t_ms * MS), "op_id": op_id, "kind": kind, "from_state": frm,
            "to_state": to, "bytes": 4096, "pages": 2, "request_id": request_id, "error": error}


def batch(t_end_ms: float, batch_id: int, kind: str, start_ms: float, num_seqs: int = 1) -> dict:
    return {"event": "batch", "ts_ns": T0_NS + int(t_end_ms * MS), "batch_id": batch_id, "kind": kind,
            "num_seqs": num_seqs, "num_tokens": 8 * num_seqs, "start_ns": T0_NS + int(start_ms * MS),
            "end_ns": T0_NS + int(t_end_ms * MS)}


def occ(t_ms: float, tier: str, used: int, cap: int) -> dict:
    return {"event": "occupancy", "ts_ns": T0_NS + int(t_ms * MS), "tier": tier, "used_pages": used,
            "capacity_pages": cap}


PREFILL_HITS = dict(prompt_tokens=64, hit_l1=0, hit_l2=0, hit_l3=0, restore_tier="none", restore_tokens=0)

EVENTS = [
    req(0, "r1", "queued"),
    occ(0, "l1", 0, 100), occ(0, "l2", 0, 200), occ(0, "l3", 0, 1000),
    req(1, "r1", "prefill_start", **PREFILL_HITS),
    req(1.5, "r2", "queued"),
    req(2, "r2", "parked"),
    op(2, 2, "restore_l2", "L2", "H2D_PENDING", request_id="r2"),
    batch(3, 1, "prefill", start_ms=1),
    req(3, "r1", "prefill_end"),
    req(3, "r1", "first_token"),
    op(3, 1, "backup", "L1_PRIVATE", "D2H_PENDING", request_id="r1"),
    occ(3, "l1", 16, 100),
    req(3.2, "r3", "queued"),
    op(4, 2, "restore_l2", "H2D_PENDING", "L1_L2", request_id="r2"),
    req(4.5, "r2", "prefill_start", prompt_tokens=64, hit_l1=0, hit_l2=32, hit_l3=0, restore_tier="l2",
        restore_tokens=32),
    op(5, 1, "backup", "D2H_PENDING", "L1_L2"),
    op(5, 1, "backup", "L1_L2", "H2S_PENDING"),
    batch(5, 2, "decode", start_ms=3),
    op(5.5, 3, "restore_l3", "L3", "S2H_PENDING", request_id="r3"),
    batch(6, 3, "prefill", start_ms=5, num_seqs=1),
    req(6, "r2", "prefill_end"),
    req(6, "r2", "first_token"),
    op(6.5, 3, "restore_l3", "S2H_PENDING", "FAILED", request_id="r3", error="OSError: short read"),
    req(6.6, "r3", "aborted", output_tokens=0, reason="abort", error=None),
    op(6.7, 5, "backup", "L1_PRIVATE", "D2H_PENDING"),
    op(6.8, 5, "backup", "D2H_PENDING", "L1_L2"),  # a backup's midpoint: not ended
    op(6.7, 6, "backup", "L1_PRIVATE", "D2H_PENDING"),
    op(6.8, 6, "backup", "D2H_PENDING", "L1_L2"),
    op(6.9, 6, "backup", "L1_L2", "L1_L2_ONLY"),  # skipped L3: ended
    req(7, "r4", "queued"),
    op(7, 4, "backup", "L1_PRIVATE", "D2H_PENDING"),  # never ends
    op(8, 1, "backup", "H2S_PENDING", "L1_L2_L3"),
    occ(8, "l2", 20, 200), occ(8, "l3", 8, 1000),
    batch(9, 4, "decode", start_ms=6, num_seqs=2),
    req(9, "r1", "finished", output_tokens=7, reason="length", error=None),
    req(9, "r2", "finished", output_tokens=5, reason="stop", error=None),
    req(9.5, "r4", "prefill_start", **PREFILL_HITS),  # never finishes
    {"event": "hello", "ts_ns": T0_NS + 10 * MS},  # unknown event
    {"event": "request", "ts_ns": T0_NS + 10 * MS, "state": "queued"},  # malformed: no rid
    {"event": "op", "op_id": 9, "kind": "backup"},  # malformed: no ts_ns
]
LAST_MS = 9.5


def write_log(path: Path, events=EVENTS, garbage=True) -> Path:
    lines = [json.dumps(e) for e in events]
    if garbage:
        lines.insert(3, "this is not json")
        lines.insert(7, "[1, 2, 3]")
        lines.append('{"event": "request", "rid": "r9"')  # truncated last line
    path.write_text("\n".join(lines) + "\n")
    return path


def load(tmp_path: Path):
    bad: list[int] = []
    events = read_events(write_log(tmp_path / "log.jsonl"), bad_lines=bad)
    return build_timeline(events, num_bad_lines=len(bad)), bad


def test_build_timeline(tmp_path):
    tl, bad = load(tmp_path)
    assert bad == [4, 8, len(EVENTS) + 3]
    assert (tl.num_bad_lines, tl.num_unknown_events, tl.num_malformed_events) == (3, 1, 2)
    assert list(tl.requests) == ["r1", "r2", "r3", "r4"]
    r1, r2, r3, r4 = tl.requests.values()
    assert r1.queue_wait_ns == 1 * MS and r1.prefill_ns == 2 * MS and r1.first_token_ns == 3 * MS
    assert r1.finish_ns == 9 * MS and r1.output_tokens == 7 and r1.final_state == "finished"
    assert r2.restore_tier == "l2" and r2.restore_wait_ns == int(2.5 * MS) and r2.hit_tokens["l2"] == 32
    assert r3.final_state == "aborted" and r3.queue_wait_ns is None
    assert r4.final_state == "running" and r4.end_ns is None
    assert {i: o.outcome for i, o in tl.ops.items()} == {
        1: "ok", 2: "ok", 3: "failed", 4: "incomplete", 5: "incomplete", 6: "ok"}
    assert list(tl.ops) == [2, 1, 3, 5, 6, 4]  # by start
    assert r1.end_reason == "length" and r3.end_reason == "abort" and r3.output_tokens == 0
    assert tl.ops[3].error == "OSError: short read" and tl.ops[1].request_id == "r1"
    assert [s for s, _, _ in tl.ops[1].state_spans(tl.last_ns)] == ["D2H_PENDING", "L1_L2", "H2S_PENDING"]
    assert [b.batch_id for b in tl.batches] == [1, 2, 3, 4]
    assert sorted(tl.occupancy) == ["l1", "l2", "l3"]
    assert tl.base_ns == T0_NS and tl.last_ns == T0_NS + int(LAST_MS * MS)


def check_chrome(trace: dict) -> None:
    """Structural checks any Chrome / Perfetto trace from us must pass."""
    events = json.loads(json.dumps(trace))["traceEvents"]
    assert all({"ph", "pid", "name"} <= set(e) for e in events)
    open_slices: dict[tuple, list[dict]] = defaultdict(list)
    x_ts: dict[tuple, list[float]] = defaultdict(list)
    for e in sorted((e for e in events if e["ph"] != "M"), key=lambda e: e["ts"]):  # stable, as a viewer sorts
        assert e["ts"] >= 0
        if e["ph"] in ("b", "e"):
            key = (e["pid"], e["cat"], e["id"])
            if e["ph"] == "b":
                open_slices[key].append(e)
            else:
                assert open_slices[key], f"'e' without 'b': {e}"
                b = open_slices[key].pop()
                assert b["name"] == e["name"] and b["ts"] <= e["ts"]
        elif e["ph"] == "X":
            assert e["dur"] >= 0
            x_ts[(e["pid"], e["tid"])].append(e["ts"])
    assert not any(open_slices.values()), "every 'b' needs its 'e'"
    for ts in x_ts.values():
        assert ts == sorted(ts)
    raw_x = [e["ts"] for e in events if e["ph"] == "X"]
    assert raw_x == sorted(raw_x)


def test_chrome_trace(tmp_path):
    tl, _ = load(tmp_path)
    trace = to_chrome(tl)
    check_chrome(trace)
    events = trace["traceEvents"]
    assert min(e["ts"] for e in events if e["ph"] != "M") == 0
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == 4 and {(e["pid"], e["tid"]) for e in xs} == {(1, 1)}
    assert xs[0]["ts"] == 1000.0 and xs[0]["dur"] == 2000.0  # µs
    def op_slice(e: dict) -> bool:  # the outer slice of an op, not a nested state
        return e["cat"] != "request" and e["name"] == f"{e['cat']} op {e['id']}"

    op_b = {e["id"]: e for e in events if e["ph"] == "b" and op_slice(e)}
    assert {i: e["cat"] for i, e in op_b.items()} == {
        1: "backup", 2: "restore_l2", 3: "restore_l3", 4: "backup", 5: "backup", 6: "backup"}
    op_e = {e["id"]: e for e in events if e["ph"] == "e" and op_slice(e)}
    assert op_e[4]["args"]["incomplete"] is True and op_e[4]["ts"] == LAST_MS * 1000
    assert op_e[5]["args"]["incomplete"] is True and "incomplete" not in op_e[6]["args"]
    assert op_e[3]["args"]["outcome"] == "failed" and "short read" in op_e[3]["args"]["error"]
    assert "incomplete" not in op_e[1]["args"] and op_e[1]["ts"] == 8000.0
    nested_1 = [e["name"] for e in events if e["ph"] == "b" and e["id"] == 1 and e["cat"] == "backup"]
    assert nested_1 == ["backup op 1", "D2H_PENDING", "L1_L2", "H2S_PENDING"]
    req_e = {e["id"]: e for e in events if e["ph"] == "e" and e["cat"] == "request" and e["name"].startswith("request")}
    assert set(req_e) == {"r1", "r2", "r3", "r4"}
    assert req_e["r4"]["args"]["incomplete"] is True and req_e["r1"]["args"]["final_state"] == "finished"
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"l1 pages", "l2 pages", "l3 pages"}
    assert all(set(e["args"]) == {"used_pages", "free_pages"} for e in events if e["ph"] == "C")


def test_png(tmp_path):
    tl, _ = load(tmp_path)
    out = tmp_path / "t.png"
    render_png(tl, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000


def test_many_requests_pack_into_lanes(tmp_path):
    events = []
    for i in range(60):
        events += [req(i, f"q{i}", "queued"), req(i + 0.5, f"q{i}", "prefill_start", **PREFILL_HITS),
                   req(i + 2, f"q{i}", "finished", output_tokens=1)]
    tl = build_timeline(events)
    out = tmp_path / "many.png"
    render_png(tl, out)
    assert out.stat().st_size > 1000
    check_chrome(to_chrome(tl))
    # each request lives 2 s and one arrives a second: two lanes hold all 60 (review, session 23:
    # a packing that gave every span its own lane passed the checks above)
    from scheduler.timeline_views import _pack_lanes
    assert _pack_lanes([(float(i), i + 2.0) for i in range(60)]) == [0, 1] * 30
    assert _pack_lanes([(0.0, 5.0), (1.0, 2.0), (2.0, 3.0), (6.0, 7.0)]) == [0, 1, 1, 0]


def test_empty_log(tmp_path):
    tl = build_timeline(read_events(write_log(tmp_path / "empty.jsonl", events=[], garbage=False)))
    check_chrome(to_chrome(tl))
    assert "0 requests" in format_tables(tl)
    render_png(tl, tmp_path / "empty.png")


def test_tables_mention_every_request_and_op(tmp_path):
    tl, _ = load(tmp_path)
    text = format_tables(tl)
    lines = text.splitlines()
    for rid, state in (("r1", "finished"), ("r2", "finished"), ("r3", "aborted"), ("r4", "running")):
        assert any(line.split()[0] == rid and state in line.split() for line in lines if line.strip()), rid
    assert "failed: OSError: short read" in text and "incomplete" in text
    assert "L1_PRIVATE > D2H_PENDING 2.00 > L1_L2 0.00 > H2S_PENDING 3.00 > L1_L2_L3" in text
    assert "3 non-JSON lines, 1 unknown events, 2 malformed events" in text

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    rich_out = Tty()
    print_tables(tl, rich_out)
    assert all(rid in rich_out.getvalue() for rid in ("r1", "r2", "r3", "r4"))


def test_cli(tmp_path):
    log = write_log(tmp_path / "log.jsonl")
    chrome, png = tmp_path / "out.json", tmp_path / "out.png"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "timeline.py"), str(log), "--chrome", str(chrome),
                           "--png", str(png)], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert "r4" in proc.stdout and "Operations" in proc.stdout
    check_chrome(json.loads(chrome.read_text()))
    assert png.stat().st_size > 0


def test_log_written_through_structlog(tmp_path):
    """Pins the format: events written the way the engine writes them (its ts_ns processor, structlog
    JSONRenderer, request events with contextvars, op events from hicache.ops.apply) come back."""
    path = tmp_path / "engine.jsonl"
    with open(path, "w") as fh:
        log = structlog.wrap_logger(
            structlog.WriteLogger(fh),
            processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                        add_monotonic_ns, structlog.processors.JSONRenderer()],
            wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),  # conftest filters globally
        )
        structlog.contextvars.clear_contextvars()
        try:
            with structlog.contextvars.bound_contextvars(rid="r1"):
                log.info("request", state="queued", prompt_tokens=40)
                log.info("request", state="parked", restore_tier="l3")
            restore = new_op(1, OpKind.RESTORE_L3, num_pages=4, num_bytes=8192, request_id="r1")
            for event in (OpEvent.START, OpEvent.S2H_DONE, OpEvent.START, OpEvent.H2D_DONE):
                apply(restore, event, logger=log)
            backup = new_op(2, OpKind.BACKUP, num_pages=4, num_bytes=8192)
            apply(backup, OpEvent.START, logger=log)
            apply(backup, OpEvent.FAIL, error="CUDA error", logger=log)
            stuck = new_op(3, OpKind.BACKUP, num_pages=1, num_bytes=2048)
            apply(stuck, OpEvent.START, logger=log)
            apply(stuck, OpEvent.D2H_DONE, logger=log)
            log.info("occupancy", tier="l1", used_pages=4, capacity_pages=64)
            with structlog.contextvars.bound_contextvars(rid="r1"):
                log.info("request", state="prefill_start", prompt_tokens=40, hit_l1=0, hit_l2=0, hit_l3=16,
                         restore_tier="l3", restore_tokens=16)
                start_ns = time.monotonic_ns()
                log.info("batch", batch_id=0, kind="prefill", num_seqs=1, num_tokens=24, start_ns=start_ns,
                         end_ns=time.monotonic_ns())
                log.info("request", state="prefill_end")
                log.info("request", state="first_token")
                log.info("request", state="finished", output_tokens=3, reason="length", error=None)
        finally:
            structlog.contextvars.clear_contextvars()
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert all({"event", "ts_ns"} <= set(e) for e in raw)
    tl = build_timeline(read_events(path))
    assert (tl.num_unknown_events, tl.num_malformed_events) == (0, 0)
    r1 = tl.requests["r1"]
    assert [s for s, _ in r1.states] == ["queued", "parked", "prefill_start", "prefill_end", "first_token", "finished"]
    assert r1.restore_tier == "l3" and r1.hit_tokens == {"l1": 0, "l2": 0, "l3": 16} and r1.output_tokens == 3
    assert r1.prompt_tokens == 40 and r1.end_reason == "length"
    assert r1.restore_wait_ns is not None and r1.restore_wait_ns >= 0
    ops = tl.ops
    assert [s for s, _ in ops[1].transitions] == ["S2H_PENDING", "L2_L3", "H2D_PENDING", "L1_L2_L3"]
    assert ops[1].initial_state == "L3" and ops[1].num_bytes == 8192 and ops[1].request_id == "r1"
    assert ops[1].transitions[-1][0] in OP_END_STATES["restore_l3"]
    assert {i: o.outcome for i, o in ops.items()} == {1: "ok", 2: "failed", 3: "incomplete"}
    assert ops[2].error == "CUDA error"
    assert len(tl.batches) == 1 and tl.occupancy["l1"][0].capacity_pages == 64
    check_chrome(to_chrome(tl))


def run_of_one_request(t_ms: float, rid: str = "r0") -> list[dict]:
    """What one short run logs: a request and the backup it caused, op ids numbered from 1."""
    return [req(t_ms, rid, "queued"), req(t_ms + 1, rid, "prefill_start", **PREFILL_HITS),
            op(t_ms + 2, 1, "backup", "L1_PRIVATE", "D2H_PENDING", request_id=rid),
            req(t_ms + 2, rid, "finished", output_tokens=2, reason="length"),
            op(t_ms + 3, 1, "backup", "D2H_PENDING", "L1_L2"), op(t_ms + 4, 1, "backup", "L1_L2", "L1_L2_ONLY")]


def test_an_id_seen_again_after_it_ended_starts_a_new_span():
    # two engines in one log without run_start lines (a log written before them): ids restart
    tl = build_timeline(run_of_one_request(0) + run_of_one_request(10))
    assert list(tl.requests) == ["r0", "r0#2"] and list(tl.ops) == [1, "1#2"]
    assert all(r.final_state == "finished" and len(r.states) == 3 for r in tl.requests.values())
    assert [o.outcome for o in tl.ops.values()] == ["ok", "ok"] and tl.ops["1#2"].start_ns == T0_NS + 12 * MS
    assert tl.requests["r0#2"].finish_ns == 2 * MS  # not 12 ms from the first run's arrival
    trace = to_chrome(tl)
    check_chrome(trace)
    ids = {(e["cat"], e["id"]) for e in trace["traceEvents"] if e["ph"] == "b" and e.get("args")}
    assert ids == {("request", "r0"), ("request", "r0#2"), ("backup", 1), ("backup", "1#2")}
    assert [line.split()[0] for line in format_tables(tl).splitlines() if line.startswith("r0")] == ["r0", "r0#2"]


def test_run_start_splits_runs_and_ends_what_a_run_left_open():
    crashed = run_of_one_request(0)[:3]  # the run stopped with its request and backup under way
    run_start = lambda t_ms: {"event": "run_start", "ts_ns": T0_NS + int(t_ms * MS), "pid": 1}  # noqa: E731
    tl = build_timeline([run_start(0), *crashed, run_start(5), *run_of_one_request(10)])
    assert tl.num_runs == 2 and tl.num_unknown_events == 0 and "in 2 runs" in format_tables(tl)
    first, second = tl.requests.values()
    assert (first.key, first.run, first.final_state) == ("r0", 0, "running")
    assert (second.key, second.run, second.final_state) == ("r0#2", 1, "finished")
    assert [(o.key, o.run, o.outcome) for o in tl.ops.values()] == [(1, 0, "incomplete"), ("1#2", 1, "ok")]
    check_chrome(to_chrome(tl))


def test_each_opened_log_starts_a_run(tmp_path):
    from scheduler.logs import configure_logging

    path = tmp_path / "new" / "dir" / "run.jsonl"  # a directory that does not exist yet
    saved = structlog.get_config()
    try:
        for _ in range(2):  # two engines appending to one log
            configure_logging(str(path))
            log = structlog.get_logger()
            log.info("request", rid="r0", state="queued", prompt_tokens=4)
            log.info("request", rid="r0", state="finished", output_tokens=1, reason="length")
    finally:
        structlog.configure(**saved)
    events = read_events(path)
    assert [e["event"] for e in events].count("run_start") == 2
    tl = build_timeline(events)
    assert tl.num_runs == 2 and list(tl.requests) == ["r0", "r0#2"] and tl.num_unknown_events == 0


def test_a_preempted_requests_restore_columns_are_its_first_admissions():
    """The Requests table shows a request's first admission (its hits, its restore), as the engine reports it;
    a resumption after a preemption is not that admission. Regressions (session 57's hunt): a request that restored
    nothing at first and parked for an L2 restore only on resuming showed `restore none` beside the resumption's
    park time as its restore wait; one whose resumption's overlapped restore was discarded kept its first hits but
    showed its restore as none."""
    resumption = dict(prompt_tokens=74, hit_l1=0, hit_l2=64, hit_l3=0, restore_tier="l2", restore_tokens=64)
    events = [req(0, "a", "queued"), req(1, "a", "prefill_start", **{**PREFILL_HITS, "hit_l1": 48}),
              req(2, "a", "prefill_end"), req(2, "a", "first_token"), req(50, "a", "preempted", preemptions=1),
              req(60, "a", "parked", restore_tier="l2"), req(240, "a", "prefill_start", **resumption),
              req(241, "a", "prefill_end"), req(241, "a", "resumed"),
              req(300, "a", "finished", output_tokens=20, reason="length"),
              req(0, "b", "queued"),
              req(1, "b", "prefill_start", **{**PREFILL_HITS, "hit_l2": 32, "restore_tier": "l2",
                                              "restore_tokens": 32, "restore_overlap": True}),
              req(2, "b", "prefill_end"), req(2, "b", "first_token"), req(50, "b", "preempted", preemptions=1),
              req(60, "b", "prefill_start", **resumption, restore_overlap=True),
              req(61, "b", "restore_overlap_discarded"), req(62, "b", "prefill_start", **PREFILL_HITS),
              req(63, "b", "prefill_end"), req(63, "b", "resumed"),
              req(300, "b", "finished", output_tokens=20, reason="length")]
    a, b = build_timeline(events).requests.values()
    hits = lambda span: {t: n for t, n in span.hit_tokens.items() if n}  # noqa: E731
    assert (hits(a), a.restore_tier, a.restore_wait_ns) == ({"l1": 48}, "none", None)
    assert (hits(b), b.restore_tier, b.restore_tokens) == ({"l2": 32}, "l2", 32)
    parked_first = build_timeline([req(0, "c", "queued"), req(1, "c", "parked", restore_tier="l2"),
                                   req(9, "c", "prefill_start", **resumption)]).requests["c"]
    assert parked_first.restore_wait_ns == 8 * MS  # (a first admission's park still counts)


def test_the_requests_table_counts_each_requests_preemptions_and_the_time_it_spent_preempted():
    """A preempted request's row says how often it was preempted and for how long (each preemption to its
    resumption; one never resumed, to its end or its run's last event); the others show 0 and "-"."""
    twice = [req(0, "a", "queued"), req(1, "a", "prefill_start", **PREFILL_HITS), req(2, "a", "prefill_end"),
             req(2, "a", "first_token"), req(10, "a", "preempted", preemptions=1), req(14, "a", "prefill_start"),
             req(15, "a", "prefill_end"), req(15, "a", "resumed"), req(20, "a", "preempted", preemptions=2),
             req(30, "a", "resumed"), req(40, "a", "finished", output_tokens=9, reason="length")]
    ended_preempted = [req(0, "b", "queued"), req(1, "b", "first_token"), req(5, "b", "preempted", preemptions=1),
                       req(12, "b", "aborted", output_tokens=3, reason="abort")]
    left_open = [req(0, "c", "queued"), req(1, "c", "first_token"), req(6, "c", "preempted", preemptions=1),
                 req(50, "d", "queued")]
    plain = [req(0, "e", "queued"), req(1, "e", "first_token"), req(3, "e", "finished", output_tokens=2)]
    tl = build_timeline(twice + ended_preempted + left_open + plain)
    a, b, c, _, e = tl.requests.values()
    assert (a.preemptions, a.preempted_ns(tl.open_end_ns(0))) == (2, 5 * MS + 10 * MS)
    assert (b.preemptions, b.preempted_ns(tl.open_end_ns(0))) == (1, 7 * MS)
    assert (c.preemptions, c.preempted_ns(tl.open_end_ns(0))) == (1, 44 * MS)
    assert (e.preemptions, e.preempted_ns(tl.open_end_ns(0))) == (0, None)
    lines = format_tables(tl).splitlines()
    header = next(ln.split() for ln in lines if ln.startswith("rid"))
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.split() and ln.split()[0] in "abcde"}
    col = lambda rid, name: rows[rid][header.index(name)]  # noqa: E731
    assert (col("a", "preemptions"), col("a", "preempted_ms")) == ("2", "15.00")
    assert (col("e", "preemptions"), col("e", "preempted_ms")) == ("0", "-")
    chrome_ends = [ev for ev in to_chrome(tl)["traceEvents"] if ev.get("ph") == "e" and ev.get("cat") == "request"
                   and ev["name"].startswith("request ") and "args" in ev]
    assert {ev["id"]: ev["args"]["preemptions"] for ev in chrome_ends} == {"a": 2, "b": 1, "c": 1, "d": 0, "e": 0}
