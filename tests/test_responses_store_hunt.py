"""A hunt over the Responses API's kept responses (scheduler/responses_store.py, the GET / DELETE / input_items routes
of scheduler/server.py): what the openai SDK reads back, ids, clients that leave, cache salts, --api-key. Regressions
first, then behaviours checked correct."""
from __future__ import annotations

import asyncio
import itertools

import httpx
import openai
import pytest

from scheduler.responses_store import StoredResponse
from scheduler.server import ServerLimits, create_app
from test_responses_hunt import LONG, _idle, _open_stream
from test_responses_store import _get, _missing, _server, _user

KEY = "sekret"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    # (test_responses_hunt's server: greedy, LONG's answer has no end of text within it)
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.tokenizer import HFTokenizer
    from test_responses_api import TEMPLATE
    from test_server import ServerThread
    from tokenizer_files import write_byte_tokenizer

    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), added=("<think>", "</think>"),
                                config={"chat_template": TEMPLATE})
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=2048))
    limits = ServerLimits(shutdown_grace_s=1.0, tool_call_parser="hermes", reasoning_parser="qwen3")
    with ServerThread(create_app(engine, limits, tokenizer=HFTokenizer(str(path)))) as s:
        s.engine = engine
        yield s


def _post(srv, **body) -> httpx.Response:
    body = {"model": "tiny", "max_output_tokens": 2, "temperature": 0, **body}
    return httpx.post(srv.url + "/v1/responses", json=body, timeout=60)


def _ok(srv, **body) -> dict:
    r = _post(srv, **body)
    assert r.status_code == 200, r.text
    return r.json()


# -- regressions ---------------------------------------------------------------------------------------------------
def test_input_items_with_one_id_twice_are_a_400_naming_input(srv, client):
    """Regression: two input items of one id were taken, and input_items' `after` cursor found the first of them:
    the SDK's auto-pagination (after = the last id of a page) went round forever. OpenAI's 400."""
    items = [{"role": "user", "content": "a", "id": "msg_x"}, {"role": "user", "content": "b", "id": "msg_x"},
             _user("c")]
    r = _post(srv, input=items)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert "'msg_x'" in r.json()["error"]["message"] and "item 1" in r.json()["error"]["message"]
    # distinct ids: every item listed once, page by page
    items[1]["id"] = "msg_y"
    kept = _ok(srv, input=items)
    pages = itertools.islice(client.responses.input_items.list(kept["id"], limit=1, order="asc"), 10)
    assert [i.id for i in pages][:2] == ["msg_x", "msg_y"]


def test_input_items_list_a_message_s_text_as_a_part_as_the_sdk_reads_it(srv, client):
    """Regression: a message given with a string content was listed with it (a string where the SDK's
    ResponseInputMessageItem has a list of parts: it read the user's message as an assistant's output message);
    OpenAI lists it as one input_text part (an assistant's: output_text), as this server lists a string input."""
    given = [_user("question"), {"role": "assistant", "content": "answer"}, {"role": "developer", "content": "rule"}]
    r = _ok(srv, input=given)
    data = _get(srv, r["id"] + "/input_items", order="asc").json()["data"]
    assert [i["content"] for i in data] == [[{"type": "input_text", "text": "question"}],
                                            [{"type": "output_text", "text": "answer", "annotations": []}],
                                            [{"type": "input_text", "text": "rule"}]]
    user, assistant, developer = client.responses.input_items.list(r["id"], order="asc")
    assert type(user).__name__ == "ResponseInputMessageItem" and user.content[0].text == "question"
    assert type(assistant).__name__ == "ResponseOutputMessage" and assistant.content[0].text == "answer"
    assert developer.role == "developer" and developer.content[0].text == "rule"
    # (the conversation a follow-up reads is the same: the parts' text, as the strings')
    follow = _ok(srv, input="next", previous_response_id=r["id"])
    whole = _ok(srv, input=[*given, *r["output"], _user("next")], store=False)
    assert follow["usage"]["input_tokens"] == whole["usage"]["input_tokens"]


def test_a_response_whose_request_id_has_a_slash_is_retrieved_listed_and_deleted(srv, client):
    """Regression: a request_id may hold "/" (printable ASCII), which the SDK sends as it is in the path: its
    response was kept, and followed by previous_response_id, but GET, input_items and DELETE were 404s."""
    rid = "team/a?b#c"
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=1, extra_body={"request_id": rid})
    assert r.id == rid and client.responses.retrieve(rid).output_text == r.output_text
    assert [i.content[0].text for i in client.responses.input_items.list(rid)] == ["hi"]
    client.responses.delete(rid)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)


@pytest.mark.parametrize("query, param", [({"limit": "many"}, "limit"), ({"limit": "1.5"}, "limit")])
def test_a_bad_input_items_query_parameter_is_a_400_naming_it(srv, query, param):
    """Regression: FastAPI's error for a query parameter was named "query" (its location), not the parameter."""
    r = _ok(srv, input="hi")
    bad = _get(srv, r["id"] + "/input_items", **query)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


# -- behaviours checked correct --------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_response_whose_client_left_is_not_kept(srv, stream):
    """Aborted, it ends as failed (a stream's error event): not kept as if it had completed."""
    before = _idle(srv)["engine"]
    rid = f"left-{stream}"

    async def scenario():
        reader, writer = await _open_stream(srv.url, {**LONG, "stream": stream, "request_id": rid})
        if stream:
            seen = b""
            while b"response.output_text.delta" not in seen:
                seen += await reader.read(65536)
        else:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                while (await c.get("/hicache/status")).json()["engine"]["decode_tokens"] < before["decode_tokens"] + 4:
                    await asyncio.sleep(0.01)
        writer.close()
    asyncio.run(scenario())
    assert _idle(srv)["engine"]["aborted"] - before["aborted"] == 1
    _missing(_get(srv, rid), rid)


def test_a_follow_up_under_another_cache_salt_reads_none_of_its_cache(srv):
    """previous_response_id across salts is served (the kept conversation is text, as GET gives it), its prompt
    under its own salt: none of the other salt's cached pages; under the same salt, the prefix is cached."""
    first = _ok(srv, input="a long enough first question to fill some pages", cache_salt="tenant-a")
    other = _ok(srv, input="next", previous_response_id=first["id"], cache_salt="tenant-b")
    same = _ok(srv, input="next", previous_response_id=first["id"], cache_salt="tenant-a")
    assert other["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert same["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] // 2


def test_a_request_id_used_again_keeps_the_later_response(srv):
    """Two responses of one id: the later one is kept (OpenAI's ids are the server's; vLLM's store is keyed
    alike), and a follow-up continues it."""
    _ok(srv, input="first", request_id="again")
    second = _ok(srv, input="second", request_id="again")
    assert _get(srv, "again").json() == second
    assert _get(srv, "again/input_items").json()["data"][0]["content"][0]["text"] == "second"
    follow = _ok(srv, input="next", previous_response_id="again", store=False)
    whole = _ok(srv, input=[_user("second"), *second["output"], _user("next")], store=False)
    assert follow["usage"]["input_tokens"] == whole["usage"]["input_tokens"]


def _plain(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple, frozenset)):
        return all(map(_plain, value))
    return value is None or isinstance(value, (str, int, float, bool))


def test_a_kept_response_holds_plain_data_only(srv, client):
    """Memory: what the store keeps is JSON data (no engine request, prompt ids or pydantic models kept alive)."""
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                include=["message.output_text.logprobs"], top_logprobs=2)
    store = srv.app.state.hc.responses
    kept = store._kept[r.id]
    assert isinstance(kept, StoredResponse)
    assert set(vars(kept)) == {"response", "conversation", "input_items", "item_ids"}
    assert all(_plain(getattr(kept, name)) for name in vars(kept))


def test_the_api_key_guards_get_delete_and_input_items(tmp_path_factory):
    with _server(tmp_path_factory, api_key=KEY) as s:
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(s.url + "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 1},
                       headers=auth, timeout=60).json()
        for method, path in (("GET", r["id"]), ("GET", r["id"] + "/input_items"), ("HEAD", r["id"]),
                             ("DELETE", r["id"])):
            url = s.url + "/v1/responses/" + path
            assert httpx.request(method, url, timeout=30).status_code == 401, (method, path)
            assert httpx.request(method, url, headers=auth, timeout=30).status_code == 200, (method, path)
