"""Session 64's mutation check of the Responses store and background runs (scheduler/responses_store.py,
scheduler/responses_background.py) and /tokenize (scheduler/api_tokenize.py): rules no test held."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from scheduler.api_models import APIError
from scheduler.api_responses import parse_request
from scheduler.responses_background import BackgroundResponses
from scheduler.responses_output import ResponseOutput
from scheduler.responses_store import ResponsesStore, StoredResponse, json_bytes
from test_tokenize_api import chat_srv  # noqa: F401 (its fixture)
from test_mutation_front_s56 import _store_with_items
from test_responses_background import _HangingChoices
from test_responses_background_hunt import _EndingChoices, _Slot


def _run(rid: str, status: str = "queued") -> SimpleNamespace:
    """A background run as the store sees one (BackgroundRun's id, finished, events and response)."""
    return SimpleNamespace(id=rid, finished=False, events=[], response={"id": rid, "status": status})


# ---------------------------------------------------------------- the store's bounds

def test_a_running_background_response_larger_than_the_bound_is_kept_until_it_ends():
    """A background response is kept from its start whatever its size (GET, cancel and its events find it while it
    runs); its final Response, ended larger than the whole bound, is not kept (its run dropped with it)."""
    store = ResponsesStore(max_responses=4, max_bytes=500)
    run = _run("bg")
    queued = {"id": "bg", "status": "queued", "input": "x" * 1000}
    store.put(StoredResponse(queued, (), ()), run)
    assert "bg" in store and store.run("bg") is run and store.running("bg")
    # its end, kept by the run before its task finished (BackgroundRun._kept): too large now, it goes
    store.put(StoredResponse({**queued, "status": "completed"}, (), ()), run)
    assert "bg" not in store and store.kept_bytes == 0 and not store.holds(run)


def test_a_background_response_s_events_count_against_the_bound():
    """A background response's bytes are its Response's, its input items', its conversation's and its run's events'
    (a replay serves every event): a finished run whose events alone exceed the bound is not kept."""
    store = ResponsesStore(max_responses=4, max_bytes=2000)
    run = _run("bg")
    run.events = [{"type": "response.output_text.delta", "delta": "y" * 300, "sequence_number": i} for i in range(3)]
    response = {"id": "bg", "status": "completed"}
    store.put(StoredResponse(response, (), ()), run)
    assert store.kept_bytes == json_bytes(response) + 2 * json_bytes(()) + sum(json_bytes(e) for e in run.events)
    run.events += [{"type": "response.output_text.delta", "delta": "y" * 300, "sequence_number": i}
                   for i in range(3, 6)]
    store.put(StoredResponse(response, (), ()), run)  # (its events now past the bound: it goes)
    assert "bg" not in store and store.kept_bytes == 0


# ---------------------------------------------------------------- input_items

@pytest.mark.parametrize("query, param", [({"limit": 0}, "limit"), ({"after": "msg_9"}, "after"),
                                          ({"before": "msg_x"}, "before"),
                                          ({"after": "msg_1", "before": "nope"}, "before")])
def test_input_items_refuse_a_limit_of_0_and_a_cursor_of_no_item(query, param):
    """`limit` is 1 to 100 (0 is a 400, not an empty page); an `after` or `before` naming no input item of the
    response is a 400 naming that cursor (not a 500 from looking it up)."""
    store = _store_with_items(3)
    with pytest.raises(APIError) as err:
        store.input_items("resp_1", **query)
    assert err.value.status == 400 and err.value.param == param
    assert [i["id"] for i in store.input_items("resp_1", limit=1, after="msg_2")["data"]] == ["msg_1"]


# ---------------------------------------------------------------- background runs

class _BrokenChoices(_EndingChoices):
    """A chat whose stream breaks on a bug after its first text (not an engine error: an exception)."""

    async def sse(self):
        await asyncio.sleep(0)
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': 'Hi'}, 'finish_reason': None}]})}\n\n"
        raise RuntimeError("a bug")


def _start(choices, **body):
    store, slot = ResponsesStore(4), _Slot()
    req = parse_request({"input": "hi", "background": True, **body})
    out = ResponseOutput(choices, req, store.keeper(req, None))
    return store, slot, out


def test_a_run_broken_by_a_bug_ends_failed_with_a_server_error():
    """A run whose events raise (a bug, not an engine error) ends "failed", its error a server_error naming the
    exception, kept so (GET's, its last event's); it cannot be followed; its slot is released."""
    store, slot, out = _start(_BrokenChoices())

    async def scenario():
        BackgroundResponses(store).start(out, slot, stream=False)
        await store.run(out.id).task
        return store.run(out.id)

    run = asyncio.run(scenario())
    failed = store.response(out.id)
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "RuntimeError: a bug" in failed["error"]["message"]
    assert run.events[-1]["type"] == "response.failed" and run.events[-1]["response"] == failed
    assert failed["output"][0]["status"] == "incomplete" and slot.released == 1 and run.finished
    with pytest.raises(APIError) as err:
        store.prior(out.id)
    assert err.value.status == 400 and "failed" in err.value.message


def test_a_second_cancel_during_the_first_one_s_cleanup_leaves_the_slot_released_once():
    """A cancel that lands while the run is closing its choices after a first cancel (a DELETE beside a POST
    .../cancel, or shutdown's close) waits for it: the cleanup is not cancelled, so the slot is released, once,
    and the run ends "cancelled"."""
    for later in range(6):
        store, slot, out = _start(_EndingChoices())

        async def scenario():
            background = BackgroundResponses(store)
            background.start(out, slot, stream=False)
            run = store.run(out.id)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            first = asyncio.ensure_future(run.cancel())
            for _ in range(later):
                await asyncio.sleep(0)
            await asyncio.wait_for(run.cancel(), timeout=10)
            await asyncio.wait_for(first, timeout=10)
            return run, background

        run, background = asyncio.run(scenario())
        assert run.finished and slot.released == 1 and not background.running, later
        assert store.response(out.id)["status"] == "cancelled" and run.events[-1]["type"] == "response.cancelled"


def test_close_at_shutdown_cancels_a_run_still_going_before_the_loop_ends():
    """BackgroundResponses.close (the server's last shutdown step) cancels the runs still going and awaits them:
    by its return the run has ended "cancelled" and released its slot (not left to the loop's own teardown)."""
    store, slot, out = _start(_HangingChoices())

    async def scenario():
        background = BackgroundResponses(store)
        background.start(out, slot, stream=False)
        run = store.run(out.id)
        for _ in range(10):
            await asyncio.sleep(0)
        assert background.running == {run} and not run.finished
        await asyncio.wait_for(background.close(), timeout=10)
        return run.finished, slot.released, store.response(out.id)["status"], background.running

    assert asyncio.run(scenario()) == (True, 1, "cancelled", set())


def test_cancel_answers_the_cancelled_response_even_where_the_store_cannot_keep_it():
    """POST .../cancel answers the run's cancelled Response; one larger than --responses-store-max-mib once ended
    is not kept (a later GET is a 404), but the cancel that ended it still answers it, not a 404."""
    store, slot, out = _start(_HangingChoices())
    store.max_bytes = 100  # (kept while it runs whatever its size; its end is too large)

    async def scenario():
        background = BackgroundResponses(store)
        background.start(out, slot, stream=False)
        for _ in range(10):
            await asyncio.sleep(0)
        return await asyncio.wait_for(background.cancel(out.id), timeout=10)

    answer = asyncio.run(scenario())
    assert answer["id"] == out.id and answer["status"] == "cancelled" and out.id not in store and slot.released == 1


# ---------------------------------------------------------------- /tokenize's chat form

def test_tokenize_chat_form_refuses_empty_messages_and_bad_unicode_and_no_unasked_token_strs(chat_srv):  # noqa: F811
    """/tokenize's chat form: an empty `messages` is a 400 naming it (as a chat completion's); text UTF-8 cannot
    encode is a 400 saying so, naming the messages or the tools that hold it; token_strs is null unless asked."""
    def tokenize(body: bytes) -> httpx.Response:
        return httpx.post(chat_srv.url + "/tokenize", content=body, headers={"content-type": "application/json"},
                          timeout=30)
    r = tokenize(b'{"messages": []}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = tokenize(b'{"messages": [{"role": "user", "content": "a\\ud800"}]}')
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"], r.text
    tool = b'{"type": "function", "function": {"name": "f", "description": "a\\udfff"}}'
    r = tokenize(b'{"messages": [{"role": "user", "content": "hi"}], "tools": [' + tool + b']}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    body = tokenize(b'{"messages": [{"role": "user", "content": "hi"}]}').json()
    assert body["token_strs"] is None and body["count"] == len(body["tokens"]) > 0
