"""Bug hunt over vLLM's allowed_token_ids / bad_words, truncate_prompt_tokens, continuous_usage_stats and
return_tokens_as_token_ids: each test pins a case found wrong (then fixed) or checked right. In process on the
CPU (tiny preset) and over HTTP (test_api_vllm_fields' and test_penalties' servers)."""
from __future__ import annotations

import pytest

from scheduler.guided import GuidedSpec
from scheduler.request import SamplingParams
import test_penalties
from test_penalties import PROMPTS, make_engine

srv = test_penalties.srv


def greedy(max_tokens=8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


# -- token bans: a step where they leave nothing to sample -------------------------------------------------
DEAD_ENDS = {  # after token 6 every allowed token is banned; greedy takes 6 first (checked below)
    "words": dict(allowed_token_ids=(5, 6), bad_words_token_ids=((6, 5), (6, 6))),
    "sampled": dict(allowed_token_ids=(5, 6), bad_words_token_ids=((6, 5), (6, 6), (5, 5)), temperature=1.0,
                    seed=1),
    "min_tokens": dict(allowed_token_ids=(77, 78), stop_token_ids=(77,), min_tokens=3,
                       bad_words_token_ids=((78, 78),)),
}


@pytest.mark.parametrize("overlap", [True, False], ids=["chained", "unchained"])
@pytest.mark.parametrize("case", list(DEAD_ENDS))
def test_a_step_with_every_token_banned_fails_the_request_clearly(case, overlap):
    """Regression: a row of -inf sampled argmax's token 0 (or a NaN draw's any token), outside allowed_token_ids,
    and streamed it. vLLM has no guard; here the request fails naming the fields, its banned token never
    emitted, and the batch's other rows go on."""
    eng = make_engine(overlap_schedule=overlap)
    p = greedy(**DEAD_ENDS[case])
    res = eng.generate([PROMPTS[0], PROMPTS[1]], [p, greedy()])
    assert set(res[0].output_ids) <= set(p.allowed_token_ids), res[0].output_ids
    assert res[0].finish_reason == "error" and "allowed_token_ids" in res[0].error, (res[0].output_ids, res[0].error)
    assert len(res[1].output_ids) == 8 and res[1].finish_reason == "length"
    eng.check_integrity()


def test_a_grammar_whose_tokens_are_all_banned_fails_naming_the_bans():
    """Its grammar's every token outside allowed_token_ids: the error says so (it said the sampled token,
    token 0, broke the grammar)."""
    eng = make_engine()
    [res] = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=8, guided=GuidedSpec("regex", "[a-z]{5}"),
                                                       allowed_token_ids=tuple(range(300, 400))))
    assert res.output_ids == [] and res.finish_reason == "error"
    assert "allowed_token_ids" in res.error and "grammar" in res.error, res.error


# -- continuous_usage_stats, truncate_prompt_tokens: checked right, pinned ---------------------------------
import test_api_vllm_fields  # noqa: E402
from test_api_vllm_fields import TEXT, ok, sse  # noqa: E402

fields_srv = pytest.fixture(scope="module", name="fields_srv")(test_api_vllm_fields.srv.__wrapped__)


def test_continuous_usage_with_a_stop_string_ends_at_the_final_count(fields_srv):
    """Each choice's last chunk's completion_tokens is what the final usage counts for it (n=2, a stop string
    that cuts the text: the tokens held back for it are counted once sent)."""
    body = {"prompt": TEXT, "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 2, "stop": ["e"],
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse(fields_srv, "/v1/completions", body)
    final = chunks[-1]["usage"]
    last = {}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            last[ch["index"]] = c["usage"]["completion_tokens"]
    assert sum(last.values()) == final["completion_tokens"], (last, final)


def test_truncation_with_n_and_a_batch_keeps_each_prompts_last_k(fields_srv):
    body = {"prompt": [TEXT, TEXT[:20]], "max_tokens": 2, "temperature": 0, "n": 2, "truncate_prompt_tokens": 7}
    out = ok(fields_srv, "/v1/completions", body)
    assert len(out["choices"]) == 4 and out["usage"]["prompt_tokens"] == 14, out["usage"]
