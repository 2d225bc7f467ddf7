"""The Responses store is bounded by the bytes of its responses' JSON as well as by their count (the leak hunt,
session 53: 40 responses of 2,000 tokens with logprobs took 640 MiB under the count of 1,000 alone)."""
from __future__ import annotations

import subprocess
import sys


from scheduler.responses_store import ResponsesStore, StoredResponse, json_bytes
from scheduler.server import ServerLimits
from test_responses_store import _get, _missing, _ok, _server


def big(rid: str, chars: int) -> StoredResponse:
    return StoredResponse(response={"id": rid, "status": "completed", "text": "x" * chars}, conversation=(),
                          input_items=())


def test_the_least_recently_used_go_until_the_bytes_fit():
    one = json_bytes(big("a", 1000).response) + 2 * json_bytes(())  # (its input items and its conversation: none)
    store = ResponsesStore(max_responses=100, max_bytes=3 * one)
    for rid in "abc":
        store.put(big(rid, 1000))
    assert len(store) == 3 and store.kept_bytes == 3 * one
    store.response("a")  # (a: used last)
    store.put(big("d", 1000))
    assert "b" not in store and all(r in store for r in "acd") and store.kept_bytes == 3 * one
    store.put(big("e", 1900))  # (the room of almost two: c and a go, in that order)
    assert sorted(store._kept) == ["d", "e"] and store.kept_bytes <= 3 * one
    store.delete("d")
    assert store.kept_bytes == json_bytes(big("e", 1900).response) + 2 * json_bytes(())


def test_one_larger_than_the_whole_bound_is_not_kept():
    store = ResponsesStore(max_responses=10, max_bytes=5000)
    store.put(big("small", 100))
    store.put(big("huge", 10_000))
    assert "huge" not in store and "small" in store
    store.put(big("small", 10_000))  # (kept again, too large now: it goes)
    assert len(store) == 0 and store.kept_bytes == 0


def test_the_server_bounds_its_store_by_the_flag(tmp_path_factory):
    with _server(tmp_path_factory, responses_store_max_mib=1) as s:
        store = s.app.state.hc.responses
        assert store.max_bytes == 1 << 20
        first = _ok(s, input="one")
        assert _get(s, first["id"]).status_code == 200 and store.kept_bytes > 0
        store.max_bytes = store.kept_bytes  # (the next one does not fit beside it: the first goes)
        second = _ok(s, input="two")
        _missing(_get(s, first["id"]), first["id"])
        assert _get(s, second["id"]).status_code == 200


def test_the_flag_is_checked():
    ran = subprocess.run([sys.executable, "-m", "scheduler.serve", "--model", "tiny", "--responses-store-max-mib", "0"],
                         capture_output=True, text=True)
    assert ran.returncode == 2 and "--responses-store-max-mib" in ran.stderr
    assert ServerLimits().responses_store_max_mib == 64


def test_a_kept_turn_counts_the_conversation_it_ends():
    """Regression (session 58's hunt): the bound left out a kept response's conversation, so the latest turn of a
    long conversation, its earlier turns dropped, kept the whole history beyond --responses-store-max-mib. A turn
    whose history alone exceeds the bound is not kept; one that fits counts it."""
    history = tuple({"role": "user", "content": "y" * 1000} for _ in range(10))  # (~10 KB of earlier turns)
    turn = StoredResponse(response={"id": "t", "status": "completed", "text": "z"}, conversation=history,
                          input_items=())
    store = ResponsesStore(max_responses=10, max_bytes=5000)
    store.put(turn)
    assert "t" not in store and store.kept_bytes == 0
    store = ResponsesStore(max_responses=10, max_bytes=50_000)
    store.put(turn)
    assert "t" in store and store.kept_bytes == json_bytes(turn.response) + 2 + json_bytes(history)


def test_the_store_bounds_help_names_the_conversation():
    """--responses-store-max-mib's help lists what the bound counts; since 70eb80b a kept response's conversation
    counts too (regression, session 59's docs hunt: the help still listed the response, its input and events only)."""
    from scheduler.serve import build_parser

    action = next(a for a in build_parser()._actions if "--responses-store-max-mib" in a.option_strings)
    assert "conversation" in action.help, action.help
