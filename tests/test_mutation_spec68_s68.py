"""Speculative decoding behaviour no test checked (session 68's second mutation check of scheduler/speculative.py,
scheduler/draft_policy.py, scheduler/beam_search.py and scheduler/api_beam_search.py: each rule here could be
broken and every test passed; each test fails on its mutant, named in its docstring, and passes as the code is).
Prompt lookup finds an aligned occurrence that overlaps a match across token boundaries; a request's accepted
drafts average with its drifted average, and a verify step is charged only what an unchained step after it adds
over its own batch's decode cost; the cost policy prices a verify step over every eligible request, at k drafts in
`verifies` and at the draft's own length in `split`, and counts the steps it declines; a running request that
decodes nothing yet (behind its overlapped restore) does not end a decode chain; a finished request's tail past
its published pages starts with its prompt's last partial page, and no tail is kept where cache_lookup is off.
Beam search: only its first step asks for prompt logprobs; ties keep their candidates' order, an ended beam first;
a search whose every candidate ends stops there; a failed step cancels the others in flight; over the API a
search's seed, its cached prompt tokens and the max_tokens it searched reach the request's choices."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from scheduler import draft_policy
import scheduler.beam_search as beam_module
from scheduler.beam_search import BeamSearchParams
from scheduler.draft_policy import DraftPolicy
from scheduler.request import SamplingParams, TokenLogprobs
from scheduler.speculative import SpeculativeConfig, TokenHistory
from test_beam_search import PROMPT as BEAM_PROMPT
from test_beam_search import make_engine as beam_engine
from test_beam_search import run as run_beams
from test_beam_search import CHAT, CMPL, HI
from test_continuations import cache_stats, fresh_prompts, spec_config
from test_mutation_loop_s64 import _hicache_engine, chains_after_an_overlapped_restore
from test_mutation_sched_s60 import _beams
from server_fixtures import byte_level_server, ok, tiny_config
from test_mutation_spec_s65 import request, speculator
from test_speculative import make_engine

COST = dict(draft_policy="cost", cache_lookup=False)


def priced(spec, rho: dict[int, float]):
    """`spec`'s cost policy with rho(B) pinned by measured step times (B: rho)."""
    for seqs, ratio in rho.items():
        spec.policy.step_s[("decode", seqs)] = 1.0
        spec.policy.step_s[("verify", seqs)] = ratio
    return spec


# -- prompt lookup --------------------------------------------------------------------------------------------------
def test_an_aligned_occurrence_overlapping_a_match_across_token_boundaries_is_found():
    """S10: after a byte match that straddles tokens, the search goes on left of its end, not of its start: here
    token 65537 (bytes 01 00 01 00) occurs at byte 0, and the misaligned match at byte 2 (its last two bytes and the
    next token's first two) overlaps it. (Mutant: the next search ended at the misaligned match's start, missed the
    aligned one, and the request had no draft.)"""
    history = TokenHistory()
    history.sync([65537, 1, 65537], [])
    assert history.propose(2, 1, 1) == [1, 65537]


# -- the cost policy ----------------------------------------------------------------------------------------------
def test_a_new_sample_averages_with_the_drifted_average():
    """D12: between its verify steps a request's average drifts back towards the prior (a token generated at a
    time); the next step's accepted drafts average with that drifted value, not with the one last recorded: at 0
    after a step that accepted none, then 100 tokens, then a step that accepts none again, the average is half the
    way drifted (1 - RECOVERY ** 100), not 0. (Mutant: averaged with the undrifted 0.)"""
    pol, req = DraftPolicy(), request([1, 2, 3])
    pol.observe_request(req, 0)  # (recorded at its length after the step: 0 + 0 + 1)
    assert req.spec_accepted == (0.0, 1)
    req.output += [9] * 101  # (the step's token, then 100 without verifying)
    pol.observe_request(req, 0)
    assert req.spec_accepted[0] == pytest.approx(draft_policy.KEEP * (1.0 - draft_policy.RECOVERY ** 100))


def test_a_verify_step_is_charged_only_what_an_unchained_step_after_it_adds_over_its_own_batchs_cost():
    """D16, D17, D19: the decode step after a verify step adds to its cost what it took beyond a decode step of its
    own batch (a request may have ended in the verify step), never less than nothing, and nothing where it ran at a
    decode step's ordinary cost (chained: every step without overlap scheduling). (Mutants: a faster step took
    from the verify's cost; a chained one's excess was charged to it; the excess was over the verify's batch.)"""
    pol = DraftPolicy()
    pol.observe_step("decode", 1, 0.010, 0.010, chained=True)
    pol.observe_step("decode", 2, 0.020, 0.020, chained=True)
    pol.observe_step("verify", 2, 0.030, 0.030, chained=False)
    pol.observe_step("decode", 1, 0.015, 0.012, chained=False)  # (B 1 after it: 5 ms beyond B 1's decode)
    assert pol.step_s[("verify", 2)] == pytest.approx(0.035)
    pol = DraftPolicy()
    pol.observe_step("decode", 1, 0.010, 0.010, chained=True)
    pol.observe_step("verify", 1, 0.012, 0.012, chained=False)
    pol.observe_step("decode", 1, 0.008, 0.008, chained=False)  # (faster than a decode step: nothing taken off)
    assert pol.step_s[("verify", 1)] == pytest.approx(0.012)
    pol.observe_step("verify", 1, 0.012, 0.012, chained=False)
    pol.observe_step("decode", 1, 0.011, 0.011, chained=True)  # (chained: a decode step's cost, its excess noise)
    assert pol.step_s[("verify", 1)] == pytest.approx(0.012)


def test_verifies_prices_the_step_over_every_eligible_request_as_split_does():
    """S17: the step after the one in flight verifies every eligible request (those without a draft too: `split`'s
    B), so `verifies` asks the policy about that B, not the number that may draft. Two eligible requests, one that
    may draft (k = 1, all of it expected): 2 + 1 > 2 x 1.6 fails, so the chain goes on, as `split` declines it.
    (Mutant: priced at B = 1, 1 + 1 > 1.0, the chain ended for a verify step that never came.)"""
    cfg = SpeculativeConfig(num_speculative_tokens=1, prompt_lookup_max=2, prompt_lookup_min=2, **COST)
    spec = priced(speculator(cfg), {1: 1.0, 2: 1.6})
    reqs = [request([1, 2, 1, 2]), request([4, 5, 6, 7])]  # (the first drafts [1]; the other may not draft)
    assert not spec.verifies(reqs)
    assert spec.split(reqs) == (reqs, None)  # (the same call in the step itself)
    spec = priced(speculator(cfg), {1: 1.0, 2: 1.4})  # 2 + 1 > 2.8: it pays
    assert spec.verifies(reqs)


def test_verifies_expects_a_new_requests_whole_k_drafts():
    """S18: a request that may draft is expected to accept up to k (its draft, still unknown, may be k long; a new
    request is expected to accept all of it), as `split` will price a draft of k. At rho 2.5 for one sequence, k = 3
    pays (1 + 3 > 2.5). (Mutant: expected at one draft, 1 + 1 < 2.5, the chain went on past a step that verifies.)"""
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=2, **COST)
    spec = priced(speculator(cfg), {1: 2.5})
    req = request([1, 2, 3, 4, 1, 2])
    assert spec.verifies([req])
    plain, drafted = spec.split([req])
    assert plain == [] and drafted == [(req, [3, 4, 1])]


def test_split_prices_a_draft_at_its_own_length_and_counts_the_steps_it_declines():
    """S24, S21: a new request is expected to accept its whole draft, as long as the lookup made it (here one token,
    though k is 3): at rho 2.5, 1 + 1 does not pay and the step decodes plainly, counted in declined_steps.
    (Mutants: the draft priced at k, 1 + 3 > 2.5, verified; the declined step not counted.)"""
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=2, **COST)
    spec = priced(speculator(cfg), {1: 2.5})
    req = request([1, 2, 3, 1, 2])  # ("1 2" occurred once, followed by 3 then the suffix itself: a draft of [3, 1, 2])
    short = request([5, 6, 7, 8, 5, 6], max_tokens=2)  # (room for one draft: max_tokens 2, its step's token first)
    assert spec.draft(req, 3) == [3, 1, 2] and spec.draft(short, 1) == [7]
    assert spec.split([short]) == ([short], None)
    assert spec.stats["declined_steps"] == 1
    plain, drafted = spec.split([req])  # (its whole draft of 3 pays: 1 + 3 > 2.5)
    assert plain == [] and drafted == [(req, [3, 1, 2])] and spec.stats["declined_steps"] == 1


# -- chains ------------------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_request_behind_its_overlapped_restore_does_not_end_a_speculative_engines_chain():
    """S15: with speculation on, a decode chain ends for a decoding request it leaves out, not for a running one
    that decodes nothing yet: a greedy request whose tail's forward ran behind its overlapped restore (PREFILL until
    the restore lands) may not draft, so the decode step after that forward chains on, as without speculation
    (test_mutation_loop_s64). (Mutant: any running request the chain left out ended it: "PDD".)"""
    eng = _hicache_engine(num_pages=128, speculative=SpeculativeConfig(num_speculative_tokens=2))
    seeded = SamplingParams(max_tokens=200, ignore_eos=True, temperature=1.0, seed=7)  # (decodes plainly)
    await chains_after_an_overlapped_restore(eng, seeded)


# -- drafts from the prefix cache: tails ---------------------------------------------------------------------------
def test_a_tail_starts_with_the_prompts_last_partial_page():
    """S29: a request whose tokens fill no page past its prompt publishes pages that end inside its prompt; its tail
    (kept for drafts) is the prompt's tokens past them, then its output. Served again, its tokens after its first
    come from one step of cache drafts. (Mutant: the tail was its output alone, read as following the last page, and
    the second serve had no cache draft.)"""
    eng = make_engine(spec_config(), dtype="float32", page_size=16)
    prompts = fresh_prompts(5, 2, 37)  # 37 + 8 tokens, 44 of them computed: pages end at 32, inside the prompt
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = [r.output_ids for r in eng.generate(prompts, params)]
    assert cache_stats(eng) == (0, 0)
    assert [r.output_ids for r in eng.generate(prompts, params)] == first
    drafts, accepted = cache_stats(eng)
    # (each: one verify step of 5 drafts from its tail, all accepted, then its last token by a plain step)
    assert (drafts, accepted) == (2, 10)
    eng.check_integrity()


def test_no_tail_is_kept_where_cache_lookup_is_off():
    """S30: tails are drafts for cache_lookup; with it off (the prefix cache on) none is kept: each would hold a
    node and its tokens for nothing. (Mutant: every finished request's tail was kept.)"""
    eng = make_engine(spec_config(cache_lookup=False), dtype="float32", page_size=16)
    eng.generate(fresh_prompts(6, 2, 37), SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(eng.speculator.tails) == 0


# -- beam search --------------------------------------------------------------------------------------------------
def test_only_the_first_step_of_a_search_asks_for_prompt_logprobs():
    """B5: a search's prompt_logprobs are its first step's; the later steps ask for none, so they read their beams'
    prefixes from the cache (a request asking for prompt logprobs computes every prompt row: it reuses no cached
    prefix). (Mutant: every step asked for them, and every step recomputed its beams' whole sequences.)"""
    eng = beam_engine()
    got = run_beams(eng, BEAM_PROMPT, BeamSearchParams(beam_width=2, max_tokens=4, prompt_logprobs=2))
    assert len(got.prompt_logprobs) == len(BEAM_PROMPT)
    hits = got.cached_tokens_per_step
    assert hits[0] == 0 and all(hit >= (len(BEAM_PROMPT) + step - 1) // eng.page_size * eng.page_size
                                for step, hit in enumerate(hits[1:], start=1)), hits


def scripted_steps(monkeypatch, candidates: dict[tuple[int, ...], list[tuple[int, float]]]) -> None:
    """Each beam's step answers from `candidates` (its tokens -> its sampled token's (id, logprob) first, then its
    likeliest), in place of the engine: scores that tie exactly, as a model's seldom do."""
    async def step(engine, tokens, params, rid, continuing=False):
        (token, logprob), *top = candidates[tuple(tokens)]
        return SimpleNamespace(output=[token], output_logprobs=[TokenLogprobs(logprob, [(token, logprob)] + top)],
                               hit_tokens={}, prompt_logprobs=[])
    monkeypatch.setattr(beam_module, "_step", step)


def test_beams_that_tie_keep_their_candidates_order_and_an_ended_beam_ranks_first(monkeypatch):
    """B19, B13: beams are ranked by score, stable on ties as vLLM's sorts are: grown beams in their candidates'
    order (each step's sampled token, then its likeliest), and at the end the completed beams before the live ones
    (vLLM's `completed.extend(all_beams)`). (Mutants: ties reversed; the live beams put before the completed.)"""
    scripted_steps(monkeypatch, {(1,): [(10, -1.0), (11, -1.0), (12, -1.0), (99, -3.0)],
                                 **{(1, t): [(t + 10, -1.0), (99, -1.0)] for t in (10, 11, 12)}})
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=0.0, stop_token_ids=(99,), ignore_eos=True)
    got = run_beams(beam_engine(), [1], params)
    # (step 0: 10, 11 and 12 tie, the first two live on; step 1: each ends, or grows, at the same score)
    assert [(b.output_ids, b.finish_reason) for b in got.beams] == [([10], "stop"), ([11], "stop")]


def test_a_search_whose_every_candidate_ends_stops_there(monkeypatch):
    """B28: where every candidate of every live beam is an end token no beam lives on, and the search ends at that
    step with its completed beams (mutant: it went on to a step of no beams, and failed on it)."""
    scripted_steps(monkeypatch, {(1,): [(99, -1.0), (98, -2.0)]})
    params = BeamSearchParams(beam_width=1, max_tokens=4, stop_token_ids=(98, 99), ignore_eos=True)
    got = run_beams(beam_engine(), [1], params)
    assert [(b.output_ids, b.end_token) for b in got.beams] == [([], 99)] and len(got.cached_tokens_per_step) == 1


@pytest.mark.asyncio
async def test_a_failed_step_cancels_the_steps_of_its_search_still_in_flight(monkeypatch):
    """B27: the first step that fails ends the search at once: the other steps in flight are cancelled (their
    requests aborted), not awaited. Here the other step would never end by itself. (Mutant: they were awaited, and
    the search hung on it.)"""
    cancelled = []

    async def step(engine, tokens, params, rid, continuing=False):
        if tuple(tokens) == (1,):
            top = [(10, -1.0), (11, -2.0)]
            return SimpleNamespace(output=[10], output_logprobs=[TokenLogprobs(-1.0, top)], hit_tokens={},
                                   prompt_logprobs=[])
        if tokens[-1] == 10:
            raise beam_module.BeamSearchError("step failed", "error")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(tuple(tokens))
            raise
    monkeypatch.setattr(beam_module, "_step", step)
    eng = beam_engine()
    try:
        with pytest.raises(beam_module.BeamSearchError, match="step failed"):
            await asyncio.wait_for(beam_module.beam_search(eng, [1], BeamSearchParams(beam_width=2, max_tokens=3)),
                                   30)  # (a guard: the search hung)
        assert cancelled == [(1, 11)]
    finally:
        await eng.shutdown()


# -- beam search over the API --------------------------------------------------------------------------------------
def test_a_searchs_seed_is_the_requests():
    """A18: a sampled search (temperature > 0) draws each step's sampled candidate with the request's seed, so a
    seeded search repeats (mutant: the seed was dropped)."""
    sp = _beams(temperature=1.0, seed=1234, top_p=0.9, min_p=0.1).search_params
    assert (sp.seed, sp.top_p, sp.min_p) == (1234, 0.9, 0.1)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=16)) as s:
        yield s


def test_a_searchs_usage_counts_its_prompts_cached_tokens(srv):
    """A17: a search's usage counts the prompt tokens its first step read from the prefix cache, as any request's
    (prompt_tokens_details.cached_tokens): the same prompt searched again reads its whole pages. (Mutant: the
    search's hit tokens never reached its choices, and its usage said 0.)"""
    text = "the quick brown fox jumps over the lazy dog"
    body = {"prompt": text, "max_tokens": 2, "n": 2, "use_beam_search": True}
    ok(srv, CMPL, body)
    again = ok(srv, CMPL, body)["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == (again["prompt_tokens"] - 1) // 4 * 4 > 0


def max_tokens_sum(srv) -> float:
    """The sum of the max_tokens histogram (hicache_request_params_max_tokens, vLLM's request_params_max_tokens)."""
    [metric] = srv.app.state.hc.metrics.request_max_tokens.collect()
    return next(s.value for s in metric.samples if s.name.endswith("_sum"))


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """--max-prompt-tokens 64 over a context of 1,024 tokens (test_beam_search_hunt's)."""
    with byte_level_server(tmp_path_factory, tiny_config(max_prompt_tokens=64)) as s:
        yield s


def test_a_searchs_choices_report_the_max_tokens_it_searched(limited):
    """A15: a chat without max_tokens searches what a step's prompt may hold (prompt + max_tokens - 1 within 64),
    and each of its choices reports that max_tokens to the metrics, not the chat's default of the rest of the
    context. (Mutant: the choices kept the request's default, 1,024 less the prompt.)"""
    prompt = ok(limited, "/tokenize", {"messages": HI})["tokens"]
    before = max_tokens_sum(limited)
    ok(limited, CHAT, {"messages": HI, "n": 2, "use_beam_search": True})
    assert max_tokens_sum(limited) - before == 2 * (64 + 1 - len(prompt))
