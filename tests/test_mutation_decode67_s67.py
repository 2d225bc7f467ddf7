"""Session 67's mutation check of the decode side (scheduler/runner.py, sampling.py, stop_strings.py, logprobs.py,
choices.py, penalty_state.py): the rules no test pinned, each test here failing on one mutant and passing as the
code is. In process on the CPU (tiny preset, decode chained on the device), plus unit-level stop-string checks."""
from __future__ import annotations

import math

import torch

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from scheduler.runner import ModelRunner
from scheduler.stop_strings import CompletionText
from scheduler.tokenizer import ByteTokenizer
from test_penalties import PROMPTS, make_engine, run

TOK = ByteTokenizer(512)


def _dense_logprobs(eng: Engine, tokens: list[int]) -> torch.Tensor:
    """log_softmax of a dense forward's raw logits over `tokens`: row i is the distribution after tokens[:i + 1]
    [len(tokens), V]."""
    with torch.inference_mode():
        return torch.log_softmax(eng.model.forward_dense(torch.tensor(tokens)).float(), dim=-1)


# -- runner.py ------------------------------------------------------------------------------------------------
def test_a_nan_row_of_a_chained_decode_step_fails_its_request_alone(monkeypatch):
    """A decode step whose row 0 has NaN logits: that request fails (its host id is marked), while the next step,
    already chained on the device, reads the row's unmarked id (mutant R8: the marked -1 went into the embedding,
    and the step's failure took the other request with it)."""
    params = [SamplingParams(max_tokens=8, ignore_eos=True)] * 2
    eng = make_engine()
    plain = run(eng, PROMPTS[:2], params)
    sampled, steps = ModelRunner._sampled, []

    def poisoned(self, logits, batch, ids_dev, prompt_lps):
        if batch.is_decode and len(batch.new_lens) == 2:
            steps.append(ids_dev is not None)
            if len(steps) == 3:
                logits = logits.clone()
                logits[0] = float("nan")
        return sampled(self, logits, batch, ids_dev, prompt_lps)
    monkeypatch.setattr(ModelRunner, "_sampled", poisoned)
    eng = make_engine()
    got = eng.generate(PROMPTS[:2], params)
    assert len(steps) > 3 and steps[3], steps  # (the step after the poisoned one was chained)
    failed = [r for r in got if r.finish_reason == "error"]
    assert len(failed) == 1 and "NaN" in failed[0].error, [(r.finish_reason, r.error) for r in got]
    ok = next(i for i, r in enumerate(got) if r.finish_reason != "error")
    assert got[ok].output_ids == plain[ok] and got[ok].finish_reason == "length"
    eng.check_integrity()


def test_allowed_token_ids_leave_logprobs_those_of_the_raw_logits():
    """Bans (allowed_token_ids) put the other tokens at -inf in a copy: the logprobs, of the raw logits, still give
    the allowed token its share among all tokens, and the top-1 is the raw likeliest (mutant R13: bans wrote -inf
    into the raw logits, and the logprobs read the banned distribution)."""
    eng = make_engine()
    [plain] = run(eng, PROMPTS[:1], [SamplingParams(max_tokens=6, ignore_eos=True)])
    allowed = next(t for t in range(300, 512) if t not in plain)
    [res] = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=6, ignore_eos=True, allowed_token_ids=[allowed],
                                                       logprobs=1))
    assert res.output_ids == [allowed] * 6
    ref = _dense_logprobs(eng, PROMPTS[0] + res.output_ids[:-1])[len(PROMPTS[0]) - 1:]  # row i: output[i]'s
    for i, lp in enumerate(res.logprobs):
        assert math.isclose(lp.logprob, float(ref[i, allowed]), abs_tol=1e-4) and lp.logprob < -1e-3, i
        assert lp.top[0][0] == int(ref[i].argmax()) != allowed, i
    assert eng.stats["chained_steps"] > 0


def test_prompt_logprobs_carry_vllms_rank_of_each_prompt_token():
    """Each prompt token's rank (the tokens at least as likely, itself too) reaches GenerationResult (mutant R12:
    the ranks were dropped on the way to the host's entries)."""
    eng = make_engine()
    prompt = PROMPTS[2] + PROMPTS[0]
    [res] = eng.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))
    ref = _dense_logprobs(eng, prompt)
    assert res.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        row, value = ref[i - 1], float(ref[i - 1, prompt[i]])
        rank = res.prompt_logprobs[i].rank
        assert rank is not None and int((row > value + 1e-4).sum()) + 1 <= rank <= int((row >= value - 1e-4).sum()), i


def test_a_simulated_prompt_continues_alike_whatever_part_of_it_was_cached():
    """--simulate's next token is a function of the last token and the position (prefix + new tokens): a prompt
    whose prefix hits the cache continues as it did when computed whole (mutant R17: the position was the prefix
    alone, so a cache hit changed the continuation)."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", simulate=True, page_size=4, num_pages=256))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = list(range(20, 33))
    [first] = eng.generate([prompt], params)
    [again] = eng.generate([prompt], params)
    assert sum(again.cached_tokens.values()) > 0 and again.output_ids == first.output_ids


# -- stop_strings.py ------------------------------------------------------------------------------------------
def test_a_completions_text_takes_no_token_after_its_stop_string_matched():
    """Once a stop string matched, the generation ended at that token: a token still fed after it (and the end's
    flush) adds no text and raises nothing (mutant T11: the matcher was fed again and raised)."""
    text = CompletionText(TOK, [], ["yz"], include_stop=True)
    assert [text.feed(t) for t in TOK.encode("xy")] == ["x", ""]
    assert text.feed(TOK.encode("z")[0]) == "yz" and text.stopped and text.matched == "yz"
    assert text.feed(TOK.encode("w")[0]) == "" and text.flush() == "" and text.matched == "yz"
