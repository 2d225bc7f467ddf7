"""Session 79's second mutation pass (scheduler/speculative.py, beam search, the Responses output, step_extras,
tokenizer, reservations, the Redis hints, the cost policy): each test kills a mutant no test noticed, named in its
docstring (the table is in the session's report)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from hicache.radix import Tier
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

PAGE_TOKENS = 4


# -- scheduler/reservations.py ---------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_new_blocked_head_of_the_same_length_is_walked_again_with_no_l1_change():
    """The head the last pass found no room for was aborted, and the next one (a prompt of the same length, whose first
    page L1 holds, locked by another request) is blocked in its place with no change to L1 between: whether it is still
    blocked is told by its own L1 prefix, not the aborted head's walk (mutant: `kept[0] is not head or` dropped in
    scheduler/reservations.py `_head_l1_prefix`, the walk kept by prefill length and L1's change count alone)."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE_TOKENS, num_pages=12))
    prefix = [5, 6, 7, 8]
    await eng.generate_async([prefix + [9]], SamplingParams(max_tokens=1))  # (its page is published, unlocked)
    await eng.stop_loop()
    adm, cache = eng.admission, eng.cache
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    first = eng.add_request([20, 21, 22, 23, 24, 25, 26, 27], params)  # (no L1 prefix)
    head = eng.add_request(prefix + [10, 11, 12, 13], params)  # (the same length: its first page in L1)
    need = adm._pages_after(first, 0)
    adm.reserved_pages += adm._l1_room_pages() - need + 1  # (others' reservations: the first one page short)
    assert await adm._admit(first) is False and adm.memory_blocked[0] == first.rid
    changes = cache.tree.changes[Tier.L1]
    assert adm._head_still_blocked()  # (its walk: no L1 prefix)
    assert await eng.abort(first.rid)
    eng._settle_aborts()
    assert await adm._admit(head) is False and adm.memory_blocked[0] == head.rid  # (its page evictable: counted)
    m = cache.tree.match(adm._reusable(head), include_storage=False, touch=False)
    assert m.lengths[Tier.L1] == PAGE_TOKENS
    cache.lock(m.handles[Tier.L1])  # another request takes the prefix: the room overall falls by its page
    adm.reserved_pages -= 1  # and a page comes back: the head, which needs one page less than the first, now fits
    assert cache.tree.changes[Tier.L1] == changes  # (no L1 change since the first head's walk)
    assert adm._pages_after(head, PAGE_TOKENS) == adm._room_beside(m.handles[Tier.L1])
    assert not adm._head_still_blocked()
    cache.unlock(m.handles[Tier.L1])
    adm.reserved_pages -= adm.reserved_pages
    await eng.shutdown()


# -- scheduler/responses_output.py -----------------------------------------------------------------------------------
def test_an_answer_with_nothing_in_it_is_one_empty_message():
    """A chat answer of no text and no call (its first token an EOS, say), whole or streamed, is a Response of one
    empty, finished message, as OpenAI's: a client reads the answer's text from it (mutant: `if not self.items:`
    dropped in scheduler/responses_output.py `OutputItems.close`, an output of no item)."""
    from scheduler.responses_output import OutputItems
    for logprobs in (False, True):
        items = OutputItems(logprobs)
        events = items.feed({"role": "assistant", "content": ""}) + items.close("completed")
        [message] = items.items
        assert message["type"] == "message" and message["status"] == "completed"
        assert [p["text"] for p in message["content"]] == [""]
        assert [e["type"] for e in events] == ["response.output_item.added", "response.content_part.added",
                                               "response.output_text.done", "response.content_part.done",
                                               "response.output_item.done"]



def _stream_ending_in(code: str):
    """Choices of one answer that writes "Hi", then ends in an error chunk of `code` (scheduler/choices.py's)."""
    class Choices:
        rid, created, model = "chatcmpl-abc", 1, "tiny"
        gens = [SimpleNamespace(req=SimpleNamespace(params=SimpleNamespace(temperature=0.0, top_p=1.0)))]

        async def sse(self):
            for chunk in ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                                        "finish_reason": None}]},
                          {"error": {"message": "gone", "type": "server_error", "param": None, "code": code}}):
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
    return Choices()


@pytest.mark.parametrize("code, kept", [("aborted", 0), ("engine_error", 1)])
def test_a_stream_aborted_keeps_no_failed_response(code, kept):
    """A stored stream that the engine aborted (its client went away, or the server stops) ends failed, and is not
    kept: nobody reads it back; one that failed is kept, as OpenAI's (mutants: `and not aborted` dropped in
    scheduler/responses_output.py `ResponseOutput._kept_failed`; `aborted=error["code"] == "aborted"` dropped in
    `ResponseOutput.events`)."""
    from scheduler.api_responses import parse_request
    from scheduler.responses_output import ResponseOutput
    kept_responses: list[dict] = []

    async def run() -> list[dict]:
        out = ResponseOutput(_stream_ending_in(code), parse_request({"input": "hi"}), keep=kept_responses.append)
        return [json.loads(block.split("\ndata: ")[1]) async for block in out.sse()]

    events = asyncio.run(run())
    assert events[-1]["type"] == "response.failed"
    assert len(kept_responses) == kept

