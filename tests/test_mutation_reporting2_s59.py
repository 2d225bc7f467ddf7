"""Reporting guards found untested by session 59's second mutation check (scheduler/prom_vllm.py and the replay's
report in scheduler/replay.py): vLLM's prefix-cache hits count every tier and its KV-cache usage stays in 0..1;
the replay summary's percentiles, TTFT unit, counts and tallies of failed requests, and its per-request records."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from scheduler.config import EngineConfig
from scheduler.prom_vllm import VllmCollector, _kv_cache_usage
from scheduler.replay import DIRECTIONS, Outcome, ReplayItem, _percentile, format_summary, request_records, summarize


# -- scheduler/prom_vllm.py -----------------------------------------------------------------------
def test_prefix_cache_hits_are_every_tiers_hits():
    """vllm:prefix_cache_hits: tokens served from L1, L2 or L3; queries: those and the recomputed ones."""
    class NoFamilies:  # (ServerMetrics' own families: none observed)
        def __getattr__(self, name):
            return NS(collect=lambda: [])
    engine = NS(status=lambda: {"engine": {}, "tiers": {}},
                metrics=lambda: {"hit_tokens": {"l1": 3, "l2": 5, "l3": 7}, "recomputed_tokens": 11})
    got = {s.name: s.value for fam in VllmCollector(NoFamilies(), engine, "m").collect() for s in fam.samples}
    assert (got["vllm:prefix_cache_hits_total"], got["vllm:prefix_cache_queries_total"]) == (15, 26)


def test_kv_cache_usage_stays_within_0_and_1():
    """0..1 as vLLM's gauge, whatever the status says (defensive: /metrics reads the status on the engine's loop,
    where free + evictable <= capacity and capacity > 0 hold), and 0 for no L1 or an L1 of no pages."""
    l1 = lambda cap, free, evictable: {"tiers": {"l1": {"capacity_pages": cap, "free_pages": free,  # noqa: E731
                                                        "evictable_pages": evictable}}}
    assert _kv_cache_usage(l1(10, 8, 5)) == 0.0 and _kv_cache_usage(l1(10, 0, -2)) == 1.0
    assert _kv_cache_usage(l1(0, 0, 0)) == 0.0 and _kv_cache_usage({"tiers": {"l1": None}}) == 0.0
    assert _kv_cache_usage(l1(10, 2, 3)) == 0.5


# -- scheduler/replay.py: the report ---------------------------------------------------------------
def outcome(index: int, line_no: int, prompt: int, output: int = 0, **kw):
    return Outcome(ReplayItem(index, line_no, 0.0, [1] * prompt, max(1, output)), list(range(output)), **kw)


def summary(outcomes, wall_s: float = 2.0, **run) -> dict:
    run = {"outcomes": outcomes, "metrics": {"directions": {d: {"bytes": 0} for d in DIRECTIONS}},
           "integrity": "passed", "wall_s": wall_s, "engine_crash": None, **run}
    return summarize(run, [], EngineConfig(model="tiny"), {})


def test_percentiles_interpolate_between_the_sorted_values():
    values = [40.0, 10.0, 30.0, 20.0]
    assert _percentile(values, 0.5) == pytest.approx(25.0)
    assert _percentile(values, 0.9) == pytest.approx(37.0)
    assert _percentile(values, 0.0) == 10.0 and _percentile(values, 1.0) == 40.0 and _percentile([], 0.5) is None


def test_the_summarys_ttft_is_in_ms_and_its_p99_is_the_99th_percentile():
    """TTFT of the completed requests only (a failed request's first token aside), in milliseconds."""
    done = [outcome(i, i + 1, 8, 2, finish_reason="length", ttft_s=(i + 1) / 1000) for i in range(11)]
    failed = outcome(11, 12, 8, 1, finish_reason="error", error="boom", ttft_s=5.0)
    s = summary(done + [failed])
    assert s["ttft_ms"] == pytest.approx({"p50": 6.0, "p90": 10.0, "p99": 10.9})
    assert s["throughput_req_s"] == pytest.approx(11 / 2.0)  # (completed requests per second)


def test_failed_requests_are_counted_and_kept_apart_from_the_completed_ones_tallies():
    """A request that failed after admission (its engine said "error", or the engine crashed) is failed whatever
    its finish reason; its prompt is failed_prompt_tokens, its hits and recomputed tokens are left out of the
    completed prompts' (they add up to prompt_tokens), its tokens still count as output tokens."""
    ok = outcome(0, 1, 32, 4, finish_reason="length", hit_tokens={"l1": 16, "l2": 8}, recomputed_tokens=8)
    errored = outcome(1, 3, 48, 3, finish_reason="error", error="nan logits", hit_tokens={"l1": 16, "l3": 16},
                      recomputed_tokens=16)
    refused = outcome(2, 2, 2000, error="prompt exceeds L1")
    s = summary([ok, errored, refused])
    assert (s["requests"], s["completed"], s["failed"]) == (3, 1, 2)
    assert (s["prompt_tokens"], s["failed_prompt_tokens"], s["output_tokens"]) == (32, 2048, 7)
    assert s["hit_tokens"] == {"l1": 16, "l2": 8, "l3": 0} and s["recomputed_tokens"] == 8
    assert s["errors"] == [{"index": 1, "line": 3, "error": "nan logits"},
                           {"index": 2, "line": 2, "error": "prompt exceeds L1"}]
    assert s["throughput_req_s"] == pytest.approx(0.5)
    rows = dict(line.split("  ", 1) for line in format_summary(s).splitlines())
    assert rows["prompt tokens"].strip() == "32 (+2,048 in failed requests)"
    assert rows["hit tokens L1"].strip() == "16 (50.0%)" and rows["hit tokens L2"].strip() == "8 (25.0%)"


def test_a_summary_without_failed_prompts_says_nothing_of_them():
    s = summary([outcome(0, 1, 32, 4, finish_reason="stop", recomputed_tokens=32)])
    assert "in failed requests" not in format_summary(s) and s["failed_prompt_tokens"] == 0


def test_records_are_in_trace_line_order_with_times_in_ms():
    """Requests run in arrival order (index), records list them by trace line; TTFT and latency in ms."""
    a = outcome(0, 3, 8, 2, finish_reason="length", ttft_s=0.002, latency_s=0.005)
    b = outcome(1, 1, 8, 2, finish_reason="length", ttft_s=0.001, latency_s=0.004)
    records = request_records([a, b])
    assert [r["line"] for r in records] == [1, 3]
    assert (records[0]["ttft_ms"], records[0]["latency_ms"]) == pytest.approx((1.0, 4.0))
    assert request_records([a], timed=False)[0]["ttft_ms"] is None


def test_the_summary_shows_what_preemptions_computed_again():
    s = summary([outcome(0, 1, 8, 2, finish_reason="length")], preempted=2, preempted_recomputed_tokens=40)
    assert (s["preempted"], s["preempted_recomputed_tokens"]) == (2, 40)
    assert "2 times (40 tokens computed again)" in format_summary(s)
