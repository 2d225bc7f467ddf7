"""Bug hunt: structured outputs (scheduler/guided.py) meeting the rest of the engine: min_tokens and stop ids
that hold back what the grammar allows, a grammar whole before its first token, ignore_eos, sampling filters,
logprobs, chunked prefill beside unguided requests, aborts, restores from L2 / L3, specs that are not what a
GuidedSpec is, and llguidance's errors. The referee: a guided answer is what its grammar allows (or a prefix of
it, by length), no request fails where a valid answer exists, and every tier is whole after."""
from __future__ import annotations

import gc
import json
import re
import weakref

import pytest

from hicache_helpers import finish, read_stream, served_then_below_l1, until
from scheduler import sampling
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.guided import Guide, Guides, GuidedSpec
from scheduler.request import RequestError, SamplingParams
from scheduler.tokenizer import BYTE_OFFSET, ByteTokenizer, HFTokenizer
from test_guided import ckpt_eng, eng  # noqa: F401 (fixtures: the tiny model without EOS; a checkpoint with EOS 256)

EOS = 256  # (ckpt_eng's)


def _b(ch: str) -> int:
    """The tiny model's byte-tokenizer id of a character."""
    return ord(ch) + BYTE_OFFSET


def _one(engine, spec: GuidedSpec, prompt: list[int] | None = None, **kw):
    prompt = prompt or ByteTokenizer(engine.vocab_size).encode("Answer: ")
    [r] = engine.generate([prompt], SamplingParams(guided=spec, **{"max_tokens": 20, **kw}))
    return r


# -- a mask that leaves nothing to sample -------------------------------------------------------------------
def test_a_grammar_whole_before_its_first_token_ends_the_answer_there(eng, ckpt_eng):
    """Regression: a grammar that takes only the empty string (llguidance: accepting, not yet stopped) allowed
    only EOS; the tiny model has none (its stand-in is never allowed), so the mask was empty, the step sampled
    id 0 from a row of -inf, and the request failed ("the token sampled broke the request's grammar"). Now it
    ends with no token, "stop"; a model with an EOS samples it."""
    r = _one(eng, GuidedSpec("regex", ""))
    assert (r.finish_reason, r.output_ids, r.error) == ("stop", [], None)
    r = _one(ckpt_eng, GuidedSpec("regex", ""))
    assert (r.finish_reason, r.output_ids) == ("stop", [EOS])
    eng.check_integrity(), ckpt_eng.check_integrity()


def test_a_grammar_that_needs_a_token_the_model_cannot_sample_fails_saying_so(eng):
    """Its only continuation is the tiny model's stand-in EOS (never allowed): a clear error, not a row of -inf
    sampled and the grammar's parser state dumped."""
    r = _one(eng, GuidedSpec("grammar", f'start: "a" <[{eng.vocab_size - 1}]>'))
    assert r.finish_reason == "error" and r.output_ids == [_b("a")]
    assert "allows no token" in r.error and "\n" not in r.error, r.error
    eng.check_integrity()


def test_min_tokens_yields_to_the_grammar(eng, ckpt_eng):
    """min_tokens holds back EOS and the stop ids; where the grammar allows nothing else, no valid answer can be
    longer: the grammar wins (regression: every allowed token at -inf, a row of -inf sampled, the request failed).
    vLLM fills such a row unconstrained; here the answer stays valid and ends "stop", as at the grammar's end."""
    r = _one(ckpt_eng, GuidedSpec("regex", ""), min_tokens=3)
    assert (r.finish_reason, r.output_ids, r.error) == ("stop", [EOS], None)
    r = _one(eng, GuidedSpec("regex", "a|ab"), stop_token_ids=(_b("b"),), min_tokens=3)  # ("b" is the stop id)
    assert (r.finish_reason, r.output_ids, r.error) == ("stop", [_b("a"), _b("b")], None)
    # (verified: where the grammar allows more, min_tokens holds EOS back; at the grammar's end the answer ends)
    r = _one(ckpt_eng, GuidedSpec("regex", "[0-9]{2,5}"), min_tokens=4, logit_bias={EOS: 50.0})
    assert r.finish_reason == "stop" and r.output_ids[-1] == EOS and len(r.output_ids) == 5
    r = _one(ckpt_eng, GuidedSpec("regex", "[0-9]{2}"), min_tokens=6)
    assert r.finish_reason == "stop" and re.fullmatch("[0-9]{2}", ckpt_eng.tok.decode(r.output_ids))
    eng.check_integrity(), ckpt_eng.check_integrity()


# -- specs that are not what a GuidedSpec is ----------------------------------------------------------------
@pytest.mark.parametrize("spec", [GuidedSpec("choice", "yes"), GuidedSpec("choice", '"yes"'),
                                  GuidedSpec("regex", ["a"]), {"kind": "regex", "value": "a"}])
def test_a_malformed_spec_is_that_requests_error(eng, spec):
    """Regression: a choice that is not JSON raised json's JSONDecodeError, an unhashable spec (a dict, a list
    value) lru_cache's TypeError, out of add_request (generate() and the server take only RequestError)."""
    with pytest.raises(RequestError) as err:
        eng.add_request([10, 11], SamplingParams(guided=spec))
    assert err.value.param == "guided" and not eng.waiting


def test_a_tokenizer_llguidance_cannot_take_is_a_request_error(ckpt_eng):
    """Regression: llguidance refusing the tokenizer (here: more ids than the model's vocabulary) raised its
    ValueError out of validate, for every guided request."""
    guides = Guides(ckpt_eng.config.model, 200, (EOS,))
    guides.use(HFTokenizer(ckpt_eng.config.model))
    with pytest.raises(RequestError, match="tokenizer") as err:
        guides.check(GuidedSpec("regex", "[0-9]+"))
    assert err.value.param == "guided"


def test_an_engines_grammar_cache_goes_with_it():
    """Regression: the lru_cache on the method kept every Guides (and its tokenizer) alive, and `use` cleared
    every engine's cache."""
    guides, other = Guides("tiny", 512, ()), Guides("tiny", 512, ())
    spec = GuidedSpec("regex", "[0-9]+")
    guides.check(spec), other.check(spec)
    other.use(None)
    assert guides.compiled.cache_info().hits == 0 and guides.check(spec) and guides.compiled.cache_info().hits == 1
    ref = weakref.ref(guides)
    del guides
    gc.collect()
    assert ref() is None


def test_each_request_of_a_spec_has_its_own_matcher():
    """A spec is compiled once (its matcher copied for each request: compiling a large schema again for each
    request held the loop ~25 ms at 1,000 properties); one request's tokens move no other's matcher."""
    guides = Guides("tiny", 512, ())
    spec = GuidedSpec("choice", json.dumps(["ab", "cd"]))
    first, second = guides.start(spec), guides.start(spec)
    assert first.accept(_b("a")) is None and first.accept(_b("b")) is None and first.complete
    assert not second.complete and second.accept(_b("c")) is None and second.accept(_b("d")) is None
    assert guides.start(spec).accept(_b("c")) is None and guides.compiled.cache_info().misses == 1


def test_the_grammars_error_is_its_first_line():
    """llguidance's error carries its parser state and the whole grammar (kilobytes, to a client's 500)."""
    guide = Guides("tiny", 512, ()).start(GuidedSpec("regex", "[0-9]+"))
    assert isinstance(guide, Guide)
    broken = guide.accept(_b("x"))
    assert broken.startswith("Parser Error") and "\n" not in broken and len(broken) < 300, broken
    big = "(" * 2000 + "a" + ")" * 2000
    with pytest.raises(RequestError) as err:
        Guides("tiny", 512, ()).check(GuidedSpec("regex", big))
    assert len(str(err.value)) < 600


# -- verified: what guided answers meet ---------------------------------------------------------------------
def _nested(depth: int) -> str:
    schema = '{"type": "integer"}'
    for _ in range(depth):
        schema = '{"type": "array", "items": ' + schema + '}'
    return schema


@pytest.mark.parametrize("spec, says", [
    (GuidedSpec("json_schema", _nested(5000)), "recursion limit"),
    (GuidedSpec("json_schema", json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                                              for i in range(20000)}})), "too large"),
    (GuidedSpec("grammar", "start: " + "(" * 5000 + '"a"' + ")" * 5000), "too deeply nested"),
])
def test_a_pathological_spec_is_that_requests_error(eng, spec, says):
    """Valid JSON (or Lark) past llguidance's limits: refused at once, a short message, nothing queued."""
    with pytest.raises(RequestError, match=says) as err:
        eng.add_request([10, 11], SamplingParams(guided=spec))
    assert err.value.param == "guided" and len(str(err.value)) < 600 and not eng.waiting


def test_ignore_eos_still_ends_at_the_grammars_end(ckpt_eng):
    """ignore_eos: EOS ends nothing, but once the grammar is whole the answer is (EOS taken by a grammar that
    allows it is its last token)."""
    r = _one(ckpt_eng, GuidedSpec("regex", "[0-9]{2}"), ignore_eos=True)
    assert r.finish_reason == "stop" and re.fullmatch("[0-9]{2}", ckpt_eng.tok.decode(r.output_ids))
    r = _one(ckpt_eng, GuidedSpec("regex", "[0-9]{2,5}"), ignore_eos=True, logit_bias={EOS: 50.0})
    assert r.finish_reason == "stop" and r.output_ids[-1] == EOS and len(r.output_ids) == 3
    r = _one(ckpt_eng, GuidedSpec("regex", "[a-z]{30}"), max_tokens=5)  # (cut by length: a prefix)
    assert r.finish_reason == "length" and re.fullmatch("[a-z]{5}", ckpt_eng.tok.decode(r.output_ids))
    ckpt_eng.check_integrity()


@pytest.mark.parametrize("kernel", [False, True])
def test_sampling_filters_pick_among_allowed_tokens(eng, monkeypatch, kernel):
    """top_k / top_p / min_p over rows mostly at -inf, by the torch path and by the rejection kernel (on the
    CPU under TRITON_INTERPRET=1); penalties and a logit_bias for a masked token change nothing of that."""
    monkeypatch.setattr(sampling, "USE_KERNEL", kernel)
    tok = ByteTokenizer(eng.vocab_size)
    spec = GuidedSpec("regex", "[a-c]{3}x[0-9]{2}")
    params = [SamplingParams(max_tokens=10, guided=spec, seed=s, **{"temperature": 1.0, **kw}) for s, kw in enumerate([
        {"top_p": 0.9}, {"top_k": 5}, {"top_k": 2, "top_p": 0.5}, {"min_p": 0.3}, {"top_k": 400},
        {"temperature": 0.05, "top_p": 0.99}, {"repetition_penalty": 2.0, "logit_bias": {_b("z"): 100.0}}])]
    for r in eng.generate([tok.encode("Answer: ")] * len(params), params):
        assert r.finish_reason == "stop" and re.fullmatch("[a-c]{3}x[0-9]{2}", tok.decode(r.output_ids))
    eng.check_integrity()


def test_logprobs_and_prompt_logprobs_beside_a_grammar(eng):
    """Both read the raw logits (vLLM's default): every prompt row's, and each sampled token's."""
    r = _one(eng, GuidedSpec("regex", "[0-9]{3}"), logprobs=2, prompt_logprobs=1)
    assert r.finish_reason == "stop" and re.fullmatch("[0-9]{3}", ByteTokenizer(eng.vocab_size).decode(r.output_ids))
    assert len(r.logprobs) == 3 and all(lp.logprob <= 0.0 for lp in r.logprobs)
    eng.check_integrity()


def test_chunked_prompts_guided_beside_unguided():
    """Prompts over --max-prefill-tokens, guided and not, one spec shared by several requests: a chunk before
    the last fills a mask and advances nothing; the unguided answers are those they get alone."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=4096, max_prefill_tokens=16))
    tok = ByteTokenizer(eng.vocab_size)
    prompts = [tok.encode(f"{i} " * 25) for i in range(6)]
    spec = GuidedSpec("choice", json.dumps(["red", "green", "blue"]))
    alone = [r.output_ids for r in eng.generate(prompts[::2], SamplingParams(max_tokens=8))]
    mixed = eng.generate(prompts, [SamplingParams(max_tokens=8) if i % 2 == 0 else
                                   SamplingParams(max_tokens=8, guided=spec, temperature=1.0, seed=i)
                                   for i in range(6)])
    assert [r.output_ids for r in mixed[::2]] == alone
    assert all(r.finish_reason == "stop" and tok.decode(r.output_ids) in ("red", "green", "blue") for r in mixed[1::2])
    eng.check_integrity()


@pytest.mark.asyncio
@pytest.mark.parametrize("tier", ["l2", "l3"])
async def test_restored_and_aborted_guided_requests(tier):
    """A guided request whose prefix comes back from L2 / L3 answers as its grammar allows; one aborted
    mid-answer ends, and every tier is whole."""
    config = EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4, max_prefill_tokens=16)
    eng = Engine(config.with_hicache(enable=True, host_ratio=2.0, storage_ratio=8.0 if tier == "l3" else 0.0,
                                     transfer_backend="torch", policy="always"))
    tok = ByteTokenizer(eng.vocab_size)
    prefix = tok.encode("the shared context " * 3)
    await served_then_below_l1(eng, prefix, tier)
    spec = GuidedSpec("regex", "[0-9]{4}")
    [r] = await eng.generate_async([prefix + [7]], SamplingParams(max_tokens=10, guided=spec))
    assert r.finish_reason == "stop" and re.fullmatch("[0-9]{4}", tok.decode(r.output_ids))
    assert r.cached_tokens[tier] > 0
    req = eng.add_request(prefix + [9], SamplingParams(max_tokens=40, guided=GuidedSpec("regex", "[a-z]{30}")))
    await until(lambda: len(req.output) >= 3)
    await eng.abort(req.rid)
    tokens, reason = await read_stream(req)
    assert reason == "abort" and re.fullmatch("[a-z]+", tok.decode(tokens))
    await finish(eng)
