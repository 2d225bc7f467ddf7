"""Session 69's mutation check of the Responses API (scheduler/responses_store.py, responses_background.py,
responses_output.py, responses_items.py, responses_logprobs.py): rules no test held. A run dropped by DELETE whose
end comes after a new run took its id; a run's end kept (as its use) where its ending events fail; starting_after -1
refused; a message before a call "completed"; a reasoning item's part added before its deltas; parallel_tool_calls
false and the sampling a response ran with echoed; tokens after a whole answer's last call not the text's;
input_items' `order` exactly asc/desc, and the ids given to items sent without one. Direct calls on the fakes of
the existing background and logprobs tests, no server."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from scheduler.api_models import APIError
from scheduler.api_responses import parse_request
from scheduler.responses_background import BackgroundResponses
from scheduler.responses_logprobs import AnswerLogprobs
from scheduler.responses_output import OutputItems, ResponseOutput
from scheduler.responses_store import ResponsesStore, StoredResponse
from test_mutation_front_s56 import _store_with_items
from test_responses_background import _HangingChoices
from test_responses_background_hunt import _EndingChoices, _Slot
from test_mutation_sampling_s61 import CALL_PIECES, _entry

_RUNNING = ("queued", "in_progress")


class _NoUsageChoices(_HangingChoices):
    """A hanging chat whose usage cannot be read: a cancelled run's cut_short fails (a bug in its items)."""

    def usage_body(self) -> dict:
        raise RuntimeError("no usage")


def _output(store: ResponsesStore, choices, **body) -> ResponseOutput:
    req = parse_request({"input": "hi", "background": True, **body})
    return ResponseOutput(choices, req, store.keeper(req, None))


# ---------------------------------------------------------------- the store and background runs

async def _streaming(run) -> None:
    """Let the run's task go until it has sent its first delta (created, in_progress, a message added, its part,
    its delta) and hangs there: a bounded count of loop turns, not a time."""
    for _ in range(100):
        if len(run.events) >= 5 or run.finished:
            break
        await asyncio.sleep(0)
    assert len(run.events) >= 5 and not run.finished


def test_a_deleted_run_ending_after_a_new_run_took_its_id_leaves_the_new_one_kept():
    """DELETE drops a running response, then awaits its cancel; a background request of the same request_id may
    start meanwhile (the id is free). The deleted run's cancelled end is not kept over the new run (the store holds
    it no more): the new run stays the one GET, cancel and its events find."""
    store = ResponsesStore(4)
    first, second = _output(store, _HangingChoices()), _output(store, _HangingChoices())
    assert first.id == second.id

    async def scenario():
        background = BackgroundResponses(store)
        background.start(first, _Slot(), stream=False)
        old = store.run(first.id)
        await _streaming(old)
        store.delete(first.id)  # (DELETE's first step: its cancel awaited after it)
        background.start(second, _Slot(), stream=False)
        new = store.run(second.id)
        await asyncio.wait_for(old.cancel(), timeout=10)
        seen = store.run(second.id), store.response(second.id)["status"], store.holds(old)
        await asyncio.wait_for(background.close(), timeout=10)
        return old, new, seen

    old, new, (found, status, holds_old) = asyncio.run(scenario())
    assert old.response["status"] == "cancelled" and not holds_old
    assert found is new and status in _RUNNING


def test_a_run_whose_ending_events_fail_is_still_kept_as_it_ended():
    """A cancelled run whose last events cannot be made (a bug) ends with its Response alone, "cancelled", and that
    end is kept as any run's end: used last, so that above --responses-store-max it is the response kept meanwhile
    that goes, not the one just ended."""
    store = ResponsesStore(1)
    out = _output(store, _NoUsageChoices())

    async def scenario():
        background = BackgroundResponses(store)
        background.start(out, _Slot(), stream=False)
        run = store.run(out.id)
        await _streaming(run)
        store.put(StoredResponse({"id": "resp_other", "status": "completed", "output": []}, (), ()))
        assert "resp_other" in store and out.id in store  # (the running one is not dropped)
        await asyncio.wait_for(run.cancel(), timeout=10)
        return run

    run = asyncio.run(scenario())
    assert run.response["status"] == "cancelled" and store.response(out.id) is run.response
    assert "resp_other" not in store and len(store) == 1


def test_a_replay_starting_after_minus_1_is_refused():
    """GET ?stream=true&starting_after=N takes a sequence number, 0 or more: -1 is a 400 naming it (not read as
    "from the start", which is what leaving it out asks); 0 is a replay."""
    store = ResponsesStore(4)
    run = SimpleNamespace(id="bg", finished=False, events=[], response={"id": "bg", "status": "queued"},
                          follow=lambda after: _no_events())
    store.put(StoredResponse({"id": "bg", "status": "queued"}, (), ()), run)
    background = BackgroundResponses(store)
    with pytest.raises(APIError) as err:
        background.get("bg", stream=True, starting_after=-1)
    assert err.value.status == 400 and err.value.param == "starting_after"
    assert background.get("bg", stream=True, starting_after=0).media_type == "text/event-stream"


async def _no_events():
    return
    yield


# ---------------------------------------------------------------- output items

def test_text_before_a_call_is_a_completed_message():
    """Text then a call (the hermes parser's "auto"): the message is finished "completed" as the call starts (it was
    written whole), not "incomplete" as a cut answer's last item."""
    items = OutputItems()
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    events = items.feed({"content": "Let me look."}) + items.feed({"tool_calls": [call]}) + items.close("completed")
    assert [(i["type"], i["status"]) for i in items.items] == [("message", "completed"), ("function_call", "completed")]
    done = [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["completed", "completed"]


def test_a_reasoning_item_opens_its_reasoning_text_part_before_its_deltas():
    """A streamed reasoning item is written as a message's: added, its (empty) reasoning_text part added, the
    deltas, the text done, the part done, the item done (the SDK's stream accumulator adds the part before it
    appends deltas to it)."""
    items = OutputItems()
    events = items.feed({"reasoning_content": "hm"}) + items.feed({"reasoning_content": "m"})
    events += items.finish("completed")
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done"]
    added = events[1]
    assert added["part"] == {"type": "reasoning_text", "text": ""} and added["content_index"] == 0
    assert added["item_id"] == events[0]["item"]["id"] and events[-1]["item"]["content"][0]["text"] == "hmm"


@pytest.mark.parametrize("parallel", [False, True])
def test_the_response_echoes_parallel_tool_calls_and_the_sampling_it_ran_with(parallel):
    """parallel_tool_calls false is echoed false (true where asked or left out); temperature and top_p are those the
    request ran with (the server's defaults filled where it gave none), not the request's nulls."""
    req = parse_request({"input": "hi", "parallel_tool_calls": parallel})
    choices = _EndingChoices()
    choices.gens = [SimpleNamespace(req=SimpleNamespace(params=SimpleNamespace(temperature=0.7, top_p=0.9)))]
    response = ResponseOutput(choices, req).response("completed", [])
    assert response["parallel_tool_calls"] is parallel
    assert (response["temperature"], response["top_p"]) == (0.7, 0.9)


# ---------------------------------------------------------------- logprobs

def test_a_whole_answer_s_tokens_after_its_last_call_are_not_its_text_s():
    """A whole answer of text, a call, then a token of no text: the output_text takes its own token only; the one
    after the call, at the answer's end, is dropped (the text was not the last thing written)."""
    pieces = ["O", *CALL_PIECES, "token_id:9"]
    whole = AnswerLogprobs(None).feed(list(range(len(pieces))), [_entry(p) for p in pieces],
                                      {"content": "O", "tool_calls": [{"id": "c"}]}, last=True)
    assert [e["token"] for e in whole] == ["O"]
    shaper, streamed = AnswerLogprobs(None), []
    deltas = [{"content": "O"}, {}, {}, {"tool_calls": [{"id": "c"}]}, {}]
    for i, (piece, delta) in enumerate(zip(pieces, deltas)):
        streamed += shaper.feed([i], [_entry(piece)], delta, last=i == len(pieces) - 1)
    assert [e["token"] for e in streamed] == ["O"]


# ---------------------------------------------------------------- input_items

@pytest.mark.parametrize("order", ["", "ASC", "descending"])
def test_input_items_take_only_asc_or_desc(order):
    """`order` is "asc" or "desc", exactly (an empty `?order=` or another spelling is a 400 naming it)."""
    store = _store_with_items(3)
    with pytest.raises(APIError) as err:
        store.input_items("resp_1", order=order)
    assert err.value.status == 400 and err.value.param == "order"


def test_input_items_sent_without_an_id_get_one_prefixed_by_their_type():
    """Each input item without an id gets one of OpenAI's form for its type: msg_, fc_, fco_, rs_; one given keeps
    its own. (A reasoning item of content alone, no summary, is taken: its text is its content's.)"""
    store = ResponsesStore(4)
    req = parse_request({"input": [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "so"}]},  # (no summary: taken)
        {"role": "user", "content": "and?", "id": "msg_mine"}]})
    store.keeper(req, None)({"id": "resp_x", "status": "completed", "output": []})
    ids = [item["id"] for item in store.input_items("resp_x", order="asc")["data"]]
    assert [i.split("_")[0] for i in ids[:4]] == ["msg", "fc", "fco", "rs"] and ids[4] == "msg_mine"
    assert len(set(ids)) == 5
