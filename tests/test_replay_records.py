"""The replay's per-request records (`request_records` in the summary and its `--json-out` file): one
per replayed trace line, in trace order, whose hits and recomputed tokens add up to the summary's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler.replay import run_cli

TIERS = ("l1", "l2", "l3")


def rec(ts: int, n_in: int, n_out: int, ids) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": list(ids)})


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> tuple[Path, list[int], int]:
    """Conversations that reuse prefixes across small tiers, timestamps out of file order, a malformed
    line and a request longer than L1: (path, the good lines, the too-long request's line)."""
    def ids(k: int, n: int = 10) -> range:  # conversation k's first n hash ids: 160 tokens at 10
        return range(100 * k, 100 * k + n)
    huge = rec(35, 40000, 4, range(10_000, 10_079))  # 1,250 tokens at 16 a hash id: more than L1
    # L1 holds 3 prompts: conversation 1 is back from L2 at 50 ms and from L3 at 170 ms
    lines = [rec(0, 5000, 5, ids(1)), rec(20, 5000, 5, ids(2)), rec(10, 3000, 5, ids(1, 6)),
             '{"timestamp": 15, "input_length": 700',  # bad JSON: a problem, not a record
             rec(30, 5000, 5, ids(3)), huge, rec(40, 5000, 5, ids(4)), rec(50, 5000, 5, ids(1)),
             *(rec(60 + 10 * k, 5000, 5, ids(k)) for k in range(5, 16)), rec(170, 5000, 5, ids(1))]
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    good = [i + 1 for i, line in enumerate(lines) if not line.endswith("700")]
    return path, good, lines.index(huge) + 1


def replay(trace_path: Path, out: Path, *flags: str) -> tuple[dict, dict]:
    summary = run_cli(["--trace", str(trace_path), "--block-tokens", "16", "--time-scale", "0", "--concurrency", "1",
                       "--max-output-tokens", "4", "--l1-tokens", "512", "--l2-tokens", "1024", "--l3-tokens", "8192",
                       "--hicache-policy", "always", "--no-progress", "--json-out", str(out), *flags])
    return summary, json.loads(out.read_text())


def check_records(s: dict, trace, timed: bool) -> None:
    _, good, huge_line = trace
    records = s["request_records"]
    assert s["requests"] == len(good) and s["failed"] == 1  # the summary as it was
    assert [r["line"] for r in records] == good  # trace order, the malformed line 4 left out
    assert [p["line"] for p in s["problems"]] == [4]
    for tier in TIERS:
        assert sum(r["hit_tokens"][tier] for r in records) == s["hit_tokens"][tier], tier
    assert sum(r["recomputed_tokens"] for r in records) == s["recomputed_tokens"]
    assert min(s["hit_tokens"].values()) > 0, s["hit_tokens"]
    by_line = {r["line"]: r for r in records}
    failed = by_line[huge_line]
    assert "exceeds" in failed["error"] and failed["output_tokens"] == 0 and failed["recomputed_tokens"] == 0
    assert failed["ttft_ms"] is None and failed["latency_ms"] is None
    assert [e["line"] for e in s["errors"]] == [huge_line] and s["errors"][0]["error"] == failed["error"]
    assert failed["prompt_tokens"] == s["failed_prompt_tokens"]
    ok = [r for r in records if r["error"] is None]
    assert sum(r["prompt_tokens"] for r in ok) == s["prompt_tokens"]
    assert sum(r["output_tokens"] for r in records) == s["output_tokens"]
    for r in ok:
        assert sum(r["hit_tokens"].values()) + r["recomputed_tokens"] == r["prompt_tokens"], r
        assert r["finish_reason"] == "length" and r["output_tokens"] >= 1
        if timed:
            assert r["ttft_ms"] is not None and r["latency_ms"] >= r["ttft_ms"] > 0
        else:
            assert r["ttft_ms"] is None and r["latency_ms"] is None
    assert [by_line[line]["arrival_ms"] for line in (1, 3, len(good) + 1)] == [0, 10, 170]


def test_records_of_a_real_replay(trace, tmp_path):
    summary, written = replay(trace[0], tmp_path / "out.json")
    check_records(written, trace, timed=True)
    assert written["request_records"] == json.loads(json.dumps(summary["request_records"]))


def test_records_of_a_simulated_replay(trace, tmp_path):
    real, _ = replay(trace[0], tmp_path / "real.json")
    summary, written = replay(trace[0], tmp_path / "sim.json", "--simulate")
    check_records(written, trace, timed=False)
    strip = lambda s: [{k: v for k, v in r.items() if k not in ("ttft_ms", "latency_ms")} for r in s["request_records"]]
    assert strip(summary) == strip(real)  # a simulated run's hits are a real one's, request by request
