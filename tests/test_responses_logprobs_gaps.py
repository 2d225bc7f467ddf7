"""The Responses API's output_text logprobs (scheduler/responses_logprobs.py, scheduler/responses_output.py) where
an answer has text after a tool call, and where it ends in tokens that show no text: each output_text carries its
own text's tokens, whole and streamed; a stream's deltas' logprobs add up to the whole response's, and no
`response.output_text.delta` is empty.

The answers are forced over HTTP: the chat body a Responses request is served by gets a `guided_regex` (and
`stop`) the Responses API has no field for (`_forced`)."""
from __future__ import annotations

import json

import httpx
import pytest

from scheduler import api_responses
from scheduler.reasoning import ReasoningTokens
from scheduler.responses_logprobs import AnswerLogprobs, event_form
from scheduler.responses_output import OutputItems
import test_responses_api
from test_responses_api import WEATHER
from test_tool_calls_hunt import _regex

srv = test_responses_api.srv  # (its server fixture: hermes, qwen3; `client`: conftest.py)

INCLUDE = ["message.output_text.logprobs"]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>'


def _forced(monkeypatch, answer: str, **chat_fields) -> None:
    """Responses requests answer `answer` exactly (a guided regex on the chat that serves them)."""
    chat_body = api_responses.chat_body
    monkeypatch.setattr(api_responses, "chat_body", lambda req, history=(): {
        **chat_body(req, history), "guided_regex": _regex(answer), **chat_fields})


def _whole_and_streamed(srv, **body) -> tuple[dict, list[dict]]:
    body = {"model": "tiny", "input": "weather?", "max_output_tokens": 200, "temperature": 0, "include": INCLUDE,
            "top_logprobs": 1, **body}
    whole = httpx.post(srv.url + "/v1/responses", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    return whole.json(), events


def _texts(response: dict) -> list[tuple[str, list[dict]]]:
    """Each output_text's (text, logprobs)."""
    return [(p["text"], p["logprobs"]) for item in response["output"] if item["type"] == "message"
            for p in item["content"]]


def _pieces(logprobs: list[dict]) -> str:
    return "".join(lp["token"] for lp in logprobs)


def _check_stream(whole: dict, events: list[dict]) -> list[dict]:
    """A stream's invariants: no empty delta; each message's deltas' logprobs are its output_text.done's and its
    final part's; all of them together the whole response's. Its deltas."""
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(d["delta"] for d in deltas), [d for d in deltas if not d["delta"]]
    dones = [e for e in events if e["type"] == "response.output_text.done"]
    final = _texts(events[-1]["response"])
    assert len(dones) == len(final)
    for done, (text, logprobs) in zip(dones, final):
        mine = [d for d in deltas if d["item_id"] == done["item_id"]]
        assert "".join(d["delta"] for d in mine) == done["text"] == text
        assert [lp for d in mine for lp in d["logprobs"]] == done["logprobs"] == event_form(logprobs)
        last_delta = max(e["sequence_number"] for e in mine)
        assert last_delta < done["sequence_number"]
    streamed, expected = ([lp for d in deltas for lp in d["logprobs"]],
                          event_form([lp for _, lps in _texts(whole) for lp in lps]))
    assert [lp["token"] for lp in streamed] == [lp["token"] for lp in expected]  # (another request: the values
    assert [lp["logprob"] for lp in streamed] == pytest.approx([lp["logprob"] for lp in expected], abs=1e-4)
    return deltas  # may differ in their last digits, its prompt read from the prefix cache)


def test_text_after_a_call_carries_its_own_tokens_whole_and_streamed(srv, monkeypatch):
    """A whole response's one output_text holds the text before the call and after it (regression: the tokens
    after the call carried no logprobs); a stream's two messages each their own; the call's carry none."""
    _forced(monkeypatch, "Let me check.\n" + CALL + "\nDone.")
    whole, events = _whole_and_streamed(srv, tools=[WEATHER])
    assert [i["type"] for i in whole["output"]] == ["message", "function_call"]
    [(text, logprobs)] = _texts(whole)
    assert text == "Let me check.\nDone." and _pieces(logprobs) == text  # (one byte token a character)
    _check_stream(whole, events)
    assert [(t, _pieces(lps)) for t, lps in _texts(events[-1]["response"])] == [
        ("Let me check.", "Let me check."), ("\nDone.", "\nDone.")]


@pytest.mark.parametrize("answer, text", [
    ("Voilà.\n" + CALL + "\nFini ✓", "Voilà.\nFini ✓"),  # (regression: pieces matched to text stopped at "à")
    ("A " + CALL + "\n" + CALL + "\n\nB", "A B"),  # between and after calls
    (CALL + "\nDone.", "Done."),  # an answer that opens with a call
])
def test_every_token_of_text_around_calls_is_the_output_text_s_once(srv, monkeypatch, answer, text):
    """One byte token a byte (a piece of a character of several: "\ufffd"): an output_text's logprobs are its
    text's tokens, each once, those of the call blocks left out; the blanks next to a call that the parser drops
    or joins the texts by may differ (a blank it drops after a call goes with the text that follows, as a stream
    gives it)."""
    _forced(monkeypatch, answer)
    whole, events = _whole_and_streamed(srv, tools=[WEATHER])
    [(got, logprobs)] = _texts(whole)
    assert got == text
    byte_pieces = "".join(ch if ch.isascii() else "\ufffd" * len(ch.encode()) for ch in text)
    assert "".join(_pieces(logprobs).split()) == "".join(byte_pieces.split())
    _check_stream(whole, events)


def test_a_stream_that_ends_in_tokens_of_no_text_sends_no_empty_delta(srv, monkeypatch):
    """The last tokens' text is cut (a stop string here; an EOS, a token that decodes to nothing alike): their
    logprobs join the last delta that has text (regression: an empty delta carried them), as the whole response's
    output_text has them."""
    _forced(monkeypatch, "Hello world", stop=["orld"])
    whole, events = _whole_and_streamed(srv)
    [(text, logprobs)] = _texts(whole)
    assert text == "Hello w" and _pieces(logprobs) == "Hello world"
    deltas = _check_stream(whole, events)
    assert deltas[-1]["delta"] == "w" and [lp["token"] for lp in deltas[-1]["logprobs"]] == list("world")


# -- without a server ----------------------------------------------------------------------------------------
def _entry(piece: str) -> dict:
    return {"token": piece, "logprob": -1.0, "bytes": list(piece.encode()), "top_logprobs": []}


def test_a_last_token_of_no_text_joins_the_last_delta():
    """An EOS (its text left out) ends the answer: no delta of "", its logprob on the text's last delta."""
    items = OutputItems(logprobs=True)
    shaper = AnswerLogprobs(None)
    events = []
    for ids, entry, delta, last in (([1], _entry("a"), {"content": "a"}, False),
                                    ([2], _entry("b"), {"content": "b"}, False),
                                    ([3], _entry("token_id:3"), {}, True)):
        events += items.feed(delta, shaper.feed(ids, [entry], delta, last=last))
    events += items.close("completed")
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(d["delta"], [lp["token"] for lp in d["logprobs"]]) for d in deltas] == [("a", ["a"]),
                                                                                    ("b", ["b", "token_id:3"])]
    assert items.items[0]["content"][0]["logprobs"] == [_entry("a"), _entry("b"), _entry("token_id:3")]
    # a stream's chunk of text and a call (its text written first, the call ending the message), then a last
    # token of no text: no text is open to take it, it is dropped (no empty delta, no failure)
    items = OutputItems(logprobs=True)
    events = items.feed({"content": "a", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
                        [_entry("a")])
    events += items.feed({}, [_entry("token_id:3")]) + items.close("completed")
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(d["delta"], d["logprobs"]) for d in deltas] == [("a", event_form([_entry("a")]))]


def test_a_whole_answer_s_text_around_calls_is_read_token_by_token():
    """A whole answer (one delta, text and calls): the tokens of the call blocks left out, the text's after them
    kept, whatever its characters (a piece of an incomplete character is no prefix of the text)."""
    pieces = ["O", "\ufffd", "\ufffd", "\n", "<tool_call>", '{"name": "f"}', "</tool_call>", "\n", "z", "token_id:9"]
    entries = [_entry(p) for p in pieces]
    taken = AnswerLogprobs(None).feed(list(range(len(pieces))), entries,
                                      {"content": "Oé\nz", "tool_calls": [{"id": "c"}]}, last=True)
    assert [e["token"] for e in taken] == ["O", "\ufffd", "\ufffd", "\n", "z", "token_id:9"]


class _Markers:
    """Think markers of one id each (as Qwen3's): 1 "<think>", 2 "</think>"."""
    start, end = (1,), (2,)

    @staticmethod
    def blank(token_id: int) -> bool:
        return False


def test_a_whole_answer_s_thought_then_text_around_a_call():
    """--reasoning-parser and hermes: the thought's tokens (markers too) and the call's carry none; the text's
    before the call and after it are the output_text's (the blank before the call dropped with it, the one the
    text after it starts with its own)."""
    pieces = ["<think>", "hm", "</think>", "Ok", "\n", "<tool_call>", '{"name": "f"}', "</tool_call>", "\nDone"]
    shaper = AnswerLogprobs(ReasoningTokens(_Markers(), thinking=False))
    taken = shaper.feed([1, 5, 2, 10, 11, 12, 13, 14, 15], [_entry(p) for p in pieces],
                        {"reasoning_content": "hm", "content": "Ok\nDone", "tool_calls": [{"id": "c"}]}, last=True)
    assert [e["token"] for e in taken] == ["Ok", "\nDone"]
