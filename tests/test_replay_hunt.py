"""The replay driver and the timeline tool as a user meets them (bug hunt, session 27), each fix with its
regression test: chained decode steps as overlapping "X" slices of one thread (Perfetto drops them);
a crashed run's open spans running on through every later run, and a run appended after a crash
mid-line merged into it; the PNG drawing runs an hour apart as two slivers; capacities and
--block-tokens too large for a tier or the model as tracebacks or errors naming a flag not given;
every prompt of the trace synthesized up front; a byte-order mark costing the first request; a
gzipped trace or one of many bad lines printing a line each. Guard: hit tokens equal to what the
hash ids' shared prefixes predict."""
from __future__ import annotations

import gzip
import json
import tracemalloc
from collections import defaultdict
from pathlib import Path

import pytest
import structlog

from scheduler.presets import model_config_of
from scheduler.replay import build_items, main, run_cli
from scheduler.timeline import build_timeline, read_events
from scheduler.timeline_views import format_tables, render_png, to_chrome
from scheduler.trace import TokenSynth, TraceRecord, load_trace, scale_record
from test_timeline import MS, T0_NS, batch, op, req
from test_tools_edges import load_timeline_script

SAMPLE = Path(__file__).resolve().parent.parent / "scheduler" / "sample_trace.jsonl"
SIM = ["--simulate", "--no-progress", "--max-requests", "2"]  # bundled sample, no model: fast
GOOD = '{"timestamp": %d, "input_length": 700, "output_length": 4, "hash_ids": [1, 2]}'
HOUR_MS = 3_600_000


@pytest.fixture
def restore_logging():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def check_perfetto(trace: dict) -> None:
    """What Perfetto's JSON importer needs beyond test_timeline.check_chrome: "X" slices of one thread
    nest or are apart (it drops one that overlaps the slice before it), every "b" has its "e"."""
    events = json.loads(json.dumps(trace))["traceEvents"]
    x_spans: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    open_async: dict[tuple, list[str]] = defaultdict(list)
    for e in sorted((e for e in events if e["ph"] != "M"), key=lambda e: e["ts"]):
        assert e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
            x_spans[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
        elif e["ph"] == "b":
            open_async[(e["pid"], e["cat"], e["id"])].append(e["name"])
        elif e["ph"] == "e":
            assert open_async[(e["pid"], e["cat"], e["id"])].pop() == e["name"]
    assert not any(open_async.values())
    for thread, spans in x_spans.items():
        stack: list[tuple[float, float]] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1][1], f"X slices overlap on {thread}: {stack[-1]}, {(start, end)}"
            stack.append((start, end))


def run_start(t_ms: float) -> dict:
    return {"event": "run_start", "ts_ns": T0_NS + int(t_ms * MS), "pid": 1}


# -- timeline --------------------------------------------------------------------------------------
def test_chained_decode_steps_are_not_overlapping_slices_of_one_thread():
    # a decode chain launches step N+1 before step N's tokens are back: the engine logs overlapping
    # batches (every replay with --concurrency > 1 and every server log has them)
    events = [batch(10, 1, "prefill", start_ms=0), batch(20, 2, "decode", start_ms=10),
              batch(26, 3, "decode", start_ms=15), batch(30, 4, "decode", start_ms=22),
              batch(40, 5, "decode", start_ms=30)]
    trace = to_chrome(build_timeline(events))
    check_perfetto(trace)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["args"]["batch_id"] for e in xs) == [1, 2, 3, 4, 5]
    assert {e["tid"] for e in xs} == {1, 2}  # two lanes suffice, and each has a name
    named = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 1}
    assert named == {1, 2}


def test_spans_a_crashed_run_left_open_end_with_that_run():
    crashed = [run_start(0), req(0, "r0", "queued"), req(1, "r0", "prefill_start"),
               op(2, 1, "backup", "L1_PRIVATE", "D2H_PENDING", request_id="r0")]  # then the process died
    later = [run_start(HOUR_MS), req(HOUR_MS + 1, "r0", "queued"), req(HOUR_MS + 10, "r0", "finished", output_tokens=1)]
    tl = build_timeline(crashed + later)
    trace = to_chrome(tl)
    check_perfetto(trace)
    ends_us = {e["id"]: e["ts"] for e in trace["traceEvents"] if e["ph"] == "e" and e["name"] in ("request r0",
                                                                                                  "backup op 1")}
    assert ends_us == {"r0": 2000.0, 1: 2000.0}  # before: an hour later, at the second run's last event
    op_line = next(line for line in format_tables(tl).splitlines() if line.startswith("1 "))
    assert "D2H_PENDING 0.00" in op_line and "incomplete" in op_line  # before: "D2H_PENDING 3600008.00"
    assert tl.num_runs == 2 and tl.open_end_ns(0) == T0_NS + 2 * MS


def test_png_draws_runs_one_after_the_other(tmp_path):
    from scheduler.timeline_views import png_ms

    first = [run_start(0), req(0, "r0", "queued"), req(5, "r0", "finished", output_tokens=1)]
    second = [run_start(HOUR_MS), req(HOUR_MS + 1, "r0", "queued"),
              req(HOUR_MS + 4, "r0", "finished", output_tokens=1)]
    rebooted = [run_start(-HOUR_MS), req(-HOUR_MS, "r0", "queued"),
                req(-HOUR_MS + 2, "r0", "finished", output_tokens=1)]
    tl = build_timeline(first + second + rebooted)  # the third run's clock restarted below the others
    ms = png_ms(tl)
    a, b, c = tl.requests.values()
    assert [ms(r.arrival_ns, r.run) for r in (a, b, c)] == [0.0, 5.0, 8.0]  # each run where the one before ended
    assert [ms(r.end_ns, r.run) for r in (a, b, c)] == [5.0, 8.0, 10.0]
    render_png(tl, tmp_path / "runs.png")
    assert (tmp_path / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_appended_after_a_crash_mid_line_is_a_run_of_its_own(tmp_path, restore_logging, capsys):
    """Two simulated replays into one log, the first cut in the middle of its last line (a run killed
    while writing), then the timeline tool with both outputs."""
    log = tmp_path / "run.jsonl"
    args = ["--simulate", "--no-progress", "--max-requests", "12", "--concurrency", "6", "--log-json", str(log)]
    assert main(args) == 0
    with open(log, "r+b") as f:  # the crashed run's last line loses its end, newline included
        f.truncate(log.stat().st_size - 20)
    assert main(args) == 0
    events = read_events(log)
    tl = build_timeline(events)
    assert tl.num_runs == 2  # before: 1, this run's run_start glued to the cut line and lost
    assert sum(e.get("event") == "run_start" for e in events) == 2
    assert sum(r.key.endswith("#2") for r in tl.requests.values()) == 12
    chrome, png = tmp_path / "out" / "trace.json", tmp_path / "out" / "timeline.png"
    assert load_timeline_script().main([str(log), "--no-tables", "--chrome", str(chrome), "--png", str(png)]) == 0
    check_perfetto(json.loads(chrome.read_text()))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- replay ----------------------------------------------------------------------------------------
def exit_code(capsys, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [
    ("--l1-gib", "1e300"), ("--l2-gib", "1e300"), ("--l3-gib", "1e300"),  # before: OverflowError tracebacks
    ("--l2-tokens", "1" + "0" * 400), ("--l3-tokens", "1" + "0" * 400),
    ("--l3-tokens", "1" + "0" * 15), ("--l2-gib", "1e12"), ("--l3-gib", "1e-7"),  # before: named --hicache-*
])
def test_a_capacity_no_tier_can_have_is_one_line_naming_its_flag(capsys, flag, value):
    code, err = exit_code(capsys, [*SIM, flag, value])
    assert code == 2 and flag in err and "--hicache" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("value", ["1" + "0" * 400, str(model_config_of("tiny").max_position_embeddings + 1)])
def test_block_tokens_beyond_the_models_positions_is_one_line(capsys, value):
    # before: 10**400 an OverflowError traceback, 10**9 a MemoryError one, 4097 a replay of prompts too long
    code, err = exit_code(capsys, [*SIM, "--block-tokens", value])
    assert code == 2 and "--block-tokens" in err and "positions" in err


def test_prompts_are_synthesized_when_submitted_not_up_front():
    # 64 requests of 64 distinct blocks at 512 tokens: 2 M tokens, 75 MB as lists of Python ints (the
    # bundled Mooncake trace took 6.1 GB and 33 s before its first request)
    vocab = model_config_of("tiny").vocab_size
    records = [TraceRecord(i + 1, float(i), 64 * 512, 4, tuple(range(i * 64, (i + 1) * 64))) for i in range(64)]
    tracemalloc.start()
    try:
        items = build_items(records, vocab, 512, max_input_tokens=30_000)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_bytes < 4 << 20, peak_bytes
    assert [it.prompt_tokens for it in items] == [30_000] * 64
    synth = TokenSynth(vocab, 512)
    assert items[5].prompt == synth.prompt_tokens(scale_record(records[5], 512), 30_000)


def test_a_trace_with_a_byte_order_mark_keeps_its_first_request(tmp_path):
    trace = tmp_path / "bom.jsonl"
    trace.write_bytes(b"\xef\xbb\xbf" + ((GOOD % 0) + "\r\n" + (GOOD % 5) + "\r\n").encode())
    records, problems = load_trace(trace)
    assert [r.line_no for r in records] == [1, 2] and problems == []


def test_a_gzipped_trace_is_one_problem_not_one_per_line(tmp_path):
    trace = tmp_path / "trace.jsonl.gz"
    trace.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    records, problems = load_trace(trace)  # before: 101 "not UTF-8" / "bad JSON" problems, each printed
    assert records == [] and len(problems) == 1 and "gzip" in problems[0].reason


def test_many_malformed_lines_are_counted_not_each_printed(tmp_path, capsys):
    trace = tmp_path / "renamed.jsonl"  # a converter that wrote "ids" for "hash_ids": every line but one
    bad = '{"timestamp": %d, "input_length": 700, "output_length": 4, "ids": [1, 2]}'
    trace.write_text("\n".join([GOOD % 0] + [bad % t for t in range(1, 41)]) + "\n")
    s = run_cli(["--trace", str(trace), "--block-tokens", "16", "--simulate", "--no-progress", "--time-scale", "0",
                 "--json-out", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert s["completed"] == 1 and len(s["problems"]) == 40
    assert err.count(": skipped: missing field(s): hash_ids") == 10
    assert "... and 30 more malformed lines skipped (--json-out lists them all)" in err


# -- guards ----------------------------------------------------------------------------------------
def hash_id_prefix_hits(records: list[TraceRecord], block_tokens: int, page_tokens: int, max_input_tokens: int) -> int:
    """Hit tokens an unbounded prefix cache must give, from the hash ids alone: each prompt shares with
    the ones before it the blocks of its longest hash-id prefix seen before (the last such block as far
    as both prompts cover it), aligned down to a page, at most all but its last token."""
    covered: dict[tuple[int, ...], int] = {}  # hash-id prefix -> tokens of its last block some prompt had
    hits = 0
    for rec in sorted(records, key=lambda r: r.timestamp_ms):
        rec = scale_record(rec, block_tokens)
        num_tokens = min(rec.input_tokens, max_input_tokens)
        blocks = rec.hash_ids[:-(-num_tokens // block_tokens)]
        shared = 0
        for i in range(len(blocks)):
            seen = covered.get(blocks[: i + 1], 0)
            shared = i * block_tokens + min(seen, num_tokens - i * block_tokens)
            if seen < block_tokens:
                break
        hits += min(shared // page_tokens, (num_tokens - 1) // page_tokens) * page_tokens
        for i in range(len(blocks)):
            key = blocks[: i + 1]
            covered[key] = max(covered.get(key, 0), min(block_tokens, num_tokens - i * block_tokens))
    return hits


def test_hit_tokens_are_what_the_hash_ids_shared_prefixes_predict():
    # blocks of 24 tokens on pages of 16, prompts clipped: an unbounded L1 hits exactly the shared
    # prefixes; the tiered default run splits as many or fewer hits across tiers, adding up
    num_requests, max_input_tokens = 120, 600
    common = ["--simulate", "--no-progress", "--max-requests", str(num_requests), "--block-tokens", "24",
              "--max-input-tokens", str(max_input_tokens)]
    unbounded = run_cli([*common, "--l1-tokens", "10000000", "--disable-hicache"])
    records, _ = load_trace(SAMPLE, max_requests=num_requests)
    assert unbounded["failed"] == 0
    assert unbounded["hit_tokens"] == {"l1": hash_id_prefix_hits(records, 24, 16, max_input_tokens), "l2": 0, "l3": 0}
    assert unbounded["hit_tokens"]["l1"] > 0
    tiered = run_cli(common)
    for s in (unbounded, tiered):
        assert sum(s["hit_tokens"].values()) + s["recomputed_tokens"] == s["prompt_tokens"]
    assert tiered["prompt_tokens"] == unbounded["prompt_tokens"]
    assert 0 < sum(tiered["hit_tokens"].values()) <= unbounded["hit_tokens"]["l1"]
    assert tiered["hit_tokens"]["l2"] > 0 and tiered["hit_tokens"]["l3"] > 0
