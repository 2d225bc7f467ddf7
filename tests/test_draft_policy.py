"""Speculative decoding's cost policy (scheduler/draft_policy.py, `"draft_policy": "cost"`): the estimates on their
own, then the tiny CPU engine with the step cost ratio pinned (no timing decides a test): drafts that are always
rejected stop being verified, and their steps chain again, after two tries and then about one in 1 / (1 - RECOVERY)
tokens; drafts that are accepted keep every verify step; the outputs are plain decoding's either way."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from scheduler import draft_policy
from scheduler.draft_policy import DraftPolicy, prior_rho
from scheduler.request import SamplingParams
from scheduler.speculative import SpeculativeConfig, Speculator
from test_speculative import VOCAB, make_engine, spec_stats


def request(output_tokens: int = 0):
    return SimpleNamespace(output=[0] * output_tokens, spec_accepted=None)


# -- the estimates ------------------------------------------------------------------------------------------
def test_a_new_request_expects_its_whole_draft():
    """(Each request is tried once. Regression: from the prior of 1, on the CPU, where a verify step costs ~2.5
    decode steps, no request was ever tried, and the sample trace's drafts, 2.3 accepted a step, never ran.)"""
    pol, req = DraftPolicy(), request()
    assert pol.expected(req, 0) == 0.0 and pol.expected(req, 5) == 5.0
    pol.observe_request(req, 2)  # the first step's accepted drafts start its average
    assert pol.expected(req, 5) == pytest.approx(2.0)


def test_observations_average_and_drift_back_to_the_prior():
    pol, req = DraftPolicy(), request(10)
    pol.observe_request(req, 1)  # its start, recorded at 10 + 1 + 1 tokens
    assert req.spec_accepted == (pytest.approx(1.0), 12)
    req.output += [0, 0]  # (its step's tokens taken)
    pol.observe_request(req, 0)  # 0.5 * 1 + 0.5 * 0
    assert req.spec_accepted == (pytest.approx(0.5), 13) and pol.expected(req, 15) == pytest.approx(0.5)
    req.output += [0]
    pol.observe_request(req, 0)
    assert req.spec_accepted[0] == pytest.approx(0.25)
    req.output += [0] * 101  # its step's token, then 100 without a verify step: 99 % of the distance left each
    assert pol.expected(req, 15) == pytest.approx(1.0 - 0.75 * draft_policy.RECOVERY ** 100)
    pol.observe_request(req, 4)
    assert pol.expected(req, 15) > 1.0 and pol.expected(req, 1) == 1.0  # (above the prior; at most the draft)


def test_rho_is_the_prior_until_both_steps_were_timed_then_their_ratio_clamped():
    pol = DraftPolicy()
    assert pol.rho(4) == prior_rho(4) == pytest.approx(1.144)
    pol.observe_step("decode", 4, 0.010, 0.010, chained=True)
    pol.observe_step("verify", 4, 0.012, 0.012, chained=False)
    assert pol.rho(4) == prior_rho(4)  # (a verify step's cost is known after the step that follows it)
    pol.observe_step("decode", 4, 0.010, 0.010, chained=True)  # chained behind it: no extra
    assert pol.rho(4) == pytest.approx(1.2) and pol.rho(8) == prior_rho(8)
    pol.observe_step("decode", 4, 0.015, 0.015, chained=True)  # averaged: 0.8 * 0.010 + 0.2 * 0.015
    assert pol.step_s[("decode", 4)] == pytest.approx(0.011) and pol.rho(4) == pytest.approx(0.012 / 0.011)
    pol.observe_step("decode", 2, 0.001, 0.001, chained=True)
    pol.observe_step("verify", 2, 1.0, 1.0, chained=False)
    pol.observe_step("verify", 2, 1.0, 1.0, chained=False)  # (a verify step after a verify step closes the first alone)
    assert pol.rho(2) == pytest.approx(1000.0)
    pol.observe_step("decode", 1, 0.002, 0.002, chained=True)
    pol.observe_step("verify", 1, 0.001, 0.001, chained=False)
    pol.observe_step("decode", 1, 0.002, 0.002, chained=True)
    assert pol.rho(1) == 1.0


def test_a_stalled_step_moves_an_average_by_at_most_its_outlier_share():
    """(Regression: on the H200 one stalled decode sample, where a workload chained few decode steps, held rho at 1
    for the rest of a run, and drafts that no step accepted were verified at every step: 0.84 x.)"""
    pol = DraftPolicy()
    pol.observe_step("decode", 4, 0.005, 0.005, chained=True)
    pol.observe_step("decode", 4, 0.100, 0.100, chained=True)  # a step the host stalled
    assert pol.step_s[("decode", 4)] == pytest.approx(0.8 * 0.005 + 0.2 * draft_policy.OUTLIER * 0.005)


def test_a_verify_step_costs_what_the_unchained_decode_step_after_it_adds():
    """(Regression: timed from its launch alone, a verify step at batch 4 looked 1.2 x a decode step on the H200
    where it cost ~1.5 x, and a policy that thought so verified drafts at 0.84 x the plain tokens a second.)"""
    pol = DraftPolicy()
    pol.observe_step("decode", 4, 0.005, 0.005, chained=True)
    pol.observe_step("verify", 4, 0.006, 0.0055, chained=False)  # from the end of the step before: its drafting too
    pol.observe_step("decode", 4, 0.0065, 0.0055, chained=False)  # not chained behind it: 1.5 ms beyond a chained one
    assert pol.step_s[("verify", 4)] == pytest.approx(0.0075) and pol.rho(4) == pytest.approx(1.5)
    assert pol.step_s[("decode", 4)] == pytest.approx(0.005)  # (an unchained decode step is not a chained one's cost)


def test_without_a_chained_decode_step_an_unchained_ones_launch_to_end_is_the_decode_cost():
    """(Regression: on the H200 at batch 4 a verify step could come at every step, so no decode step was chained and
    rho stayed the prior, 1.14, where a verify step cost ~1.5 x: drafts were verified at 0.84 x.)"""
    pol = DraftPolicy()
    pol.observe_step("decode", 4, 0.0060, 0.0050, chained=False)  # 1 ms of host work before its launch
    pol.observe_step("verify", 4, 0.0070, 0.0060, chained=False)
    pol.observe_step("decode", 4, 0.0060, 0.0050, chained=False)
    assert pol.step_s[("decode_alone", 4)] == pytest.approx(0.005)
    assert pol.step_s[("verify", 4)] == pytest.approx(0.008) and pol.rho(4) == pytest.approx(1.6)
    pol.observe_step("decode", 4, 0.004, 0.009, chained=True)  # a chained one, once there is one, is the cost
    assert pol.rho(4) == pytest.approx(2.0)


@pytest.mark.parametrize("seqs, accepted, rho, want", [(1, 0.03, 1.02, True), (1, 0.01, 1.02, False),
                                                        (8, 2.5, 1.3, True), (8, 2.3, 1.3, False),
                                                        (4, 0.0, 1.0, False), (4, 0.01, 1.0, True)])
def test_pays(seqs, accepted, rho, want, monkeypatch):
    monkeypatch.setattr(DraftPolicy, "rho", lambda self, n: rho)
    assert DraftPolicy().pays(seqs, accepted) is want


def test_the_config_takes_the_policy_and_refuses_another():
    assert SpeculativeConfig(3).draft_policy == "cost"
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "draft_policy": "always"}) \
        == SpeculativeConfig(3, draft_policy="always")
    with pytest.raises(ValueError, match="draft_policy must be one of"):
        SpeculativeConfig(3, draft_policy="never")


# -- the engine ---------------------------------------------------------------------------------------------
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def plain_outputs():
    rng = random.Random(11)
    prompts = [[rng.randrange(VOCAB) for _ in range(24)] for _ in range(2)]
    eng = make_engine()
    return prompts, [r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]


def run(policy: str, prompts, outputs, wrong: bool, monkeypatch) -> tuple[dict, list, int]:
    """Generate with drafts taken from the plain run's outputs (wrong: each token + 1, never accepted) and the
    step cost ratio pinned at 1.3 -> (the speculative counters, the outputs, the chained steps)."""
    monkeypatch.setattr(DraftPolicy, "rho", lambda self, seqs: 1.3)
    plain = {tuple(p): o for p, o in zip(prompts, outputs)}

    def draft(self, req, k):
        nxt = plain[tuple(req.prompt)][len(req.output):len(req.output) + k]
        return [(t + 1) % VOCAB for t in nxt] if wrong else nxt
    monkeypatch.setattr(Speculator, "draft", draft)
    # (lookup bounds of 1: `verifies` finds a possible draft at every step, so only the policy lets steps chain)
    eng = make_engine(SpeculativeConfig(4, prompt_lookup_max=1, prompt_lookup_min=1, draft_policy=policy))
    got = [r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]
    eng.check_integrity()
    return spec_stats(eng), got, eng.stats["chained_steps"]


def test_rejected_drafts_stop_being_verified_and_their_steps_chain(plain_outputs, monkeypatch):
    prompts, outputs = plain_outputs
    always, got_always, chained_always = run("always", prompts, outputs, True, monkeypatch)
    cost, got_cost, chained_cost = run("cost", prompts, outputs, True, monkeypatch)
    assert got_always == got_cost == outputs
    assert always["accepted_tokens"] == cost["accepted_tokens"] == 0
    assert always["verify_steps"] >= MAX_TOKENS - 2 and always["declined_steps"] == 0 and chained_always == 0
    # one try (its whole draft expected, then 0), then about one in 20-35 tokens (drifting back towards 1 by 1 %
    # a token, verified at 0.3 a sequence, halved by each try)
    assert 1 <= cost["verify_steps"] <= 6, cost
    assert chained_cost >= MAX_TOKENS // 2, chained_cost


def test_accepted_drafts_keep_every_verify_step(plain_outputs, monkeypatch):
    prompts, outputs = plain_outputs
    always, got_always, _ = run("always", prompts, outputs, False, monkeypatch)
    cost, got_cost, _ = run("cost", prompts, outputs, False, monkeypatch)
    assert got_always == got_cost == outputs
    assert cost["declined_steps"] == 0 and cost["verify_steps"] == always["verify_steps"] > 0
    assert cost["accepted_tokens"] == cost["draft_tokens"] > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_the_loop_reports_every_step_and_whether_it_was_chained(plain_outputs, monkeypatch, overlap):
    """rho's samples: every decode and verify step, each flagged chained when it ran at a decode step's ordinary
    cost (enqueued behind the one before it; every decode step without overlap scheduling)."""
    prompts, outputs = plain_outputs
    seen = []
    monkeypatch.setattr(DraftPolicy, "observe_step",
                        lambda self, kind, seqs, s, launched_s, chained: seen.append((kind, seqs, s, chained)))
    monkeypatch.setattr(DraftPolicy, "rho", lambda self, seqs: 1.3)
    plain = {tuple(p): o for p, o in zip(prompts, outputs)}
    monkeypatch.setattr(Speculator, "draft", lambda self, req, k: [
        (t + 1) % VOCAB for t in plain[tuple(req.prompt)][len(req.output):len(req.output) + k]])
    eng = make_engine(SpeculativeConfig(4, prompt_lookup_max=1, prompt_lookup_min=1), overlap_schedule=overlap)
    eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    stats = spec_stats(eng)
    assert sum(k == "verify" for k, _, _, _ in seen) == stats["verify_steps"] > 0
    assert sum(k == "decode" for k, _, _, _ in seen) == eng.stats["batches"] - stats["verify_steps"] - 1  # (a prefill)
    chained = sum(k == "decode" and c for k, _, _, c in seen)
    if overlap:
        assert chained == eng.stats["chained_steps"] > 0
        assert not any(c for k, _, _, c in seen if k == "verify")
    else:
        assert eng.stats["chained_steps"] == 0 and chained == eng.stats["batches"] - stats["verify_steps"] - 1 > 0
    assert all(s > 0 and n == 2 for _, n, s, _ in seen)
