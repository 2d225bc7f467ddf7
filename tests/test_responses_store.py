"""Stored responses (scheduler/responses_store.py): a Response kept when `store` is true (the default), a follow-up by
`previous_response_id` served after the stored conversation (and so from the prefix cache), GET / DELETE /
input_items, the bound (--responses-store-max) and `store: false`."""
from __future__ import annotations

import httpx
import openai
import pytest

from scheduler.api_models import APIError
from scheduler.api_responses import ResponsesShape, parse_request
from scheduler.responses_store import ResponsesStore, StoredResponse
from scheduler.server import ServerLimits
from server_fixtures import byte_level_server, tiny_config
from test_responses_api import TEMPLATE, WEATHER


def _server(tmp_path_factory, **limits):
    return byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=48), chat_template=TEMPLATE,
                             limits=ServerLimits(shutdown_grace_s=1.0, tool_call_parser="hermes", **limits))


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with _server(tmp_path_factory) as s:
        yield s


def _post(srv, **body) -> httpx.Response:
    body = {"model": "tiny", "max_output_tokens": 3, "temperature": 0, **body}
    return httpx.post(srv.url + "/v1/responses", json=body, timeout=60)


def _ok(srv, **body) -> dict:
    r = _post(srv, **body)
    assert r.status_code == 200, r.text
    return r.json()


def _get(srv, path: str, **params) -> httpx.Response:
    return httpx.get(srv.url + "/v1/responses/" + path, params=params, timeout=30)


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _missing(r: httpx.Response, rid: str, param: str | None = None) -> None:
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert rid in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


def test_a_follow_up_is_served_after_the_stored_conversation_from_the_prefix_cache(srv):
    """Turn 2 by previous_response_id: the prompt of the conversation sent whole (turn 1's input and output, then
    turn 2's), its instructions first; turn 1's instructions are not carried over; its prefix is cached."""
    first = _ok(srv, input="hello there, how are you?", instructions="be kind", max_output_tokens=4)
    assert first["store"] is True and first["previous_response_id"] is None
    second = _ok(srv, input="and then?", instructions="be kind", previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"] and second["store"] is True
    cached_tokens = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached_tokens >= first["usage"]["input_tokens"] - 4  # (all but the last, partial page: page_size 4)
    whole = _ok(srv, input=[_user("hello there, how are you?"), *first["output"], _user("and then?")],
                instructions="be kind", store=False)
    assert second["usage"]["input_tokens"] == whole["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 4
    assert second["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]
    # without instructions: none (turn 1's are not the follow-up's)
    bare = _ok(srv, input="and then?", previous_response_id=first["id"])
    whole = _ok(srv, input=[_user("hello there, how are you?"), *first["output"], _user("and then?")], store=False)
    assert bare["usage"]["input_tokens"] == whole["usage"]["input_tokens"] < second["usage"]["input_tokens"]


def test_a_chain_of_three_turns_carries_the_whole_conversation(srv, client):
    one = client.responses.create(model="tiny", input="first question", max_output_tokens=3, temperature=0)
    two = client.responses.create(model="tiny", input=[_user("second")], previous_response_id=one.id,
                                  max_output_tokens=3, temperature=0)
    three = client.responses.create(model="tiny", input="third", previous_response_id=two.id, max_output_tokens=3,
                                    temperature=0)
    assert three.previous_response_id == two.id and two.previous_response_id == one.id
    items = [_user("first question"), *[o.model_dump(exclude_none=True) for o in one.output], _user("second"),
             *[o.model_dump(exclude_none=True) for o in two.output], _user("third")]
    whole = client.responses.create(model="tiny", input=items, max_output_tokens=3, temperature=0, store=False)
    assert three.usage.input_tokens == whole.usage.input_tokens and three.output_text == whole.output_text
    assert three.usage.input_tokens_details.cached_tokens >= two.usage.input_tokens - 4


def test_a_function_call_is_carried_into_the_follow_up_with_its_output(srv, client):
    """A response's function_call is the stored conversation's assistant tool call; the follow-up sends its
    function_call_output alone (the template renders both: the prompt is the one of them all sent back)."""
    named = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model="tiny", input="weather?", tools=[WEATHER], tool_choice=named,
                                max_output_tokens=40, temperature=0)
    [call] = r.output
    assert call.type == "function_call"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    follow = client.responses.create(model="tiny", input=[result], previous_response_id=r.id, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=2, temperature=0)
    whole = client.responses.create(model="tiny", input=[_user("weather?"), call.model_dump(exclude_none=True), result],
                                    tools=[WEATHER], tool_choice="none", max_output_tokens=2, temperature=0,
                                    store=False)
    without_call = client.responses.create(model="tiny", input=[_user("weather?"), result], tools=[WEATHER],
                                           tool_choice="none", max_output_tokens=2, store=False)
    assert follow.usage.input_tokens == whole.usage.input_tokens > without_call.usage.input_tokens
    assert follow.output_text == whole.output_text


def test_get_returns_what_post_returned_and_delete_removes_it(srv):
    posted = _ok(srv, input="keep me", metadata={"k": "v"})
    got = _get(srv, posted["id"])
    assert got.status_code == 200 and got.json() == posted
    assert httpx.head(srv.url + "/v1/responses/" + posted["id"], timeout=30).status_code == 200
    deleted = httpx.delete(srv.url + "/v1/responses/" + posted["id"], timeout=30)
    assert deleted.status_code == 200 and deleted.json() == {"id": posted["id"], "object": "response.deleted",
                                                             "deleted": True}
    _missing(_get(srv, posted["id"]), posted["id"])
    _missing(_get(srv, posted["id"] + "/input_items"), posted["id"])
    _missing(httpx.delete(srv.url + "/v1/responses/" + posted["id"], timeout=30), posted["id"])
    _missing(_post(srv, input="more", previous_response_id=posted["id"]), posted["id"], "previous_response_id")


def test_the_sdk_retrieves_and_deletes(client):
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_input_items_are_the_request_s_as_given_with_ids(srv, client):
    text = _ok(srv, input="plain text")
    [item] = _get(srv, text["id"] + "/input_items").json()["data"]
    assert item["id"].startswith("msg_") and item["type"] == "message" and item["role"] == "user"
    assert item["content"] == [{"type": "input_text", "text": "plain text"}]
    given = [{"type": "message", "role": "user", "content": "a", "id": "msg_given"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]}, _user("c")]
    r = _ok(srv, input=given)
    page = _get(srv, r["id"] + "/input_items").json()  # (OpenAI's order: the newest first)
    assert page["object"] == "list" and page["has_more"] is False
    assert [i["content"] for i in page["data"]] == [[{"type": "input_text", "text": "c"}],  # (a string: one part)
                                                    [{"type": "output_text", "text": "b"}],
                                                    [{"type": "input_text", "text": "a"}]]
    assert page["data"][-1]["id"] == "msg_given" and page["last_id"] == "msg_given"
    assert page["first_id"] == page["data"][0]["id"] and all(i["type"] == "message" for i in page["data"])
    asc = _get(srv, r["id"] + "/input_items", order="asc", limit=2).json()
    assert [i["content"][0]["text"] for i in asc["data"]] == ["a", "b"] and asc["has_more"]
    rest = _get(srv, r["id"] + "/input_items", order="asc", after=asc["last_id"]).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["c"] and rest["has_more"] is False
    assert [i.id for i in client.responses.input_items.list(r["id"], order="asc")] == [
        *(i["id"] for i in asc["data"]), rest["data"][0]["id"]]
    bad = _get(srv, r["id"] + "/input_items", order="sideways")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "order"


def test_store_false_keeps_nothing(srv):
    r = _ok(srv, input="forget me", store=False)
    assert r["store"] is False
    _missing(_get(srv, r["id"]), r["id"])
    _missing(_post(srv, input="more", previous_response_id=r["id"]), r["id"], "previous_response_id")


def test_an_unknown_previous_response_id_is_a_404_naming_the_field(srv):
    r = _post(srv, input="hi", previous_response_id="resp_nope")
    _missing(r, "resp_nope", "previous_response_id")
    assert r.json()["error"]["code"] == "previous_response_not_found"
    assert _post(srv, input="hi", conversation="conv_1").status_code == 400
    assert httpx.get(srv.url + "/hicache/status", timeout=30).json()["server"]["in_flight"] == 0


def test_a_streamed_response_is_stored_when_it_ends(srv, client):
    with client.responses.stream(model="tiny", input="stream me", max_output_tokens=3, temperature=0) as stream:
        events = list(stream)
    assert events[0].response.model_extra["store"] is True
    final = events[-1].response
    got = _get(srv, final.id).json()
    assert got == final.model_dump(mode="json", exclude_unset=True) and got["store"] is True
    follow = _ok(srv, input="next", previous_response_id=final.id)
    whole = _ok(srv, input=[_user("stream me"), *got["output"], _user("next")], store=False)
    assert follow["usage"]["input_tokens"] == whole["usage"]["input_tokens"]


def test_the_store_keeps_the_last_responses_used(tmp_path_factory):
    """--responses-store-max 2: a third response drops the one least recently stored or continued."""
    with _server(tmp_path_factory, responses_store_max=2) as s:
        one, two = _ok(s, input="one"), _ok(s, input="two")
        three = _ok(s, input="three")
        _missing(_get(s, one["id"]), one["id"])
        assert _get(s, two["id"]).status_code == _get(s, three["id"]).status_code == 200
        _ok(s, input="again", previous_response_id=two["id"], store=False)  # (two: used last)
        _ok(s, input="four")
        _missing(_get(s, three["id"]), three["id"])
        assert _get(s, two["id"]).status_code == 200


def test_a_store_of_none_keeps_nothing(tmp_path_factory):
    with _server(tmp_path_factory, responses_store_max=0) as s:
        r = _ok(s, input="hi")
        assert r["store"] is False
        _missing(_get(s, r["id"]), r["id"])


# -- without a server -------------------------------------------------------------------------------------
def _stored(rid: str) -> StoredResponse:
    return StoredResponse(response={"id": rid}, conversation=({"role": "user", "content": rid},), input_items=())


def test_the_store_drops_its_oldest_and_hands_out_copies():
    store = ResponsesStore(max_responses=2)
    for rid in ("a", "b", "c"):
        store.put(_stored(rid))
    assert len(store) == 2 and "a" not in store
    history = store.conversation("b")
    history[0]["content"] = "changed"  # (a request's copy: the stored conversation is not changed)
    assert store.conversation("b") == [{"role": "user", "content": "b"}]
    store.put(_stored("d"))  # (b was used last: c goes)
    assert "c" not in store and "b" in store
    assert store.delete("b") == {"id": "b", "object": "response.deleted", "deleted": True}
    with pytest.raises(APIError) as err:
        store.delete("b")
    assert err.value.status == 404
    off = ResponsesStore(max_responses=0)
    assert not off.enabled
    off.put(_stored("a"))
    assert len(off) == 0


def test_a_kept_conversation_is_its_input_and_output_as_messages_without_its_instructions():
    """Each kind of output item as the same item sent back as input makes it (one assistant turn of thinking,
    text and a call); a follow-up's messages: its instructions, the kept conversation, its input."""
    store = ResponsesStore(max_responses=4)
    first = parse_request({"input": "hi", "instructions": "old rules"})
    output = [{"id": "rs_1", "type": "reasoning", "summary": [], "status": "completed",
               "content": [{"type": "reasoning_text", "text": "hmm"}]},
              {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
              {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}",
               "status": "completed"}]
    store.keeper(first, None)({"id": "resp_1", "output": output})
    turn = {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "reasoning_content": "hmm",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert store.conversation("resp_1") == [{"role": "user", "content": "hi"}, turn]
    shape = ResponsesShape(store)
    body = shape.chat_body({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "ok"}],
                            "instructions": "new rules", "previous_response_id": "resp_1"})
    result = {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
    assert body["messages"] == [{"role": "system", "content": "new rules"}, {"role": "user", "content": "hi"}, turn,
                                result]
    shape.store.keeper(shape.req, shape.prior)({"id": "resp_2", "output": [
        {"id": "msg_2", "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}]})
    assert store.conversation("resp_2") == [{"role": "user", "content": "hi"}, turn, result,
                                            {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]}]
    assert store.keeper(parse_request({"input": "x", "store": False}), None) is None
    with pytest.raises(APIError) as err:
        ResponsesShape().chat_body({"input": "x", "previous_response_id": "resp_1"})  # (no store: none kept)
    assert err.value.status == 404 and err.value.param == "previous_response_id"
