"""Hunt over session 44's features (stop_reason, POST /reset_prefix_cache, OpenAI client fields, guided grammars
through non-special added tokens): the cases where a plausible bug would hide, on tiny CPU servers."""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from server_fixtures import byte_level_server, ok, post, sse, tiny_config
from test_server import wait_idle

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    config = tiny_config(num_pages=300, max_new_tokens_limit=64).with_hicache(enable=True, host_ratio=2.0,
                                                                             storage_ratio=0)
    with byte_level_server(tmp_path_factory, config) as s:
        yield s


def _reason(choice: dict) -> tuple:
    return choice["finish_reason"], choice["stop_reason"]


# -- stop_reason ----------------------------------------------------------------------------------------------
def test_echo_never_matches_a_stop_string_of_the_prompt(srv):
    """The prompt holds the stop string: echo sends it, and only generated text may match."""
    body = {"prompt": "hello", "temperature": 0, "max_tokens": 6, "stop": ["ell"]}
    plain = ok(srv, COMPLETIONS, body)["choices"][0]
    echoed = ok(srv, COMPLETIONS, {**body, "echo": True})["choices"][0]
    assert echoed["text"] == "hello" + plain["text"] and _reason(echoed) == _reason(plain)
    chunks = sse(srv, COMPLETIONS, {**body, "echo": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == echoed["text"]
    assert _reason(chunks[-1]["choices"][0]) == _reason(plain)


def test_a_stop_string_inside_min_tokens_is_no_reason(srv):
    """min_tokens: a string whose match ends in the first min_tokens tokens' text never matches."""
    body = {"prompt": "hello", "temperature": 0, "max_tokens": 6}
    free = ok(srv, COMPLETIONS, body)["choices"][0]
    ids = free["token_ids"]
    stop = free["text"][:1]
    assert stop and stop.isprintable(), free
    held = ok(srv, COMPLETIONS, {**body, "stop": [stop], "min_tokens": 6})["choices"][0]
    later = stop in free["text"][len(stop):]
    assert held["token_ids"][:len(ids)] == ids[:len(held["token_ids"])]
    if not later:
        assert _reason(held) == ("length", None), held


def test_a_guided_answer_ended_by_the_eos_has_no_stop_reason(srv):
    for stream in (False, True):
        body = {"messages": HI, "guided_choice": ["yes", "no"], "temperature": 0, "max_tokens": 20}
        if stream:
            last = [c for c in sse(srv, CHAT, body) if c["choices"]][-1]["choices"][0]
        else:
            last = ok(srv, CHAT, body)["choices"][0]
        assert _reason(last) == ("stop", None), last


def test_an_aborted_stream_with_stop_strings_leaves_the_server_serving(srv):
    body = {"prompt": "hello", "temperature": 0, "max_tokens": 60, "ignore_eos": True, "stream": True,
            "stop": ["\x01never"], "n": 2}
    with httpx.stream("POST", srv.url + COMPLETIONS, json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    wait_idle(srv)
    again = ok(srv, COMPLETIONS, {**body, "stream": False, "max_tokens": 4})
    assert [_reason(c) for c in again["choices"]] == [("length", None)] * 2


# -- /reset_prefix_cache --------------------------------------------------------------------------------------
def _cached(r: dict) -> int:
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_concurrent_resets_all_answer_and_leave_the_pools_whole(srv):
    body = {"prompt": "concurrent resets of one engine's prefix cache " * 3, "max_tokens": 4, "temperature": 0}
    first = ok(srv, COMPLETIONS, body)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        runs = [pool.submit(ok, srv, COMPLETIONS, body) for _ in range(2)]
        resets = [pool.submit(httpx.post, srv.url + "/reset_prefix_cache", timeout=60) for _ in range(4)]
        assert all(f.result().status_code == 200 for f in resets)
        assert all(f.result()["choices"][0]["token_ids"] == first["choices"][0]["token_ids"] for f in runs)
    for tier, t in wait_idle(srv)["tiers"].items():
        if t is not None:
            assert t["private_pages"] == 0 and t["free_pages"] + t["resident_pages"] == t["capacity_pages"], tier
    srv.call(srv.engine.check_integrity)


def test_a_salted_prefix_is_reset_too(srv):
    body = {"prompt": "a salted prefix is the tenant's own cache " * 2, "max_tokens": 2, "temperature": 0,
            "cache_salt": "tenant-a"}
    ok(srv, COMPLETIONS, body)
    assert _cached(ok(srv, COMPLETIONS, body)) > 0
    assert httpx.post(srv.url + "/reset_prefix_cache", timeout=60).status_code == 200
    assert _cached(ok(srv, COMPLETIONS, body)) == 0


def test_under_write_back_an_l1_reset_writes_back_first(tmp_path_factory):
    """write_back: L1's pages are the only copy; a reset of L1 alone saves them to L2, and a repeat hits there."""
    config = tiny_config(num_pages=300, max_new_tokens_limit=64).with_hicache(
        enable=True, host_ratio=2.0, storage_ratio=0, write_policy="write_back")
    with byte_level_server(tmp_path_factory, config) as s:
        body = {"prompt": "write back before the flush, or lose the only copy " * 2, "max_tokens": 4,
                "temperature": 0}
        first = ok(s, COMPLETIONS, body)
        wait_idle(s)
        r = httpx.post(s.url + "/reset_prefix_cache?tiers=l1", timeout=60)
        assert r.status_code == 200 and r.json()["pages_freed"]["l1"] > 0, r.text
        again = ok(s, COMPLETIONS, body)
        assert _cached(again) > 0 and again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        wait_idle(s)
        s.call(s.engine.check_integrity)


# -- OpenAI client fields -------------------------------------------------------------------------------------
NULLS = {"metadata": None, "store": None, "service_tier": None, "prompt_cache_key": None,
         "prompt_cache_retention": None, "prompt_cache_options": None, "safety_identifier": None}
CHAT_NULLS = {**NULLS, "reasoning_effort": None, "verbosity": None, "modalities": None, "audio": None,
              "prediction": None, "web_search_options": None, "moderation": None, "functions": None,
              "function_call": None}


def test_every_new_field_null_is_the_answer_without_it(srv):
    for path, base, nulls in [(COMPLETIONS, {"prompt": "hello"}, NULLS), (CHAT, {"messages": HI}, CHAT_NULLS)]:
        body = {**base, "temperature": 0, "max_tokens": 4}
        want = ok(srv, path, body)["choices"][0]["token_ids"]
        assert ok(srv, path, {**body, **nulls})["choices"][0]["token_ids"] == want, path


def test_a_responses_null_reasoning_effort_is_served(srv):
    for reasoning in (None, {}, {"effort": None}):
        r = post(srv, "/v1/responses", {"input": "hello", "max_output_tokens": 4, "temperature": 0,
                                        "reasoning": reasoning})
        assert r.status_code == 200, (reasoning, r.text)


def test_a_bad_responses_reasoning_effort_names_its_field(srv):
    r = post(srv, "/v1/responses", {"input": "hello", "max_output_tokens": 4, "reasoning": {"effort": "huge"}})
    assert r.status_code == 400 and "reasoning" in (r.json()["error"].get("param") or ""), r.text


# -- guided grammars through non-special added tokens ---------------------------------------------------------
@pytest.fixture(scope="module")
def added_guides(tmp_path_factory):
    pytest.importorskip("llguidance")
    from scheduler.guided import Guides
    from scheduler.tokenizer import HFTokenizer
    from tokenizer_files import write_byte_tokenizer
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), added=("<tool_call>", "<思考>"),
                                special=("<|end|>",))
    g = Guides("unused", 512, (258,))
    g.use(HFTokenizer(str(path)))
    return g


def _drive(guides, spec, pick) -> list[int]:
    import torch
    guide, taken = guides.start(spec), []
    for _ in range(64):
        row = torch.zeros(guide.words, dtype=torch.int32)
        guide.fill_mask(row)
        allowed = [t for t in range(512) if (int(row[t // 32]) >> (t % 32)) & 1]
        if guide.complete or allowed == [258]:
            return taken
        token = pick(allowed)
        assert guide.accept(token) is None, (taken, token)
        taken.append(token)
    raise AssertionError(taken)


@pytest.mark.parametrize("pick", [min, max], ids=["lowest", "highest"])
def test_a_non_ascii_added_token_and_an_enum_of_tool_call_can_be_followed(added_guides, pick):
    from scheduler.guided import GuidedSpec
    for spec, want in [(GuidedSpec("regex", "<思考>ab"), "<思考>ab"),
                       (GuidedSpec("json_schema", json.dumps({"type": "string", "enum": ["<tool_call>"]})),
                        '"<tool_call>"')]:
        taken = _drive(added_guides, spec, pick)
        assert added_guides.tokenizer.decode(taken, skip_special_tokens=False) == want, (spec, taken)
