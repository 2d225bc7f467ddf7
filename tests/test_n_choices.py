"""OpenAI's `n` (choices per prompt) on /v1/completions and /v1/chat/completions (scheduler/api_models.py,
scheduler/server.py, scheduler/choices.py): it was a 400 "'n' must be 1". Each choice is its own engine
request (as each prompt of a batch is), so P prompts with n give P * n choices, choice index
prompt_index * n + j; usage counts each prompt's tokens once and every choice's completion tokens; each
choice holds one of --max-concurrent-requests; with a seed, choice j samples with seed + j (vLLM's
derivation), so the choices differ and a repeat repeats them. Real servers on the CPU (tiny preset); the
harness is tests/test_server.py's."""
from __future__ import annotations

import json
import math

import httpx
import pytest

from scheduler.api_models import N_MAX
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from server_fixtures import byte_level_server, tiny_config
from test_server import ServerThread, assert_pools_whole, wait_idle
from test_stop_batch_api import busy_then_fits, leave_and_check_aborts, small_srv  # noqa: F401  (small_srv: the fixture)

HI = [{"role": "user", "content": "hi"}]
SAMPLED = {"temperature": 1.0, "seed": 1234, "ignore_eos": True}
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    config = tiny_config(num_pages=400, max_new_tokens_limit=64).with_hicache(enable=True, host_ratio=2.0)
    with byte_level_server(tmp_path_factory, config) as s:
        yield s


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, path: str, body: dict) -> list[dict]:
    """A stream's chunks; framing checked: `data: {...}` events, then exactly one `data: [DONE]`."""
    with httpx.Client(timeout=60) as c, c.stream("POST", url + path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and events.count("data: [DONE]") == 1, events[-3:]
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


def _text(choice: dict) -> str:
    if "message" in choice:
        return choice["message"]["content"]
    return choice["text"] if "text" in choice else choice["delta"].get("content") or ""


def _ids(r: dict) -> list[list[int]]:
    return [c["token_ids"] for c in r["choices"]]


# -- shapes --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n_choices_whole_and_streamed(srv, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 6, **SAMPLED, **({"messages": HI} if chat else {"prompt": "hello there"})}
    single = _post(srv.url, path, body)
    r = _post(srv.url, path, {**body, "n": 3})
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["finish_reason"] for c in r["choices"]] == ["length"] * 3
    assert all(len(ids) == 6 for ids in _ids(r))
    usage = r["usage"]  # the prompt once (OpenAI's count), every choice's completion tokens
    assert usage["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == 18 and usage["total_tokens"] == usage["prompt_tokens"] + 18
    assert usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    # streamed: the same choices (seeded), interleaved, each chunk naming its choice; one usage at the end
    *chunks, last = _stream(srv.url, path, {**body, "n": 3, "stream_options": {"include_usage": True}})
    assert last["choices"] == [] and (last["usage"]["prompt_tokens"], last["usage"]["completion_tokens"]) == \
        (usage["prompt_tokens"], 18)
    assert all(len(ch["choices"]) == 1 and ch["usage"] is None for ch in chunks)
    assert {ch["choices"][0]["index"] for ch in chunks} == {0, 1, 2}
    for i, want in enumerate(r["choices"]):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == i]
        assert "".join(_text(c) for c in mine) == _text(want)
        assert [t for c in mine for t in c["token_ids"]] == want["token_ids"]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
        if chat:  # each choice's first delta carries the role
            assert mine[0]["delta"]["role"] == "assistant" and all("role" not in c["delta"] for c in mine[1:])
    assert_pools_whole(srv)


def test_the_openai_client_reads_n_choices(client):
    r = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, n=3, seed=9, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 12
    chat = client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, n=2, seed=9)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, n=2, seed=9,
                                                 stream=True))
    for i, want in enumerate(chat.choices):
        got = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices[0].index == i)
        assert got == want.message.content


def test_a_prompt_list_with_n_gives_prompt_major_choices(srv):
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    body = {"max_tokens": 8, **GREEDY}
    singles = [_post(srv.url, "/v1/completions", {**body, "prompt": p}) for p in prompts]
    r = _post(srv.url, "/v1/completions", {**body, "prompt": prompts, "n": 2})
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    # index = prompt_index * n + j: greedy, so each prompt's two choices are its single answer
    want = [singles[0]["choices"][0]["token_ids"]] * 2 + [singles[1]["choices"][0]["token_ids"]] * 2
    assert _ids(r) == want
    assert r["usage"]["prompt_tokens"] == 5 + 3 and r["usage"]["completion_tokens"] == 4 * 8
    chunks = _stream(srv.url, "/v1/completions", {**body, "prompt": prompts, "n": 2})
    for i, ids in enumerate(want):
        assert [t for ch in chunks if ch["choices"][0]["index"] == i for t in ch["choices"][0]["token_ids"]] == ids
    assert_pools_whole(srv)


# -- sampling ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_greedy_n_choices_are_the_same_text(srv, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 10, **GREEDY, **({"messages": HI} if chat else {"prompt": "abc"})}
    r = _post(srv.url, path, {**body, "n": 4})
    assert len(r["choices"]) == 4 and len({_text(c) for c in r["choices"]}) == 1
    assert len({tuple(ids) for ids in _ids(r)}) == 1


def test_seeded_choices_differ_and_repeat_and_choice_j_samples_with_seed_plus_j(srv):
    body = {"prompt": "hello", "max_tokens": 12, **SAMPLED}
    r = _post(srv.url, "/v1/completions", {**body, "n": 4})
    assert len({tuple(ids) for ids in _ids(r)}) == 4  # distinct seeds: distinct samples
    assert _ids(_post(srv.url, "/v1/completions", {**body, "n": 4})) == _ids(r)  # and a repeat repeats them
    # the documented derivation: choice j is the request with seed + j (choice 0: n=1's own answer)
    for j in range(4):
        alone = _post(srv.url, "/v1/completions", {**body, "seed": body["seed"] + j})
        assert alone["choices"][0]["token_ids"] == r["choices"][j]["token_ids"], j
    # the seed's 64-bit range wraps (two's complement, as the generator reads a seed): no 400 at its top
    top = _post(srv.url, "/v1/completions", {**body, "seed": (1 << 64) - 1, "n": 2})
    assert _ids(top)[1] == _post(srv.url, "/v1/completions", {**body, "seed": 0})["choices"][0]["token_ids"]


def test_unseeded_choices_draw_independently(srv):
    r = _post(srv.url, "/v1/completions", {"prompt": "hello", "max_tokens": 12, "temperature": 1.0, "n": 4,
                                           "ignore_eos": True})
    assert len({tuple(ids) for ids in _ids(r)}) == 4


def _same_logprobs(a, b) -> bool:
    """Equal shapes, tokens and ids; logprobs within float noise (a batch's rows differ in their last bits)."""
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, abs_tol=1e-4)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same_logprobs(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same_logprobs, a, b))
    return a == b


def test_logprobs_per_choice(srv):
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 5, **SAMPLED, "logprobs": 2}
    r = _post(srv.url, "/v1/completions", {**body, "n": 3})
    for j, choice in enumerate(r["choices"]):
        alone = _post(srv.url, "/v1/completions", {**body, "seed": body["seed"] + j})["choices"][0]
        assert len(choice["logprobs"]["tokens"]) == 5 and _same_logprobs(choice["logprobs"], alone["logprobs"])
    assert len({tuple(c["logprobs"]["tokens"]) for c in r["choices"]}) == 3  # each choice's own
    chat = {"messages": HI, "max_tokens": 4, **SAMPLED, "logprobs": True, "top_logprobs": 1}
    r = _post(srv.url, "/v1/chat/completions", {**chat, "n": 2})
    for j, choice in enumerate(r["choices"]):
        alone = _post(srv.url, "/v1/chat/completions", {**chat, "seed": chat["seed"] + j})["choices"][0]
        assert len(choice["logprobs"]["content"]) == 4 and _same_logprobs(choice["logprobs"], alone["logprobs"])
    chunks = _stream(srv.url, "/v1/chat/completions", {**chat, "n": 2})
    for j, choice in enumerate(r["choices"]):
        streamed = [e for ch in chunks if ch["choices"][0]["index"] == j and ch["choices"][0]["logprobs"]
                    for e in ch["choices"][0]["logprobs"]["content"]]
        assert _same_logprobs(streamed, choice["logprobs"]["content"])


# -- validation ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("n,code", [(0, "invalid_value"), (-1, "invalid_value"), (N_MAX + 1, "invalid_value"),
                                    ("2", "invalid_type"), (2.0, "invalid_type"), (True, "invalid_type")])
def test_n_outside_its_range_or_not_an_integer_is_a_400(srv, chat, n, code):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    before = wait_idle(srv)["engine"]
    r = httpx.post(srv.url + path, json={"n": n, "max_tokens": 2, **({"messages": HI} if chat else {"prompt": [1]})},
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("n", code), err
    if code == "invalid_value":
        assert f"[1, {N_MAX}]" in err["message"], err
    assert wait_idle(srv)["engine"]["prefill_tokens"] == before["prefill_tokens"]  # nothing was queued


def test_n_at_its_cap_is_served_and_best_of_is_still_refused(srv):
    r = _post(srv.url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "n": N_MAX})
    assert [c["index"] for c in r["choices"]] == list(range(N_MAX))
    bad = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2], "n": 2, "best_of": 2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "best_of", bad.text
    assert_pools_whole(srv)


# -- limits and disconnects ----------------------------------------------------------------------------------
def test_each_choice_counts_against_max_concurrent_requests(small_srv):
    s = small_srv
    for body in ({"prompt": [1, 2], "n": 4}, {"prompt": [[1, 2], [3, 4]], "n": 2}):  # more than 3 in all: never
        r = httpx.post(s.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("n", "batch_too_large") and "--max-concurrent-requests" in \
            err["message"], err
    assert len(_post(s.url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "n": 3})["choices"]) == 3

    busy_then_fits(s, {"prompt": [1, 2], "n": 3, "max_tokens": 2}, {"prompt": [1, 2], "n": 2, "max_tokens": 2})


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_leaving_aborts_all_n_engine_requests(small_srv, stream):
    leave_and_check_aborts(small_srv, {"prompt": [3, 4, 5], "n": 3, "max_tokens": 1000, **SAMPLED}, stream, requests=3)


# -- failures ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [True, False], ids=["batch", "one_prompt"])
def test_an_engine_failure_under_n_names_the_choice(batch):
    """A choice the engine fails (its cached prefix is corrupt: NaN K/V) fails the request, and the error
    names that choice, and its prompt in a batch (regression: under n it named the prompt only)."""
    from test_sampling_hunt import _poison_l1_prefix

    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256, max_new_tokens_limit=64))
    bad = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
        _post(s.url, "/v1/completions", {"prompt": bad, "max_tokens": 2})  # its prefix is now in L1
        s.call(_poison_l1_prefix, engine, bad[:8])
        body = {"prompt": [[30, 31, 32], bad] if batch else bad, "max_tokens": 40, "n": 2, **GREEDY}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        where = "prompt 1 of the batch, choice " if batch else "choice "
        assert err["message"].startswith(where) and err["message"][len(where)] in "01", err
        assert err["message"][len(where) + 1:].startswith(" of 2: the engine failed this request"), err
        assert (err["param"], err["code"]) == ("prompt.1" if batch else None, "engine_error"), err
        wait_idle(s)
        s.call(engine.check_integrity)
