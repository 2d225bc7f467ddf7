"""vLLM's beam search (`use_beam_search`, `n` the beam width, `length_penalty`; scheduler/beam_search.py, served by
scheduler/api_beam_search.py): in process against a reference search over dense forwards of each whole sequence
(no paged K/V, no prefix cache), then over HTTP on the tiny preset with the byte-level tokenizer."""
from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time

import httpx
import pytest
import torch

from hicache.radix import Tier
from hicache_helpers import finish, until
from scheduler.beam_search import BeamSearchError, BeamSearchParams, beam_search
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams
from server_fixtures import byte_level_server, ok, post, sse, tiny_config

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def make_engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256, **kw))


def with_eos(eng: Engine, eos: int) -> Engine:
    eng.model_config = dataclasses.replace(eng.model_config, eos_token_id=eos)
    return eng


def run(eng: Engine, prompt: list[int], params: BeamSearchParams):
    async def go():
        try:
            return await beam_search(eng, prompt, params)
        finally:
            await eng.stop_loop()
    return asyncio.run(go())


def dense_logprobs(eng: Engine, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(eng.model.forward_dense(torch.tensor(tokens))[-1].float(), dim=-1)


def reference(eng: Engine, prompt: list[int], width: int, steps: int, length_penalty: float = 1.0,
              ends: tuple[int, ...] = (), include_end: bool = False, min_tokens: int = 0) -> list[tuple]:
    """vLLM's algorithm over each beam's whole sequence forwarded densely: (tokens after the prompt, cum logprob,
    ended) of the best `width`, best first."""
    def score(beam):
        tokens, cum, ended = beam
        return cum / ((len(prompt) + len(tokens) - (ended and include_end)) ** length_penalty)

    live, done = [([], 0.0, False)], []
    for step in range(steps):
        grown = []
        for tokens, cum, _ in live:
            values, ids = torch.topk(dense_logprobs(eng, prompt + tokens), 2 * width + len(ends))
            top = [(t, v) for t, v in zip(ids.tolist(), values.tolist()) if step >= min_tokens or t not in ends]
            for t, v in top[:2 * width]:  # (before min_tokens the end tokens are masked: the likeliest others)
                if t in ends:
                    if step >= min_tokens:
                        done.append((tokens + [t] if include_end else tokens, cum + v, True))
                else:
                    grown.append((tokens + [t], cum + v, False))
        live = sorted(grown, key=score, reverse=True)[:width]
    return sorted(done + live, key=score, reverse=True)[:width]


def same_beams(got, want) -> None:
    assert [b.output_ids for b in got.beams] == [w[0] for w in want]
    for b, (_, cum, ended) in zip(got.beams, want):
        assert math.isclose(b.cum_logprob, cum, abs_tol=1e-3)
        assert b.finish_reason == ("stop" if ended else "length")


def candidate(eng: Engine, prompt: list[int], rank: int) -> int:
    """The prompt's `rank`-th likeliest next token (0: the greedy one)."""
    return int(torch.topk(dense_logprobs(eng, prompt), rank + 1).indices[rank])


# -- in process -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("width,length_penalty", [(2, 1.0), (3, 0.5), (4, 2.0)])
def test_the_beams_are_a_reference_searchs(width, length_penalty):
    eng = make_engine()
    got = run(eng, PROMPT, BeamSearchParams(beam_width=width, max_tokens=3, length_penalty=length_penalty))
    same_beams(got, reference(eng, PROMPT, width, 3, length_penalty))
    assert not eng.requests
    eng.check_integrity()


@pytest.mark.parametrize("include_end", [False, True])
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 3.0])
def test_an_eos_candidate_completes_a_beam(include_end, length_penalty):
    eng = make_engine()
    eos = candidate(eng, PROMPT, 2)  # (a candidate of the first step: a beam ends there)
    with_eos(eng, eos)
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=length_penalty,
                              include_stop_str_in_output=include_end)
    got = run(eng, PROMPT, params)
    same_beams(got, reference(eng, PROMPT, 2, 3, length_penalty, ends=(eos,), include_end=include_end))
    ended = [b for b in got.beams if b.finish_reason == "stop"]
    if length_penalty < 3.0:  # (a short beam wins unless the penalty favours long ones enough)
        assert ended and ended[0].output_ids == ([eos] if include_end else [])
        assert ended[0].end_token == eos


def test_ignore_eos_makes_the_eos_an_ordinary_token():
    eng = make_engine()
    eos = candidate(eng, PROMPT, 0)
    with_eos(eng, eos)
    got = run(eng, PROMPT, BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    same_beams(got, reference(eng, PROMPT, 2, 3))
    assert got.beams[0].output_ids[0] == eos and all(b.finish_reason == "length" for b in got.beams)


def test_stop_token_ids_end_beams_as_the_eos_does_and_min_tokens_holds_them_off():
    eng = make_engine()
    stop = candidate(eng, PROMPT, 1)
    got = run(eng, PROMPT, BeamSearchParams(beam_width=2, max_tokens=3, stop_token_ids=(stop,)))
    same_beams(got, reference(eng, PROMPT, 2, 3, ends=(stop,)))
    assert any(b.end_token == stop for b in got.beams)
    held = run(eng, PROMPT, BeamSearchParams(beam_width=2, max_tokens=3, stop_token_ids=(stop,), min_tokens=2))
    same_beams(held, reference(eng, PROMPT, 2, 3, ends=(stop,), min_tokens=2))
    assert all(len(b.output_ids) >= 2 for b in held.beams)


def test_width_one_is_greedy_decoding():
    eng = make_engine()
    [greedy] = eng.generate([PROMPT], SamplingParams(max_tokens=6))
    got = run(eng, PROMPT, BeamSearchParams(beam_width=1, max_tokens=6))
    assert [b.output_ids for b in got.beams] == [greedy.output_ids]


def test_beams_are_distinct_and_sorted_by_score():
    eng = make_engine()
    for p in (0.0, 1.0, 2.0):
        got = run(eng, [40, 41, 42], BeamSearchParams(beam_width=5, max_tokens=4, length_penalty=p))
        assert len(got.beams) == 5 and len({tuple(b.tokens) for b in got.beams}) == 5
        scores = [b.score(p) for b in got.beams]
        assert scores == sorted(scores, reverse=True)
        for b in got.beams:
            assert b.tokens[:3] == [40, 41, 42] and math.isclose(b.score(p), b.cum_logprob / len(b.tokens) ** p)


def test_length_penalty_reorders_only_beams_of_different_lengths():
    eng = make_engine()
    orders = {p: [b.output_ids for b in run(eng, PROMPT, BeamSearchParams(beam_width=3, max_tokens=3,
                                                                             length_penalty=p)).beams]
              for p in (0.0, 1.0, 3.0)}
    assert orders[0.0] == orders[1.0] == orders[3.0]  # (all of one length: by cum logprob alone)
    with_eos(eng, candidate(eng, PROMPT, 2))
    short = run(eng, PROMPT, BeamSearchParams(beam_width=3, max_tokens=3, length_penalty=0.0)).beams
    long = run(eng, PROMPT, BeamSearchParams(beam_width=3, max_tokens=3, length_penalty=3.0)).beams
    assert short[0].finish_reason == "stop" and short[0].output_ids == []  # (the least negative sum)
    assert long[0].finish_reason == "length" and len(long[0].output_ids) == 3  # (divided by the most)


def test_each_step_reads_the_beams_prefix_from_the_cache():
    """Each step re-prefills its beams' whole sequences; all but their last, partial page is a hit."""
    eng = make_engine()
    steps, page = 6, eng.page_size
    got = run(eng, PROMPT, BeamSearchParams(beam_width=3, max_tokens=steps))
    hits = got.cached_tokens_per_step
    assert len(hits) == steps and hits[0] == 0 and hits == sorted(hits)
    for step, hit in enumerate(hits[1:], start=1):
        assert hit >= (len(PROMPT) + step - 1) // page * page
    m = eng.metrics()
    assert m["hit_tokens"]["l1"] >= sum(hits)
    step_tokens = len(PROMPT) + sum(3 * (len(PROMPT) + s) for s in range(1, steps))
    assert m["recomputed_tokens"] < step_tokens / 2
    eng.check_integrity()


def test_prompt_logprobs_come_from_the_first_step():
    eng = make_engine()
    [plain] = eng.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=3))
    got = run(eng, PROMPT, BeamSearchParams(beam_width=2, max_tokens=2, prompt_logprobs=3))
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(PROMPT)
    for a, b in zip(got.prompt_logprobs[1:], plain.prompt_logprobs[1:]):
        assert [t for t, _ in a.top] == [t for t, _ in b.top] and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)


def on_adds(eng: Engine, at: int, then) -> list[int]:
    """`then()` once the engine has queued `at` requests (a search's steps in flight); the count of adds."""
    real, count = eng.add_request, [0]

    def add(*args, **kwargs):
        req = real(*args, **kwargs)
        count[0] += 1
        if count[0] == at:
            then()
        return req
    eng.add_request = add
    return count


def test_cancelling_the_search_aborts_its_steps_in_flight():
    eng = make_engine()

    async def go():
        reached = asyncio.Event()
        on_adds(eng, 1 + 4, reached.set)  # (the prompt's step, then the four beams')
        task = asyncio.ensure_future(beam_search(eng, PROMPT, BeamSearchParams(beam_width=4, max_tokens=12)))
        await reached.wait()
        assert len(eng.requests) == 4
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await finish(eng)  # (no request left, every tier whole)
    asyncio.run(go())


def test_a_failed_step_fails_the_search():
    """NaN K/V under a cached prefix: the step that reads it fails, and the search with it, its other steps
    aborted."""
    eng = make_engine()
    prompt = list(range(20, 44))
    eng.generate([prompt], SamplingParams(max_tokens=1))
    m = eng.cache.tree.match(prompt, include_storage=False, touch=False)
    eng.cache.l1.kv[:, :, torch.tensor(m.pages[Tier.L1], dtype=torch.int64)] = float("nan")

    async def go():
        with pytest.raises(BeamSearchError) as err:
            await beam_search(eng, prompt + [7], BeamSearchParams(beam_width=3, max_tokens=4))
        assert err.value.finish_reason == "error" and "NaN" in str(err.value)
        await until(lambda: not eng.requests)
        await finish(eng)
    asyncio.run(go())


def test_a_shutdown_mid_search_ends_it_as_aborted():
    eng = make_engine()

    async def go():
        shutdown = []
        on_adds(eng, 3, lambda: shutdown.append(asyncio.ensure_future(eng.shutdown(grace_s=0.0))))
        with pytest.raises(BeamSearchError) as err:
            await beam_search(eng, PROMPT, BeamSearchParams(beam_width=2, max_tokens=12))
        assert err.value.finish_reason == "abort"
        await shutdown[0]
        assert not eng.requests
    asyncio.run(go())


@pytest.mark.parametrize("params,param", [
    (BeamSearchParams(beam_width=0), "beam_width"),
    (BeamSearchParams(beam_width=11), "beam_width"),
    (BeamSearchParams(length_penalty=1e3), "length_penalty"),
    (BeamSearchParams(length_penalty=float("nan")), "length_penalty"),
    (BeamSearchParams(max_tokens=0), "max_tokens"),
    (BeamSearchParams(temperature=-1.0), "temperature"),
])
def test_bad_params_are_request_errors_naming_the_field(params, param):
    with pytest.raises(RequestError) as err:
        params.validate(make_engine(), PROMPT)
    assert err.value.param == param


def test_the_last_steps_prompt_must_fit_the_prompt_limit():
    """A step's prompt is the beam's whole sequence: prompt + max_tokens - 1 tokens at the last step."""
    eng = make_engine(max_prompt_tokens=16)
    BeamSearchParams(max_tokens=10).validate(eng, PROMPT)
    with pytest.raises(RequestError) as err:
        BeamSearchParams(max_tokens=11).validate(eng, PROMPT)
    assert err.value.param == "max_tokens"


# -- HTTP ---------------------------------------------------------------------------------------------------
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hello there"}]
TEXT = "the quick brown fox"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=16)) as s:
        yield s


def in_process(prompt: list[int], params: BeamSearchParams, eos: int | None = None):
    eng = make_engine()
    return run(eng if eos is None else with_eos(eng, eos), prompt, params)


def clean(srv) -> None:
    """Nothing left running, no slot held, every tier whole."""
    st = srv.app.state.hc

    async def idle():
        await until(lambda: not srv.engine.requests and st.in_flight == 0)
    asyncio.run_coroutine_threadsafe(idle(), srv.loop).result(timeout=30)
    srv.call(srv.engine.check_integrity)


def test_completions_beams_are_the_in_process_search(srv):
    ids = srv.tok.encode(TEXT)
    body = {"prompt": TEXT, "max_tokens": 4, "n": 3, "use_beam_search": True, "length_penalty": 0.7}
    r = ok(srv, CMPL, body)
    want = in_process(ids, BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=0.7))
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in r["choices"]] == [b.output_ids for b in want.beams]
    assert all(c["finish_reason"] == "length" and c["stop_reason"] is None for c in r["choices"])
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert r["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in r["choices"]) == 12
    clean(srv)


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_width_one_is_the_greedy_answer_rendered_alike(srv, path):
    """n=1: the greedy answer, its text, finish and usage as an ordinary request's (the same rendering)."""
    body = {"prompt": TEXT} if path == CMPL else {"messages": HI}
    body |= {"max_tokens": 6, "temperature": 0}
    plain, beam = ok(srv, path, body), ok(srv, path, {**body, "use_beam_search": True})
    key = "text" if path == CMPL else "message"
    assert beam["choices"][0][key] == plain["choices"][0][key]
    assert beam["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert beam["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"] == "length"
    assert beam["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert beam["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] == 6
    clean(srv)


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_a_stream_sends_each_beams_whole_text_then_its_end(srv, path):
    body = {"prompt": TEXT} if path == CMPL else {"messages": HI}
    body |= {"max_tokens": 5, "n": 2, "use_beam_search": True}
    whole = ok(srv, path, body)
    chunks = sse(srv, path, {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert chunks[-1]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    for choice in whole["choices"]:
        mine = [ch["choices"][0] for ch in chunks[:-1] if ch["choices"][0]["index"] == choice["index"]]
        role = [] if path == CMPL else [{"delta": {"role": "assistant", "content": ""}, "token_ids": []}]
        assert [{k: c[k] for k in ("delta", "token_ids")} for c in mine[:len(role)]] == role  # (vLLM's role chunk)
        text, end = mine[len(role):]
        assert text["finish_reason"] is None and end["finish_reason"] == choice["finish_reason"] == "length"
        assert text["token_ids"] == choice["token_ids"] and end["token_ids"] == []
        if path == CMPL:
            assert text["text"] == choice["text"] and end["text"] == ""
        else:
            assert text["delta"] == {"content": choice["message"]["content"]}
    clean(srv)


def test_a_chats_beams_are_the_in_process_search_of_its_rendered_prompt(srv):
    rendered = ok(srv, "/tokenize", {"messages": HI})["tokens"]
    r = ok(srv, CHAT, {"messages": HI, "max_tokens": 3, "n": 2, "use_beam_search": True})
    want = in_process(rendered, BeamSearchParams(beam_width=2, max_tokens=3))
    assert [c["token_ids"] for c in r["choices"]] == [b.output_ids for b in want.beams]
    assert all(c["message"]["role"] == "assistant" for c in r["choices"])
    clean(srv)


@pytest.mark.parametrize("include", [False, True])
def test_an_eos_ended_beam_is_a_stop_choice(srv, include):  # (its stop_reason the EOS: vLLM's beam search sets it)
    ids = srv.tok.encode(TEXT)
    eos = candidate(srv.engine, ids, 2)
    model = srv.engine.model_config
    srv.call(lambda: setattr(srv.engine, "model_config", dataclasses.replace(model, eos_token_id=eos)))
    try:
        body = {"prompt": TEXT, "max_tokens": 3, "n": 2, "use_beam_search": True, "include_stop_str_in_output": include}
        r = ok(srv, CMPL, body)
        chunks = sse(srv, CMPL, body)
    finally:
        srv.call(lambda: setattr(srv.engine, "model_config", model))
    want = in_process(ids, BeamSearchParams(beam_width=2, max_tokens=3, include_stop_str_in_output=include), eos)
    assert [c["token_ids"] for c in r["choices"]] == [b.output_ids for b in want.beams]
    stops = [c for c in r["choices"] if c["finish_reason"] == "stop"]
    assert stops and stops[0]["token_ids"] == ([eos] if include else []) and stops[0]["stop_reason"] == eos
    assert stops[0]["text"] == (srv.tok.decode([eos]) if include else "")  # (the EOS's text: an ordinary choice's)
    assert r["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in r["choices"])
    ends = {ch["choices"][0]["index"]: ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]}
    assert ends == {c["index"]: c["finish_reason"] for c in r["choices"]}
    clean(srv)


def test_a_batch_of_prompts_gets_n_beams_each(srv):
    r = ok(srv, CMPL, {"prompt": [TEXT, "hello"], "max_tokens": 2, "n": 2, "use_beam_search": True})
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    want = in_process(srv.tok.encode("hello"), BeamSearchParams(beam_width=2, max_tokens=2))
    assert [c["token_ids"] for c in r["choices"][2:]] == [b.output_ids for b in want.beams]
    assert r["usage"]["prompt_tokens"] == len(TEXT) + len("hello") and r["usage"]["completion_tokens"] == 8
    clean(srv)


def test_fields_it_honours(srv):
    """stop_token_ids end beams, echo puts the prompt first, prompt_logprobs and a seed are served."""
    ids = srv.tok.encode(TEXT)
    stop = candidate(srv.engine, ids, 1)
    base = {"prompt": TEXT, "max_tokens": 3, "n": 2, "use_beam_search": True}
    r = ok(srv, CMPL, {**base, "stop_token_ids": [stop], "echo": True, "prompt_logprobs": 1, "seed": 3,
                       "presence_penalty": 0, "logit_bias": {}})
    want = in_process(ids, BeamSearchParams(beam_width=2, max_tokens=3, stop_token_ids=(stop,)))
    assert [c["token_ids"] for c in r["choices"]] == [b.output_ids for b in want.beams]
    assert any(c["finish_reason"] == "stop" and c["stop_reason"] == stop for c in r["choices"])
    assert all(c["text"].startswith(TEXT) for c in r["choices"])
    assert all(len(c["prompt_logprobs"]) == len(ids) for c in r["choices"])
    clean(srv)


def test_length_penalty_without_beam_search_is_ignored(srv):
    body = {"prompt": TEXT, "max_tokens": 4, "temperature": 0}
    assert ok(srv, CMPL, {**body, "length_penalty": 5.0})["choices"] == ok(srv, CMPL, body)["choices"]


@pytest.mark.parametrize("path,extra,param", [
    (CMPL, {"n": 11}, "n"),
    (CMPL, {"logprobs": 2}, "logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 2}, "logprobs"),
    (CMPL, {"stop": ["fox"]}, "stop"),
    (CHAT, {"stop": "x"}, "stop"),
    (CMPL, {"presence_penalty": 0.5}, "presence_penalty"),
    (CMPL, {"frequency_penalty": -0.5}, "frequency_penalty"),
    (CHAT, {"repetition_penalty": 1.2}, "repetition_penalty"),
    (CMPL, {"logit_bias": {"7": 5}}, "logit_bias"),
    (CMPL, {"allowed_token_ids": [1, 2, 3]}, "allowed_token_ids"),
    (CMPL, {"bad_words": ["fox"]}, "bad_words"),
    (CMPL, {"guided_regex": "[a-z]+"}, "guided_regex"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
    (CMPL, {"length_penalty": 1e3}, "length_penalty"),
    (CMPL, {"max_tokens": 0, "echo": True}, "max_tokens"),
])
def test_fields_it_cannot_honour_are_400s_naming_them(srv, path, extra, param):
    body = {"prompt": TEXT} if path == CMPL else {"messages": HI}
    r = post(srv, path, {**body, "max_tokens": 3, "n": 2, "use_beam_search": True, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    clean(srv)


def test_the_responses_api_has_no_beam_search(srv):
    r = post(srv, "/v1/responses", {"input": "hi", "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search", r.text


def test_a_client_that_leaves_cancels_the_search(srv):
    """Each beam holds a slot (n of them, as n choices do); a client gone mid-search aborts the steps in flight and
    the search queues no more."""
    st, left, slots = srv.app.state.hc, threading.Event(), []
    real = srv.engine.add_request

    def add(*args, **kwargs):  # (the server's loop held at the second step until the client has gone)
        slots.append(st.in_flight)
        if len(slots) == 1 + 8:
            left.wait(timeout=10)
        return real(*args, **kwargs)
    srv.call(lambda: setattr(srv.engine, "add_request", add))
    try:
        body = {"prompt": TEXT, "max_tokens": 16, "n": 8, "use_beam_search": True, "stream": True}
        with httpx.stream("POST", srv.url + CMPL, json=body, timeout=60):
            deadline = time.monotonic() + 30
            while len(slots) < 1 + 8:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        left.set()
        clean(srv)
    finally:
        left.set()
        srv.call(lambda: vars(srv.engine).pop("add_request"))
    assert set(slots) == {8} and len(slots) < 1 + 8 * 15
    assert ok(srv, CMPL, {"prompt": TEXT, "max_tokens": 2})["usage"]["completion_tokens"] == 2


def test_a_failed_step_fails_the_request(srv):
    """A step that reads NaN K/V fails; the request is the engine's error (500), as a failed choice's."""
    prompt = list(range(60, 84))
    ok(srv, CMPL, {"prompt": prompt, "max_tokens": 1})

    def poison():
        m = srv.engine.cache.tree.match(prompt, include_storage=False, touch=False)
        srv.engine.cache.l1.kv[:, :, torch.tensor(m.pages[Tier.L1], dtype=torch.int64)] = float("nan")
    srv.call(poison)
    r = post(srv, CMPL, {"prompt": prompt + [7], "max_tokens": 3, "n": 2, "use_beam_search": True})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "engine_error" and "NaN" in r.json()["error"]["message"]
    clean(srv)


def test_a_search_aborted_before_it_began_reads_as_aborted():
    """Its choices' abort may land before the search's task ran, or before any choice read it."""
    from scheduler.api_beam_search import _Search

    async def go():
        late = _Search(None)  # (never run)
        reader = asyncio.ensure_future(late.result())
        await asyncio.sleep(0)  # (the reader made the task; it has not run)
        late.cancel()
        early = _Search(None)
        early.cancel()
        for outcome in (reader, early.result()):
            with pytest.raises(BeamSearchError) as err:
                await outcome
            assert err.value.finish_reason == "abort"
    asyncio.run(go())
