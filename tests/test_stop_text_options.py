"""vLLM's text options of a choice (scheduler/stop_strings.py, scheduler/generation.py `Generation`):
`include_stop_str_in_output` (the text ends after the stop string that matched, or with the stop token's
text) and `skip_special_tokens` (false: special tokens' text kept). Both were a 400 "unknown field"."""
from __future__ import annotations

import json

import httpx
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.stop_strings import StopMatcher
from scheduler.tokenizer import HFTokenizer
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

BOS = 256


def test_the_matcher_keeps_the_stop_string_when_asked():
    kept, dropped = StopMatcher(["STOP"], include_stop=True), StopMatcher(["STOP"])
    assert [kept.feed(d) for d in ("ab", "cST", "OPxyz")] == ["ab", "c", "STOP"] and kept.matched == "STOP"
    assert [dropped.feed(d) for d in ("ab", "cST", "OPxyz")] == ["ab", "c", ""] and dropped.matched == "STOP"


@pytest.fixture(scope="module")
def srv():
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
        yield s


def _complete(s, **body) -> dict:
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "hello", "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _streamed(s, **body) -> str:
    text = ""
    with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                      json={"prompt": "hello", "temperature": 0, "stream": True, **body}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_a_stop_string_ends_the_text_after_it(srv):
    full = _complete(srv, max_tokens=24)["text"]
    stop = full[6:8]
    at = full.find(stop)
    plain = _complete(srv, max_tokens=24, stop=[stop])
    kept = _complete(srv, max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    assert plain["text"] == full[:at] and plain["finish_reason"] == "stop"
    assert kept["text"] == full[:at + len(stop)] and kept["finish_reason"] == "stop"
    assert kept["token_ids"] == plain["token_ids"]  # the same tokens: only the text differs
    assert _streamed(srv, max_tokens=24, stop=[stop], include_stop_str_in_output=True) == kept["text"]


def test_a_stop_token_shows_its_text_when_asked(srv):
    ids = _complete(srv, max_tokens=12)["token_ids"]
    k = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])  # its first time: the stop lands there
    before, through = _complete(srv, max_tokens=k)["text"], _complete(srv, max_tokens=k + 1)["text"]
    assert before != through
    plain = _complete(srv, max_tokens=12, stop_token_ids=[ids[k]])
    kept = _complete(srv, max_tokens=12, stop_token_ids=[ids[k]], include_stop_str_in_output=True)
    assert (plain["text"], plain["finish_reason"]) == (before, "stop")
    assert (kept["text"], kept["finish_reason"]) == (through, "stop")
    assert plain["token_ids"] == kept["token_ids"] == ids[:k + 1]


@pytest.fixture(scope="module")
def bos_srv(tmp_path_factory):
    """A checkpoint tokenizer whose BOS "<s>" (id 256) is a special token."""
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), special=("<s>",))
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=HFTokenizer(str(path)))) as s:
        yield s


@pytest.mark.parametrize("skip, text", [(None, ""), (True, ""), (False, "<s><s><s>")])
def test_special_tokens_text_is_kept_only_when_asked(bos_srv, skip, text):
    extra = {} if skip is None else {"skip_special_tokens": skip}
    choice = _complete(bos_srv, max_tokens=3, logit_bias={str(BOS): 100}, **extra)  # the model says "<s>" thrice
    assert choice["token_ids"] == [BOS] * 3 and choice["text"] == text
    assert _streamed(bos_srv, max_tokens=3, logit_bias={str(BOS): 100}, **extra) == text


def test_both_are_strict_booleans(srv):
    for field in ("include_stop_str_in_output", "skip_special_tokens"):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, field: "yes"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_special_tokens_logprobs_entry_is_its_text_when_kept(bos_srv):
    """With skip_special_tokens false a completion's logprobs pieces are the text's (their offsets add up to
    it); by default a special token has no text, and its piece names its id (regression: always the id)."""
    bias = {"logit_bias": {str(BOS): 100}, "logprobs": 1}
    kept = _complete(bos_srv, max_tokens=3, skip_special_tokens=False, **bias)
    assert kept["logprobs"]["tokens"] == ["<s>"] * 3 and kept["logprobs"]["text_offset"] == [0, 3, 6]
    assert "".join(kept["logprobs"]["tokens"]) == kept["text"]
    assert _complete(bos_srv, max_tokens=3, **bias)["logprobs"]["tokens"] == [f"token_id:{BOS}"] * 3
