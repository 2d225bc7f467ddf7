"""The Responses API's token logprobs (scheduler/responses_logprobs.py): `include:
["message.output_text.logprobs"]` with `top_logprobs` alternatives puts the chat's logprobs on the output_text
part and on each `response.output_text.delta` (whose logprobs add up to the whole response's); `top_logprobs`
without the include asks for nothing (vLLM's); the think block's tokens (--reasoning-parser) and a function
call's carry none."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from scheduler.api_responses import parse_request
from scheduler.reasoning import ReasoningTokens, think_markers
from scheduler.responses_logprobs import AnswerLogprobs, event_form
from scheduler.responses_output import OutputItems, ResponseOutput
import test_responses_api
from test_responses_api import _chat, _post

srv = test_responses_api.srv  # (its server fixture, reused; `client`: conftest.py)

INCLUDE = ["message.output_text.logprobs"]


def _no_bytes(entries: list[dict]) -> list[dict]:
    """The chat's entries in the events' shape (openai-python's ResponseTextDeltaEvent.Logprob: no bytes)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


def test_include_puts_the_chat_s_logprobs_on_the_output_text(srv, client):
    kw = dict(model="tiny", input="hello there", max_output_tokens=6, temperature=0, extra_body={"seed": 7})
    # the prompt cached first, so the requests compared below both hit it: a prefill over an uncached
    # prompt rounds its logprobs differently (in the 7th digit; run alone, this test failed so)
    client.responses.create(**kw)
    r = client.responses.create(**kw, include=INCLUDE, top_logprobs=3)
    chat = _chat(srv, [{"role": "user", "content": "hello there"}], max_completion_tokens=6, seed=7, logprobs=True,
                 top_logprobs=3)["choices"][0]
    assert chat["message"].get("reasoning_content") is None and not chat["message"].get("tool_calls")
    [message] = r.output
    [part] = message.content
    assert part.text == chat["message"]["content"]
    assert [lp.model_dump() for lp in part.logprobs] == chat["logprobs"]["content"]
    assert len(part.logprobs) == 6 and all(len(lp.top_logprobs) == 3 for lp in part.logprobs)
    assert r.top_logprobs == 3


def test_streamed_deltas_logprobs_add_up_to_the_whole_response_s(client):
    kw = dict(model="tiny", input="hello there", max_output_tokens=6, temperature=0, include=INCLUDE,
              top_logprobs=2)
    client.responses.create(**kw)  # the prompt cached first, as in the test above
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [lp.model_dump() for d in deltas for lp in d.logprobs]
    expected = _no_bytes([lp.model_dump() for lp in whole.output[0].content[0].logprobs])
    assert streamed == expected and len(streamed) == 6
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.model_dump() for lp in done.logprobs] == expected
    final = events[-1].response.output[0].content[0]
    assert [lp.model_dump() for lp in final.logprobs] == [lp.model_dump() for lp in whole.output[0].content[0].logprobs]


def test_top_logprobs_without_the_include_asks_for_none(client):
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=3, temperature=0, top_logprobs=5)
    assert r.output[0].content[0].logprobs is None and r.top_logprobs == 5
    with client.responses.stream(model="tiny", input="hi", max_output_tokens=3, top_logprobs=5) as stream:
        assert all(e.logprobs == [] for e in stream if e.type == "response.output_text.delta")


def test_include_without_top_logprobs_gives_the_sampled_tokens_alone(client):
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=3, temperature=0, include=INCLUDE)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == 3 and all(lp.top_logprobs == [] for lp in logprobs)


@pytest.mark.parametrize("value", [21, -1, 2.5, "3", True])
def test_top_logprobs_out_of_range_is_a_400_naming_it(srv, value):
    r = _post(srv, top_logprobs=value, include=INCLUDE)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


def test_unknown_include_values_are_still_refused(srv):
    r = _post(srv, include=[*INCLUDE, "file_search_call.results"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "include", r.text
    assert "'file_search_call.results'" in r.json()["error"]["message"]


def test_a_thought_s_tokens_carry_no_logprobs(srv, client):
    """The prompt opens a think block ("think"): every token is the reasoning item's; the chat has their logprobs,
    the (empty) output_text none of them."""
    kw = dict(model="tiny", input="hi", instructions="think", max_output_tokens=4, temperature=0)
    r = client.responses.create(**kw, include=INCLUDE, top_logprobs=1)
    chat = _chat(srv, [{"role": "system", "content": "think"}, {"role": "user", "content": "hi"}],
                 max_completion_tokens=4, logprobs=True, top_logprobs=1)["choices"][0]
    assert chat["message"]["reasoning_content"] and len(chat["logprobs"]["content"]) == 4
    assert r.output[0].type == "reasoning" and r.output_text == ""
    assert all(not getattr(p, "logprobs", None) for item in r.output for p in getattr(item, "content", None) or ())
    with client.responses.stream(**kw, include=INCLUDE, top_logprobs=1) as stream:
        assert all(e.logprobs == [] for e in stream if e.type == "response.output_text.delta")


# -- without a server: which tokens are the output_text's -----------------------------------------------------
class _Markers:
    """Think markers of one id each (as Qwen3's): 1 "<think>", 2 "</think>"; 0 is whitespace."""
    start, end = (1,), (2,)

    @staticmethod
    def blank(token_id: int) -> bool:
        return token_id == 0


def _entry(token_id: int) -> dict:
    return {"token": f"t{token_id}", "logprob": -1.0, "bytes": [116], "top_logprobs": []}


def _sides(ids: list[int], thinking: bool = False, chunks: int = 1) -> list[int]:
    """The ids whose entries go to the output_text, the answer fed in `chunks`-sized pieces as content deltas."""
    shaper = AnswerLogprobs(ReasoningTokens(_Markers(), thinking))
    out = []
    for at in range(0, len(ids), chunks):
        part = ids[at:at + chunks]
        out += shaper.feed(part, [_entry(t) for t in part], {"content": "x"})
    return [int(e["token"][1:]) for e in out]


@pytest.mark.parametrize("chunks", [1, 2, 100])
def test_only_the_tokens_after_the_think_block_are_the_output_text_s(chunks):
    assert _sides([0, 1, 5, 6, 2, 7, 8], chunks=chunks) == [7, 8]  # blank, <think>, thought, </think>, answer
    assert _sides([5, 6, 2, 7], thinking=True, chunks=chunks) == [7]  # the prompt opened the block
    assert _sides([0, 2, 7], thinking=True, chunks=chunks) == [7]
    assert _sides([0, 5, 6], chunks=chunks) == [0, 5, 6]  # no block: all of it (the blank too, as the text)
    assert _sides([5, 6], thinking=True, chunks=chunks) == []  # cut inside the thought


def test_without_a_reasoning_parser_every_token_is_the_text_s():
    shaper = AnswerLogprobs(None)
    assert shaper.feed([1, 2], [_entry(1), _entry(2)], {"content": "ab"}) == [_entry(1), _entry(2)]


def test_held_text_s_tokens_wait_for_its_content_and_a_call_s_carry_none():
    shaper = AnswerLogprobs(None)
    assert shaper.feed([3], [_entry(3)], {}) == []  # (text held by the tool parser: no delta yet)
    assert shaper.feed([4], [_entry(4)], {"content": "ab"}) == [_entry(3), _entry(4)]
    assert shaper.feed([5], [_entry(5)], {}) == []
    assert shaper.feed([6], [_entry(6)], {"tool_calls": [{"id": "c"}]}) == []  # (the call's markup)
    assert shaper.feed([7], [_entry(7)], {"content": "z"}) == [_entry(7)]
    # text and a call in one delta (a whole answer): the text's tokens, not the call block's
    shaper = AnswerLogprobs(None)
    entries = [{**_entry(t), "token": piece} for t, piece in enumerate(["He", "y", "<tool", "_call>", '{"name": "f"}',
                                                                        "</tool_call>"])]
    assert shaper.feed([0, 1, 2, 3, 4, 5], entries, {"content": "Hey", "tool_calls": [{"id": "c"}]}) == entries[:2]


def test_output_items_carry_logprobs_on_the_text_only():
    items = OutputItems(logprobs=True)
    events = items.feed({"reasoning_content": "hm"}, [])
    events += items.feed({"content": "ab"}, [_entry(1), _entry(2)])
    events += items.feed({"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}, [])
    events += items.close("completed")
    [delta] = [e for e in events if e["type"] == "response.output_text.delta"]
    assert delta["logprobs"] == event_form([_entry(1), _entry(2)])
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == event_form([_entry(1), _entry(2)])
    reasoning, message, call = items.items
    assert message["content"][0]["logprobs"] == [_entry(1), _entry(2)]
    assert "logprobs" not in reasoning["content"][0] and "logprobs" not in call


def test_a_response_s_text_after_a_thought_carries_its_tokens_alone_whole_and_streamed():
    """Through ResponseOutput, a chat answer (--reasoning-parser) of "<think>" (1) "hm" (5) "</think>" (2) then
    "ok" (7) "!" (8): the output_text's logprobs are 7's and 8's, whole and streamed."""
    entries = {t: _entry(t) for t in (1, 5, 2, 7, 8)}

    class Tokenizer:
        def encode(self, text, add_special_tokens=False):
            return {"<think>": [1], "</think>": [2]}[text]

        def decode(self, ids, skip_special_tokens=False):
            return " " if ids == [0] else "x"

    class ThinkingChoices:
        rid, created, model, parses = "chatcmpl-abc", 1, "tiny", True
        gens = [SimpleNamespace(req=SimpleNamespace(params=SimpleNamespace(temperature=0.0, top_p=1.0)),
                                st=SimpleNamespace(tokenizer=Tokenizer()))]
        usage = {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens": 5,
                 "total_tokens": 6}

        def reasoning_counter(self, gen):  # (a parser; the prompt opened no think block)
            return ReasoningTokens(think_markers(gen.st.tokenizer), thinking=False)

        def usage_body(self):
            return self.usage

        async def body(self, request):
            message = {"role": "assistant", "reasoning_content": "hm", "content": "ok!", "tool_calls": []}
            return {"choices": [{"message": message, "finish_reason": "stop", "token_ids": list(entries),
                                 "logprobs": {"content": list(entries.values())}}], "usage": self.usage}

        async def sse(self):
            for t, delta in ((1, {}), (5, {"reasoning_content": "hm"}), (2, {}), (7, {"content": "ok"}),
                             (8, {"content": "!"})):
                choice = {"index": 0, "delta": delta, "token_ids": [t], "logprobs": {"content": [entries[t]]},
                          "finish_reason": "stop" if t == 8 else None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            yield "data: [DONE]\n\n"

    req = parse_request({"input": "hi", "include": INCLUDE, "top_logprobs": 0})

    async def run():
        whole = json.loads((await ResponseOutput(ThinkingChoices(), req).complete(None)).body)
        events = [json.loads(block.split("\ndata: ")[1]) async for block in ResponseOutput(ThinkingChoices(), req).sse()]
        return whole, events

    whole, events = asyncio.run(run())
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and message["content"][0]["logprobs"] == [entries[7], entries[8]]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [lp for d in deltas for lp in d["logprobs"]] == event_form([entries[7], entries[8]])
    assert events[-1]["response"]["output"][1]["content"][0]["logprobs"] == [entries[7], entries[8]]
