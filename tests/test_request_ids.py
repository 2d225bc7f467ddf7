"""vLLM's request ids (scheduler/request_ids.py): the body's `request_id` and the X-Request-Id header name a
request's response (`cmpl-{id}`, `chatcmpl-{id}`, a Response's `{id}`) and its engine requests' rids, so the
structured logs (the timeline) carry the client's id; --enable-request-id-headers echoes X-Request-Id on
every response; GET|POST /ping answers as /health (SageMaker's check)."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from hicache_helpers import capture_op_logs
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from server_fixtures import byte_level_server, ok, post, sse, tiny_config
from test_server import ServerThread
from test_server_text import _write_byte_level_tokenizer

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "abc", "max_tokens": 2}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=64)) as s:
        yield s


@pytest.fixture(scope="module")
def echo_srv(tmp_path_factory):
    """A server started with --enable-request-id-headers."""
    path = tmp_path_factory.mktemp("tok")
    _write_byte_level_tokenizer(path)
    app = create_app(Engine(tiny_config()), ServerLimits(shutdown_grace_s=1.0, enable_request_id_headers=True),
                     tokenizer=HFTokenizer(str(path)))
    with ServerThread(app) as s:
        yield s


def engine_rids(logs: list[dict]) -> set[str]:
    return {e["rid"] for e in logs if e.get("event") == "request"}


# -- the body's request_id ------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, prefix", [("/v1/completions", COMPLETION, "cmpl"),
                                                 ("/v1/chat/completions", CHAT, "chatcmpl")])
def test_the_body_id_names_the_response_and_the_engine_logs(srv, path, body, prefix):
    with capture_op_logs() as logs:
        out = ok(srv, path, {**body, "request_id": "client-42"})
    assert out["id"] == f"{prefix}-client-42"  # (vLLM's form)
    [rid] = engine_rids(logs)  # one engine request, its whole timeline under the client's id
    assert rid.startswith(f"{prefix}-client-42-")
    states = [e["state"] for e in logs if e.get("event") == "request"]
    assert states[0] == "queued" and "finished" in states


def test_streamed_chunks_carry_the_id(srv):
    chunks = sse(srv, "/v1/chat/completions", {**CHAT, "request_id": "s-1"})
    assert chunks and {c["id"] for c in chunks} == {"chatcmpl-s-1"}


def test_without_an_id_the_response_id_is_a_fresh_one(srv):
    a, b = ok(srv, "/v1/completions", COMPLETION)["id"], ok(srv, "/v1/completions", COMPLETION)["id"]
    assert a.startswith("cmpl-") and b.startswith("cmpl-") and a != b


# -- the X-Request-Id header ----------------------------------------------------------------------------
def test_the_header_names_a_request_and_wins_over_the_body(srv):
    def call(body, header):
        r = httpx.post(srv.url + "/v1/completions", json=body, headers={"X-Request-Id": header}, timeout=60)
        assert r.status_code == 200, r.text
        return r

    with capture_op_logs() as logs:
        r = call(COMPLETION, "hdr-7")
    assert r.json()["id"] == "cmpl-hdr-7"
    assert all(rid.startswith("cmpl-hdr-7-") for rid in engine_rids(logs))
    # vLLM's precedence (_base_request_id(raw_request, request.request_id)): the header first
    assert call({**COMPLETION, "request_id": "body-1"}, "hdr-8").json()["id"] == "cmpl-hdr-8"
    assert "x-request-id" not in r.headers  # (echoed only with --enable-request-id-headers)


def test_the_header_is_echoed_only_with_the_flag(echo_srv):
    r = httpx.post(echo_srv.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "e-1"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "e-1"
    r = httpx.post(echo_srv.url + "/v1/completions", json={**COMPLETION, "request_id": "b-1"}, timeout=60)
    assert r.json()["id"] == "cmpl-b-1" and r.headers["x-request-id"] == "b-1"  # (the id the request ran under)
    r = httpx.post(echo_srv.url + "/v1/completions", json=COMPLETION, timeout=60)
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]
    with httpx.stream("POST", echo_srv.url + "/v1/completions", json={**COMPLETION, "stream": True},
                      headers={"X-Request-Id": "st-1"}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "st-1"
        assert json.loads(next(ln for ln in r.iter_lines() if ln.startswith("data: "))[6:])["id"] == "cmpl-st-1"
    for r in (httpx.get(echo_srv.url + "/health", timeout=10),  # (every response, as vLLM's middleware)
              httpx.post(echo_srv.url + "/v1/completions", json={"prompt": "a", "bogus": 1}, timeout=10)):
        assert r.headers["x-request-id"]
    assert httpx.get(echo_srv.url + "/v1/models", headers={"X-Request-Id": "m-1"}).headers["x-request-id"] == "m-1"


# -- bad ids --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["", "x" * 257, "a b", "tab\there", "é", "nul\x00", 7, ["a"]])
@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                                        ("/v1/responses", {"input": "hi", "max_output_tokens": 2})])
def test_a_bad_body_id_is_a_400_naming_it(srv, path, body, value):
    r = post(srv, path, {**body, "request_id": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "request_id"


@pytest.mark.parametrize("value", ["a b", "x" * 257, b"caf\xe9"])
def test_a_bad_header_id_is_a_400_naming_it(srv, value):
    r = httpx.post(srv.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": value}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "request_id" and "X-Request-Id" in err["message"]


def test_the_longest_id_is_taken(srv):
    assert ok(srv, "/v1/completions", {**COMPLETION, "request_id": "~" * 256})["id"] == "cmpl-" + "~" * 256


# -- duplicates, choices and batches --------------------------------------------------------------------
def test_two_requests_in_flight_with_one_id_both_run(srv):
    """vLLM (since its #27987) keeps a client's id as the response's and makes the engine's id unique with a
    random suffix: the same id twice in flight is served twice (the engine refuses a duplicate rid)."""
    done: list[dict] = []
    with capture_op_logs() as logs:
        with httpx.stream("POST", srv.url + "/v1/completions", json={**COMPLETION, "max_tokens": 32,
                          "ignore_eos": True, "stream": True, "request_id": "dup"}, timeout=60) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            assert next(ln for ln in lines if ln.startswith("data: "))  # the first is in flight now
            t = threading.Thread(target=lambda: done.append(ok(srv, "/v1/completions",
                                                                {**COMPLETION, "request_id": "dup"})))
            t.start()
            t.join(60)
            assert "data: [DONE]" in list(lines)
    assert done[0]["id"] == "cmpl-dup"
    rids = engine_rids(logs)
    assert len(rids) == 2 and all(rid.startswith("cmpl-dup-") for rid in rids)


def test_choices_and_batches_get_unique_engine_rids_under_the_client_id(srv):
    with capture_op_logs() as logs:
        out = ok(srv, "/v1/completions", {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 2, "request_id": "bat"})
        chat = ok(srv, "/v1/chat/completions", {**CHAT, "n": 2, "request_id": "cn"})
    assert out["id"] == "cmpl-bat" and len(out["choices"]) == 4 and chat["id"] == "chatcmpl-cn"
    rids = engine_rids(logs)
    assert len([r for r in rids if r.startswith("cmpl-bat-")]) == 4
    assert len([r for r in rids if r.startswith("chatcmpl-cn-")]) == 2 and len(rids) == 6


# -- the Responses API ----------------------------------------------------------------------------------
def test_a_responses_request_id_is_the_response_id(srv):
    """vLLM's ResponsesRequest.request_id is the Response's id as given (its default: resp_{uuid})."""
    with capture_op_logs() as logs:
        out = ok(srv, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "request_id": "resp_mine"})
    assert out["id"] == "resp_mine"
    [rid] = engine_rids(logs)
    assert "resp_mine" in rid
    assert ok(srv, "/v1/responses", {"input": "hi", "max_output_tokens": 2})["id"].startswith("resp_")


# -- /ping ----------------------------------------------------------------------------------------------
def test_ping_answers_as_health(srv):
    health = httpx.get(srv.url + "/health", timeout=10)
    for method in ("GET", "POST"):
        r = httpx.request(method, srv.url + "/ping", timeout=10)
        assert r.status_code == 200 and r.json() == health.json()
    assert httpx.head(srv.url + "/ping", timeout=10).status_code == 200


def test_the_flag_reaches_the_server(monkeypatch):
    import scheduler.serve as serve

    class Started(Exception):
        pass

    seen: list[ServerLimits] = []

    def create(_engine, limits, tokenizer=None):
        seen.append(limits)
        raise Started  # (no uvicorn)

    monkeypatch.setattr(serve, "create_app", create)
    for argv in (["--enable-request-id-headers"], []):
        with pytest.raises(Started):
            serve.main(["--port", "0", "--device", "cpu", "--model", "tiny", *argv])
    assert [limits.enable_request_id_headers for limits in seen] == [True, False]
