"""Regressions from session 52's hunts of /v1/responses: a background response cancelled while it thought reports the
reasoning tokens it made (its usage said 0, its whole output a reasoning item); a call the SDK dumped with `async_` is
served; a chat field sent to it is named as sent."""
from __future__ import annotations


import httpx
import pytest

from test_responses_hunt import _idle
# (its server: --reasoning-parser qwen3)
from test_responses_s51_hunt import _check_cut_short, srv, streamed_until  # noqa: F401

THINKING = {"model": "tiny", "input": "think", "max_output_tokens": 900, "temperature": 0,  # (TEMPLATE opens the block)
            "logit_bias": {"256": -100, "257": -100}}  # (no "<think>" / "</think>": it thinks to the end)


def test_a_background_response_cancelled_while_thinking_counts_its_reasoning_tokens(srv):  # noqa: F811
    reader, events, ids = streamed_until(srv, THINKING, "response.reasoning_text.delta", 3)
    httpx.post(f"{srv.url}/v1/responses/{ids['id']}/cancel", timeout=60)
    reader.join(60)
    final = _check_cut_short(events, ids["id"])
    assert [item["type"] for item in final["output"]] == ["reasoning"]
    usage = final["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == usage["output_tokens"] >= 3, usage
    assert httpx.get(f"{srv.url}/v1/responses/{ids['id']}", timeout=30).json()["usage"] == usage
    _idle(srv)
    srv.call(srv.engine.check_integrity)


def test_a_call_the_sdk_dumped_with_async_by_its_python_name_is_served(srv):  # noqa: F811
    """openai 3.x's ResponseFunctionToolCall names the field `async_` (alias "async"): its plain model_dump() writes
    "async_": null, which was a 400 "Extra inputs are not permitted" of an agent sending its output back."""
    from openai.types.responses import ResponseFunctionToolCall
    call = ResponseFunctionToolCall(type="function_call", call_id="c1", name="f", arguments="{}", status="completed")
    dumped = call.model_dump()
    assert "async_" in dumped
    items = [{"role": "user", "content": "hi"}, dumped, {"type": "function_call_output", "call_id": "c1",
                                                        "output": "done"}]
    r = httpx.post(srv.url + "/v1/responses", json={"model": "tiny", "input": items, "max_output_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field, value", [("prompt", {"id": "pmpt_1"}), ("messages", []), ("max_tokens", 5),
                                          ("max_completion_tokens", 5), ("response_format", {"type": "json_object"}),
                                          ("reasoning_effort", "low")])
def test_a_chat_field_sent_to_responses_is_named_as_sent(srv, field, value):  # noqa: F811
    """An unknown field of the Responses body itself that a chat also has was renamed as the chat path's errors are:
    'max_tokens' said "unknown field 'max_output_tokens'" of a body that may well carry that one."""
    r = httpx.post(srv.url + "/v1/responses", json={"model": "tiny", "input": "x", field: value}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert f"'{field}'" in r.json()["error"]["message"]


def test_items_a_previous_response_holds_sent_again_are_openais_400(srv):  # noqa: F811
    """A follow-up that sends its previous response's output items again (their ids) was served with them twice in
    its prompt; OpenAI answers 400 "Duplicate item found with id ...". An earlier turn's input item likewise; a new
    item, or one of another chain, is served."""
    def respond(**body):
        return httpx.post(srv.url + "/v1/responses", json={"model": "tiny", "max_output_tokens": 2, **body}, timeout=60)
    first = respond(input=[{"role": "user", "content": "hello", "id": "msg_mine"}]).json()
    second = respond(previous_response_id=first["id"], input="next").json()
    for resent in (first["output"][0], {"role": "user", "content": "hello", "id": "msg_mine"}):
        r = respond(previous_response_id=second["id"], input=[resent, {"role": "user", "content": "more"}])
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert f"Duplicate item found with id {resent['id']}" in r.json()["error"]["message"]
    assert respond(previous_response_id=second["id"], input=[{"role": "user", "content": "x", "id": "msg_new"}]
                   ).status_code == 200
    assert respond(input=[first["output"][0], {"role": "user", "content": "more"}]).status_code == 200  # (no chain)
