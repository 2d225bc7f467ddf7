"""Session 79's hunt over the Responses API's state over time (scheduler/api_responses.py, responses_store.py,
responses_background.py, responses_output.py) against OpenAI's API reference, through the openai SDK against a real
server: regressions."""
from __future__ import annotations

import time

import httpx
import pytest

from test_responses_api import WEATHER
from test_responses_background import _ended, _server

NAMED = {"type": "function", "name": "get_weather"}  # (a call the grammar ends: status "completed")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with _server(tmp_path_factory) as s:
        yield s


def _completed(client, **body):
    return client.responses.create(model="tiny", input="weather?", tools=[WEATHER], tool_choice=NAMED,
                                   max_output_tokens=40, temperature=0, **body)


def test_a_completed_response_says_when_it_completed_and_an_unfinished_one_does_not(srv, client):
    """OpenAI's `completed_at`: the Unix time a Response completed, present only when its status is "completed"
    (regression: never sent, so a client's `completed_at - created_at` raised on None)."""
    before = int(time.time())
    whole = _completed(client)
    assert whole.status == "completed" and before <= whole.completed_at <= time.time()
    assert whole.completed_at >= whole.created_at
    assert client.responses.retrieve(whole.id).completed_at == whole.completed_at  # (kept as sent)
    with client.responses.stream(model="tiny", input="weather?", tools=[WEATHER], tool_choice=NAMED,
                                 max_output_tokens=40, temperature=0) as stream:
        events = list(stream)
    created, done = events[0].response, events[-1].response
    assert done.status == "completed" and done.completed_at >= created.created_at and created.completed_at is None
    queued = client.responses.create(model="tiny", input="weather?", tools=[WEATHER], tool_choice=NAMED,
                                     max_output_tokens=40, temperature=0, background=True)
    assert queued.status == "queued" and queued.completed_at is None
    ended = _ended(client, queued.id)
    assert ended.status == "completed" and ended.completed_at >= ended.created_at
    incomplete = client.responses.create(model="tiny", input="hi", max_output_tokens=2, temperature=0)
    assert incomplete.status == "incomplete" and incomplete.completed_at is None
    body = httpx.get(f"{srv.url}/v1/responses/{incomplete.id}", timeout=60).json()
    assert "completed_at" in body and body["completed_at"] is None  # (as OpenAI's: the field, null)


def test_a_completed_background_response_failed_as_it_was_kept_says_no_completed_at(srv, client, monkeypatch):
    """A run whose completed Response raised as it was kept ends "failed" (BackgroundRun._kept): it did not
    complete, so it carries no `completed_at` (OpenAI's: only a completed Response has one)."""
    store = srv.app.state.hc.responses
    real, calls = store.put, []

    def put(stored, run=None):
        calls.append(stored.response["status"])
        if stored.response["status"] == "completed" and calls.count("completed") == 1:
            raise RuntimeError("injected: put raised")
        return real(stored, run)
    monkeypatch.setattr(store, "put", put)
    queued = client.responses.create(model="tiny", input="weather?", tools=[WEATHER], tool_choice=NAMED,
                                     max_output_tokens=40, temperature=0, background=True)
    ended = _ended(client, queued.id)
    assert calls[-2:] == ["completed", "failed"]
    assert ended.status == "failed" and "injected" in ended.error.message and ended.completed_at is None
