"""The structured log and the timeline built from it, checked on logs real tiny-model CPU engines
wrote (bug hunt, session timeline-2): several runs appended to one file, faults injected through
hicache/faults.py, chunked prefill, aborts and an engine shut down mid-flight. What a user of the
timeline relies on: every request with its arrival and end (aborted and failed ones with a reason),
every op's transitions legal per hicache/ops.py and ended (or shown unfinished), no negative
duration, a Chrome trace Perfetto takes, totals that agree with the engine's own metrics, and a
PNG for any log, a truncated one included."""
from __future__ import annotations

import asyncio
import json
import math
import random
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import structlog

from hicache.faults import Fault, FaultInjector
from hicache.ops import INITIAL, TERMINAL, TRANSITIONS, OpKind, OpState
from hicache.radix import Tier
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from scheduler.timeline import build_timeline, read_events, split_runs
from scheduler.timeline_views import format_tables, render_png, to_chrome
from test_faults import PROMPT, REUSABLE, TransferGate, run_one, until
from test_restore_overlap import _prefix_only_in_l2
from test_timeline import PREFILL_HITS, req

PAGE = 4


@pytest.fixture
def restore_logging():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def engine(log: Path, faults: FaultInjector | None = None, num_pages: int = 48, **options) -> Engine:
    hicache = {k: options.pop(k) for k in ("write_policy", "io_timeout_s", "prefetch") if k in options}
    config = EngineConfig(model="tiny", device="cpu", num_pages=num_pages, page_size=PAGE, log_json=str(log),
                          **options).with_hicache(enable=True, transfer_backend="torch", policy="always", **hicache)
    return Engine(config, faults=faults or FaultInjector())


def legal(kind: str, frm: str, to: str) -> bool:
    return any(dst.name == to for dst in TRANSITIONS[OpKind(kind)].get(OpState[frm], {}).values())


def check_log(events: list[dict]) -> None:
    """The raw log, run by run: each op's first event leaves its kind's initial state, each next one
    leaves the state the last one entered, by an edge of hicache/ops.py's table, and every op ended
    (every run here ends in shutdown(), which drains); each request queued ends once, aborted and
    failed ones with a reason."""
    for run, run_events in enumerate(split_runs(events)):
        at: dict[int, tuple[str, str]] = {}
        ended: dict[str, int] = Counter()
        queued: set[str] = set()
        for e in run_events:
            if e["event"] == "op":
                kind, frm, to = e["kind"], e["from_state"], e["to_state"]
                expect = at[e["op_id"]][1] if e["op_id"] in at else INITIAL[OpKind(kind)].name
                assert frm == expect and legal(kind, frm, to), (run, e)
                at[e["op_id"]] = (kind, to)
            elif e["event"] == "request" and e["state"] == "queued":
                queued.add(e["rid"])
            elif e["event"] == "request" and e["state"] in ("finished", "aborted", "failed"):
                ended[e["rid"]] += 1
                assert e["state"] == "finished" or e.get("reason"), e
        open_ops = {i: s for i, (k, s) in at.items() if OpState[s] not in TERMINAL[OpKind(k)]}
        assert not open_ops, (run, open_ops)
        assert set(ended) == queued and all(n == 1 for n in ended.values()), (run, queued, ended)


def check_timeline(tl) -> None:
    for r in tl.requests.values():
        names = [s for s, _ in r.states]
        assert names[0] == "queued", (r.key, names)
        if r.final_state == "finished":
            assert "first_token" in names and r.first_token_ns is not None, (r.key, names)
        if r.final_state in ("aborted", "failed"):
            assert r.end_reason, r.key
        assert all(b >= a for _, a, b in r.phase_spans(tl.open_end_ns(r.run))), r.key
        for ns in (r.queue_wait_ns, r.restore_wait_ns, r.prefill_ns, r.first_token_ns, r.finish_ns):
            assert ns is None or ns >= 0, (r.key, names)
    for op in tl.ops.values():
        state = op.initial_state
        for to, _ in op.transitions:
            assert legal(op.kind, state, to), (op.key, state, to)
            state = to
        assert all(b >= a for _, a, b in op.state_spans(tl.open_end_ns(op.run))), op.key


def check_chrome(trace: dict) -> None:
    """What Perfetto's JSON importer needs: strict JSON (no NaN), each async "b" closed by an "e" of
    the same name on its (cat, id) track in nesting order, one outer slice per id, "X" slices
    non-negative and in time order per thread."""
    events = json.loads(json.dumps(trace, allow_nan=False))["traceEvents"]
    stacks: dict[tuple, list[str]] = defaultdict(list)
    outer: Counter = Counter()
    x_ts: dict[tuple, list[float]] = defaultdict(list)
    for e in events:
        if e["ph"] == "b":
            if not stacks[(e["cat"], e["id"])]:
                outer[(e["cat"], e["id"])] += 1
            stacks[(e["cat"], e["id"])].append(e["name"])
        elif e["ph"] == "e":
            assert stacks[(e["cat"], e["id"])].pop() == e["name"], e
        elif e["ph"] == "X":
            assert e["dur"] >= 0 and math.isfinite(e["ts"])
            x_ts[(e["pid"], e["tid"])].append(e["ts"])
    assert not any(stacks.values())
    assert all(n == 1 for n in outer.values()), [k for k, n in outer.items() if n > 1]
    assert all(ts == sorted(ts) for ts in x_ts.values())


def totals_of_run(tl, run: int) -> dict:
    """What the timeline says a run did, in the terms of the engine's metrics."""
    hits: Counter = Counter()
    for r in tl.requests.values():
        if r.run == run:
            hits.update(r.hit_tokens)
    ops = [o for o in tl.ops.values() if o.run == run]
    return {"hit_tokens": {t: hits[t] for t in ("l1", "l2", "l3")},
            "restores_done": sum(o.kind != "backup" and o.transitions[-1][0] in ("L1_L2", "L1_L2_L3") for o in ops),
            "backups_done": sum(o.kind == "backup" and o.outcome == "ok" for o in ops),
            "failed_ops": sum(o.outcome == "failed" for o in ops),
            "cancellations": sum(o.outcome == "cancelled" for o in ops)}


def totals_of_metrics(m: dict) -> dict:
    op_failures = sum(n for kind, n in m["failures"].items() if kind not in ("nan_logits", "l1_overcommit"))
    return {"hit_tokens": m["hit_tokens"], "restores_done": m["restores_done"], "backups_done": m["backups_done"],
            "failed_ops": op_failures, "cancellations": m["cancellations"]}


# -- bugs found ----------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_abort_during_an_overlapped_restore_counts_no_hit(tmp_path, restore_logging):
    """Regression: a request admitted on an L2 restore landing layer by layer under its forward
    (Admission._admit_overlapped) counts its hits only once it takes the restore over
    (Restoring.adopt_restored); aborted before, it counts none. Its prefill_start line carried the
    hits and nothing later took them back: the timeline gave it 24 L2 hit tokens the metrics never
    counted."""
    log = tmp_path / "run.jsonl"
    eng = engine(log)
    gate, task = await _forward_ahead_of_its_restore(eng)
    [r] = eng.running
    op = r.overlap_op
    assert await eng.abort(r.rid)
    await until(lambda: op.payload["cancel"])
    gate.release.set()
    assert (await task).finish_reason == "abort"
    await eng.cache.drain()
    metrics = eng.metrics()
    await eng.shutdown()
    assert metrics["hit_tokens"]["l2"] == 0  # (the engine: no L2 hit)

    events = read_events(log)
    starts = [e for e in events if e.get("rid") == r.rid and e.get("state") == "prefill_start"]
    assert starts and starts[0]["hit_l2"] == REUSABLE and starts[0].get("restore_overlap")  # the scenario
    tl = build_timeline(events)
    span = tl.requests[r.rid]
    assert span.final_state == "aborted" and span.end_reason == "abort"
    assert span.hit_tokens.get("l2", 0) == 0, span.hit_tokens
    assert totals_of_run(tl, 0)["hit_tokens"] == metrics["hit_tokens"]
    check_log(events)
    check_timeline(tl)


def test_hits_of_a_discarded_overlapped_admission_are_dropped():
    """The engine resets a request's hits when it discards its overlapped forward (Restoring._rewind):
    a request that ends before it is admitted again restored nothing. (Regression: the timeline
    kept the discarded admission's hits and restore tier.)"""
    tl = build_timeline([
        req(0, "r", "queued"),
        req(1, "r", "prefill_start", prompt_tokens=25, hit_l1=0, hit_l2=24, hit_l3=0, restore_tier="l2",
            restore_tokens=24, restore_overlap=True),
        req(2, "r", "restore_overlap_discarded", restore_failed=True),
        req(3, "r", "aborted", output_tokens=0, reason="abort"),
        req(4, "s", "queued"),  # and one readmitted after its discard: its last admission's hits
        req(5, "s", "prefill_start", prompt_tokens=25, hit_l1=0, hit_l2=24, hit_l3=0, restore_tier="l2",
            restore_tokens=24, restore_overlap=True),
        req(6, "s", "restore_overlap_discarded", restore_failed=False),
        req(7, "s", "prefill_start", **PREFILL_HITS),
        req(8, "s", "finished", output_tokens=1, reason="length"),
    ])
    r, s = tl.requests["r"], tl.requests["s"]
    assert sum(r.hit_tokens.values()) == 0 and r.restore_tier in (None, "none") and not r.restore_tokens
    assert r.final_state == "aborted" and r.end_reason == "abort"
    assert sum(s.hit_tokens.values()) == 0 and s.restore_tier == "none"
    row = next(line for line in format_tables(tl).splitlines() if line.startswith("r "))
    assert " l2 " not in row, row


async def _forward_ahead_of_its_restore(eng):
    """Start `eng` with PROMPT's prefix in L2 only, send PROMPT, and hold its restore's H2D until
    its forward (run behind the restore) has finished: (the H2D's gate, the request's task)."""
    await eng.start()
    await _prefix_only_in_l2(eng)
    gate = TransferGate(eng, "h2d")
    task = asyncio.create_task(run_one(eng))
    await until(lambda: any(r.overlap_result is not None for r in eng.running))
    return gate, task


@pytest.mark.asyncio
async def test_a_forward_run_behind_its_restore_is_logged_with_its_sequence(tmp_path, restore_logging):
    """Regression: a tail forward whose overlapped restore had not published yet when it ended has
    its output held (Restoring.after_overlapped_forward returns no request): its batch was logged
    with num_seqs 0, a prefill of no sequence computing a token."""
    log = tmp_path / "run.jsonl"
    eng = engine(log)
    gate, task = await _forward_ahead_of_its_restore(eng)
    gate.release.set()
    await task
    await eng.cache.drain()
    await eng.shutdown()
    tl = build_timeline(read_events(log))
    assert tl.batches and all(b.num_seqs >= 1 for b in tl.batches), [
        (b.batch_id, b.kind, b.num_seqs, b.num_tokens) for b in tl.batches if b.num_seqs < 1]
    tail = [b for b in tl.batches if b.kind == "prefill" and b.num_tokens == len(PROMPT) - REUSABLE]
    assert tail and tail[-1].num_seqs == 1


# -- invariants on real logs ----------------------------------------------------------------------
async def _workload(eng: Engine, rng: random.Random, *, stop_mid: bool) -> dict | None:
    """Requests sharing prefixes in waves, some aborted, tiers emptied between waves so later ones
    restore from L2 and L3 (and prefetch); returns the metrics after a drain, or None when the
    engine is shut down with requests and ops still under way."""
    bases = [[rng.randrange(500) for _ in range(n)] for n in (16, 24, 40)]

    async def one(prompt: list[int], max_tokens: int):
        return await eng.generate_async([prompt], SamplingParams(max_tokens=max_tokens))

    tasks = []
    for wave in range(3):
        for _ in range(4):
            prompt = rng.choice(bases) + [rng.randrange(500) for _ in range(rng.randrange(1, 6))]
            tasks.append(asyncio.create_task(one(prompt, rng.choice([1, 3, 6]))))
        await asyncio.sleep(0.005)
        for rid in list(eng.requests)[:1]:
            await eng.abort(rid)
        if stop_mid and wave == 2:
            await eng.shutdown()
            await asyncio.gather(*tasks)
            return None
        await asyncio.gather(*tasks)
        await eng.cache.drain()
        eng.cache.tree.evict(Tier.L1, 10 ** 6)
        if wave % 2 == 0:
            eng.cache.tree.evict(Tier.L2, 10 ** 6)
    await eng.cache.drain()
    metrics = eng.metrics()
    await eng.shutdown()
    return metrics


@pytest.mark.asyncio
async def test_three_runs_with_faults_in_one_log(tmp_path, restore_logging):
    """Three engines append to one log: a plain one with chunked prefill; one with failing and slow
    L3 reads (past their deadline) under write_back; one with failing copies and L3 writes, shut
    down mid-flight. Then a crash mid-line. The timeline splits the runs, every check holds and
    each finished run's totals are its metrics."""
    log = tmp_path / "run.jsonl"
    rng = random.Random(5)
    slow = FaultInjector()
    slow.arm(Fault.EIO_READ, times=2)
    slow.arm(Fault.SLOW_READ, times=2, delay_s=0.4)
    broken = FaultInjector()
    broken.arm(Fault.TRANSFER_RAISE, times=2)
    broken.arm(Fault.EIO_WRITE, times=2)
    metrics = []
    for faults, options, stop_mid in ((None, dict(max_prefill_tokens=16), False),
                                      (slow, dict(write_policy="write_back", io_timeout_s=0.2), False),
                                      (broken, {}, True)):
        eng = engine(log, faults, num_pages=40, **options)
        await eng.start()
        metrics.append(await _workload(eng, rng, stop_mid=stop_mid))
    with open(log, "a") as f:
        f.write('{"event": "request", "rid": "req-0", "sta')  # a crash mid-write

    bad: list[int] = []
    events = read_events(log, bad_lines=bad)
    tl = build_timeline(events, num_bad_lines=len(bad))
    assert tl.num_runs == 3 and len(bad) == 1 and tl.num_malformed_events == 0
    check_log(events)  # (shutdown() mid-flight drains: its ops end too)
    check_timeline(tl)
    check_chrome(to_chrome(tl))
    outcomes = Counter(o.outcome for o in tl.ops.values())
    assert outcomes["failed"] >= 2 and outcomes["ok"] >= 1, outcomes  # the faults fired
    assert any(o.kind != "backup" and o.outcome == "ok" for o in tl.ops.values())  # restores ran
    assert any(r.final_state == "aborted" for r in tl.requests.values())
    for run, m in enumerate(metrics):
        if m is not None:
            assert totals_of_run(tl, run) == totals_of_metrics(m), run
    render_png(tl, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("text", [
    "",
    '{"event": "run_start", "ts_ns": 5, "pid": 1}\n',
    '{"event": "run_start", "ts_ns": 5, "pid": 1}\n{"event": "request", "rid": "a", "state": "queued", "ts_ns": 9}\n',
    '{"event": "request", "rid": "a", "state": "queued", "ts_ns": 9}\n{"event": "request", "rid": "a", "sta',
    '{"event": "requ',
])
def test_png_and_trace_of_small_and_truncated_logs(tmp_path, text):
    path = tmp_path / "log.jsonl"
    path.write_text(text)
    tl = build_timeline(read_events(path))
    check_chrome(to_chrome(tl))
    check_timeline(tl)
    render_png(tl, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0


@pytest.mark.parametrize("name", ["timeline", "timeline.out", "t.PNG"])
def test_png_is_written_where_asked_whatever_its_name(tmp_path, capsys, name):
    """Regression: `--png timeline` wrote timeline.png (matplotlib adds the extension of its default
    format) while the tool said "wrote timeline"; `--png timeline.out` ended in matplotlib's
    ValueError traceback (an unknown format)."""
    from test_tools_edges import load_timeline_script

    log = tmp_path / "run.jsonl"
    log.write_text('{"event": "request", "rid": "a", "state": "queued", "ts_ns": 9}\n')
    out = tmp_path / name
    assert load_timeline_script().main([str(log), "--no-tables", "--png", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run.jsonl", name])
    assert f"wrote {out}" in capsys.readouterr().err


def test_a_request_that_fails_to_queue_is_not_left_running_in_the_log(tmp_path, restore_logging, monkeypatch):
    """`add_request` logs "queued", then starts the request's prefetch; when that raises, the request
    is taken back and the caller gets the error (tests/test_leftovers2_hunt.py stages it the same
    way). Regression: the log never ended it, and the timeline showed it running to the run's end."""
    log = tmp_path / "run.jsonl"
    eng = engine(log)

    def fails(req):
        raise RuntimeError("the store cannot be asked now")

    with monkeypatch.context() as patch:
        patch.setattr(eng.admission, "maybe_prefetch", fails)
        with pytest.raises(RuntimeError, match="cannot be asked"):
            eng.add_request(PROMPT, SamplingParams(max_tokens=2), rid="lost")
    [result] = eng.generate([PROMPT], SamplingParams(max_tokens=2))
    assert result.error is None
    asyncio.run(eng.shutdown())
    events = read_events(log)
    check_log(events)
    tl = build_timeline(events)
    lost = tl.requests["lost"]
    assert lost.final_state == "failed" and "cannot be asked" in (lost.end_reason or ""), lost
    check_timeline(tl)
