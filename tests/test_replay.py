"""Trace replay (scheduler/replay.py, scripts/replay_trace.py): simulated vs real hits, outputs with and
without the cache, the JSON summary, malformed traces, bad requests, and the timeline of a replay."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import structlog

from scheduler.replay import build_parser, format_summary, main, outputs_digest, run_cli
from scheduler.replay_args import SAMPLE_TRACE, config_from_replay_args, fill_defaults
from scheduler.timeline import build_timeline, read_events
from scheduler.timeline_views import render_png, to_chrome
from scheduler.trace import load_trace

REQUIRED_KEYS = ("requests", "completed", "failed", "prompt_tokens", "hit_tokens", "recomputed_tokens", "ttft_ms",
                 "throughput_req_s", "bytes", "integrity", "outputs_digest", "problems", "config")
GOOD = '{"timestamp": %d, "input_length": 700, "output_length": 40, "hash_ids": [%d, %d]}'


def reuse_slice_lines(num_requests: int = 40, within: int = 200) -> list[str]:
    """Raw lines of a short slice of the bundled sample that has reuse inside itself: every request of
    the first `within` whose first two hash ids recur there, plus evenly spread other requests (they
    push the shared prefixes out of L1 and L2), in trace order. Reuse in the sample is 35-250 requests
    apart, so no 40 consecutive lines hit L2 and L3 both."""
    records, _ = load_trace(SAMPLE_TRACE, max_requests=within)
    groups = Counter(r.hash_ids[:2] for r in records if len(r.hash_ids) >= 2)
    keep = [r for r in records if groups[r.hash_ids[:2]] > 1]
    rest = [r for r in records if groups[r.hash_ids[:2]] <= 1]
    step = len(rest) / (num_requests - len(keep))
    chosen = sorted(keep + [rest[int(i * step)] for i in range(num_requests - len(keep))], key=lambda r: r.line_no)
    lines = SAMPLE_TRACE.read_text().splitlines()
    return [lines[r.line_no - 1] for r in chosen]


@pytest.fixture(scope="module")
def slice_args(tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("trace") / "slice.jsonl"
    path.write_text("\n".join(reuse_slice_lines()) + "\n")
    # deterministic: one request at a time (and its cache operations), restores forced
    return ["--trace", str(path), "--block-tokens", "16", "--time-scale", "0", "--concurrency", "1",
            "--max-input-tokens", "256", "--max-output-tokens", "8", "--l1-tokens", "1024", "--l2-tokens", "4096",
            "--l3-tokens", "16384", "--hicache-policy", "always", "--no-progress"]


@pytest.fixture(scope="module")
def real_run(slice_args, tmp_path_factory):
    """One real (tiny model, CPU) replay of the slice with every tier, its no-cache twin, a JSON summary
    and a structured log; the global structlog configuration is restored afterwards."""
    out = tmp_path_factory.mktemp("real")
    saved = structlog.get_config()
    try:
        summary = run_cli([*slice_args, "--compare-no-cache", "--json-out", str(out / "summary.json"),
                           "--log-json", str(out / "events.jsonl")])
    finally:
        structlog.configure(**saved)
    return summary, out


def test_simulated_hits_equal_real_hits(real_run, slice_args):
    real, _ = real_run
    sim = run_cli([*slice_args, "--simulate"])
    _assert_same_hits(real, sim)


def test_simulated_hits_equal_real_hits_with_blocking_restores(slice_args):
    args = [*slice_args, "--disable-hicache-prefetch"]
    _assert_same_hits(run_cli(args), run_cli([*args, "--simulate"]))


def _assert_same_hits(real: dict, sim: dict) -> None:
    assert real["failed"] == sim["failed"] == 0
    assert real["hit_tokens"]["l2"] > 0 and real["hit_tokens"]["l3"] > 0, real["hit_tokens"]
    assert sim["hit_tokens"] == real["hit_tokens"]
    assert sim["recomputed_tokens"] == real["recomputed_tokens"]
    assert sim["integrity"] == "passed"
    assert sim["config"]["engine"]["simulate"] is True


def test_hierarchy_hits_and_outputs_equal_no_cache(real_run):
    s, _ = real_run
    assert s["requests"] == s["completed"] == 40 and s["failed"] == 0
    assert s["hit_tokens"]["l2"] > 0 and s["hit_tokens"]["l3"] > 0
    assert all(s["bytes"][d] > 0 for d in ("d2h", "h2d", "h2s", "s2h")), s["bytes"]
    assert s["integrity"] == "passed"
    assert s["compare_no_cache"]["failed"] == 0
    assert s["compare_no_cache"]["outputs_digest"] == s["outputs_digest"]
    assert s["compare_no_cache"]["match"] is True
    hits = sum(s["hit_tokens"].values())
    assert hits + s["recomputed_tokens"] == s["prompt_tokens"]


def test_json_out_has_every_required_key(real_run):
    _, out = real_run
    s = json.loads((out / "summary.json").read_text())
    for key in REQUIRED_KEYS:
        assert key in s, key
    assert set(s["hit_tokens"]) == {"l1", "l2", "l3"}
    assert set(s["ttft_ms"]) == {"p50", "p90", "p99"} and s["ttft_ms"]["p50"] > 0
    assert set(s["bytes"]) == {"d2h", "h2d", "h2s", "s2h"}
    assert s["throughput_req_s"] > 0 and s["problems"] == []
    assert len(s["outputs_digest"]) == 64
    assert s["config"]["engine"]["hicache"]["enable"] is True
    assert s["config"]["engine"]["num_pages"] == 1024 // 16
    assert s["config"]["replay"]["block_tokens"] == 16


def test_timeline_of_a_replay_is_a_valid_chrome_trace_and_png(real_run, tmp_path):
    _, out = real_run
    bad: list[int] = []
    tl = build_timeline(read_events(out / "events.jsonl", bad_lines=bad), num_bad_lines=len(bad))
    assert bad == [] and len(tl.requests) == 40  # the no-cache twin logs nothing into this run's log
    assert all(r.final_state == "finished" for r in tl.requests.values())
    assert tl.batches and tl.ops
    trace = json.loads(json.dumps(to_chrome(tl)))
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    open_slices: Counter = Counter()
    for e in events:
        assert {"name", "ph", "pid", "tid", "ts"} <= set(e), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
        elif e["ph"] in ("b", "e"):
            open_slices[(e["cat"], e["id"], e["name"])] += 1 if e["ph"] == "b" else -1
            assert open_slices[(e["cat"], e["id"], e["name"])] >= 0, e  # never ends before it began
        else:
            assert e["ph"] in ("M", "C"), e
    assert all(n == 0 for n in open_slices.values())
    cats = {e["cat"] for e in events if e["ph"] == "b"}
    assert cats >= {"request", "backup", "restore_l2"} and cats & {"restore_l3", "prefetch_l3"}, cats
    png = tmp_path / "timeline.png"
    render_png(tl, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_malformed_lines_are_skipped_with_line_numbers(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text("\n".join([
        GOOD % (0, 1, 2),
        '{"timestamp": 10, "input_length": 700',                                        # 2: bad JSON
        GOOD % (20, 1, 3),
        '{"timestamp": 30, "input_length": 700, "output_length": 5}',                  # 4: no hash_ids
        '{"timestamp": 40, "input_length": 700, "output_length": 5, "hash_ids": [1]}',  # 5: 1 id for 2 blocks
        "",
        '[1, 2, 3]',                                                                     # 7: not an object
        GOOD % (50, 1, 2),
    ]) + "\n")
    args = ["--trace", str(trace), "--block-tokens", "16", "--time-scale", "0", "--no-progress", "--simulate"]
    s = run_cli(args)
    assert [p["line"] for p in s["problems"]] == [2, 4, 5, 7]
    assert s["requests"] == s["completed"] == 3
    err = capsys.readouterr().err
    for line_no in (2, 4, 5, 7):
        assert f"bad.jsonl:{line_no}: skipped" in err
    with pytest.raises(SystemExit) as exc:
        main([*args, "--strict"])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "--strict" in err and "4 malformed line(s)" in err and "line 2: bad JSON" in err


def test_bad_requests_fail_and_the_run_continues(tmp_path):
    trace = tmp_path / "big.jsonl"
    huge = '{"timestamp": 5, "input_length": 40000, "output_length": 4, "hash_ids": [%s]}' % ", ".join(
        str(100 + i) for i in range(79))
    trace.write_text("\n".join([GOOD % (0, 1, 2), huge, GOOD % (9, 1, 2)]) + "\n")
    s = run_cli(["--trace", str(trace), "--block-tokens", "16", "--time-scale", "0", "--no-progress",
                 "--concurrency", "1", "--l1-tokens", "512"])
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"][0]["line"] == 2 and "exceeds" in s["errors"][0]["error"]
    assert s["integrity"] == "passed" and s["hit_tokens"]["l1"] > 0
    # the failed request was never prefilled: its prompt is apart, and hits + recomputed = prompt tokens
    assert s["prompt_tokens"] < 512 < s["failed_prompt_tokens"]  # the L1 holds 512 tokens
    assert sum(s["hit_tokens"].values()) + s["recomputed_tokens"] == s["prompt_tokens"]
    assert f"(+{s['failed_prompt_tokens']:,} in failed requests)" in format_summary(s)


def test_engine_crash_fails_the_remaining_requests(monkeypatch):
    from scheduler import runner
    launch, calls = runner.SimRunner.launch, []

    def failing_launch(self, batch, chain=None):
        calls.append(1)
        if len(calls) == 30:
            raise RuntimeError("injected crash")
        return launch(self, batch, chain)

    monkeypatch.setattr(runner.SimRunner, "launch", failing_launch)
    args = ["--simulate", "--no-progress", "--max-requests", "20"]
    s = run_cli(args)
    assert "injected crash" in s["engine_crash"] and s["completed"] + s["failed"] == 20 and s["failed"] >= 1
    # the completed requests' hits and recomputed tokens add up to their prompts (regression: the engine's totals,
    # the failed requests' prefills among them, were shown against the completed prompts: over 100 %)
    assert sum(s["hit_tokens"].values()) + s["recomputed_tokens"] == s["prompt_tokens"]
    calls.clear()
    assert main(args) == 1


def test_no_argument_defaults():
    args = build_parser().parse_args([])
    fill_defaults(args)
    assert Path(args.trace) == SAMPLE_TRACE and args.block_tokens == 16 and args.concurrency == 1
    assert args.time_scale == 0 and 150 <= args.max_requests <= 300
    cfg = config_from_replay_args(args)
    assert cfg.device == "cpu" and cfg.model == "tiny" and cfg.hicache.enable and cfg.page_size == 16
    bpp = 16 * 2 * 2 * 2 * 16 * 4  # page x K/V x layers x kv heads x head_dim x float32
    assert cfg.num_pages == 4096 // 16
    assert cfg.hicache.host_pages(cfg.num_pages, bpp) == 24576 // 16
    assert cfg.hicache.storage_pages(0, bpp) == 65536 // 16
    user = build_parser().parse_args(["--trace", "x.jsonl", "--disable-hicache"])
    fill_defaults(user)
    assert user.block_tokens == 512 and user.max_requests is None and user.l1_tokens is None
    assert not config_from_replay_args(user).hicache.enable


def test_simulate_sample_defaults_and_huge_capacities():
    s = run_cli(["--simulate", "--no-progress"])  # the README command, simulated: cost model at its priors
    assert s["failed"] == 0 and s["hit_tokens"]["l2"] > 0 and s["hit_tokens"]["l3"] > 0
    big = run_cli(["--simulate", "--no-progress", "--model", "qwen3-8b", "--max-requests", "40",
                   "--l1-tokens", "4096", "--l2-gib", "2", "--l3-gib", "2000", "--hicache-policy", "always"])
    assert big["completed"] == 40 and big["integrity"] == "passed"
    assert big["config"]["engine"]["dtype"] == "bfloat16"
    assert big["config"]["engine"]["hicache"]["storage_size_gb"] == 2000.0
    assert big["bytes"]["h2s"] > 0


def test_concurrent_replay_with_arrival_times(slice_args):
    args = list(slice_args)
    args[args.index("--concurrency") + 1] = "4"
    args[args.index("--time-scale") + 1] = "0.001"
    s = run_cli([*args, "--max-requests", "16", "--max-input-tokens", "128"])
    assert s["completed"] == 16 and s["integrity"] == "passed"


def test_outputs_digest_depends_on_order_and_boundaries():
    from scheduler.replay import Outcome, ReplayItem
    item = ReplayItem(0, 1, 0.0, [1], 1)
    d = lambda *outs: outputs_digest([Outcome(item, list(o)) for o in outs])  # noqa: E731
    assert d([1, 2], [3]) != d([1], [2, 3]) != d([3], [1, 2])
    assert d([1, 2], [3]) == d([1, 2], [3])
