"""Regressions from session 51's hunt of structured outputs: a guided choice of 2,000 or more choices, grammars no
text satisfies (or llguidance gives up on at once) refused before they are queued, and the error of bans that leave a
grammar nothing."""
from __future__ import annotations

import json

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.guided import GuidedSpec
from scheduler.request import RequestError, SamplingParams
from scheduler.tokenizer import BYTE_OFFSET, ByteTokenizer


@pytest.fixture(scope="module")
def eng():
    return Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=2048))


def _one(eng, **params):
    [out] = eng.generate([ByteTokenizer(eng.vocab_size).encode("pick: ")], SamplingParams(max_tokens=10, **params))
    return out


def test_a_choice_of_thousands_is_one_of_them(eng):
    """A choice was a rule of one alternative a choice, and llguidance's parser takes at most 2,000 items a row: from
    2,000 choices every request failed at its first token ("Current row has 2001 items"), where an enum of 5,000 ran."""
    choices = [f"c{i}" for i in range(3000)] + ["quote\"d", "new\nline", "c1234x"]  # (one a prefix of another)
    out = _one(eng, guided=GuidedSpec("choice", json.dumps(choices)))
    assert out.finish_reason == "stop" and ByteTokenizer(eng.vocab_size).decode(out.output_ids) in choices, out
    eng.check_integrity()


@pytest.mark.parametrize("kind, value", [
    ("regex", "[^\\s\\S]"),  # (no string)
    ("grammar", 'start: a\na: a "x"'),  # (a rule only itself derives)
    ("json_schema", json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}})),
])
def test_a_grammar_that_cannot_take_a_first_token_is_refused_before_it_is_queued(eng, kind, value):
    """Each compiled, so the request was queued and then failed (a 500 over HTTP): no text satisfies the first two, and
    llguidance gives up on the third (3,000 optional properties) at its first token. The same kind of schema pattern
    was already refused up front."""
    with pytest.raises(RequestError) as err:
        eng.validate([1, 2, 3], SamplingParams(max_tokens=10, guided=GuidedSpec(kind, value)))
    assert err.value.param == "guided" and f"guided {kind}" in str(err.value)
    before = dict(eng.stats)
    out = _one(eng, guided=GuidedSpec(kind, value))  # (refused, a request's error: nothing ran)
    assert out.finish_reason == "error" and f"guided {kind}" in out.error
    assert eng.stats["batches"] == before["batches"]


@pytest.mark.parametrize("grammar", [GuidedSpec("regex", ""), GuidedSpec("regex", "[0-9]+"),
                                     GuidedSpec("json_schema", json.dumps({"type": "object"}))],
                         ids=["empty", "digits", "json_object"])
def test_grammars_that_take_a_first_token_or_are_whole_empty_are_served(eng, grammar):
    out = _one(eng, guided=grammar)
    assert out.finish_reason in ("stop", "length") and out.error is None


@pytest.mark.parametrize("bans", [
    dict(allowed_token_ids=(0, ord("a") + BYTE_OFFSET)),
    dict(bad_words_token_ids=tuple((ord(d) + BYTE_OFFSET,) for d in "0123456789")),
    dict(bad_words_token_ids=tuple((ord(d) + BYTE_OFFSET,) for d in "0123456789"), temperature=1.0, seed=3),
], ids=["allowed", "bad_words", "bad_words-sampled"])
def test_bans_that_leave_a_grammar_nothing_say_so(eng, bans):
    """The token sampled from a row with nothing left is arbitrary (argmax of -inf, or a draw): it was named as
    breaking the grammar, which read as a grammar or engine bug, unless it happened to be a banned one."""
    out = _one(eng, guided=GuidedSpec("regex", "[0-9]+"), **bans)
    assert out.finish_reason == "error" and "ban every token that its grammar allows" in out.error, out.error
    eng.check_integrity()
