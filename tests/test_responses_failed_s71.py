"""Session 71: a Responses API response that FAILS server-side (the engine failed its request: `Engine.fail_own_work`
for a raise in its own step work; or a bug in the server's rendering) with `store` true, not background. It was not
kept: GET /v1/responses/{id} answered 404 (and input_items, DELETE), while a failed background response was kept
failed. OpenAI keeps a failed response: GET gives it `status: "failed"` with its `error` ({code, message}), its
input_items are listed, DELETE drops it, and a follow-up naming it as previous_response_id is a 400 (a failed
response cannot be continued; the same 400 as for a failed background response). Streamed and whole answer the same:
GET gives what the client saw last (the stream's `response.failed` Response; for a whole response, a failed Response
of its 500's message, with no output). `store: false` keeps nothing, failed or not; one whose client went away is not
kept (tests/test_responses_store_hunt.py pins that). The server is driven in-process through its ASGI app
(tests/test_raise_http_s69.py's `serving`: the real engine on the tiny preset, CPU; its exit checks integrity)."""
from __future__ import annotations

import json

import httpx
import pytest

from scheduler.responses_output import OutputItems
from test_raise_api2_s71 import _answer
from test_raise_api_s70 import sse_events
from test_raise_extras_s71 import patch
from test_raise_http_s69 import RESPONSE, ASGICall, a_later_request_is_served, serving

HANG_GUARD_S = 20  # a request with no answer by then would wait forever
LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}


def engine_fails_it(monkeypatch, eng):
    """Reading the step's logprobs raises for every row that asks them: the engine fails the request alone
    (`fail_own_work`), its error naming what raised; -> the words the client's error carries, and the undo."""
    return "reading this request's logprobs", patch(
        monkeypatch, eng.runner, "logprobs_of", lambda handle, wants: wants is not None
        and any(w is not None for w in wants))


def rendering_raises(monkeypatch, eng):
    """Making the Response's output items raises (a bug in the server's rendering, whole or streamed)."""
    return "injected: feed raised", patch(monkeypatch, OutputItems, "feed", lambda *args: True)


FAULTS = {"engine": engine_fails_it, "rendering": rendering_raises}


async def post_failing(app, body: dict, stream: bool) -> tuple[str, dict]:
    """POST `body`, which fails server-side: -> the error's message, and the Response (or 500 body) the client saw
    last."""
    call = ASGICall(app, "/v1/responses", {**body, "stream": stream})
    status = await call.answer()
    if not stream:
        assert status == 500, status
        error = _answer(call)["error"]
        return error["message"], _answer(call)
    assert status == 200, status
    events = sse_events(call)
    last_name, last = events[-1]
    assert last_name == "response.failed", events[-3:]
    failed = json.loads(last)["response"]
    assert failed["status"] == "failed"
    return failed["error"]["message"], failed


def client(app) -> httpx.AsyncClient:
    """Requests to the app itself (its lifespan already entered by `serving`)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hicache", timeout=HANG_GUARD_S)


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_failed_response_is_kept_failed_with_its_error(monkeypatch, fault, stream):
    """GET gives the failed Response (its error the one the client got), input_items lists its input, a follow-up
    naming it is a 400 naming previous_response_id, DELETE drops it; nothing is left held. Was: a 404 for each."""
    rid = f"failing-{fault}-{stream}"
    async with serving(monkeypatch) as (app, st, eng, queued):
        says, undo = FAULTS[fault](monkeypatch, eng)
        message, seen = await post_failing(app, {**RESPONSE, **LOGPROBS, "request_id": rid}, stream)
        assert says in message, message
        assert st.in_flight == 0 and not eng.requests
        undo()  # (the follow-up and the requests after are served as any)
        async with client(app) as http:
            got = await http.get(f"/v1/responses/{rid}")
            assert got.status_code == 200, f"the failed response was not kept: {got.text}"
            kept = got.json()
            assert kept["id"] == rid and kept["status"] == "failed" and kept["store"] is True
            assert kept["error"] == {"code": "server_error", "message": message}
            if stream:
                assert kept == seen, "GET differs from the stream's response.failed Response"
            else:
                assert kept["output"] == [] and kept["background"] is False
            items = (await http.get(f"/v1/responses/{rid}/input_items")).json()
            assert [(i["type"], i["role"], i["content"]) for i in items["data"]] == \
                [("message", "user", [{"type": "input_text", "text": "hi"}])]
            follow_up = await http.post("/v1/responses", json={**RESPONSE, "previous_response_id": rid})
            assert follow_up.status_code == 400, follow_up.text
            assert follow_up.json()["error"]["param"] == "previous_response_id"
            assert "failed" in follow_up.json()["error"]["message"]
            deleted = await http.delete(f"/v1/responses/{rid}")
            assert deleted.status_code == 200 and deleted.json() == {"id": rid, "object": "response.deleted",
                                                                      "deleted": True}
            assert (await http.get(f"/v1/responses/{rid}")).status_code == 404
        assert st.in_flight == 0 and rid not in st.responses and not st.background.running
        await a_later_request_is_served(app)


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_failed_response_with_store_false_is_not_kept(monkeypatch, stream):
    """`store: false` keeps nothing, failed or not: GET is a 404, as a follow-up naming it (previous_response_id)."""
    rid = f"unkept-{stream}"
    async with serving(monkeypatch) as (app, st, eng, queued):
        _, undo = engine_fails_it(monkeypatch, eng)
        _, seen = await post_failing(app, {**RESPONSE, **LOGPROBS, "request_id": rid, "store": False}, stream)
        assert stream is False or seen["store"] is False
        undo()
        async with client(app) as http:
            assert (await http.get(f"/v1/responses/{rid}")).status_code == 404
            follow_up = await http.post("/v1/responses", json={**RESPONSE, "previous_response_id": rid})
            assert follow_up.status_code == 404 and follow_up.json()["error"]["param"] == "previous_response_id"
        assert len(st.responses) == 0 and st.in_flight == 0 and not eng.requests


@pytest.mark.asyncio
async def test_a_failed_response_whose_keeping_raises_still_answers_its_failure(monkeypatch):
    """Keeping the failed Response raises (the store's `put`): the client still gets its 500 with the engine's error
    (not the keep's), nothing is kept, nothing is left held."""
    async with serving(monkeypatch) as (app, st, eng, queued):
        says, undo_engine = engine_fails_it(monkeypatch, eng)
        undo_put = patch(monkeypatch, st.responses, "put", lambda *args: True)
        message, _ = await post_failing(app, {**RESPONSE, **LOGPROBS, "request_id": "unkeepable"}, stream=False)
        assert says in message and "put raised" not in message
        undo_engine()
        undo_put()
        assert "unkeepable" not in st.responses and st.in_flight == 0 and not eng.requests
        await a_later_request_is_served(app)
