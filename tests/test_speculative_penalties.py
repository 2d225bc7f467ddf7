"""Speculative decoding of requests with penalties, logit_bias or min_tokens (scheduler/runner.py `_launch_verify`,
`speculative.verify_penalties`, penalty_state's `draft_ids`): each verify row is scored as the plain step after its
drafts would be, its drafts counted as generated in that row alone. So on the tiny CPU engine in float32 the tokens
equal plain decoding's, served once (prompt lookup's drafts) and again (the first answers' drafts, from the prefix
cache), greedy and sampled with top_k 1 (the sampler's path). Token bans (allowed_token_ids, bad words) the same
way (`verify_bans`: a bad word matched over the output and the drafts before the row), and a row with no token
left fails its request as a plain step does. (Structured outputs: tests/test_speculative_guided.py.)"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.request import SamplingParams
from scheduler.speculative import eligible
from test_speculative import SPEC, make_engine, record_steps
from test_speculative_logprobs import looping, plain  # noqa: F401 (its fixtures: the same prompts, a plain engine)


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
        "allowed_token_ids": {"allowed_token_ids": sorted({t for a in answers for t in a} - {first[2]})},
        "bad_words": {"bad_words_token_ids": [[first[1], first[2]], [first[3], first[4], first[5]], [first[7]]]},
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


def test_a_verify_row_with_no_token_left_fails_the_request_as_a_plain_step_does(plain, monkeypatch):
    """allowed_token_ids [t] and the bad word [t, t]: after its first token t, nothing is left. The prompt's repeats
    draft t again; the verify row after the pending token has no token, and the request fails there, as plainly."""
    t = 17
    prompt = [t] * 12
    params = SamplingParams(max_tokens=8, allowed_token_ids=[t], bad_words_token_ids=[[t, t]])
    [want] = plain.generate([prompt], params)
    assert want.finish_reason == "error" and "ban every token" in want.error and want.output_ids == [t]
    eng = make_engine(SPEC)
    steps = record_steps(monkeypatch)
    [got] = eng.generate([prompt], params)
    assert (got.output_ids, got.finish_reason, got.error) == (want.output_ids, want.finish_reason, want.error)
    assert steps and steps[0].draft  # (it failed in a verify step)
    eng.check_integrity()


def test_a_nan_verify_row_of_a_banning_request_fails_as_nan_not_as_a_ban(monkeypatch):
    """A verify step whose rows' logits were NaN (every id marked, < 0) for a request with allowed_token_ids: it
    fails for its NaN logits, as a plain step's would (regression: the mark was judged a banned token)."""
    from scheduler.runner import ModelRunner
    t = 17
    launch = ModelRunner._launch_verify

    def poisoned(self, batch):
        handle = launch(self, batch)
        handle.host.fill_(-1)  # (on the CPU: the ids themselves, NAN_TOKEN each)
        return handle
    monkeypatch.setattr(ModelRunner, "_launch_verify", poisoned)
    eng = make_engine(SPEC)
    steps = record_steps(monkeypatch)
    [got] = eng.generate([[t] * 12], SamplingParams(max_tokens=8, allowed_token_ids=[t, t + 1]))
    assert steps and got.finish_reason == "error" and "NaN" in got.error, got.error
    eng.check_integrity()


def test_seeded_sampled_requests_still_decode_plainly():
    """(Grammars with min_tokens speculate since session 50: tests/test_speculative_guided.py.)"""
    assert not eligible(SamplingParams(max_tokens=4, temperature=0.7, seed=3))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_verify_bans_rows_ban_what_the_whole_history_bans(data):
    """verify_bans keeps only the output's last (longest word) tokens before a row's drafts: each row's host bans
    equal those of the whole output followed by the drafts before it, in either layout."""
    from scheduler.penalty_state import PenaltyState
    from scheduler.speculative import verify_bans
    from scheduler.token_bans import RowBans
    tok = st.integers(0, 5)
    words = tuple(tuple(w) for w in data.draw(st.lists(st.lists(tok, min_size=1, max_size=4), min_size=1, max_size=4)))
    output = data.draw(st.lists(tok, max_size=6))
    if data.draw(st.booleans()):  # (an output that ends with a word's prefix: the row after it bans its last token)
        output += list(data.draw(st.sampled_from(words))[:-1])
    draft = data.draw(st.lists(tok, max_size=5))
    stride = data.draw(st.sampled_from([0, 8]))
    ban = RowBans(None, words, output, PenaltyState())
    rows = verify_bans([None, ban], [[], draft], [1, len(draft) + 1], stride, 16)
    start = 8 if stride else 1
    assert rows[0] is None and all(r is None for i, r in enumerate(rows) if not start <= i < start + len(draft) + 1)
    index = ban.index("cpu")
    for j in range(len(draft) + 1):
        whole = RowBans(None, words, output + draft[:j], ban.state)
        assert rows[start + j].host_bans(index, False) == whole.host_bans(index, False)
