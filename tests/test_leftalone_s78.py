"""What session 77 noticed and left, fixed in session 78, each with the test that failed without its fix."""
from __future__ import annotations

import argparse

import pytest

from scheduler.api_models import ChatCompletionRequest, CompletionRequest
from scheduler.prompt_truncation import kept_tokens
from script_helpers import load

LIMITS = dict(prompt_limit=4096, context_tokens=64, default_max_tokens=16, max_tokens_limit=4096)


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
def test_a_truncation_past_the_longest_prompt_names_the_limit_field_the_chat_used(field):
    """A chat's truncate_prompt_tokens past the longest prompt it can have is refused with the limit that set it, by
    the name the client sent (it said "max_tokens" to a body of max_completion_tokens)."""
    req = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], truncate_prompt_tokens=60,
                                **{field: 10})
    with pytest.raises(ValueError) as info:
        kept_tokens(req, True, **LIMITS)
    assert f"less its {field} - 1" in str(info.value), str(info.value)
    assert "55 tokens" in str(info.value)  # (64 - (10 - 1))


def test_a_completions_truncation_past_the_longest_prompt_names_max_tokens():
    req = CompletionRequest(model="tiny", prompt=[1, 2], max_tokens=10, truncate_prompt_tokens=60)
    with pytest.raises(ValueError, match=r"less its max_tokens - 1"):
        kept_tokens(req, False, **LIMITS)


def test_the_stress_benchs_decode_step_p90_interpolates_as_its_p50_does():
    """decode_pass's step p90 is the interpolated percentile its p50 is (it took a rounded-down rank: of 10 steps,
    the 9th smallest, 0.1 of a step below)."""
    mod = load("bench_hicache_stress")
    times = [0.0]
    for i in range(10):
        times.append(times[-1] + (i + 1) / 1e3)  # steps of 1, 2, ... 10 ms
    rec = {"error": None, "first": 0.0, "start": 0.0, "end": times[-1], "times": times, "ids": list(range(11)),
           "pending_backups": 0}
    step = mod.decode_pass([rec], wall=1.0)["step_ms"]
    assert step["p50"] == pytest.approx(5.5) and step["p90"] == pytest.approx(9.1), step


def test_the_stress_benchs_hit_bound_is_left_out_for_batches():
    """Its ceiling assumes requests one at a time (each hit one forward at the weight-read floor, the wall the sum of
    the requests'): with --batch-size 4 it bounds nothing, and is not printed (it was)."""
    mod = load("bench_hicache_stress")
    args = argparse.Namespace(batch_size=4, num_prefixes=2, requests=8, device="cpu")
    assert mod.hit_bound(args, {"wall_s": 1.0, "requests": 8}, {}) is None


def test_the_kernel_benchs_attention_table_marks_the_fastest_right_config_not_a_wrong_one(capsys):
    """The default run's attention table stars the fastest config of a shape within ATT_ERR_LIMIT; a faster one whose
    output is wrong (or NaN) is marked ! (it was starred as the best)."""
    mod = load("bench_kernels")
    base = {"seqs": 1, "rows_per_seq": 1, "context": 1024, "block": 64, "warps": 4, "prefetch_pages": False,
            "kv_gib_s": 1.0}
    rows = [{**base, "splits": 8, "us": 5.0, "max_err": 0.5}, {**base, "splits": 4, "us": 7.0, "max_err": 1e-3},
            {**base, "splits": 2, "us": 9.0, "max_err": 1e-3}, {**base, "splits": 1, "us": 4.0, "max_err": float("nan")}]
    mod.attention_table(rows)
    marks = {int(line.split()[4]): line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert marks == {8: "!", 4: "*", 2: "1.00e-03", 1: "!"}, marks
