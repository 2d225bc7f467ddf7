"""Reporting guards found untested by session 59's mutation check of scheduler/timeline.py, timeline_views.py,
prom.py, prom_vllm.py, hicache/metrics.py, hicache/inspection.py and the replay's summary: what the timeline's
columns say of a preempted or re-admitted request, span keys, event order, and the figures /metrics and the
replay report derive."""
from __future__ import annotations

import pytest

from scheduler.timeline import build_timeline
from scheduler.timeline_views import format_tables, op_rows, request_rows
from test_timeline import MS, PREFILL_HITS, T0_NS, op, req


# -- timeline -------------------------------------------------------------------------------------
def column(tl, rid: str, name: str) -> str:
    from scheduler.timeline_views import REQUEST_COLUMNS
    return next(row for row in request_rows(tl) if row[0] == rid)[REQUEST_COLUMNS.index(name)]


def test_a_preempted_requests_queue_wait_and_prompt_are_its_first_admissions():
    """A resumption's prefill_start (its prompt folded with its output: more tokens) is not the request's
    arrival in the engine: queue_ms and prompt_tokens stay the first admission's."""
    events = [req(0, "a", "queued"), req(1, "a", "prefill_start", **PREFILL_HITS), req(2, "a", "prefill_end"),
              req(2, "a", "first_token"), req(10, "a", "preempted", preemptions=1),
              req(25, "a", "prefill_start", **{**PREFILL_HITS, "prompt_tokens": 74}), req(26, "a", "prefill_end"),
              req(26, "a", "resumed"), req(30, "a", "finished", output_tokens=20, reason="length")]
    tl = build_timeline(events)
    span = tl.requests["a"]
    assert (span.queue_wait_ns, span.prompt_tokens) == (1 * MS, 64)
    assert column(tl, "a", "queue_ms") == "1.00"


def test_a_restore_wait_runs_from_the_park_to_the_admission_after_it():
    """An admission whose overlapped restore was discarded comes back through the queue and may park: its restore
    wait is that park to the prefill_start after it (not the discarded admission's, before the park: negative)."""
    events = [req(0, "a", "queued"),
              req(1, "a", "prefill_start", **{**PREFILL_HITS, "hit_l2": 32, "restore_tier": "l2",
                                              "restore_tokens": 32, "restore_overlap": True}),
              req(4, "a", "restore_overlap_discarded"), req(5, "a", "parked", restore_tier="l2"),
              req(9, "a", "prefill_start", **{**PREFILL_HITS, "hit_l2": 32, "restore_tier": "l2",
                                              "restore_tokens": 32}),
              req(12, "a", "prefill_end"), req(12, "a", "first_token")]
    span = build_timeline(events).requests["a"]
    assert span.restore_wait_ns == 4 * MS and span.prefill_ns == 11 * MS


def test_events_are_taken_in_time_order_not_file_order():
    """Lines of one run written out of order (threads logging at once) are read by ts_ns: a request whose
    `finished` line was written before its `first_token` one still ended."""
    events = [req(0, "a", "queued"), req(9, "a", "finished", output_tokens=3, reason="length"),
              req(1, "a", "prefill_start", **PREFILL_HITS), req(3, "a", "prefill_end"), req(3, "a", "first_token")]
    span = build_timeline(events).requests["a"]
    assert span.final_state == "finished" and span.first_token_ns == 3 * MS and span.finish_ns == 9 * MS


def test_a_reused_rid_never_takes_the_key_of_a_request_named_like_its_next_span():
    """The second span of "r0" is keyed "r0#2" unless a request of that very name exists: then "r0#3"."""
    one = lambda t, rid: [req(t, rid, "queued"), req(t + 1, rid, "finished", output_tokens=1)]  # noqa: E731
    tl = build_timeline(one(0, "r0") + one(5, "r0#2") + one(10, "r0"))
    assert list(tl.requests) == ["r0", "r0#2", "r0#3"]
    assert [(r.rid, r.arrival_ns - T0_NS) for r in tl.requests.values()] == [("r0", 0), ("r0#2", 5 * MS),
                                                                             ("r0", 10 * MS)]


def test_an_ops_bytes_are_its_last_transitions():
    """A backup's bytes are its D2H's, then its L3 write's (only the pages L3 lacks): the table shows the last."""
    events = [op(0, 1, "backup", "L1_PRIVATE", "D2H_PENDING"), op(1, 1, "backup", "D2H_PENDING", "L1_L2"),
              {**op(2, 1, "backup", "L1_L2", "H2S_PENDING"), "bytes": 1024, "pages": 1},
              {**op(3, 1, "backup", "H2S_PENDING", "L1_L2_L3"), "bytes": 1024, "pages": 1}]
    tl = build_timeline(events)
    assert (tl.ops[1].num_bytes, tl.ops[1].num_pages) == (1024, 1)
    assert op_rows(tl)[0][4] == "1024" and "L1_L2_L3" in format_tables(tl)


def test_the_summary_counts_batches_per_kind_and_names_runs_only_when_several():
    from scheduler.timeline_views import summary_line
    from test_timeline import batch
    tl = build_timeline([batch(1, 1, "prefill", 0), batch(2, 2, "decode", 1), batch(3, 3, "prefill", 2),
                         req(0, "a", "queued"), req(3, "a", "aborted", output_tokens=0, reason="abort")])
    line = summary_line(tl)
    assert "batches: 1 decode, 2 prefill; span 3.00 ms;" in line and " runs" not in line
    assert column(tl, "a", "output_tokens") == "0"  # (an abort before any token: 0, not "-" as one never ended)


def test_a_request_preempted_in_a_crashed_run_is_preempted_until_that_runs_end():
    """preempted_ms of a request its run left preempted (the engine stopped) ends with that run, not the next."""
    run_start = lambda t_ms: {"event": "run_start", "ts_ns": T0_NS + int(t_ms * MS), "pid": 1}  # noqa: E731
    crashed = [req(0, "a", "queued"), req(1, "a", "first_token"), req(4, "a", "preempted", preemptions=1),
               req(10, "b", "queued")]
    later = [req(1000, "c", "queued"), req(1001, "c", "finished", output_tokens=1)]
    tl = build_timeline([run_start(0), *crashed, run_start(999), *later])
    assert column(tl, "a", "preempted_ms") == "6.00"


def test_the_chrome_trace_lists_its_events_in_time_order():
    """Batches, requests, ops and counters are interleaved by ts (a slice's "e" before the next "b" at one ts)."""
    from scheduler.timeline_views import to_chrome
    from test_timeline import EVENTS
    ts = [e["ts"] for e in to_chrome(build_timeline(EVENTS))["traceEvents"] if e["ph"] != "M"]
    assert len(ts) > 20 and ts == sorted(ts)
    ends = {e["id"]: e["args"]["final_state"] for e in to_chrome(build_timeline(EVENTS))["traceEvents"]
            if e["ph"] == "e" and e.get("cat") == "backup" and "args" in e}
    assert ends[1] == "L1_L2_L3" and ends[4] == "D2H_PENDING"


def test_the_plain_tables_columns_are_as_wide_as_their_longest_cell():
    tl = build_timeline([req(0, "a-request-with-a-long-id", "queued"), req(1, "b", "queued")])
    lines = format_tables(tl).splitlines()
    header = next(ln for ln in lines if ln.startswith("rid"))
    row = next(ln for ln in lines if ln.startswith("b "))
    assert header.index("arrival_ms") == row.index("1.00") == len("a-request-with-a-long-id") + 2


# -- hicache/metrics.py ---------------------------------------------------------------------------
def test_a_directions_recurring_seconds_never_go_below_zero_and_its_rate_is_in_gib():
    """The default sample is end to end less setup and the compute wait, at least 0 (timers read apart can
    overlap); gib_s is bytes / 2**30 over the recurring seconds (GiB/s, as its name and HELP say)."""
    from hicache.metrics import DirectionStats
    s = DirectionStats()
    s.add(1 << 30, end_to_end_s=1.0, setup_s=0.7, compute_wait_s=0.5)
    assert s.recurring_s == 0.0 and s.gib_s == 0.0 and s.count == 1
    s.add(1 << 30, end_to_end_s=2.0)
    assert s.recurring_s == 2.0 and s.gib_s == 1.0 and s.as_dict()["bytes"] == 2 << 30
    s.add(0, enqueue_s=0.25, setup_s=0.5, service_s=1.0, end_to_end_s=3.0)
    d = s.as_dict()
    assert (d["enqueue_s"], d["setup_s"], d["service_s"], d["end_to_end_s"]) == (0.25, 1.2, 1.0, 6.0)


def test_metrics_as_dict_is_a_snapshot():
    """A status read (engine.status()["metrics"]) does not change as the cache counts on."""
    from hicache.metrics import Metrics
    m = Metrics()
    d = m.as_dict()
    m.hit_tokens["l1"] += 4
    m.evictions_pages["l2"] += 1
    m.policy_skips["restore"] += 1
    m.count_failure("eio")
    assert d["hit_tokens"]["l1"] == d["evictions_pages"]["l2"] == d["policy_skips"]["restore"] == 0
    assert d["failures"] == {}


# -- scheduler/prom.py, prom_vllm.py --------------------------------------------------------------
def scraped(monkeypatch, edit_status=None, edit_metrics=None, model_name="m"):
    """(samples by (name, labels)) of one /metrics rendering of an idle tiny engine whose status / metrics
    are edited to distinct values, and the ServerMetrics."""
    from prometheus_client.parser import text_string_to_metric_families

    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.prom import ServerMetrics
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=48))
    status, metrics = engine.status(), engine.metrics()
    (edit_status or (lambda s: None))(status)
    (edit_metrics or (lambda m: None))(metrics)
    monkeypatch.setattr(engine, "status", lambda: status)
    monkeypatch.setattr(engine, "metrics", lambda: metrics)
    sm = ServerMetrics(engine, model_name)

    def render():
        out = {}
        for fam in text_string_to_metric_families(sm.render().decode()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out
    return render, sm


def test_engine_families_read_each_their_own_field(monkeypatch):
    """Each engine figure on /metrics is its own status field, in seconds: a distinct value for each."""
    def edit(st):
        st["engine"].update(waiting=2, parked=3, running=5, prefill_tokens=70, decode_tokens=11, chained_steps=13,
                            restore_overlaps=17, preempted=19, preempted_recomputed_tokens=23)
        st["tiers"]["l1"].update(free_pages=8, resident_pages=30, evictable_pages=20, protected_pages=10,
                                 private_pages=6)
        st["cost_model"]["directions"]["recompute"]["us_per_token"] = 50.0
        st["cost_model"]["directions"]["h2s"]["gib_s"] = None

    def edit_m(m):
        for i, d in enumerate(("d2h", "h2d", "h2s", "s2h")):
            m["directions"][d].update(extents=100 + i, enqueue_s=1.0 + i, service_s=9.0 + i)
        m["failures"] = {"eio": 4}
    render, sm = scraped(monkeypatch, edit, edit_m)
    sm.ended("cancelled", 3, 2)  # (a reason that is none of vLLM's four: an error)
    s = render()
    assert s[("hicache_requests_finished_total", (("finish_reason", "error"),))] == 1
    assert s[("hicache_pool_used_pages", (("tier", "l1"),))] == 48 - 8
    assert s[("hicache_pool_pages", (("state", "private"), ("tier", "l1")))] == 6
    assert s[("hicache_engine_requests", (("state", "parked"),))] == 3
    assert [s[("hicache_engine_tokens_total", (("kind", k),))] for k in ("prefill", "decode")] == [70, 11]
    assert [s[("hicache_engine_overlapped_steps_total", (("kind", k),))] for k in ("decode_chain", "restore")] \
        == [13, 17]
    assert s[("hicache_cost_model_recompute_seconds_per_token", ())] == pytest.approx(50e-6)
    assert s[("hicache_cost_model_gib_per_second", (("direction", "h2s"),))] == float("inf")
    assert [s[("hicache_storage_extents_total", (("direction", d),))] for d in ("h2s", "s2h")] == [102, 103]
    assert s[("hicache_transfer_phase_seconds_total", (("direction", "h2d"), ("phase", "enqueue")))] == 2.0
    assert s[("hicache_operation_failures_total", (("kind", "eio"),))] == 4
    assert s[("hicache_operation_failures_total", (("kind", "nan_logits"),))] == 0
    vllm = lambda name: s[(name, (("model_name", "m"),))]  # noqa: E731
    assert (vllm("vllm:num_requests_waiting"), vllm("vllm:num_requests_running")) == (5, 5)
    assert vllm("vllm:num_preemptions_total") == 19


# -- hicache/inspection.py ------------------------------------------------------------------------
def test_a_tiers_status_splits_its_pages_by_state():
    from types import SimpleNamespace as NS

    from hicache.inspection import tier_status
    from hicache.radix import Tier
    alloc = NS(num_pages=10, num_free=3, num_private=lambda: 2)
    mgr = NS(tree=NS(allocators={Tier.L1: alloc}, evictable_pages=lambda t: 4, num_resident_pages={Tier.L1: 5}),
             allocator=lambda t: alloc, geometry=NS(bytes_per_page=100))
    assert tier_status(mgr, Tier.L1) == {"capacity_pages": 10, "free_pages": 3, "resident_pages": 5,
                                         "evictable_pages": 4, "protected_pages": 1, "private_pages": 2,
                                         "capacity_bytes": 1000}
    assert tier_status(mgr, Tier.L2) is None


def test_a_second_server_renders_the_engines_one_step_histogram():
    """Each engine's step histogram is made by its first server; a second one renders it, not a new one."""
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.prom import ServerMetrics
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=48))
    first, second = ServerMetrics(engine), ServerMetrics(engine)
    engine.runner.observe_step_tokens(8)
    assert second.step_tokens is first.step_tokens
    assert b"hicache_engine_step_tokens_count 1.0" in first.render()
