"""What session 67's re-check of scheduler/choices.py (choices67) found unpinned: a stream's stop_reason is in
each choice's last chunk only (vLLM's: None in a choice's earlier chunks), even where that choice's events ran
ahead of the chunks rendered: a Generation sets its `stop_reason` just before it yields its end, and with n > 1
merge's reader for a choice may queue that end before the stream renders the choice's earlier items, so a chunk
must take the stop_reason from its own end (`fin`), not from the Generation's attribute as it is by then.
No server: `Choices` over test_mutation_sched2_s60's fake choices."""
from __future__ import annotations

import asyncio
import json

from test_mutation_sched2_s60 import _choices, _end, _Gen


class _StoppingGen(_Gen):
    """A fake choice that, as Generation.events, sets its stop_reason just before it yields its end."""

    def __init__(self, prompt: list[int], items: list[tuple], reason: str | int) -> None:
        super().__init__(prompt, items)
        self.reason = reason

    async def events(self):
        for item in self.items:
            if item[2] is not None:
                self.stop_reason = self.reason
            yield item


def _stream(gens) -> list[dict]:
    async def read():
        return [chunk async for chunk in _choices(gens, n=len(gens), max_tokens=3, stream=True).sse()]
    return [json.loads(c[6:]) for c in asyncio.run(read()) if c != "data: [DONE]\n\n"]


def test_a_stream_s_stop_reason_is_in_each_choice_s_last_chunk_only():
    """n = 2, each choice ended by a stop (a string, a token id) after 3 tokens: its first two chunks carry
    stop_reason None and finish_reason None, its last its stop_reason beside finish_reason "stop"."""
    def items(ids):
        return [(chr(96 + t), [t], None, []) for t in ids[:-1]] + [(chr(96 + ids[-1]), ids[-1:], _end("stop"), [])]
    gens = [_StoppingGen([1, 2], items([5, 6, 7]), "###"), _StoppingGen([1, 2], items([8, 9, 10]), 42)]
    got: dict[int, list[tuple]] = {}
    for chunk in _stream(gens):
        [c] = chunk["choices"]
        got.setdefault(c["index"], []).append((c["text"], c["finish_reason"], c["stop_reason"]))
    assert got == {0: [("e", None, None), ("f", None, None), ("g", "stop", "###")],
                   1: [("h", None, None), ("i", None, None), ("j", "stop", 42)]}
