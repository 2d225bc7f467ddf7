"""Speculative decoding and beam search behaviour no test checked (session 65's mutation check of
scheduler/speculative.py and scheduler/beam_search.py: each could be changed and every test passed; each test here
fails on its mutant): exactly max_seqs eligible requests still verify; a chain goes on where the prefix cache holds
only the token in flight after a context; an anchor the tree dropped is walked again from the root; a verify step's
counters count only requests that drafted, and its taken tokens only those kept; a stop inside a verify step ends
the request before the tokens after it are judged by its bans; the widest beam search is served, a search's per-step
cached count is its least beam's, and a finished search leaves Engine.continuing at 0."""
from __future__ import annotations

from types import SimpleNamespace

import scheduler.beam_search as beam_module
from hicache.radix import Tier
from scheduler.beam_search import LENGTH_PENALTY_MAX, MAX_BEAM_WIDTH, BeamSearchParams
from scheduler.request import RequestState, SamplingParams
from scheduler.speculative import SpeculativeConfig, Speculator
from test_beam_search import PROMPT as BEAM_PROMPT
from test_beam_search import make_engine as beam_engine
from test_beam_search import run as run_beams
from test_radix import make_tree, put
from test_speculative import make_engine as spec_engine

ALWAYS = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1, draft_policy="always",
                           cache_lookup=False)


def speculator(config: SpeculativeConfig = ALWAYS, max_seqs: int = 16, tree=None) -> Speculator:
    """A Speculator over a stand-in engine: the prefix cache on with `tree`, else off."""
    engine = SimpleNamespace(config=SimpleNamespace(enable_prefix_cache=tree is not None),
                             cache=SimpleNamespace(tree=tree))
    return Speculator(engine, config, max_seqs)


def request(prompt: list[int], output: list[int] = (), max_tokens: int = 16) -> SimpleNamespace:
    """The fields of a decoding Request the Speculator reads."""
    return SimpleNamespace(prompt=list(prompt), cache_prompt=list(prompt), output=list(output),
                           params=SamplingParams(max_tokens=max_tokens), spec_history=None, guide=None,
                           draft_anchor=None, state=RequestState.DECODE, spec_accepted=None)


# -- speculative.py -----------------------------------------------------------------------------------------------
def test_exactly_max_seqs_eligible_requests_still_verify():
    """S22/S52: a verify step takes up to max_seqs sequences, that many included (split and verifies alike)."""
    spec = speculator(max_seqs=2)
    reqs = [request([1, 2, 3, 1, 2]), request([4, 5, 6, 4, 5])]
    plain, drafted = spec.split(reqs)
    assert plain == [] and [d for _, d in drafted] == [[3, 1], [6, 4]]
    assert spec.verifies(reqs)
    three = reqs + [request([7, 8, 7])]
    assert spec.split(three) == (three, None) and not spec.verifies(three)


def test_an_anchor_the_tree_dropped_is_walked_again_from_the_root():
    """S30: a request's draft anchor whose node left the tree (evicted, then its tokens inserted again as new nodes)
    is not walked on from: its drafts come from the root's walk, as the first time."""
    tree, allocs = make_tree(4, pages=64)
    a = list(range(100, 124))
    put(tree, allocs, a)
    put(tree, allocs, a[:8] + list(range(200, 208)))  # (splits a's node at 8: an anchor below the root)
    spec = speculator(SpeculativeConfig(num_speculative_tokens=3, draft_policy="always"), tree=tree)
    req = request(a[:8], output=a[8:10])
    assert spec.cache_draft(req, 3) == a[10:13]
    anchor = req.draft_anchor[0]
    assert anchor is not tree.root and anchor.key == tuple(a[:8])
    tree.evict(Tier.L1, 64)
    assert anchor.parent is None  # (the premise: it left the tree)
    put(tree, allocs, a)
    req.output.append(a[10])
    assert spec.cache_draft(req, 3) == a[11:14]


def test_a_chain_goes_on_where_the_prefix_cache_holds_only_the_token_in_flight_after_a_context():
    """S51: `verifies` counts a request as one that may draft from the prefix cache only where the tree holds two
    tokens after its context (the first may be the token in flight, unknown when the step after it is planned)."""
    tree, allocs = make_tree(4, pages=16)
    a = list(range(100, 108))
    put(tree, allocs, a)
    spec = speculator(SpeculativeConfig(num_speculative_tokens=2, draft_policy="always"), tree=tree)
    assert spec.verifies([request(a[:6])])  # (two tokens after it)
    assert not spec.verifies([request(a[:7])])  # (one: the token in flight, and no draft after it is known)


def test_a_verify_steps_counters_count_only_requests_that_drafted_and_tokens_kept():
    """S42: a request verified without drafts (beside one with them) is no draft in vLLM's counters; S41: the
    tokens a step took are those its requests kept (a NaN mark, -1 here, is none)."""
    spec = speculator()
    reqs = [request([1, 2, 3]), request([4, 5, 6]), request([7, 8, 9])]

    def after_step(req, chunk, token, same_step=False):
        if token >= 0:
            req.output.append(token)

    taken = spec.after_verify(reqs, [[5, 6], [], [3, 4]], [[5, 7, 9], [3], [3, -1, 2]], after_step)
    stats = spec.stats
    assert (stats["verify_steps"], stats["drafts"], stats["draft_tokens"], stats["accepted_tokens"]) == (1, 2, 4, 2)
    assert stats["accepted_per_pos"] == [2, 0]
    assert taken == 4 and [r.output for r in reqs] == [[5, 7], [3], [3]]


def test_a_stop_inside_a_verify_step_ends_the_request_before_the_next_rows_bans_judge_it():
    """S38: the tokens a verify step yields after one that ended its request are not taken: here the row after the
    stop id has no token its bans allow, which, taken, failed the finished request as "error"."""
    eng = spec_engine(ALWAYS)
    params = SamplingParams(max_tokens=8, allowed_token_ids=[10, 20], stop_token_ids=[20], min_tokens=1,
                            logit_bias={20: 50.0}, bad_words_token_ids=((20, 10), (20, 20)))
    [got] = eng.generate([[1, 2, 10, 20, 30, 3]], params)  # (10 drafts 20, 30: the stop is accepted)
    assert (got.output_ids, got.finish_reason, got.error) == ([10, 20], "stop", None)
    assert eng.speculator.stats["accepted_tokens"] == 1 and eng.stats["failed"] == 0


# -- beam_search.py -----------------------------------------------------------------------------------------------
def test_the_widest_beam_search_and_the_longest_length_penalty_are_served():
    """B1: beam_width == MAX_BEAM_WIDTH (2 * it logprobs == MAX_LOGPROBS) is valid, as README's 1..MAX_BEAM_WIDTH."""
    eng = beam_engine()
    BeamSearchParams(beam_width=MAX_BEAM_WIDTH, max_tokens=2).validate(eng, BEAM_PROMPT)
    BeamSearchParams(beam_width=MAX_BEAM_WIDTH, length_penalty=-LENGTH_PENALTY_MAX).validate(eng, BEAM_PROMPT)


def test_cached_tokens_per_step_is_the_fewest_any_beam_of_the_step_read(monkeypatch):
    """B12: a step's count is its beams' least hit (here the second beam's made to read none), not the most."""
    real, first_beams = beam_module._step, []

    async def step(engine, tokens, params, rid, continuing=False):
        req = await real(engine, tokens, params, rid, continuing)
        if rid.endswith(".1"):
            req.hit_tokens = {k: 0 for k in req.hit_tokens}
        elif continuing:
            first_beams.append(sum(req.hit_tokens.values()))
        return req

    monkeypatch.setattr(beam_module, "_step", step)
    got = run_beams(beam_engine(), BEAM_PROMPT, BeamSearchParams(beam_width=2, max_tokens=3))
    assert all(first_beams) and len(first_beams) == 2  # (the premise: the other beam read its prefix cached)
    assert got.cached_tokens_per_step[1:] == [0, 0]


def test_a_finished_search_is_no_longer_counted_as_continuing():
    """B28: Engine.continuing counts searches under way (a shutdown's grace waits for them): back to 0 after."""
    eng = beam_engine()
    run_beams(eng, BEAM_PROMPT, BeamSearchParams(beam_width=2, max_tokens=2))
    assert eng.continuing == 0
