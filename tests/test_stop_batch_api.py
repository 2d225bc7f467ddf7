"""Stop strings and batches of prompts on the OpenAI-compatible API (scheduler/stop_strings.py,
scheduler/choices.py, scheduler/server.py, scheduler/api_models.py): both were 400s ("stop strings
are not supported", "this server takes one prompt per request") that real clients hit (LangChain and
lm-eval send `stop`; the openai SDK's `prompt=[...]`). Real servers on the CPU (tiny preset, greedy);
the harness is tests/test_server.py's. Expected results are computed from the unconstrained output
of the same request: its per-token text (the pieces of its stream), then the earliest token after
which the text holds a stop string. The matcher, the validation of `stop` and the engine's end of a
stopped request, without a server, are in tests/test_stop_strings.py."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import ByteTokenizer, HFTokenizer
from test_http_hunt2 import _open_stream
from test_server import ServerThread, assert_pools_whole, wait_idle
from test_server_text import _write_byte_level_tokenizer

TOK = ByteTokenizer(512)
GREEDY = {"temperature": 0, "ignore_eos": True}


# -- a server -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv():
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=200,
                                 max_new_tokens_limit=64).with_hicache(enable=True, host_ratio=2.0))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
        s.engine = engine
        yield s


def _post(url: str, body: dict, path: str = "/v1/completions") -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, body: dict, path: str = "/v1/completions") -> list[dict]:
    """The chunks of a stream; framing checked: `data: {...}` events, then exactly one `data: [DONE]`."""
    with httpx.Client(timeout=60) as c, c.stream("POST", url + path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and events.count("data: [DONE]") == 1, events[-3:]
    assert all(e.startswith("data: {") for e in events[:-2]), events
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


def _text(choice: dict) -> str:
    """A choice's text: a completion's, a chat message's, or a chat chunk's delta."""
    if "message" in choice:
        return choice["message"]["content"]
    return choice["text"] if "text" in choice else choice["delta"].get("content") or ""


def _pieces(url: str, body: dict, path: str = "/v1/completions") -> tuple[list[int], list[str]]:
    """An unconstrained greedy request's token ids and the text each token added (its stream's chunks; a chat's
    first, its role alone, left out)."""
    chunks = _stream(url, body, path)
    if "messages" in body:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        chunks = chunks[1:]
    assert all(len(ch["choices"][0]["token_ids"]) == 1 for ch in chunks)
    whole = _post(url, body, path)["choices"][0]
    assert "".join(_text(ch["choices"][0]) for ch in chunks) == _text(whole)
    return [ch["choices"][0]["token_ids"][0] for ch in chunks], [_text(ch["choices"][0]) for ch in chunks]


def _expected(ids: list[int], pieces: list[str], stops: list[str]) -> tuple[str, list[int]]:
    """(text, token ids) once a stop string is in the text: the text before the earliest match, and
    the tokens up to and including the one whose text completed it (vLLM's count)."""
    for k in range(len(pieces)):
        text = "".join(pieces[:k + 1])
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        if hits:
            return text[:min(hits)], ids[:k + 1]
    raise AssertionError(f"no stop string of {stops} in {''.join(pieces)!r}")


def _straddling_stop(pieces: list[str], avoid: str = "") -> tuple[str, int]:
    """A stop string made of the end of token j's text and the start of token j + 1's that first occurs
    there (so that it is completed by token j + 1), and not in `avoid`: (the string, j + 1)."""
    text = "".join(pieces)
    for j in range(2, len(pieces) - 2):
        if pieces[j] and pieces[j + 1]:
            stop = pieces[j][-2:] + pieces[j + 1][:2]
            if text.find(stop) == len("".join(pieces[:j + 1])) - len(pieces[j][-2:]) and stop not in avoid:
                return stop, j + 1
    raise AssertionError(f"no token boundary to straddle in {pieces}")


def test_a_stop_string_over_a_token_boundary_ends_the_text_before_it(srv):
    body = {"prompt": "hello", "max_tokens": 48, **GREEDY}
    ids, pieces = _pieces(srv.url, body)
    stop, k = _straddling_stop(pieces)
    text, kept = _expected(ids, pieces, [stop])
    assert len(kept) == k + 1 and text == "".join(pieces)[:"".join(pieces).find(stop)]
    before = wait_idle(srv)["engine"]
    r = _post(srv.url, {**body, "stop": stop})
    choice = r["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["token_ids"]) == (text, "stop", kept)
    assert r["usage"]["completion_tokens"] == len(kept) and r["usage"]["total_tokens"] == 5 + len(kept)
    assert_pools_whole(srv)  # the engine request ended: its private pages are back
    after = httpx.get(srv.url + "/hicache/status").json()["engine"]
    # it finished (a stop), not aborted: its KV is published like a stop token's
    assert (after["finished"] - before["finished"], after["aborted"] - before["aborted"]) == (1, 0)
    assert after["decode_tokens"] - before["decode_tokens"] < body["max_tokens"] - 1  # it did not run on
    # streamed: the same text in pieces, nothing of the stop string sent, "stop" on the last chunk
    chunks = _stream(srv.url, {**body, "stop": [stop]})
    assert "".join(_text(ch["choices"][0]) for ch in chunks) == text
    assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == kept
    assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert_pools_whole(srv)


def test_a_stop_string_that_is_a_multibyte_character_split_over_byte_tokens(srv):
    for prompt in ("hello", "abc", "The quick brown fox", "x", "0123"):
        body = {"prompt": prompt, "max_tokens": 48, **GREEDY}
        ids, pieces = _pieces(srv.url, body)
        chars = [ch for ch in "".join(pieces) if ord(ch) > 0x7F and ch != "\ufffd"]
        if chars:
            break
    else:
        pytest.fail("no greedy output of the tiny model held a whole multi-byte character")
    stop = chars[0]
    text, kept = _expected(ids, pieces, [stop])
    assert TOK.decode(kept[-len(stop.encode()):]) == stop and TOK.decode(kept[-1:]) == "\ufffd"  # its bytes
    choice = _post(srv.url, {**body, "stop": stop})["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["token_ids"]) == (text, "stop", kept), stop
    chunks = _stream(srv.url, {**body, "stop": stop})
    assert "".join(_text(ch["choices"][0]) for ch in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_text_that_might_start_a_stop_string_is_held_then_released_when_it_does_not(srv):
    """A stop string that starts with two tokens' text and goes on as the output never does: those
    two tokens' text is held back while it might be the stop string's start, then sent; the texts,
    streamed or not, are the unconstrained ones."""
    body = {"prompt": "The quick brown fox", "max_tokens": 32, **GREEDY}
    ids, pieces = _pieces(srv.url, body)
    full = "".join(pieces)
    j = next(j for j in range(4, len(pieces) - 4) if pieces[j] and pieces[j + 1])
    stop = pieces[j] + pieces[j + 1] + "\x00\x00\x00"
    assert stop not in full
    got = _post(srv.url, {**body, "stop": [stop, "<id:9999>"]})["choices"][0]
    assert (got["text"], got["token_ids"], got["finish_reason"]) == (full, ids, "length")
    chunks = _stream(srv.url, {**body, "stop": [stop, "<id:9999>"]})
    sent = [_text(ch["choices"][0]) for ch in chunks]
    assert "".join(sent) == full and [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == ids
    assert len("".join(sent[:j + 2])) <= len("".join(pieces[:j]))  # tokens j and j + 1: held
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_across_the_prompt_and_the_completion_is_not_matched(srv):
    body = {"prompt": "hello", "max_tokens": 16, **GREEDY}
    ids, pieces = _pieces(srv.url, body)
    text = "".join(pieces)
    stop = "lo" + text[:2]  # the prompt's end and the completion's start
    assert stop not in text
    choice = _post(srv.url, {**body, "stop": stop})["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["token_ids"]) == (text, "length", ids)


def test_stop_strings_and_stop_token_ids_together_the_first_to_come_ends_it(srv):
    body = {"prompt": "abc", "max_tokens": 32, **GREEDY}
    ids, pieces = _pieces(srv.url, body)
    first = next(i for i in range(8, len(ids)) if ids.index(ids[i]) == i)
    stop_id = ids[first]
    by_id = _post(srv.url, {**body, "stop": [stop_id]})["choices"][0]  # (as before: token ids only)
    assert (by_id["token_ids"], by_id["finish_reason"]) == (ids[:first + 1], "stop")
    assert by_id["text"] == TOK.decode(ids[:first])  # the stop token's text left out
    choice = _post(srv.url, {**body, "stop": "<id:9999>", "stop_token_ids": [stop_id]})["choices"][0]
    assert choice == by_id
    stop, _ = _straddling_stop(pieces[:first])
    text, kept = _expected(ids, pieces, [stop])
    choice = _post(srv.url, {**body, "stop": stop, "stop_token_ids": [stop_id]})["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (text, kept, "stop")


def test_chat_stop_strings(tmp_path):
    _write_byte_level_tokenizer(tmp_path)
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=200,
                                 max_new_tokens_limit=64).with_hicache(enable=True, host_ratio=2.0))
    app = create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=HFTokenizer(str(tmp_path)))
    with ServerThread(app) as s:
        s.engine = engine
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 32, **GREEDY}
        ids, pieces = _pieces(s.url, body, path)
        stop, _ = _straddling_stop(pieces)
        text, kept = _expected(ids, pieces, [stop])
        r = _post(s.url, {**body, "stop": [stop]}, path)
        choice = r["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"], choice["token_ids"]) == (text, "stop", kept)
        assert r["usage"]["completion_tokens"] == len(kept)
        chunks = _stream(s.url, {**body, "stop": [stop]}, path)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(_text(ch["choices"][0]) for ch in chunks) == text
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert_pools_whole(s)


# -- batches of prompts --------------------------------------------------------------------------------------
BATCHES = [["hello", "abc", "The quick brown fox"], [[3 + b for b in b"hello"], [40, 41, 42, 43, 44, 45], [7]]]


@pytest.mark.parametrize("prompts", BATCHES, ids=["strings", "token-arrays"])
def test_a_batch_gets_one_choice_per_prompt_in_order_and_the_usage_summed(srv, prompts):
    body = {"max_tokens": 8, **GREEDY}
    singles = [_post(srv.url, {**body, "prompt": p}) for p in prompts]
    r = _post(srv.url, {**body, "prompt": prompts})
    assert r["id"].startswith("cmpl-") and r["object"] == "text_completion"
    assert [c["index"] for c in r["choices"]] == list(range(len(prompts)))
    for got, single in zip(r["choices"], singles):
        want = single["choices"][0]
        assert (got["text"], got["token_ids"], got["finish_reason"]) == (want["text"], want["token_ids"], "length")
    usage = r["usage"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[key] == sum(s["usage"][key] for s in singles), key
    assert usage["prompt_tokens_details"]["cached_tokens"] == sum(usage["cached_tokens_per_tier"].values())
    assert_pools_whole(srv)


def test_a_streamed_batch_interleaves_its_choices_and_ends_with_one_usage_and_one_done(srv):
    prompts = BATCHES[0]
    body = {"max_tokens": 8, **GREEDY, "prompt": prompts}
    _post(srv.url, body)  # (the prompts now in L1 for both: what they cache the same)
    whole = _post(srv.url, body)
    chunks = _stream(srv.url, {**body, "stream_options": {"include_usage": True}})
    *chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all(len(ch["choices"]) == 1 and ch["usage"] is None and ch["id"] == chunks[0]["id"] for ch in chunks)
    order = [ch["choices"][0]["index"] for ch in chunks]
    assert order != sorted(order)  # run concurrently, not one after another
    for i, want in enumerate(whole["choices"]):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == want["text"]
        assert [t for c in mine for t in c["token_ids"]] == want["token_ids"]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]


def test_stop_strings_apply_to_each_prompt_of_a_batch(srv):
    prompts = ["hello", "The quick brown fox"]
    body = {"max_tokens": 40, **GREEDY}
    refs = [_pieces(srv.url, {**body, "prompt": p}) for p in prompts]
    stops = [_straddling_stop(refs[0][1], avoid="".join(refs[1][1]))[0], "<id:9999>"]
    expected = [(*_expected(*refs[0], stops), "stop"), ("".join(refs[1][1]), refs[1][0], "length")]
    before = wait_idle(srv)["engine"]
    r = _post(srv.url, {**body, "prompt": prompts, "stop": stops})
    assert [(c["text"], c["token_ids"], c["finish_reason"]) for c in r["choices"]] == expected
    assert r["usage"]["completion_tokens"] == sum(len(e[1]) for e in expected)
    # a choice ended by its stop string ends then (finished, not aborted), not when the batch ends (it
    # would run on to max_tokens beside the other one)
    after = wait_idle(srv)["engine"]
    assert (after["aborted"] - before["aborted"], after["finished"] - before["finished"]) == (0, 2)
    chunks = _stream(srv.url, {**body, "prompt": prompts, "stop": stops})
    for i, (text, ids, finish) in enumerate(expected):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == i]
        assert ("".join(c["text"] for c in mine), [t for c in mine for t in c["token_ids"]]) == (text, ids)
        assert mine[-1]["finish_reason"] == finish
    assert_pools_whole(srv)


@pytest.mark.parametrize("prompts,param,needle", [
    (["ok", "", "fine"], "prompt.1", "the prompt is empty"),
    ([[5, 6], [7, 8], [9, 512]], "prompt.2", "outside the vocabulary"),
    ([[5, 6], [7] * 1000], "prompt.1", "exceeds the limit"),
], ids=["empty", "out-of-vocabulary", "too-long"])
def test_a_batch_with_one_bad_prompt_is_a_400_naming_it_and_queues_nothing(srv, prompts, param, needle):
    before = httpx.get(srv.url + "/hicache/status").json()["engine"]
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompts, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"] and f"prompt {param[-1]} of the batch" in err["message"]
    st = wait_idle(srv)
    assert st["engine"]["prefill_tokens"] == before["prefill_tokens"] and st["server"]["in_flight"] == 0


def test_an_engine_refusal_of_one_prompt_names_it_and_leaves_no_request_behind(srv):
    """The engine's own check (prompt + max_tokens past the KV pool) refuses prompt 1 before any is queued."""
    prompts = [[5, 6], [7] * 790]
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompts, "max_tokens": 64}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith("prompt 1 of the batch: prompt (790) + max_tokens (64)"), err
    assert err["param"] == "max_tokens", err  # (the engine names the field to lower)
    assert wait_idle(srv)["engine"]["waiting"] == 0
    assert_pools_whole(srv)


# -- limits, disconnects and failures ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_srv():
    """Three requests in flight at most; room for three long ones."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=1100, max_new_tokens_limit=1000,
                                 ).with_hicache(enable=True, host_ratio=2.0))
    with ServerThread(create_app(engine, ServerLimits(max_concurrent_requests=3, shutdown_grace_s=1.0))) as s:
        s.engine = engine
        yield s


def test_a_batch_counts_one_request_per_prompt_against_max_concurrent_requests(small_srv):
    s = small_srv
    r = httpx.post(s.url + "/v1/completions", json={"prompt": [[1, 2]] * 4, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "batch_too_large", r.text
    assert "--max-concurrent-requests" in r.json()["error"]["message"]
    assert len(_post(s.url, {"prompt": [[1, 2]] * 3, "max_tokens": 2})["choices"]) == 3

    busy_then_fits(s, {"prompt": [[1, 2]] * 3, "max_tokens": 2}, {"prompt": [[1, 2]] * 2, "max_tokens": 2})


def busy_then_fits(s, busy_body: dict, fits_body: dict) -> None:
    """With one of the three places taken by a running request, `busy_body` (three engine requests) is
    a 429 to retry, and `fits_body` (two) is served; nothing is left held after."""
    async def scenario():
        reader, writer = await _open_stream(s.url, {"prompt": [1, 2, 9], "max_tokens": 1000, **GREEDY})
        try:
            while b"data: " not in await reader.read(65536):  # it runs: one place of three is taken
                pass
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                busy = await c.post("/v1/completions", json=busy_body)
                fits = await c.post("/v1/completions", json=fits_body)
        finally:
            writer.close()
        return busy, fits
    busy, fits = asyncio.run(scenario())
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1", busy.text
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
    assert_pools_whole(s)
    assert httpx.get(s.url + "/hicache/status").json()["server"]["in_flight"] == 0


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_leaving_a_batch_aborts_every_prompt(small_srv, stream):
    body = {"prompt": [[3, 4, 5], [6, 7, 8], [9, 10, 11]], "max_tokens": 1000, **GREEDY}
    leave_and_check_aborts(small_srv, body, stream, requests=3)


def leave_and_check_aborts(s, body: dict, stream: bool, requests: int) -> None:
    """A client sends `body` to /v1/completions (streamed: reads a few chunks; whole: waits until a few
    tokens were generated), then goes away: every one of the `requests` engine requests it started
    is aborted, long before its max_tokens, and the pools are whole."""
    before = wait_idle(s)["engine"]

    async def scenario():
        if stream:
            reader, writer = await _open_stream(s.url, body)
            seen = b""
            while seen.count(b"data: ") < 3:  # a few chunks arrived; then the client goes away
                seen += await reader.read(65536)
        else:
            host, port = s.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            data = json.dumps(body).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(data) + data)
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                while (await c.get("/hicache/status")).json()["engine"]["decode_tokens"] < before["decode_tokens"] + 6:
                    await asyncio.sleep(0.02)
        writer.close()
    asyncio.run(scenario())
    deadline = time.monotonic() + 60
    while (eng := httpx.get(s.url + "/hicache/status").json()["engine"])["running"] + eng["waiting"]:
        assert time.monotonic() < deadline, eng
        time.sleep(0.05)
    assert eng["aborted"] - before["aborted"] == requests, eng
    assert eng["decode_tokens"] - before["decode_tokens"] < requests * (body["max_tokens"] - 1)
    assert_pools_whole(s)


def test_an_engine_failure_of_one_prompt_fails_the_batch_naming_it(tmp_path):
    """A prompt whose cached prefix is corrupt (NaN K/V: the engine fails that request, and only it)
    in a batch: the response is the engine's 500 naming the prompt, the other prompts are aborted, and
    a stream ends with that error event and [DONE]."""
    from test_sampling_hunt import _poison_l1_prefix

    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256, max_new_tokens_limit=64))
    bad = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
        _post(s.url, {"prompt": bad, "max_tokens": 2})  # its prefix is now in L1
        s.call(_poison_l1_prefix, engine, bad[:8])
        body = {"prompt": [[30, 31, 32], bad, [40, 41, 42]], "max_tokens": 40, **GREEDY}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt.1" and err["code"] == "engine_error", err
        assert err["message"].startswith("prompt 1 of the batch: the engine failed this request") and "NaN" in \
            err["message"], err
        # the failure dropped the poisoned prefix (hicache/suspect.py): cache and poison it again
        _post(s.url, {"prompt": bad, "max_tokens": 2})
        s.call(_poison_l1_prefix, engine, bad[:8])
        with httpx.Client(timeout=60) as c, c.stream("POST", s.url + "/v1/completions",
                                                     json={**body, "stream": True}) as resp:
            events = resp.read().decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""] and events.count("data: [DONE]") == 1
        last = json.loads(events[-3][len("data: "):])
        assert last["error"]["param"] == "prompt.1" and last["error"]["code"] == "engine_error", last
        for _ in range(600):
            st = httpx.get(s.url + "/hicache/status").json()
            if st["engine"]["running"] + st["engine"]["waiting"] + st["server"]["in_flight"] == 0:
                break
            time.sleep(0.05)
        assert st["engine"]["failed"] == 2 and st["engine"]["aborted"] == 4, st["engine"]
        s.call(engine.check_integrity)
        ok = _post(s.url, {"prompt": [[30, 31, 32], [40, 41, 42]], "max_tokens": 4})
        assert [c["finish_reason"] for c in ok["choices"]] == ["length", "length"]
