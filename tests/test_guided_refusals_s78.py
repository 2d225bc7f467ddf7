"""Session 78's hunt, structured outputs keep their promise: a spec the engine cannot serve is that request's error.

A regex that ends in a lone backslash (an escape of
nothing: Python's re, the jsonschema package and Rust's regex crate all refuse it) is a request's error, not served
as another regex. llguidance dropped the backslash and matched the rest, so guided_regex "ab$\\" answered "ab",
a schema's "pattern" "^ab\\" let any string that starts with "ab" through, and a patternProperties name "^a\\"
took every key that starts with "a"; each a 200 whose answer no validator could check.

A choice spec whose JSON text nests past Python's parser raised RecursionError out of `Engine.generate`, the whole
batch lost (a schema's is its request's error, as is a choice's that is not JSON)."""
from __future__ import annotations

import json
import re

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.guided import GuidedSpec
from scheduler.request import RequestError, SamplingParams
from scheduler.tokenizer import ByteTokenizer
from server_fixtures import byte_level_server, post, tiny_config


@pytest.fixture(scope="module")
def eng():
    return Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=2048))


def _schema(schema: dict) -> GuidedSpec:
    return GuidedSpec("json_schema", json.dumps(schema))


@pytest.mark.parametrize("spec", [
    GuidedSpec("regex", "\\"),
    GuidedSpec("regex", "ab\\"),
    GuidedSpec("regex", "ab$\\"),
    GuidedSpec("regex", "a\\\\\\"),  # (an escaped backslash, then a lone one)
    _schema({"type": "string", "pattern": "^ab\\"}),
    _schema({"type": "string", "pattern": "^ab$\\"}),
    _schema({"type": "object", "properties": {"k": {"type": "string", "pattern": "x\\"}}}),
    _schema({"type": "object", "patternProperties": {"^a\\": {"type": "integer"}}, "additionalProperties": False}),
], ids=lambda s: s.value)
def test_a_regex_ending_in_a_lone_backslash_is_refused(eng, spec):
    with pytest.raises(RequestError, match="lone backslash") as err:
        eng.add_request([10, 11], SamplingParams(max_tokens=8, guided=spec))
    assert err.value.param == "guided" and not eng.waiting


def test_an_escaped_backslash_at_the_end_is_still_served(eng):
    """An even run of backslashes at the end is escaped backslashes: the answer ends in that character."""
    tok = ByteTokenizer(eng.vocab_size)
    regex = eng.generate([tok.encode("x")], SamplingParams(max_tokens=8, guided=GuidedSpec("regex", "ab\\\\")))[0]
    assert regex.finish_reason == "stop" and tok.decode(regex.output_ids) == "ab\\"
    pattern = _schema({"type": "string", "pattern": "^a\\\\$"})
    text = tok.decode(eng.generate([tok.encode("x")], SamplingParams(max_tokens=8, guided=pattern))[0].output_ids)
    assert re.fullmatch(r"^a\\$", json.loads(text))
    eng.check_integrity()


def test_over_http_it_is_a_400_naming_the_field(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config()) as srv:
        for field, value in (("guided_regex", "ab$\\"), ("guided_json", {"type": "string", "pattern": "^ab\\"})):
            r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 8, field: value})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field and "lone backslash" in r.json()["error"]["message"]


def test_a_choice_nested_past_the_parser_is_its_requests_error(eng):
    deep = GuidedSpec("choice", "[" * 100_000)
    with pytest.raises(RequestError, match="non-empty list") as err:
        eng.add_request([10, 11], SamplingParams(max_tokens=4, guided=deep))
    assert err.value.param == "guided" and not eng.waiting
    refused, other = eng.generate([[10, 11], [12, 13]], [SamplingParams(max_tokens=4, guided=deep),
                                                         SamplingParams(max_tokens=4)])
    assert refused.finish_reason == "error" and "non-empty list" in refused.error
    assert other.finish_reason == "length" and len(other.output_ids) == 4
    eng.check_integrity()
