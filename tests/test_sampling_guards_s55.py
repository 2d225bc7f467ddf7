"""Sampling behaviour no test checked (session 55's mutation check: each could be changed and every test passed;
each test here fails on its mutant): a verify step samples with min_p and reports the raw logits' logprobs; bans
leave logprobs raw; min_p comes before top-p (vLLM V1); top_k = vocabulary - 1 drops a token; a verify row the
grammar and min_tokens' last held token meet is the grammar's; a bad word at the very start of the answer is banned,
and a row bans leave empty fails before streaming the banned token; beam search keeps 2 * beam_width candidates."""
from __future__ import annotations

import pytest
import torch

import scheduler.sampling as sampling
from scheduler.beam_search import BeamSearchParams, _candidates
from scheduler.guided import GuidedSpec
from scheduler.request import SamplingParams, TokenLogprobs
from scheduler.sampling import sample
from scheduler.tokenizer import ByteTokenizer
from test_beam_search import PROMPT as BEAM_PROMPT
from test_beam_search import make_engine as beam_engine
from test_beam_search import run as beam_run
from test_penalties import PROMPTS
from test_penalties import make_engine as plain_engine
from test_speculative import SPEC, looping_prompts, spec_stats
from test_speculative import make_engine as spec_engine
from test_speculative_guided import SPEC as GUIDED_SPEC
from test_speculative_guided import make as guided_engine


@pytest.fixture(scope="module")
def looping():
    return looping_prompts(5, 20, 8, 32, need=3)[:4]


def test_a_verify_step_samples_with_min_p(looping):
    """(min_p 1.0 keeps only the likeliest token: the greedy output, drafted or not.)"""
    want = [r.output_ids for r in spec_engine().generate(looping, SamplingParams(max_tokens=20))]
    eng = spec_engine(SPEC)
    torch.manual_seed(6)
    got = [r.output_ids for r in eng.generate(looping, SamplingParams(max_tokens=20, temperature=0.9, min_p=1.0))]
    assert spec_stats(eng)["drafts"] > 0 and got == want


def test_a_verify_steps_logprobs_are_the_raw_logits(looping):
    params = SamplingParams(max_tokens=16, logprobs=3, logit_bias={t: 5.0 for t in range(0, 512, 7)})
    eng = spec_engine(SPEC)
    drafted, plain = eng.generate(looping, params), spec_engine().generate(looping, params)
    assert spec_stats(eng)["drafts"] > 0
    for a, b in zip(drafted, plain):
        assert a.output_ids == b.output_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-3) and [t for t, _ in la.top] == [t for t, _ in lb.top]


def test_bans_leave_the_logprobs_raw():
    eng = plain_engine()
    free = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=1, logprobs=5, ignore_eos=True))[0]
    top = [t for t, _ in free.logprobs[0].top]
    allowed = [t for t in range(512) if t not in top[:3]][:5]  # (the three likeliest banned)
    for kw in ({"allowed_token_ids": allowed}, {"bad_words_token_ids": [[top[3]]]}):
        got = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=1, logprobs=5, ignore_eos=True, **kw))[0]
        assert [t for t, _ in got.logprobs[0].top] == top, kw
        assert [v for _, v in got.logprobs[0].top] == pytest.approx([v for _, v in free.logprobs[0].top], abs=1e-5)


@pytest.mark.parametrize("kernel", [False, True])
def test_min_p_comes_before_top_p(kernel, monkeypatch):
    """(p = .5 .3 .1 .1: min_p 0.3 keeps .625 / .375, then top_p 0.6 keeps token 0 alone; top-p first kept 0 and 1.)"""
    monkeypatch.setattr(sampling, "USE_KERNEL", kernel)
    torch.manual_seed(3)
    n = 64  # (the interpreter runs a kernel program a row; top-p first would draw token 1 with p .375 a row)
    ids = sample(torch.tensor([0.5, 0.3, 0.1, 0.1]).log().expand(n, 4).contiguous(), [1.0] * n, [0.6] * n,
                 [None] * n, min_ps=[0.3] * n)
    assert set(ids.tolist()) == {0}


@pytest.mark.parametrize("kernel", [False, True])
def test_top_k_of_the_vocabulary_less_one_drops_the_least_likely(kernel, monkeypatch):
    monkeypatch.setattr(sampling, "USE_KERNEL", kernel)
    torch.manual_seed(4)
    n = 200  # (token 3 drawn with p .1 a row where it is kept: missed by all 200, 7e-10)
    ids = sample(torch.tensor([0.4, 0.3, 0.2, 0.1]).log().expand(n, 4).contiguous(), [1.0] * n, [1.0] * n,
                 [None] * n, [3] * n)
    assert set(ids.tolist()) == {0, 1, 2}


def test_a_verify_row_where_min_tokens_last_held_token_is_the_grammars_only_one():
    """(Regex x{2}y, stop "y", min_tokens 3: "y" is token 2, the last min_tokens holds, and the grammar's only token:
    the grammar wins, as in a plain step; the verify row held it and the request failed.)"""
    plain = guided_engine()
    tok = ByteTokenizer(plain.vocab_size)
    [stop_id] = tok.encode("y")
    prompts = [tok.encode("xxyxxyxxy abc abc abc xxy"), tok.encode("The cat and the dog and the cat ")]
    params = SamplingParams(max_tokens=24, guided=GuidedSpec("regex", "x{2}y"), min_tokens=3, stop_token_ids=[stop_id])
    want = [(r.output_ids, r.finish_reason, r.error) for r in plain.generate(prompts, params)]
    eng = guided_engine(GUIDED_SPEC)
    for _ in range(2):  # (drafts by prompt lookup, then from the prefix cache)
        assert [(r.output_ids, r.finish_reason, r.error) for r in eng.generate(prompts, params)] == want
    assert eng.status()["engine"]["speculative"]["verify_steps"] > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_a_bad_word_at_the_start_of_the_answer_is_banned(overlap):
    eng = plain_engine(overlap_schedule=overlap)
    base = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=6, ignore_eos=True))[0].output_ids
    for word in (base[:3], base[:4]):
        got = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=6, ignore_eos=True, bad_words_token_ids=[word]))[0]
        assert got.error is None and got.output_ids[:len(word)] != word, (word, got.output_ids)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_row_bans_leave_empty_fails_before_streaming_the_banned_token(overlap):
    eng = plain_engine(overlap_schedule=overlap)
    for word in ([0, 0], [0, 0, 0]):
        got = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True, allowed_token_ids=[0],
                                                       bad_words_token_ids=[word]))[0]
        assert got.output_ids == [0] * (len(word) - 1) and got.error is not None, (word, got.output_ids)


def test_beam_search_keeps_twice_the_beam_width_candidates():
    class Step:  # (the finished step request fields _candidates reads)
        output = [7]
        output_logprobs = [TokenLogprobs(-1.0, [(7, -1.0), (3, -2.0), (9, -3.0), (4, -4.0)])]
    assert [t for t, _ in _candidates(Step, 4, set())] == [7, 3, 9, 4]
    first = beam_engine().generate([BEAM_PROMPT], SamplingParams(max_tokens=1, ignore_eos=True))[0].output_ids[0]
    result = beam_run(beam_engine(), BEAM_PROMPT, BeamSearchParams(beam_width=1, max_tokens=3, length_penalty=10.0,
                                                                  stop_token_ids=(first,), ignore_eos=True))
    best = result.beams[0]  # (the second likeliest first token grows a beam that outscores the one ended at once)
    assert (best.finish_reason, len(best.output_ids)) == ("length", 3)
