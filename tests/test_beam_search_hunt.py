"""Defects found hunting in the beam search (scheduler/beam_search.py, scheduler/api_beam_search.py), each a
regression test: min_tokens that lost every beam where end tokens were a step's likeliest, and a max_tokens left
out that the search refused under --max-prompt-tokens; and (session 45, later) a search cut short by a shutdown's
grace."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from scheduler.beam_search import BeamSearchParams, beam_search
from scheduler.request import RequestError, SamplingParams
from server_fixtures import byte_level_server, ok, post, tiny_config
from test_beam_search import (PROMPT, candidate, clean, dense_logprobs, make_engine, on_adds, reference, run,
                              same_beams, with_eos)

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hello there"}]


# -- min_tokens: end tokens passed over, not the beams lost -------------------------------------------------
def test_min_tokens_passes_over_end_tokens_that_are_a_beams_likeliest():
    """n=1 whose two likeliest first tokens are end tokens (the EOS and a stop id): the search returned no beam
    (a choice of no text, "length"); the end tokens are passed over as masked, as an ordinary request's are."""
    eng = make_engine()
    eos, stop = candidate(eng, PROMPT, 0), candidate(eng, PROMPT, 1)
    with_eos(eng, eos)
    [plain] = eng.generate([PROMPT], SamplingParams(max_tokens=3, min_tokens=1, stop_token_ids=(stop,), temperature=0))
    got = run(eng, PROMPT, BeamSearchParams(beam_width=1, max_tokens=3, min_tokens=1, stop_token_ids=(stop,)))
    assert len(got.beams) == 1, "min_tokens lost the beam"
    assert got.beams[0].output_ids[0] == plain.output_ids[0]  # (the likeliest token that is no end token)
    same_beams(got, reference(eng, PROMPT, 1, 3, ends=(eos, stop), min_tokens=1))
    assert not eng.requests
    eng.check_integrity()


def test_min_tokens_keeps_every_beam_where_end_tokens_fill_the_likeliest():
    """Width 2: a step's 2 * 2 likeliest are all end tokens; the beams are the likeliest others."""
    eng = make_engine()
    ends = [candidate(eng, PROMPT, r) for r in range(4)]
    with_eos(eng, ends[0])
    params = BeamSearchParams(beam_width=2, max_tokens=2, min_tokens=2, stop_token_ids=tuple(ends[1:]))
    got = run(eng, PROMPT, params)
    assert len(got.beams) == 2 and all(len(b.output_ids) == 2 for b in got.beams)
    same_beams(got, reference(eng, PROMPT, 2, 2, ends=tuple(ends), min_tokens=2))


def test_min_tokens_holding_every_logprob_it_asks_still_grows_the_beams():
    """Session 51, regression: a step asks 2 * beam_width + (end tokens held) logprobs, at most MAX_LOGPROBS (20);
    where the held end tokens were the 20 likeliest and the step sampled one, the beam had no candidate, and a
    search of one beam returned none (over HTTP a 200 of no token). The step's own min_tokens now masks them from
    its sampled token: the likeliest other token, as the reference's masked search takes."""
    eng = make_engine()
    stops = tuple(int(t) for t in torch.topk(dense_logprobs(eng, PROMPT), 20).indices)
    params = BeamSearchParams(beam_width=1, max_tokens=3, stop_token_ids=stops, min_tokens=2)
    got = run(eng, PROMPT, params)
    same_beams(got, reference(eng, PROMPT, 1, 3, ends=stops, min_tokens=2))
    assert got.beams and len(got.beams[0].output_ids) >= 2 and got.beams[0].output_ids[0] not in stops
    assert not eng.requests
    eng.check_integrity()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=16)) as s:
        yield s


def test_min_tokens_over_http_returns_the_beam(srv):
    ids = srv.tok.encode("the quick brown fox")
    eos, stop = candidate(srv.engine, ids, 0), candidate(srv.engine, ids, 1)
    model = srv.engine.model_config
    srv.call(lambda: setattr(srv.engine, "model_config", dataclasses.replace(model, eos_token_id=eos)))
    try:
        r = ok(srv, CMPL, {"prompt": ids, "max_tokens": 3, "min_tokens": 2, "stop_token_ids": [stop],
                           "use_beam_search": True})
    finally:
        srv.call(lambda: setattr(srv.engine, "model_config", model))
    [choice] = r["choices"]
    assert len(choice["token_ids"]) >= 2 and r["usage"]["completion_tokens"] == len(choice["token_ids"])
    clean(srv)


# -- max_tokens left out: within what a step's prompt may hold --------------------------------------------
@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """--max-prompt-tokens 64 over a context of 1,024 tokens."""
    with byte_level_server(tmp_path_factory, tiny_config(max_prompt_tokens=64)) as s:
        yield s


def test_a_chat_without_max_tokens_searches_what_a_step_may_hold(limited):
    """A chat's default max_tokens is the rest of the context (996 here): the search was a 400 naming max_tokens,
    a field the request never sent; it is now the most a step's prompt (64 tokens) allows."""
    prompt = ok(limited, "/tokenize", {"messages": HI})["tokens"]
    r = post(limited, CHAT, {"messages": HI, "n": 2, "use_beam_search": True})
    assert r.status_code == 200, r.text
    longest = max(len(c["token_ids"]) for c in r.json()["choices"])
    assert 0 < longest <= 64 + 1 - len(prompt)
    clean(limited)


def test_a_completion_near_the_prompt_limit_without_max_tokens(limited):
    prompt = list(range(40, 100))  # (60 tokens: the default 16 would need a last step of 75)
    r = ok(limited, CMPL, {"prompt": prompt, "n": 2, "use_beam_search": True})
    assert all(len(c["token_ids"]) <= 64 + 1 - len(prompt) for c in r["choices"])
    clean(limited)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_max_tokens_given_is_still_refused_where_it_does_not_fit(limited, field):
    r = post(limited, CHAT, {"messages": HI, field: 60, "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_search_in_flight_at_shutdown_finishes_within_the_grace():
    """Regression: a search was cut short by a shutdown with a grace it would have finished within (its next step
    was refused, a 503), though an ordinary request in flight gets that grace. The engine's shutdown now waits for
    the searches under way (Engine.continuing) and takes their steps until the grace ends; a new request is still
    refused at once."""
    eng = make_engine()
    params = BeamSearchParams(beam_width=2, max_tokens=8)

    async def go():
        shutdown = []
        on_adds(eng, 3, lambda: shutdown.append(asyncio.ensure_future(eng.shutdown(grace_s=30.0))))
        result = await beam_search(eng, PROMPT, params)
        await shutdown[0]
        with pytest.raises(RequestError):
            eng.add_request(PROMPT, SamplingParams(max_tokens=1))
        return result
    result = asyncio.run(go())
    assert len(result.beams) == 2 and all(len(b.output_ids) == 8 for b in result.beams)
    assert result.beams == run(make_engine(), PROMPT, params).beams
    assert not eng.requests
