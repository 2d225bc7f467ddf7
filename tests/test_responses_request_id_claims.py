"""A background response's request_id is claimed from its check to its run's start (scheduler/responses_store.py
`claim`): two background POSTs of one new id, both checked before either run started, ran both, and the second,
kept under the id, put the first out of every route's reach (session 46's noticed race, fixed in session 47). And a
response of the id that finished while a background run of it goes on is not kept over the run."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from scheduler.api_models import APIError
from scheduler.api_responses import ResponsesShape
from scheduler.responses_store import ResponsesStore, StoredResponse
from test_responses_background import _server

BODY = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "temperature": 0}


def test_a_second_background_request_of_an_id_claimed_is_refused_until_the_claim_is_given_back():
    store = ResponsesStore(8)
    first = ResponsesShape(store)
    first.chat_body({**BODY, "background": True, "request_id": "dup"})
    assert store.running("dup")  # (no run yet: claimed)
    for background in (True, False):
        with pytest.raises(APIError) as exc:
            ResponsesShape(store).chat_body({**BODY, "background": background, "request_id": "dup"})
        assert exc.value.status == 400 and exc.value.param == "request_id"
    first.release_claim()  # (it failed before its run started)
    assert not store.running("dup")
    ResponsesShape(store).chat_body({**BODY, "background": True, "request_id": "dup"})
    ResponsesShape(store).chat_body({**BODY, "request_id": "other"})  # (not background: claims nothing)
    assert not store.running("other")


def test_a_response_finished_beside_a_running_background_run_of_its_id_is_not_kept_over_it():
    store = ResponsesStore(8)
    run = SimpleNamespace(finished=False, events=[], response={"id": "same", "status": "in_progress"})
    store.put(StoredResponse(run.response, (), ()), run)
    store.put(StoredResponse({"id": "same", "status": "completed"}, (), ()))  # (a plain request of the id)
    assert store.run("same") is run and store.response("same")["status"] == "in_progress"
    run.finished = True  # once the run ended, the id is anyone's
    store.put(StoredResponse({"id": "same", "status": "completed"}, (), ()))
    assert store.run("same") is None and store.response("same")["status"] == "completed"


def test_two_background_posts_of_one_new_id_racing_a_grammar_compile_start_one_run(tmp_path_factory):
    with _server(tmp_path_factory, max_concurrent_requests=4) as srv:
        guides = srv.engine.guides
        check, entered, released = guides.check, threading.Event(), threading.Event()

        def slow_check(spec):  # (off the loop, in the executor: held until the second POST was answered)
            entered.set()
            released.wait(30)
            return check(spec)
        guides.check = slow_check
        schema = {"type": "json_schema", "name": "s", "schema": {"type": "object", "properties": {
            "a": {"enum": ["x", "y"]}}, "required": ["a"], "additionalProperties": False}}
        answers = {}

        def post(name, body):
            answers[name] = httpx.post(srv.url + "/v1/responses", json=body, timeout=60)
        first = threading.Thread(target=post, args=("first", {**BODY, "background": True, "request_id": "race",
                                                              "text": {"format": schema}}))
        first.start()
        assert entered.wait(10)
        post("second", {**BODY, "background": True, "request_id": "race"})
        released.set()
        first.join()
        guides.check = check
        assert answers["first"].status_code == 200, answers["first"].text
        assert answers["second"].status_code == 400 and answers["second"].json()["error"]["param"] == "request_id"
        for _ in range(200):  # the one run, reachable to its end
            got = httpx.get(srv.url + "/v1/responses/race", timeout=10).json()
            if got["status"] not in ("queued", "in_progress"):
                break
            time.sleep(0.05)
        assert got["status"] in ("completed", "incomplete") and got["text"]["format"]["type"] == "json_schema"
        srv.call(srv.engine.check_integrity)


def test_a_background_request_failing_after_its_claim_gives_its_id_back(tmp_path_factory):
    """Regression guard (session 55's mutation check: nothing failed with the server's release_claim() calls gone):
    a background POST whose id was claimed and which then fails (a schema llguidance refuses, a 400) gives the id
    back; before, the next background POST of that id was refused as "still running" until a restart."""
    bad = {"type": "json_schema", "name": "s", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "[^\\s\\S]"}}, "required": ["a"]}}
    with _server(tmp_path_factory, max_concurrent_requests=4) as srv:
        refused = httpx.post(srv.url + "/v1/responses", json={**BODY, "background": True, "request_id": "once",
                                                               "text": {"format": bad}}, timeout=60)
        assert refused.status_code == 400, refused.text
        again = httpx.post(srv.url + "/v1/responses", json={**BODY, "background": True, "request_id": "once"},
                           timeout=60)
        assert again.status_code == 200, again.text
