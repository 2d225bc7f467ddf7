"""What a client, an operator or a scraper sees, found unpinned by session 67's mutation check of the HTTP server's
smaller modules (scheduler/prom.py, prom_vllm.py, api_admin.py, api_auth.py, api_tokenize.py, prompt_truncation.py,
sse_response.py, batch_api.py, api_tools.py, chat_messages.py): the key check's bare /v1 and its OPTIONS
pass-through (as vLLM's); /tokenize's chat form refusing an empty conversation as
/v1/chat/completions does; a message's `name` reaching the chat template; a stream's clean-up running to its end
under a cancellation delivered again at each await. Each test names the mutant it was verified to kill."""
from __future__ import annotations

import asyncio

import anyio
import httpx
import pytest

from scheduler.chat_messages import ChatMessage
from test_mutation_s61 import _Ends
from test_mutation_sched_s60 import KEY, _app
from test_tokenize_api import chat_srv  # noqa: F401 (a fixture: a server whose tokenizer has a chat template)


# -- api_auth.py ------------------------------------------------------------------------------------------
def test_the_bare_v1_path_is_guarded_too():
    """/v1 itself (no route here) is behind the key, as vLLM's prefix check guards it: a keyless client gets
    the 401, not a 404 that tells it what is routed (U04)."""
    client = _app(api_key=KEY)
    r = client.get("/v1")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert client.get("/v1", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_an_options_request_passes_the_key_check_without_cors():
    """OPTIONS carries no Authorization header (a browser's preflight): the key check hands it on unchecked, as
    vLLM's does, so without --allowed-origins the app answers it (405: no OPTIONS route), not a 401 (U06)."""
    r = _app(api_key=KEY).options("/v1/models")
    assert r.status_code == 405, r.text


# -- api_tokenize.py --------------------------------------------------------------------------------------
def test_tokenize_refuses_an_empty_conversation_as_chat_completions_does(chat_srv):
    """/tokenize's chat form with messages [] is the 400 naming messages that /v1/chat/completions answers, not
    the count of a template rendered over nothing (K07)."""
    chat = httpx.post(chat_srv.url + "/v1/chat/completions", json={"messages": [], "max_tokens": 1}, timeout=30)
    tok = httpx.post(chat_srv.url + "/tokenize", json={"messages": []}, timeout=30)
    assert chat.status_code == tok.status_code == 400, (chat.text, tok.text)
    assert tok.json()["error"]["param"] == chat.json()["error"]["param"] == "messages"


# -- chat_messages.py -------------------------------------------------------------------------------------
def test_a_messages_name_reaches_the_template():
    """A message's `name` (OpenAI's participant name) is passed to the template, as transformers passes a message:
    a template that writes it (or tells two users apart by it) sees it (C10)."""
    got = ChatMessage.model_validate({"role": "user", "content": "hi", "name": "bob"}).as_template_dict()
    assert got == {"role": "user", "content": "hi", "name": "bob"}


# -- sse_response.py --------------------------------------------------------------------------------------
class _SlowClose(_Ends):
    """Choices whose close awaits (as a real one's aborts do), under a cancellation that is delivered again at each
    await (anyio's cancel scopes: an ASGI server that cancels a gone client's task group)."""

    async def close(self) -> None:
        await asyncio.sleep(0)
        self.events.append("close")


def test_a_cancelled_stream_still_closes_its_choices_and_frees_its_slot():
    """Cancelled from outside while it waits for a token, a stream's clean-up (its generator, its choices' close,
    its slot) runs shielded to its end: an await in it is not cancelled again, so the slot is never leaked (S07)."""
    from scheduler.sse_response import SSEResponse
    ends = _SlowClose()

    async def receive():
        await asyncio.Event().wait()

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            scope.cancel()  # (the first chunk went out: the stream now waits for a token that never comes)

    async def run() -> None:
        nonlocal scope
        with anyio.CancelScope() as scope:
            await SSEResponse(ends.body(), ends, ends)({"type": "http", "asgi": {"version": "3.0"}}, receive, send)
    scope = None
    asyncio.run(run())
    assert ends.events == ["generator closed", "close", "release"], ends.events
