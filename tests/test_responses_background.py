"""Background responses (`background: true`, scheduler/responses_background.py) through the openai SDK and httpx:
answered "queued" at once and read by GET as they run, streamed and replayed from a sequence number, a client that
leaves changing nothing, cancel (its engine request aborted, its pages freed), DELETE of a running one,
previous_response_id of one not finished, the slot and metrics, --api-key, and the server's shutdown with one
running."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from scheduler.api_models import APIError
from scheduler.api_responses import ResponsesShape, parse_request
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.responses_background import BackgroundResponses
from scheduler.responses_output import ResponseOutput
from scheduler.responses_store import ResponsesStore, StoredResponse
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from test_responses_api import TEMPLATE
from test_responses_hunt import LONG, _idle, _open_stream
from test_responses_store import _missing, _user
from test_server import ServerThread, metric_samples
from tokenizer_files import write_byte_tokenizer

EVENT = TypeAdapter(ResponseStreamEvent)
KEY = "sekret"


def _server(tmp_path_factory, **limits) -> ServerThread:
    """test_responses_hunt's server (greedy, LONG's answer has no end of text within it), its engine on `engine`."""
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), added=("<think>", "</think>"),
                                config={"chat_template": TEMPLATE})
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=2048))
    limits = ServerLimits(shutdown_grace_s=1.0, tool_call_parser="hermes", reasoning_parser="qwen3", **limits)
    s = ServerThread(create_app(engine, limits, tokenizer=HFTokenizer(str(path))))
    s.engine = engine
    return s


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with _server(tmp_path_factory) as s:
        yield s


def _post(srv, **body) -> httpx.Response:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "temperature": 0, **body}
    return httpx.post(srv.url + "/v1/responses", json=body, timeout=60)


def _ok(srv, **body) -> dict:
    r = _post(srv, **body)
    assert r.status_code == 200, r.text
    return r.json()


def _ended(client, rid: str, seen: set | None = None):
    """The response once it ended (GET until its status is no longer queued or in_progress; those seen added)."""
    deadline = time.monotonic() + 60
    while (r := client.responses.retrieve(rid)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, r
        if seen is not None:
            seen.add(r.status)
        time.sleep(0.01)
    return r


def _streamed(url: str, method: str = "GET", **kw) -> list[dict]:
    with httpx.stream(method, url, timeout=60, **kw) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def _decoding(srv, rid: str) -> None:
    """Wait until the background response `rid` wrote a token (its events followed until a delta)."""
    with httpx.stream("GET", f"{srv.url}/v1/responses/{rid}", params={"stream": "true"}, timeout=60) as r:
        for line in r.iter_lines():
            if '"response.output_text.delta"' in line:
                return


def _aborted(srv) -> float:
    return metric_samples(srv.url).get(("hicache_requests_total", (("outcome", "aborted"),)), 0.0)


def test_a_background_response_is_answered_queued_and_read_by_get_as_it_runs(srv, client):
    """The POST's answer: the Response queued, background true, no output; GET while it runs: queued or in
    progress; once it ended, the answer a response served whole gives (greedy), its input items listed."""
    kw = dict(model="tiny", input="hello there", max_output_tokens=6, temperature=0)
    r = client.responses.create(**kw, background=True)
    assert r.status == "queued" and r.background is True and r.output == [] and r.usage is None
    seen: set = set()
    done = _ended(client, r.id, seen)
    assert seen <= {"queued", "in_progress"}
    whole = client.responses.create(**kw)
    assert whole.background is False
    assert done.status == "incomplete" and done.background is True and done.model_extra["store"] is True
    assert done.output_text == whole.output_text and done.usage.output_tokens == 6
    assert done.usage.input_tokens == whole.usage.input_tokens
    assert [i.content[0].text for i in client.responses.input_items.list(r.id)] == ["hello there"]
    assert _idle(srv)["server"]["in_flight"] == 0


def test_a_streamed_background_response_is_replayed_after_any_sequence_number(srv, client):
    """The POST's events as a stream's (the first two: the Response queued, `response.created` then
    `response.queued`, as OpenAI's), each of the SDK's types; GET ?stream=true sends them again, after
    `starting_after` where given; GET then reads the final Response."""
    events = _streamed(srv.url + "/v1/responses", "POST", json={
        "model": "tiny", "input": "hello", "max_output_tokens": 5, "temperature": 0, "stream": True,
        "background": True})
    for e in events:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert types[-1] == "response.incomplete" and "response.queued" not in types[3:]
    assert [e["response"]["status"] for e in events[:3]] == ["queued", "queued", "in_progress"]
    assert all(e["response"]["background"] for e in events if "response" in e)
    rid = events[0]["response"]["id"]
    url = f"{srv.url}/v1/responses/{rid}"
    assert _streamed(url, params={"stream": "true"}) == events
    assert _streamed(url, params={"stream": "true", "starting_after": 3}) == events[4:]
    assert _streamed(url, params={"stream": "true", "starting_after": len(events) + 5}) == []
    with client.responses.retrieve(rid, stream=True, starting_after=len(events) - 2) as stream:
        [last] = list(stream)
    assert last.type == "response.incomplete" and last.sequence_number == len(events) - 1
    assert httpx.get(url, timeout=30).json() == events[-1]["response"]
    bad = httpx.get(url, params={"stream": "true", "starting_after": -2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_does_not_end_its_background_response(srv, client, stream):
    """Its run is not the request's: it goes on to its end (a client leaving aborts a response that is not
    background: tests/test_responses_hunt.py)."""
    before = _idle(srv)["engine"]
    rid = f"left-bg-{stream}"

    async def scenario():
        reader, writer = await _open_stream(srv.url, {"input": "go", "max_output_tokens": 40, "temperature": 0,
                                                      "stream": stream, "background": True, "request_id": rid})
        seen = b""
        while b"response.output_text.delta" not in seen and b'"queued"' not in seen:
            seen += await reader.read(65536)
        writer.close()
    asyncio.run(scenario())
    done = _ended(client, rid)
    assert done.status == "incomplete" and done.usage.output_tokens == 40
    assert _idle(srv)["engine"]["aborted"] == before["aborted"]


def test_cancel_aborts_a_running_background_response_and_frees_its_pages(srv, client):
    """It holds its slot once answered; cancelled, its engine request is aborted (counted so), its pages freed, its
    slot released; it says cancelled (GET too), and cancelling it again answers it as it is. Its events so far are
    replayed, and the stream ends."""
    before, aborted = _idle(srv), _aborted(srv)
    r = client.responses.create(**LONG, model="tiny", background=True)
    assert httpx.get(srv.url + "/hicache/status").json()["server"]["in_flight"] == 1
    _decoding(srv, r.id)
    assert client.responses.retrieve(r.id).status == "in_progress"
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.background is True and cancelled.id == r.id
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id) == cancelled
    after = _idle(srv)
    assert after["engine"]["aborted"] - before["engine"]["aborted"] == 1 and _aborted(srv) == aborted + 1
    assert metric_samples(srv.url)[("hicache_requests_in_flight", ())] == 0
    srv.call(srv.engine.check_integrity)
    events = _streamed(f"{srv.url}/v1/responses/{r.id}", params={"stream": "true"})
    assert events[0]["type"] == "response.created" and "response.output_text.delta" in {e["type"] for e in events}
    follow = _post(srv, input="next", previous_response_id=r.id)  # (cancelled: no conversation to follow)
    assert follow.status_code == 400 and follow.json()["error"]["param"] == "previous_response_id", follow.text


def test_delete_of_a_running_background_response_cancels_it(srv, client):
    before = _idle(srv)["engine"]
    r = client.responses.create(**LONG, model="tiny", background=True)
    _decoding(srv, r.id)
    deleted = httpx.delete(f"{srv.url}/v1/responses/{r.id}", timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    _missing(httpx.get(f"{srv.url}/v1/responses/{r.id}", timeout=30), r.id)
    assert _idle(srv)["engine"]["aborted"] - before["aborted"] == 1
    srv.call(srv.engine.check_integrity)


def test_previous_response_id_of_a_background_response_not_finished_is_a_400(srv, client):
    """Running, it has no conversation yet (a 400 naming previous_response_id); once finished it is followed as
    any kept response."""
    r = client.responses.create(**LONG, model="tiny", background=True)
    early = _post(srv, input="next", previous_response_id=r.id)
    assert early.status_code == 400 and early.json()["error"]["param"] == "previous_response_id", early.text
    assert "not finished" in early.json()["error"]["message"]
    client.responses.cancel(r.id)
    short = client.responses.create(model="tiny", input="hello there", max_output_tokens=4, temperature=0,
                                    background=True)
    done = _ended(client, short.id)
    follow = _ok(srv, input="next", previous_response_id=short.id)
    whole = _ok(srv, input=[_user("hello there"), *[o.model_dump(exclude_none=True) for o in done.output],
                            _user("next")], store=False)
    assert follow["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert follow["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]


def test_cancel_of_a_response_not_background_is_a_400_and_of_an_unknown_one_a_404(srv, client):
    """vLLM's 400 (and GET ?stream=true of it: a 400 naming stream); a finished background response, its id holding
    "/" (routed before GET's and DELETE's), answered as it is."""
    plain = _ok(srv)
    r = httpx.post(f"{srv.url}/v1/responses/{plain['id']}/cancel", timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "Cannot cancel a synchronous response."
    assert r.json()["error"]["param"] == "response_id"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain["id"])
    _missing(httpx.post(f"{srv.url}/v1/responses/resp_nope/cancel", timeout=30), "resp_nope")
    bad = httpx.get(f"{srv.url}/v1/responses/{plain['id']}", params={"stream": "true"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream", bad.text
    client.responses.create(model="tiny", input="hi", max_output_tokens=2, background=True,
                            extra_body={"request_id": "team/bg"})
    done = _ended(client, "team/bg")
    assert client.responses.cancel("team/bg") == done and done.status == "incomplete"


def test_background_needs_the_response_kept(srv):
    """`store` false, or a server that keeps no responses (--responses-store-max 0): a 400 naming background."""
    r = _post(srv, background=True, store=False)
    assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text
    assert "store" in r.json()["error"]["message"]
    with pytest.raises(APIError) as err:
        ResponsesShape(ResponsesStore(0)).chat_body({"input": "x", "background": True})
    assert err.value.status == 400 and err.value.param == "background"
    assert _idle(srv)["server"]["in_flight"] == 0


def test_the_api_key_guards_cancel_and_shutdown_ends_a_running_background_response(tmp_path_factory):
    """--api-key: cancel and GET ?stream=true need it. At shutdown a background response still running has the
    engine's grace, then ends (aborted: failed), its task done and its slot released."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with _server(tmp_path_factory, api_key=KEY) as s:
        body = {"model": "tiny", **LONG, "background": True}
        r = httpx.post(s.url + "/v1/responses", json=body, headers=auth, timeout=60).json()
        url = f"{s.url}/v1/responses/{r['id']}"
        assert httpx.post(url + "/cancel", timeout=30).status_code == 401
        assert httpx.get(url, params={"stream": "true"}, timeout=30).status_code == 401
        short = httpx.post(s.url + "/v1/responses", json={**body, "max_output_tokens": 1, "request_id": "short"},
                           headers=auth, timeout=60).json()
        with openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            assert _ended(c, short["id"]).status == "incomplete"
            assert c.responses.cancel(short["id"]).status == "incomplete"
        st = s.app.state.hc
        run = s.call(st.responses.run, r["id"])
        assert not run.finished
    assert run.finished and run.task.done() and not st.background.running
    assert run.response["status"] in ("failed", "incomplete") and st.in_flight == 0
    assert st.metrics.in_flight._value.get() == 0


# -- without a server -------------------------------------------------------------------------------------
class _Slot:
    released = 0

    def release(self) -> None:
        self.released += 1


class _FailingChoices:
    rid, created, model = "chatcmpl-bg", 1, "tiny"
    gens = [SimpleNamespace(req=SimpleNamespace(params=SimpleNamespace(temperature=0.0, top_p=1.0)))]
    closed = False

    async def sse(self):
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': 'Hi'}, 'finish_reason': None}]})}\n\n"
        error = {"message": "boom", "type": "server_error", "param": None, "code": "x"}
        yield f"data: {json.dumps({'error': error})}\n\n"

    async def close(self) -> None:
        self.closed = True

    def usage_body(self) -> dict:  # (Choices.usage_body's shape: one prompt token, one answered)
        return {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_failed_background_response_is_kept_failed_and_cannot_be_followed():
    """Kept failed, as one that is not background is (tests/test_responses_failed_s71.py): GET reports this one,
    its error set; previous_response_id of it is a 400; its slot is released and its choices closed."""
    store, slot, choices = ResponsesStore(4), _Slot(), _FailingChoices()
    req = parse_request({"input": "hi", "background": True})
    out = ResponseOutput(choices, req, store.keeper(req, None))

    async def scenario():
        background = BackgroundResponses(store)
        answer = background.start(out, slot, stream=False)
        assert json.loads(answer.body)["status"] == "queued" and store.response(out.id)["status"] == "queued"
        run = store.run(out.id)
        await run.task
        return run, [e async for e in run.follow(1)]

    run, replayed = asyncio.run(scenario())
    failed = store.response(out.id)
    assert failed["status"] == "failed" and failed["error"]["message"] == "boom" and failed["background"] is True
    assert failed["output"][0]["content"][0]["text"] == "Hi" and run.events[-1]["response"] == failed
    assert replayed == run.events[2:] and slot.released == 1 and choices.closed and run.out is None
    with pytest.raises(APIError) as err:
        store.prior(out.id)
    assert err.value.status == 400 and err.value.param == "previous_response_id"


class _HangingChoices(_FailingChoices):
    async def sse(self):
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': 'Hi'}, 'finish_reason': None}]})}\n\n"
        await asyncio.Event().wait()


@pytest.mark.parametrize("at_once", [True, False], ids=["before-its-first-step", "running"])
def test_close_cancels_the_runs_still_going_and_awaits_them(at_once):
    """The shutdown's last step (after the engine's, whose aborts end the runs reading its requests): a run still
    going is cancelled, its choices closed and its slot released; one cancelled before its task's first step too
    (a task cancelled then never runs its cleanup)."""
    store, slot, choices = ResponsesStore(4), _Slot(), _HangingChoices()
    req = parse_request({"input": "hi", "background": True})
    out = ResponseOutput(choices, req, store.keeper(req, None))

    async def scenario():
        background = BackgroundResponses(store)
        background.start(out, slot, stream=True)
        run = store.run(out.id)
        if at_once:  # (cancel() itself, in this step: close() runs it as a task, after the run's first step)
            async with asyncio.timeout(10):  # (not wait_for: its task would run after the run's first step)
                await run.cancel()
        for _ in range(100):  # (created, in_progress, a message added, its part, its delta)
            if len(run.events) < 5 and not run.finished:
                await asyncio.sleep(0)
        await asyncio.wait_for(background.close(), timeout=10)
        return run, background

    run, background = asyncio.run(scenario())
    assert run.task.done() and run.finished and not background.running and slot.released == 1 and choices.closed
    assert store.response(out.id)["status"] == "cancelled"
    # its stream ends: each item it added is done (the message it was writing "incomplete"), then the cancelled
    # Response, numbered on
    last = run.events[-1]
    assert last["type"] == "response.cancelled" and last["response"] == run.response == store.response(out.id)
    assert [e["sequence_number"] for e in run.events] == list(range(len(run.events)))
    added = [e["item"]["id"] for e in run.events if e["type"] == "response.output_item.added"]
    assert added == [e["item"]["id"] for e in run.events if e["type"] == "response.output_item.done"]
    assert [item["id"] for item in run.response["output"]] == added
    for message in run.response["output"]:
        assert message["status"] == "incomplete" and message["content"][0]["text"] == "Hi"
    if not at_once:
        assert added


def test_the_store_drops_no_running_background_response_and_drops_a_finished_one_s_events_with_it():
    store = ResponsesStore(max_responses=1)
    running = SimpleNamespace(id="bg", finished=False, events=[], response={"id": "bg", "status": "in_progress"})
    store.put(StoredResponse(running.response, (), ()), running)
    store.put(StoredResponse({"id": "a", "status": "completed"}, (), ()))
    assert "bg" in store and "a" in store and store.run("bg") is running  # (over the bound: one is running)
    store.put(StoredResponse({"id": "b", "status": "completed"}, (), ()))
    assert "a" not in store and "bg" in store and store.response("bg")["status"] == "in_progress"
    running.finished = True
    store.put(StoredResponse({"id": "c", "status": "completed"}, (), ()))
    assert len(store) == 1 and "c" in store and not store._runs
