"""The benchmarks' arithmetic (session 77's hunt): each figure a script prints divides what its label says by what
its label says, on hand-made samples or a CPU smoke run whose right answer is known."""
from __future__ import annotations

from script_helpers import CPU, load


def stage_calls(printed: str) -> dict[str, tuple[int, float]]:
    """profile_stages.py's table: stage -> (calls, ms/request)."""
    rows = {}
    for line in printed.splitlines():
        parts = line.split()
        if len(parts) == 4 and "." in parts[0] and parts[1].isdigit():
            rows[parts[0]] = (int(parts[1]), float(parts[2]))
    return rows


def test_profile_stages_times_the_measured_requests_only_not_the_warm_up(capsys):
    """The stage table's ms/request divides by the tier's measured requests: its timers must count those alone
    (regression: the warm-up requests on other prefixes were timed too, so with --warmup 3 --requests 4 the
    table showed 7 requests' calls over 4, a request's forward launch longer than its whole p50 latency)."""
    mod = load("profile_stages")
    argv = CPU + ["--num-prefixes", "2", "--prefix-tokens", "32", "--requests", "4", "--warmup", "3"]
    assert mod.main(argv) == 0
    rows = stage_calls(capsys.readouterr().out)
    assert rows["Engine.add_request"][0] == 4, rows
    assert rows["Engine.finish"][0] == 4, rows


def test_layer_copy_median_of_an_even_count_is_the_mean_of_the_middle_two():
    """bench_layer_copy.py's and probe_copy_streams.py's "median" of their --iterations (10 by default) samples
    (regression: the upper of the middle two, the 6th smallest of 10, biased every published median upward)."""
    mod = load("bench_layer_copy")
    assert mod.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert mod.median([1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0]) == 1.5
    assert mod.median([3.0, 1.0, 2.0]) == 2.0


def test_preemption_tokens_per_s_is_each_rounds_own_tokens_over_its_own_seconds():
    """bench_preemption.py's tok/s of a ratio: two rounds whose sampled streams parted (100 tokens in 1 s, then 300
    in 3 s) both ran at 100 tok/s (regression: the first round's 100 tokens over the median round's 2 s, 50 tok/s)."""
    mod = load("bench_preemption")

    def round_of(tokens: int, seconds: float) -> dict:
        return {"seconds": seconds, "outputs": [[7] * tokens], "latency_s": [seconds], "peak_running": 1,
                "preempted": 0}
    row = mod.ratio_row(0.5, [round_of(100, 1.0), round_of(300, 3.0)], [[7] * 100])
    assert row["tokens_per_s"] == 100.0
    assert row["seconds"] == 2.0 and row["same_outputs"] == 0  # (the second round parted from the first)
