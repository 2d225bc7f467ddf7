"""Speculative decoding of requests with penalties, logit_bias or min_tokens (scheduler/runner.py `_launch_verify`,
`speculative.verify_penalties`, penalty_state's `draft_ids`): each verify row is scored as the plain step after its
drafts would be, its drafts counted as generated in that row alone. So on the tiny CPU engine in float32 the tokens
equal plain decoding's, served once (prompt lookup's drafts) and again (the first answers' drafts, from the prefix
cache), greedy and sampled with top_k 1 (the sampler's path). Token bans and structured outputs still decode
plainly (`eligible`)."""
from __future__ import annotations

import pytest

from scheduler.request import SamplingParams
from scheduler.speculative import eligible
from test_speculative import SPEC, looping_prompts, make_engine, record_steps


@pytest.fixture(scope="module")
def looping() -> list[list[int]]:
    return looping_prompts(7, 40, 10, 40, need=4)[:4]


@pytest.fixture(scope="module")
def plain():
    return make_engine()


@pytest.fixture(scope="module")
def unconstrained(plain, looping) -> list[list[int]]:
    return [r.output_ids for r in plain.generate(looping, SamplingParams(max_tokens=24))]


def cases(answers: list[list[int]]) -> dict[str, dict]:
    """The sampling fields of each case; logit_bias and min_tokens' stop id from the unconstrained answers' tokens,
    so that they change them."""
    first = answers[0]
    return {
        "presence": {"presence_penalty": 0.8},
        "frequency": {"frequency_penalty": 0.5},
        "repetition": {"repetition_penalty": 1.3},
        "all three": {"presence_penalty": -0.5, "frequency_penalty": 0.3, "repetition_penalty": 0.8},
        "logit_bias": {"logit_bias": {first[2]: -100.0, first[6]: 3.0}},
        "min_tokens": {"min_tokens": 8, "stop_token_ids": [first[3]]},
        "sampled top_k 1 with presence": {"temperature": 0.7, "top_k": 1, "presence_penalty": 0.8},
    }


CASE_NAMES = list(cases([[0] * 8]))


@pytest.mark.parametrize("case", CASE_NAMES)
def test_requests_that_change_logits_verify_and_equal_plain_decoding(plain, looping, unconstrained, case,
                                                                     monkeypatch):
    fields = cases(unconstrained)[case]
    params = SamplingParams(max_tokens=24, **fields)
    assert eligible(params)
    greedy = {k: v for k, v in fields.items() if k not in ("temperature", "top_k")}  # (top_k 1 samples greedily)
    want = plain.generate(looping, SamplingParams(max_tokens=24, **greedy))
    assert [r.output_ids for r in want] != unconstrained  # (the case changes what is decoded)
    eng = make_engine(SPEC)
    steps = record_steps(monkeypatch)
    first = eng.generate(looping, params)
    again = eng.generate(looping, params)  # drafted from the first answers (the prefix cache)
    for got in (first, again):
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert sum(len(s.yielded) - 1 for s in steps) > 0  # (drafts accepted: rows after drafts were scored)
    assert eng.speculator.stats["cache_accepted_tokens"] > 0
    eng.check_integrity()


def test_min_tokens_holds_a_stop_id_in_rows_before_it_and_not_after(plain, looping, unconstrained, monkeypatch):
    """A verify step whose rows straddle min_tokens: the stop id masked in the rows before it only. The stop id is
    an answer's token m (new there) and min_tokens m, so plain decoding stops right at it, and served again the
    answer is drafted whole from the cache: its first verify step's rows run from before m to m."""
    for prompt, answer in zip(looping, unconstrained):
        m = next((m for m in (2, 3, 4) if answer[m] not in answer[:m]), None)
        if m is not None:
            break
    else:
        pytest.fail("no unconstrained answer has a new token at 2, 3 or 4: pick other seeds")
    params = SamplingParams(max_tokens=24, min_tokens=m, stop_token_ids=[answer[m]])
    [want] = plain.generate([prompt], params)
    assert want.output_ids == answer[:m + 1] and want.finish_reason == "stop"
    eng = make_engine(SPEC)
    steps = record_steps(monkeypatch)
    eng.generate([prompt], params)
    [got] = eng.generate([prompt], params)
    assert got.output_ids == want.output_ids and got.finish_reason == "stop"
    assert any(s.out_before < m < s.out_before + len(s.yielded) for s in steps)  # (one straddled it)


@pytest.mark.parametrize("fields", [{"allowed_token_ids": [1, 2, 3]}, {"bad_words_token_ids": [[5, 6]]},
                                    {"temperature": 0.7, "seed": 3}])
def test_bans_and_seeds_still_decode_plainly(fields):
    assert not eligible(SamplingParams(max_tokens=4, **fields))
