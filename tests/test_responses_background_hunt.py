"""A bug hunt of background responses (scheduler/responses_background.py) against OpenAI's docs, the openai SDK and
vLLM's serving_responses: tool calls, reasoning, logprobs and json_schema run in the background; refused requests
that leave nothing behind; --max-concurrent-requests held by runs; cancel racing the end; replays past the end; two
followers; a follower that leaves; previous_response_id chains; --responses-store-max 1; the API key on every route;
shutdown while a follower streams. Each scenario ends with the cache's integrity checked and no engine request
left."""
from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from types import AsyncGeneratorType, SimpleNamespace

import httpx
import openai
import pytest

from scheduler.api_responses import parse_request
from scheduler.responses_background import BackgroundResponses, BackgroundRun
from scheduler.responses_output import ResponseOutput
from scheduler.responses_store import ResponsesStore
from test_responses_api import CLOCK, WEATHER
from test_responses_background import KEY, _ended, _server, _streamed
from test_responses_hunt import LONG, NAMED, _idle, _open_stream, check_events
from test_server import metric_samples

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with _server(tmp_path_factory, max_concurrent_requests=2) as s:
        yield s


def _post(srv, **body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/responses", json={"model": "tiny", "temperature": 0, **body}, timeout=60)


def _clean(srv) -> dict:
    """Nothing left: no slot held (the gauge too), no run going, no engine request not done, the cache whole."""
    status = _idle(srv)
    st = srv.app.state.hc

    def check():
        srv.engine.check_integrity()
        assert all(r.done() for r in srv.engine.requests.values()), srv.engine.requests
        assert not st.background.running and st.in_flight == 0
    srv.call(check)
    assert metric_samples(srv.url)[("hicache_requests_in_flight", ())] == 0
    return status


def _final(events: list[dict]) -> dict:
    """check_events of a background stream (its first events' Response queued, not in_progress)."""
    assert events[0]["response"]["background"] is True and events[1]["type"] == "response.queued"
    return check_events(events)


def _strip(output: list[dict]) -> list[dict]:
    """Items but for their ids, logprobs to 3 places (a prompt served from the cache computes them a little apart)."""
    return json.loads(json.dumps([{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in output]),
                      parse_float=lambda x: round(float(x), 3))


BODIES = {
    "call": {"input": "weather?", "tools": [WEATHER, CLOCK], "tool_choice": NAMED, "max_output_tokens": 40},
    "required": {"input": "weather?", "tools": [WEATHER, CLOCK], "tool_choice": "required", "max_output_tokens": 60},
    "reasoning": {"input": "hi", "instructions": "think", "max_output_tokens": 5, "reasoning": {"effort": "low"}},
    "logprobs": {"input": "hello", "max_output_tokens": 6, "include": ["message.output_text.logprobs"],
                 "top_logprobs": 2},
    "json_schema": {"input": "json", "max_output_tokens": 30,
                    "text": {"format": {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}}},
}


@pytest.mark.parametrize("name", list(BODIES))
def test_a_background_response_renders_as_the_same_response_served_whole(srv, client, name):
    """Streamed and whole, a background response's events are the SDK's, its final Response (GET's, the replay's,
    the SDK's retrieve(stream=True)'s) that of the same request served in the foreground (greedy)."""
    body = BODIES[name]
    with httpx.stream("POST", srv.url + "/v1/responses", timeout=60,
                      json={"model": "tiny", "temperature": 0, **body, "stream": True, "background": True}) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    final = _final(events)
    rid = final["id"]
    assert final["background"] is True and final["store"] is True
    assert httpx.get(f"{srv.url}/v1/responses/{rid}", timeout=30).json() == final
    assert _streamed(f"{srv.url}/v1/responses/{rid}", params={"stream": "true"}) == events
    with client.responses.retrieve(rid, stream=True) as stream:
        sdk = list(stream)
    assert [e.sequence_number for e in sdk] == list(range(len(events))) and sdk[-1].response.id == rid
    with client.responses.stream(response_id=rid, starting_after=1) as resumed:  # (the SDK's resume)
        assert [e.sequence_number for e in resumed] == list(range(2, len(events)))
        if final["status"] == "completed":
            assert resumed.get_final_response().id == rid
    whole = _post(srv, **body).json()
    assert _strip(final["output"]) == _strip(whole["output"]) and final["status"] == whole["status"]
    queued = _post(srv, **body, background=True).json()
    assert queued["status"] == "queued"
    done = _ended(client, queued["id"])
    assert _strip(done.model_dump(exclude_none=True)["output"]) == _strip(whole["output"])
    after = [_post(srv, input="next", max_output_tokens=1, previous_response_id=i).json() for i in (rid, whole["id"])]
    assert after[0]["usage"]["input_tokens"] == after[1]["usage"]["input_tokens"], after  # (its conversation kept)
    if name == "logprobs":
        assert done.output[0].content[0].logprobs and len(done.output[0].content[0].logprobs[0].top_logprobs) == 2
    _clean(srv)


@pytest.mark.parametrize("body, status, param", [
    ({"bogus": 1}, 400, "bogus"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"max_output_tokens": 10 ** 7}, 400, "max_output_tokens"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"include": ["file_search_call.results"]}, 400, "include"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, 400, "text"),
    ({"previous_response_id": "resp_nope"}, 404, "previous_response_id"),
], ids=["unknown", "type", "max_tokens", "tool_choice", "include", "schema", "previous"])
def test_a_refused_background_request_keeps_nothing_and_leaves_nothing_running(srv, body, status, param):
    st = srv.app.state.hc
    kept = srv.call(len, st.responses)
    r = _post(srv, input="hi", background=True, **body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert srv.call(len, st.responses) == kept
    _clean(srv)


def test_background_runs_hold_their_slots_until_they_end_or_are_cancelled(srv, client):
    """--max-concurrent-requests 2: two runs hold both (the gauge says 2), a third request is a 429 (background or
    not, nothing kept); a cancelled run frees its slot, and so does one that ends."""
    first = client.responses.create(model="tiny", **LONG, background=True)
    second = client.responses.create(model="tiny", **LONG, background=True)
    assert metric_samples(srv.url)[("hicache_requests_in_flight", ())] == 2
    kept = srv.call(len, srv.app.state.hc.responses)
    for background in (True, False):
        r = _post(srv, input="hi", max_output_tokens=2, background=background)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    assert srv.call(len, srv.app.state.hc.responses) == kept
    assert client.responses.cancel(first.id).status == "cancelled"
    assert metric_samples(srv.url)[("hicache_requests_in_flight", ())] == 1
    short = client.responses.create(model="tiny", input="hi", max_output_tokens=2, background=True)
    assert _ended(client, short.id).status == "incomplete"
    assert client.responses.cancel(second.id).status == "cancelled"
    _clean(srv)


def test_cancel_racing_the_end_agrees_with_get_and_the_events(srv, client):
    """Cancelled as it ends (after a few ms, or none): the cancel's answer, GET's and the events' are one status,
    completed / incomplete (its terminal event recorded) or cancelled (none recorded)."""
    for i in range(12):
        r = _post(srv, input=f"race {i}", max_output_tokens=2, background=True).json()
        if i % 3:
            threading.Event().wait(0.002 * i)
        cancelled = httpx.post(f"{srv.url}/v1/responses/{r['id']}/cancel", timeout=30).json()
        got = httpx.get(f"{srv.url}/v1/responses/{r['id']}", timeout=30).json()
        events = _streamed(f"{srv.url}/v1/responses/{r['id']}", params={"stream": "true"})
        terminal = [e for e in events if e["type"] in ("response.completed", "response.incomplete")]
        assert cancelled == got and got["status"] in ("incomplete", "cancelled")
        assert (terminal[-1]["response"] if terminal else {**got, "status": "cancelled"}) == got
    _clean(srv)


def test_a_finished_run_replayed_at_or_past_its_end_ends_at_once_and_an_unknown_one_is_a_404(srv, client):
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=3, background=True)
    _ended(client, r.id)
    url = f"{srv.url}/v1/responses/{r.id}"
    events = _streamed(url, params={"stream": "true"})
    last = events[-1]["sequence_number"]
    for after in (last, last + 1, 10 ** 6):
        assert _streamed(url, params={"stream": "true", "starting_after": after}) == []
    assert _streamed(url, params={"stream": "true", "starting_after": last - 1}) == events[-1:]
    missing = httpx.get(f"{srv.url}/v1/responses/resp_nope", params={"stream": "true"}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found", missing.text
    with pytest.raises(openai.NotFoundError):
        with client.responses.retrieve("resp_nope", stream=True) as stream:
            list(stream)
    _clean(srv)


def test_two_followers_at_once_each_get_every_event(srv, client):
    r = client.responses.create(model="tiny", input="go", max_output_tokens=60, temperature=0, background=True)
    url = f"{srv.url}/v1/responses/{r.id}"
    got: list = [None, None]

    def follow(i: int) -> None:
        got[i] = _streamed(url, params={"stream": "true"})
    threads = [threading.Thread(target=follow, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got[0] == got[1] and _final(got[0])["status"] == "incomplete"
    _clean(srv)


def _live_followers() -> int:
    """BackgroundRun.follow generators not finished (a follower's left suspended: a leak)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is AsyncGeneratorType
               and o.ag_code is BackgroundRun.follow.__code__ and o.ag_frame is not None)


def test_a_follower_that_leaves_ends_its_stream_not_the_run_and_leaks_nothing(srv, client):
    """A follower's client gone mid-stream: the run goes on to its end (no abort); no task and no follow generator
    is left on the server's loop."""
    before = _clean(srv)["engine"]
    tasks = srv.call(lambda: len(asyncio.all_tasks()))
    r = client.responses.create(model="tiny", input="go", max_output_tokens=80, temperature=0, background=True)

    async def leave() -> None:
        host, port = srv.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /v1/responses/{r.id}?stream=true HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        seen = b""
        while b"response.output_text.delta" not in seen:
            seen += await reader.read(65536)
        writer.close()
    asyncio.run(leave())
    done = _ended(client, r.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 80
    after = _clean(srv)["engine"]
    assert after["aborted"] == before["aborted"]
    assert srv.call(lambda: len(asyncio.all_tasks())) <= tasks
    assert srv.call(_live_followers) == 0


def test_previous_response_id_chains_through_finished_background_responses(srv, client):
    """Each follow-up, in the background too, is served its predecessor's prompt and answer from the prefix cache,
    and answers as the same chain in the foreground does."""
    kw = dict(model="tiny", max_output_tokens=5, temperature=0)
    chain, plain, previous, previous_plain = [], [], None, None
    for text in ("hello there", "and then", "finally"):
        r = client.responses.create(**kw, input=text, background=True, previous_response_id=previous)
        chain.append(_ended(client, r.id))
        plain.append(client.responses.create(**kw, input=text, previous_response_id=previous_plain))
        previous, previous_plain = r.id, plain[-1].id
    for r, p in zip(chain[1:], plain[1:]):
        assert r.usage.input_tokens_details.cached_tokens > 0
        assert r.output_text == p.output_text and r.usage.input_tokens == p.usage.input_tokens
    _clean(srv)


def test_a_request_id_naming_a_running_background_response_is_refused(srv, client):
    """(regression: a second request of the same request_id replaced the running background response in the store:
    the first run went on, holding its slot and its engine request, but no GET, cancel or DELETE could reach it, and
    DELETE of the id left it running.) The id is refused (vLLM refuses a request id already running) while the run
    goes on; once it ended, the id may be used again."""
    client.responses.create(model="tiny", **LONG, background=True, extra_body={"request_id": "twice"})
    for background in (True, False):
        again = _post(srv, input="hi", max_output_tokens=2, background=background, request_id="twice")
        assert again.status_code == 400 and again.json()["error"]["param"] == "request_id", again.text
    assert client.responses.retrieve("twice").max_output_tokens == LONG["max_output_tokens"]
    assert client.responses.cancel("twice").status == "cancelled"
    _clean(srv)
    assert _post(srv, input="hi", max_output_tokens=2, request_id="twice").status_code == 200
    _clean(srv)


# -- a server keeping one response, its API key asked -----------------------------------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    s = _server(tmp_path_factory, api_key=KEY, responses_store_max=1)
    with s:
        yield s


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_the_api_key_guards_every_background_route(small):
    r = httpx.post(small.url + "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2,
                                                      "background": True}, headers=AUTH, timeout=60).json()
    url = f"{small.url}/v1/responses/{r['id']}"
    for method, path, params in (("GET", "", {}), ("GET", "", {"stream": "true"}), ("POST", "/cancel", {}),
                                 ("DELETE", "", {}), ("GET", "/input_items", {}), ("HEAD", "", {})):
        assert httpx.request(method, url + path, params=params, timeout=30).status_code == 401, (method, path)
    with openai.OpenAI(base_url=small.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        assert _ended(c, r["id"]).status == "incomplete"
    _clean(small)


def test_the_store_bound_keeps_the_running_background_responses(small):
    """--responses-store-max 1: runs going are all kept (GET, follow, cancel find them); once they end, the last
    kept alone remains, the others' GET, stream and cancel 404s."""
    with openai.OpenAI(base_url=small.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        a = c.responses.create(model="tiny", **LONG, background=True)
        b = c.responses.create(model="tiny", **LONG, background=True)
        assert c.responses.retrieve(a.id).status in ("queued", "in_progress")
        assert c.responses.retrieve(b.id).status in ("queued", "in_progress")
        assert c.responses.cancel(a.id).status == "cancelled"
        assert c.responses.cancel(b.id).status == "cancelled"
        assert c.responses.retrieve(b.id).status == "cancelled"
        for path, method in (("", "GET"), ("/cancel", "POST")):
            gone = httpx.request(method, f"{small.url}/v1/responses/{a.id}{path}", headers=AUTH, timeout=30)
            assert gone.status_code == 404, (path, gone.text)
        gone = httpx.get(f"{small.url}/v1/responses/{a.id}", params={"stream": "true"}, headers=AUTH, timeout=30)
        assert gone.status_code == 404
        short = c.responses.create(model="tiny", input="hi", max_output_tokens=2, background=True)
        assert _ended(c, short.id).status == "incomplete"
        assert c.responses.retrieve(short.id).status == "incomplete"
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(b.id)
    _clean(small)


def test_delete_of_a_running_background_response_drops_no_other(small):
    """(regression: DELETE cancelled the run first, whose end kept it as the most recently used, dropping the
    least recently used response above the bound, and then deleted it: with --responses-store-max 1 the response
    kept while it ran was lost, and nothing was left kept.)"""
    with openai.OpenAI(base_url=small.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        running = c.responses.create(model="tiny", **LONG, background=True)
        kept = c.responses.create(model="tiny", input="hi", max_output_tokens=2)  # (over the bound: one runs)
        assert c.responses.delete(running.id) is None
        assert c.responses.retrieve(kept.id).id == kept.id
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(running.id)
    _clean(small)


def test_shutdown_while_a_follower_streams_ends_both(tmp_path_factory):
    """SIGTERM's path (begin_shutdown, then uvicorn's exit): the run reading the engine is ended within the grace,
    its follower's stream ends, the server stops; no run, task or slot left. (A server of its own: stopping the
    module's failed the tests that ran after it in another order.)"""
    small = _server(tmp_path_factory, api_key=KEY, responses_store_max=1).__enter__()
    st = small.app.state.hc
    r = httpx.post(small.url + "/v1/responses", json={"model": "tiny", **LONG, "background": True}, headers=AUTH,
                   timeout=60).json()
    got: list = []

    def follow() -> None:
        with httpx.stream("GET", f"{small.url}/v1/responses/{r['id']}", params={"stream": "true"}, headers=AUTH,
                          timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    got.append(json.loads(line[6:]))
    follower = threading.Thread(target=follow)
    follower.start()
    while not any(e["type"] == "response.output_text.delta" for e in got):
        threading.Event().wait(0.01)
    run = small.call(st.responses.run, r["id"])
    st.begin_shutdown()
    small.__exit__(None, None, None)
    follower.join(30)
    assert not follower.is_alive() and run.finished and not st.background.running and st.in_flight == 0
    assert got[-1]["type"] in ("response.failed", "response.incomplete") and run.response == got[-1]["response"]
    small.engine.check_integrity()


# -- without a server: cancel at every step of a run's end ------------------------------------------------------
class _Slot:
    released = 0

    def release(self) -> None:
        self.released += 1


class _EndingChoices:
    """A chat of two tokens' text, then its end: each chunk a step of the loop."""
    rid, created, model = "chatcmpl-race", 1, "tiny"
    gens = [SimpleNamespace(req=SimpleNamespace(params=SimpleNamespace(temperature=0.0, top_p=1.0)))]

    def __init__(self) -> None:
        self.closed = 0

    async def sse(self):
        for text, finish in (("Hi", None), (" there", None), ("", "stop")):
            await asyncio.sleep(0)
            chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
            yield f"data: {json.dumps(chunk)}\n\n"
        await asyncio.sleep(0)
        yield "data: [DONE]\n\n"

    def usage_body(self) -> dict:
        return {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 0}}

    async def close(self) -> None:
        self.closed += 1
        await asyncio.sleep(0)


def test_cancel_at_every_step_of_a_run_agrees_with_its_events_and_store():
    """Cancelled after k steps of the loop, for every k from before its first step to after its end: the cancel's
    answer is GET's and the recorded run's (completed with its terminal event, or cancelled without one), its
    slot released once, its choices closed."""
    statuses = set()
    for k in range(40):
        store, slot, choices = ResponsesStore(4), _Slot(), _EndingChoices()
        req = parse_request({"input": "hi", "background": True})
        out = ResponseOutput(choices, req, store.keeper(req, None))

        async def scenario():
            background = BackgroundResponses(store)
            background.start(out, slot, stream=False)
            for _ in range(k):
                await asyncio.sleep(0)
            answer = await background.cancel(out.id)
            await background.close()
            return answer, store.run(out.id), [e async for e in store.run(out.id).follow()]

        answer, run, events = asyncio.run(scenario())
        terminal = [e for e in events if e["type"] in ("response.completed", "response.incomplete")]
        assert answer == store.response(out.id) == run.response, k
        assert answer["status"] == ("completed" if terminal else "cancelled"), k
        if terminal:
            assert terminal[-1]["response"] == answer and events[-1] is terminal[-1]
        assert slot.released == 1 and choices.closed >= 1 and run.finished and run.task.done()
        statuses.add(answer["status"])
    assert statuses == {"completed", "cancelled"}


def test_a_streamed_background_post_left_at_once_still_runs_to_its_end(srv, client):
    """The client gone right after sending its body (OpenAI's forum: such a response stayed queued): the run
    goes on and ends, nothing aborted."""
    before = _clean(srv)["engine"]

    async def leave() -> None:
        reader, writer = await _open_stream(srv.url, {"input": "go", "max_output_tokens": 8, "temperature": 0,
                                                      "stream": True, "background": True, "request_id": "gone"})
        await writer.drain()
        writer.close()
    asyncio.run(leave())
    deadline = time.monotonic() + 30
    while srv.call(lambda: "gone" not in srv.app.state.hc.responses):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _ended(client, "gone").status == "incomplete"
    assert _clean(srv)["engine"]["aborted"] == before["aborted"]


class _CallingChoices(_EndingChoices):
    """Text, a hermes call read out of it, text after the call (the stream's second message), its end."""

    async def sse(self):
        call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        args = {"index": 0, "function": {"arguments": '{"unit": "c"}'}}
        for delta, finish in (({"content": "Let me look."}, None), ({"tool_calls": [call]}, None),
                              ({"tool_calls": [args]}, None), ({"content": " Done."}, None), ({}, "tool_calls")):
            await asyncio.sleep(0)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish}]})}\n\n"


def test_a_running_response_s_output_is_always_the_items_finished_so_far():
    """GET while it runs: its output the items done so far (a message, a call, the text after it), each a prefix of
    the final output; kept at its end with the conversation a follow-up reads (the call the assistant's)."""
    store, slot = ResponsesStore(4), _Slot()
    req = parse_request({"input": "weather?", "background": True, "tools": [WEATHER]})
    out = ResponseOutput(_CallingChoices(), req, store.keeper(req, None))
    seen = []

    async def scenario():
        BackgroundResponses(store).start(out, slot, stream=False)
        run = store.run(out.id)
        async for event in run.follow():
            seen.append((event["type"], store.response(out.id)))
        return run

    run = asyncio.run(scenario())
    final = run.response
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "message"]
    for kind, response in seen:
        assert response["output"] == final["output"][:len(response["output"])], kind
    assert {len(r["output"]) for _, r in seen} == {0, 1, 2, 3}
    [user, assistant] = store.conversation(out.id)
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"unit": "c"}'}
    assert assistant["content"] == [{"type": "text", "text": "Let me look. Done."}] and slot.released == 1
