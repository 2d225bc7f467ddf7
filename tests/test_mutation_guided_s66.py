"""Rules of structured outputs, token bans and tool-call parsing that session 66's mutation check of
scheduler/guide_compiler.py, guided.py, token_bans.py, tool_calls.py and reasoning.py broke without any test failing:

* the grammar and schema limits count every form a grammar or schema writes (?rule, !rule, rule.2; "definitions"
  beside "$defs"; integers inside anyOf / prefixItems lists; every bound, exclusiveMaximum too), and the 64-bit
  range is inclusive: a limit that misses a form lets a chain past it reach llguidance's stack (session 52's crash);
* the compiled matchers are kept by least recent use, the newest always, their text counted once (a spec compiled by
  two callers at once) and forgotten by cache_clear;
* a checkpoint tokenizer's grammars end on the engine's EOS ids, not llguidance's guess (id 0, a byte);
* a grammar's mask and a longer bad word's ban are applied to a copy: logprobs read the raw logits (vLLM's default);
* a stuck grammar's error carries llguidance's reason; a call's arguments keep non-ASCII keys as written
  (json.dumps(ensure_ascii=False), as vLLM sends them).
No server: the tiny model on the CPU where an engine is needed."""
from __future__ import annotations

import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from scheduler.guide_compiler import (INT64_MAX, INT64_MIN, KEPT_SPEC_CHARS, MAX_GRAMMAR_RULES, MAX_SCHEMA_DEFS,
                                      MatcherCache, check_limits)
from scheduler.guided import GuidedSpec, Guides
from scheduler.request import SamplingParams
from scheduler.tokenizer import ByteTokenizer, HFTokenizer
from scheduler.tool_calls import HermesToolParser
import test_guided
from test_penalties import PROMPTS
from test_penalties import make_engine as plain_engine
from tokenizer_files import write_byte_tokenizer

eng = test_guided.eng  # (its fixture: the tiny model on the CPU, without EOS)


# -- guide_compiler: the limits ---------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["?r{i}", "!r{i}", "r{i}.2", "r{i}.-1", "?r{i}.3", "R{i}"])
def test_a_grammar_s_rules_count_in_every_form_lark_writes_them(form):
    """Inlined (?rule), kept (!rule) and prioritized (rule.2) definitions are rules too: past MAX_GRAMMAR_RULES of
    them the grammar is refused before llguidance recurses along them."""
    def grammar(n: int) -> str:
        name = form.split(".")[0].lstrip("?!")
        rules = [f'{form.format(i=i)}: "t" {name.format(i=i + 1)} | "e"' for i in range(n - 1)]
        return "\n".join([*rules, f'{form.format(i=n - 1)}: "end"'])

    check_limits("grammar", grammar(MAX_GRAMMAR_RULES))
    with pytest.raises(ValueError, match=f"a grammar of {MAX_GRAMMAR_RULES + 1} rules"):
        check_limits("grammar", grammar(MAX_GRAMMAR_RULES + 1))


@pytest.mark.parametrize("key", ["definitions", "$defs"])
def test_a_schema_s_definitions_count_under_either_key(key):
    """Draft-7's "definitions" are counted as "$defs" are (a $ref chain through them is as deep)."""
    def schema(n: int) -> str:
        return json.dumps({"type": "object", key: {f"d{i}": {"type": "string"} for i in range(n)}})

    check_limits("json_schema", schema(MAX_SCHEMA_DEFS))
    with pytest.raises(ValueError, match=f"a schema of {MAX_SCHEMA_DEFS + 1} definitions"):
        check_limits("json_schema", schema(MAX_SCHEMA_DEFS + 1))


@pytest.mark.parametrize("key", ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"])
def test_an_integer_bound_is_taken_up_to_64_bits_exactly(key):
    """Every bound llguidance clamps is checked, and the range is inclusive: INT64_MIN and INT64_MAX are taken, one
    past either is refused."""
    def schema(bound: int) -> str:
        return json.dumps({"type": "object", "properties": {"n": {"type": "integer", key: bound}}})

    for bound in (INT64_MIN, INT64_MAX, 0):
        check_limits("json_schema", schema(bound))
    for bound in (INT64_MIN - 1, INT64_MAX + 1):
        with pytest.raises(ValueError, match=f"an integer's {key} of {bound} is outside the 64-bit range"):
            check_limits("json_schema", schema(bound))


@pytest.mark.parametrize("where", ["anyOf", "oneOf", "prefixItems"])
def test_an_integer_inside_a_list_of_subschemas_is_checked(where):
    """Subschemas listed in an array (anyOf, oneOf, prefixItems) are looked into as nested objects are."""
    schema = {"type": "array", where: [{"type": "string"}, {"type": "integer", "maximum": 1e20}]}
    with pytest.raises(ValueError, match="outside the 64-bit range"):
        check_limits("json_schema", json.dumps(schema))


# -- guide_compiler: the matchers kept --------------------------------------------------------------------
def _spec(tag: str, fraction: float) -> GuidedSpec:
    return GuidedSpec("regex", tag + "a" * int(KEPT_SPEC_CHARS * fraction))


def test_a_spec_past_the_text_bound_alone_is_still_kept():
    """The newest matcher is kept whatever its size (the bound drops older ones only): its next request is a hit."""
    compiled = MatcherCache(lambda spec: object())
    big = _spec("x", 1.5)
    first = compiled(big)
    assert compiled(big) is first
    assert (compiled.cache_info().hits, compiled.cache_info().currsize) == (1, 1)


def test_the_least_recently_used_matcher_is_dropped_not_the_oldest():
    compiled = MatcherCache(lambda spec: object())
    a, b, c = _spec("a", 0.4), _spec("b", 0.4), _spec("c", 0.4)
    kept_a = compiled(a)
    compiled(b)
    assert compiled(a) is kept_a  # (a hit: a is now the most recent)
    compiled(c)  # (past the text bound: one is dropped, b)
    assert compiled(a) is kept_a
    info = compiled.cache_info()
    assert (info.hits, info.misses, info.currsize) == (2, 3, 2)


def test_a_spec_compiled_by_two_at_once_is_kept_once_and_its_text_counted_once():
    """Two first requests for one spec compile it twice (off the lock): one matcher is kept, the one first kept
    (a later request gets it), its text counted once, so a second spec of the same size still fits beside it."""
    both = threading.Barrier(2, timeout=30)
    made = []

    def compile_spec(spec):
        if spec.value.startswith("a"):
            both.wait()  # (each caller has missed before either compiles)
        made.append(object())
        return made[-1]

    compiled = MatcherCache(compile_spec)
    a = _spec("a", 0.4)
    with ThreadPoolExecutor(2) as callers:
        results = [f.result(timeout=60) for f in [callers.submit(compiled, a) for _ in range(2)]]
    assert len(made) == 2 and {id(r) for r in results} == {id(m) for m in made}
    kept = compiled(a)
    assert compiled(a) is kept and compiled.cache_info().currsize == 1
    compiled(_spec("b", 0.4))
    assert compiled.cache_info().currsize == 2 and compiled(a) is kept


def test_a_cleared_cache_counts_no_text_of_what_it_held():
    compiled = MatcherCache(lambda spec: object())
    compiled(_spec("a", 0.6))
    compiled.cache_clear()
    compiled(_spec("b", 0.45))
    compiled(_spec("c", 0.45))
    assert compiled.cache_info().currsize == 2


# -- guided: a checkpoint tokenizer's EOS ------------------------------------------------------------------
@pytest.mark.parametrize("eos", [257, 258])
def test_a_whole_grammar_allows_the_engine_s_eos_through_a_checkpoint_tokenizer(tmp_path, eos):
    """The engine's EOS ids are the ones llguidance's masks allow where the grammar is whole (not its own guess
    from the tokenizer.json, here id 0, a byte): the answer can end there."""
    pytest.importorskip("llguidance")
    path = write_byte_tokenizer(tmp_path, added=("<think>",), special=("<|end|>", "<|tag|>"))
    guides = Guides("unused", 512, (eos,))
    guides.use(HFTokenizer(str(path)))
    guide = guides.start(GuidedSpec("regex", "a"))
    assert guide.accept(guides.tokenizer.encode("a", add_special_tokens=False)[0]) is None
    row = torch.zeros(guide.words, dtype=torch.int32)
    guide.fill_mask(row)
    assert [t for t in range(512) if (int(row[t // 32]) >> (t % 32)) & 1] == [eos] and guide.complete


def test_a_guided_token_s_logprobs_read_the_logits_its_mask_left_raw(eng):
    """A grammar's mask is applied to a copy: logprobs read the raw logits (vLLM's default), so a token the grammar
    forces has its model's logprob, not 0, and the tokens it rules out are among the likeliest with theirs."""
    tok = ByteTokenizer(eng.vocab_size)
    [r] = eng.generate([tok.encode("Answer: ")], SamplingParams(max_tokens=8, logprobs=3,
                                                                guided=GuidedSpec("regex", "zzz")))
    assert tok.decode(r.output_ids) == "zzz" and len(r.logprobs) == 3
    for lp in r.logprobs:
        assert lp.logprob < 0.0 and len(lp.top) == 3 and all(math.isfinite(v) for _, v in lp.top), lp



def test_a_stuck_grammar_s_error_says_what_llguidance_found():
    """After a token the grammar refused (a NaN row's), the request's error carries llguidance's reason."""
    pytest.importorskip("llguidance")
    guides = Guides("tiny", 512, ())
    guides.use(ByteTokenizer(512))
    guide = guides.start(GuidedSpec("regex", "ab"))
    broken = guide.accept(ByteTokenizer(512).encode("z")[0])
    assert broken and "\n<state>" not in broken
    assert guide.stuck_error() == f"the request's grammar allows no token this model can sample here: {broken}"

# -- token_bans: the raw logits ---------------------------------------------------------------------------
def test_a_longer_bad_word_s_ban_leaves_the_logprobs_raw():
    """A bad word of two tokens, the only ban of its request (no static mask), bans its last token on a copy of the
    logits: the step after its first token reports the logprobs it would have without the ban."""
    eng = plain_engine()
    free = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=2, logprobs=5, ignore_eos=True))[0]
    first, top = free.output_ids[0], [t for t, _ in free.logprobs[1].top]
    got = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=2, logprobs=5, ignore_eos=True,
                                                    bad_words_token_ids=[[first, top[0]]]))[0]
    assert got.output_ids[0] == first and got.output_ids[1] != top[0]
    assert [t for t, _ in got.logprobs[1].top] == top
    assert [v for _, v in got.logprobs[1].top] == pytest.approx([v for _, v in free.logprobs[1].top], abs=1e-5)


# -- tool_calls ---------------------------------------------------------------------------------------------
def test_a_call_s_arguments_keep_their_keys_unescaped():
    """The arguments' JSON text is written as json.dumps(ensure_ascii=False) writes it (vLLM's), keys included."""
    parser = HermesToolParser()
    block = '<tool_call>{"name": "f", "arguments": {"clé": "été", "日": [1, "ü"]}}</tool_call>'
    content, calls = parser.feed(block)
    assert content == "" and [c.arguments for c in calls] == ['{"clé": "été", "日": [1, "ü"]}']


def test_a_chain_of_refs_through_properties_counts_against_the_limit():
    """A $ref chain needs no definitions: each property may point at the next ("#/properties/p1", ...). Its links are
    counted as a $defs chain's are (regression: 2,000 such links passed the limits and took ~8 s of a compile thread;
    a default 8 MiB stack overflowed on them, session 66's guided check)."""
    def chain(links: int) -> str:
        props = {f"p{i}": {"$ref": f"#/properties/p{i + 1}"} for i in range(links)}
        return json.dumps({"type": "object", "properties": {**props, f"p{links}": {"type": "string"}}})
    check_limits("json_schema", chain(MAX_SCHEMA_DEFS))
    with pytest.raises(ValueError, match=f"a schema of {MAX_SCHEMA_DEFS + 1} \\$refs: at most {MAX_SCHEMA_DEFS}"):
        check_limits("json_schema", chain(MAX_SCHEMA_DEFS + 1))
