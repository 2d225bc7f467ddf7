"""Session 78's hunt of the replay's report against the Mooncake trace format: the corners of a trace line that
were a traceback or a line misread, checked through the command (scheduler/replay.py run_cli, --simulate) and the
trace reader (scheduler/trace.py)."""
from __future__ import annotations

import json

import pytest

from scheduler.replay import run_cli
from scheduler.trace import TraceProblem, load_trace, parse_line


def _line(ts=0, n_in=1024, n_out=4, ids=(1, 2), **extra) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": list(ids), **extra})


def _simulate(trace, *extra: str) -> dict:
    return run_cli(["--trace", str(trace), "--simulate", "--no-progress", "--block-tokens", "16", "--time-scale", "0",
                    "--concurrency", "1", *extra])


DEEP = 100_000  # nesting past what Python's JSON decoder recurses into


@pytest.mark.parametrize("text", ["[" * DEEP, _line()[:-1] + ', "x": ' + "[" * DEEP + "]" * DEEP + "}"],
                         ids=["garbage", "deep-extra-field"])
def test_a_line_nested_too_deeply_is_a_problem_naming_it_not_a_traceback(text):
    """A line of JSON nested deeper than Python's decoder recurses (a corrupt line, or an extra field of a valid
    object) raised RecursionError out of the trace reader: a traceback, and none of the trace's good lines ran."""
    problem = parse_line(text, 3)
    assert isinstance(problem, TraceProblem) and problem.line_no == 3
    assert problem.reason.startswith("bad JSON") and "nested" in problem.reason


def test_a_trace_with_a_deeply_nested_line_replays_its_good_lines(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join([_line(ts=0, ids=(1, 2)), "[" * DEEP, _line(ts=10, n_in=1536, ids=(1, 2, 3))]) + "\n")
    records, problems = load_trace(trace)
    assert [r.line_no for r in records] == [1, 3] and [p.line_no for p in problems] == [2]
    s = _simulate(trace)
    assert (s["completed"], s["hit_tokens"]) == (2, {"l1": 32, "l2": 0, "l3": 0})
    assert [p["line"] for p in s["problems"]] == [2]
    assert f"{trace}:2: skipped: bad JSON" in capsys.readouterr().err


def test_hash_ids_of_unsigned_64_bit_hashes_replay_and_share_their_blocks(tmp_path, capsys):
    """A trace whose hash ids are 64-bit hashes (xxh64 and the like: from 0 to 2**64 - 1) lost every line with an id
    of 2**63 or more, "hash_ids must be a list of non-negative 64-bit integers", which those ids are; the token
    synthesis was built for them (its digit field holds any id below 2**64)."""
    big, bigger = 2**63 + 12345, 2**64 - 1
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join([_line(ts=0, ids=(big, bigger)), _line(ts=10, n_in=1536, ids=(big, bigger, 7)),
                                _line(ts=20, n_in=1536, ids=(bigger, big, 7))]) + "\n")
    records, problems = load_trace(trace)
    assert problems == [] and [r.hash_ids[0] for r in records] == [big, big, bigger]
    s = _simulate(trace)
    assert s["problems"] == [] and s["completed"] == 3
    # the second request shares the first's two blocks (32 tokens at 16 a hash id); the third, in the other
    # order, shares nothing
    assert [r["hit_tokens"]["l1"] for r in s["request_records"]] == [0, 32, 0]


def test_a_hash_id_past_64_bits_is_still_a_problem():
    assert parse_line(_line(n_in=1, ids=(2**64,)), 4) == TraceProblem(
        4, "hash_ids must be a list of non-negative 64-bit integers")


def test_the_timeline_reader_skips_a_log_line_nested_too_deeply(tmp_path):
    """A corrupt --log-json line nested past Python's JSON decoder is a bad line the timeline skips and counts, as any
    other line that is not a JSON object (regression: RecursionError out of scripts/timeline.py)."""
    from scheduler.timeline import read_events
    log = tmp_path / "run.jsonl"
    log.write_text('{"event": "a"}\n' + "[" * 100_000 + "\n" + '{"event": "b"}\n')
    bad: list[int] = []
    assert [e["event"] for e in read_events(log, bad_lines=bad)] == ["a", "b"]
    assert bad == [2]


def test_the_replay_counts_the_failed_requests_it_does_not_spell_out(tmp_path, capsys):
    """Past the first MAX_PROBLEMS_SHOWN failed requests, stderr says how many more failed (as it does for malformed
    lines; regression: 10 were listed and the rest went unsaid)."""
    from scheduler.replay import run_cli
    from scheduler.trace import MAX_PROBLEMS_SHOWN
    huge = '{"timestamp": %d, "input_length": 40000, "output_length": 4, "hash_ids": [%s]}'
    lines = [huge % (i, ", ".join(str(1000 * i + j) for j in range(79))) for i in range(MAX_PROBLEMS_SHOWN + 3)]
    trace = tmp_path / "big.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    s = run_cli(["--trace", str(trace), "--block-tokens", "16", "--time-scale", "0", "--no-progress",
                 "--l1-tokens", "512"])
    assert s["failed"] == MAX_PROBLEMS_SHOWN + 3
    err = capsys.readouterr().err
    assert err.count(") failed: ") == MAX_PROBLEMS_SHOWN and "... and 3 more failed requests" in err, err
