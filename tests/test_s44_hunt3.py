"""Hunt (request ids, the Responses API's logprobs)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from hicache_helpers import capture_op_logs
from scheduler.api_auth import CORSSettings
from scheduler.api_responses import parse_request
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.responses_output import ResponseOutput
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
import test_request_ids
from server_fixtures import ok, sse
from test_request_ids import CHAT, COMPLETION
from test_server import ServerThread
from test_tool_calls import CALL, TEMPLATE, WEATHER, _regex
from tokenizer_files import write_byte_tokenizer

INCLUDE = ["message.output_text.logprobs"]
srv = test_request_ids.srv  # (its server: the tiny engine behind the byte-level tokenizer)


@pytest.fixture(scope="module")
def tools_srv(tmp_path_factory):
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), config={"chat_template": TEMPLATE})
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=2048))
    limits = ServerLimits(shutdown_grace_s=1.0, tool_call_parser="hermes", enable_request_id_headers=True,
                          api_key="k", max_body_bytes=10_000, cors=CORSSettings(allowed_origins=("http://a.test",)))
    with ServerThread(create_app(engine, limits, tokenizer=HFTokenizer(str(path)))) as s:
        yield s


def _replay(chat_whole: dict, chat_lines: list[str], body: dict):
    """A recorded chat answer (whole and streamed) rendered as a Response by ResponseOutput."""
    class Recorded:
        rid, created, model, parses = "chatcmpl-abc", 1, "tiny", False
        gens = [SimpleNamespace(req=SimpleNamespace(params=SimpleNamespace(temperature=0.0, top_p=1.0)))]

        def reasoning_counter(self, gen):  # (no --reasoning-parser)
            return None

        def usage_body(self):
            return chat_whole["usage"]

        async def body(self, request):
            return chat_whole

        async def sse(self):
            for line in chat_lines:
                yield line + "\n\n"

        async def close(self):
            pass

    req = parse_request(body)

    async def run():
        whole = json.loads((await ResponseOutput(Recorded(), req).complete(None)).body)
        events = [json.loads(b.split("\ndata: ")[1]) async for b in ResponseOutput(Recorded(), req).sse()]
        return whole, events

    return asyncio.run(run())


def _chat_both(s, **body):
    h = {"Authorization": "Bearer k"}
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 120, "temperature": 0, **body}
    whole = httpx.post(s.url + "/v1/chat/completions", json=base, headers=h, timeout=60).json()
    with httpx.stream("POST", s.url + "/v1/chat/completions", json={**base, "stream": True}, headers=h,
                      timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    return whole, lines


# -- the Responses API's logprobs with a tool call (the hermes parser's real chunks, replayed) -------------------
def _text_and_tokens(r: dict, events: list[dict]) -> tuple[str, str, str, str]:
    """(the whole text, its logprobs' tokens joined, the streamed text, the deltas' tokens joined)."""
    parts = [p for it in r["output"] if it["type"] == "message" for p in it["content"]]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    return ("".join(p["text"] for p in parts), "".join(e["token"] for p in parts for e in p["logprobs"]),
            "".join(d["delta"] for d in deltas), "".join(e["token"] for d in deltas for e in d["logprobs"]))


def test_text_before_a_call_carries_its_own_tokens_whole_and_streamed(tools_srv):
    whole, lines = _chat_both(tools_srv, tools=[WEATHER], guided_regex=_regex("Let me look.\n" + CALL),
                              logprobs=True, top_logprobs=1)
    r, events = _replay(whole, lines, {"input": "hi", "include": INCLUDE})
    assert _text_and_tokens(r, events) == ("Let me look.", "Let me look.", "Let me look.", "Let me look.")


@pytest.mark.parametrize("wanted, text, covered", [(CALL + "\nok", "ok", "\nok"),
                                                    ("Hi " + CALL + " more", "Hi more", "Hi more")])
def test_a_whole_answer_s_text_never_takes_a_call_s_tokens(tools_srv, wanted, text, covered):
    """Regression: a whole answer's text took the first tokens that fit its length, the call's markup among them
    ("ok" after a call carried the logprobs of "<t"); the text before the first call is covered, and since session 45
    the text after it too, with the whitespace the call parser drops after a call (responses_logprobs.py)."""
    whole, lines = _chat_both(tools_srv, tools=[WEATHER], guided_regex=_regex(wanted), logprobs=True,
                              top_logprobs=1)
    r, _ = _replay(whole, lines, {"input": "hi", "include": INCLUDE})
    assert _text_and_tokens(r, [])[:2] == (text, covered)


# -- request ids -------------------------------------------------------------------------------------------
ODD = 'a/b%2F"c\\d<e>' + "~" * 243  # (JSON's and a path's specials; 256 characters)


def test_an_id_of_odd_characters_and_the_longest_length_round_trips_in_json_and_sse(srv):
    assert len(ODD) == 256
    assert ok(srv, "/v1/chat/completions", {**CHAT, "request_id": ODD})["id"] == "chatcmpl-" + ODD
    chunks = sse(srv, "/v1/completions", {**COMPLETION, "request_id": ODD})
    assert {c["id"] for c in chunks} == {"cmpl-" + ODD}
    with httpx.stream("POST", srv.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, "stream": True,
                      "request_id": ODD}, timeout=60) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[0]["response"]["id"] == ODD and events[-1]["response"]["id"] == ODD


def test_every_chunk_of_a_batch_with_n_carries_the_response_id(srv):
    with capture_op_logs() as logs:
        chunks = sse(srv, "/v1/completions", {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 2, "request_id": "bn"})
    assert {c["id"] for c in chunks} == {"cmpl-bn"} and {c["choices"][0]["index"] for c in chunks} == {0, 1, 2, 3}
    # its four requests' events, each rid the response id's (the module's server may still end an earlier test's
    # request meanwhile, whose events come too: a random order found it, seed 6918); one without it would be missing
    rids = {e["rid"] for e in logs if e.get("event") == "request" and str(e.get("rid", "")).startswith("cmpl-bn-")}
    assert len(rids) == 4


def test_a_refused_batch_logs_no_request_and_queues_none(srv):
    """A batch whose second prompt the engine refuses: every prompt is checked before one is queued."""
    with capture_op_logs() as logs:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": ["ab", [10**7]], "max_tokens": 2,
                                                          "request_id": "rf"}, timeout=60)
    assert r.status_code == 400, r.text
    # (its own requests' events, cmpl-rf-...: the module's server may still end an earlier test's request meanwhile,
    # as a random order found)
    assert not [e for e in logs if e.get("event") == "request" and str(e.get("rid", "")).startswith("cmpl-rf-")]


@pytest.mark.parametrize("method, path, body", [("POST", "/v1/completions", None),  # (401: no key)
                                                ("GET", "/nowhere", None),  # (404)
                                                ("POST", "/v1/completions", "x" * 20_000)])  # (413, with a key)
def test_every_error_response_carries_the_header(tools_srv, method, path, body):
    headers = {"X-Request-Id": "err-1", **({"Authorization": "Bearer k"} if body else {})}
    r = httpx.request(method, tools_srv.url + path, content=body, headers=headers, timeout=60)
    assert r.status_code in (401, 404, 413) and r.headers["x-request-id"] == "err-1"
    r = httpx.request(method, tools_srv.url + path, content=body, headers={k: v for k, v in headers.items()
                                                                             if k != "X-Request-Id"}, timeout=60)
    assert r.status_code >= 400 and len(r.headers["x-request-id"]) == 32  # (a fresh uuid)


def test_a_cors_preflight_and_a_streamed_response_carry_it(tools_srv):
    r = httpx.options(tools_srv.url + "/v1/chat/completions", headers={
        "Origin": "http://a.test", "Access-Control-Request-Method": "POST", "X-Request-Id": "pf-1"}, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://a.test"
    assert r.headers["x-request-id"] == "pf-1"
    body = {"input": "hi", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", tools_srv.url + "/v1/responses", json=body, timeout=60,
                      headers={"Authorization": "Bearer k", "X-Request-Id": "h-1"}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "h-1"  # (echoed as vLLM's middleware does)
        first = json.loads(next(ln for ln in r.iter_lines() if ln.startswith("data: "))[6:])
    assert first["response"]["id"] != "h-1"  # (a Response is named by its body alone, as vLLM's)


def test_a_latin1_header_is_a_400_echoed_byte_for_byte(tools_srv):
    r = httpx.post(tools_srv.url + "/v1/completions", json=COMPLETION, timeout=60,
                   headers=[(b"Authorization", b"Bearer k"), (b"X-Request-Id", b"caf\xe9")])
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    assert r.headers.raw and dict(r.headers.raw)[b"x-request-id"] == b"caf\xe9"


# -- the Responses API's logprobs of a plain answer ------------------------------------------------------------
@pytest.mark.parametrize("top", [0, 20])
def test_a_cut_answer_s_tokens_spell_its_text_once_whole_and_streamed(srv, top):
    """An answer max_output_tokens cut: one entry per output token, whole and streamed, none lost or repeated
    between deltas (the tiny model samples ids past the byte-level tokenizer's: "token_id:N" pieces of no text,
    so the pieces are compared with the stream's, not the text); `include` naming the item twice asks once."""
    body = {"input": "hi", "max_output_tokens": 7, "temperature": 0, "include": INCLUDE * 2, "top_logprobs": top}
    whole = ok(srv, "/v1/responses", body)
    with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "stream": True,
                      "stream_options": {"include_obfuscation": False}}, timeout=60) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
    text, tokens, streamed, streamed_tokens = _text_and_tokens(whole, events)
    assert whole["status"] == "incomplete" and whole["usage"]["output_tokens"] == 7
    assert text == streamed and tokens == streamed_tokens and len(whole["output"][0]["content"][0]["logprobs"]) == 7
    assert all(len(e["top_logprobs"]) == top for e in whole["output"][0]["content"][0]["logprobs"])
    assert events[-1]["type"] == "response.incomplete"
