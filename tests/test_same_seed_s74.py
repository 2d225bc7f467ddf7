""""Same seed, same answer" hunt (session 74): what a request's `seed` makes repeat, and what it must not.

A differential sweep found a seeded request's tokens (and logprobs, to float noise) the same alone on a no-cache
engine and batched, chunked, chained or not, speculating or not, preempted and resumed, beside neighbours that
abort, over HTTP streamed or not, with n choices; those cases are pinned elsewhere (tests/test_sampling_hunt.py,
tests/test_n_choices.py, tests/test_preemption.py). What is pinned here went wrong:

* an API request's `"seed": -1` (vLLM's SamplingParams, and the UIs that send it: "a random seed") was taken as the
  seed 2**64 - 1, so every such request with the same prompt and parameters got the very same "random" answer, and
  its n choices were seed + j's, the same on every call. vLLM maps -1 to no seed; so does the API now. A seed of -1
  reached by choice j's seed + j (scheduler/api_inputs.py `choice_params`) is still a seed, and so is an engine
  SamplingParams' -1 (tests/test_mutation_sampling68_s68.py pins its stream).
A server through starlette's TestClient (the tiny preset on the CPU, no tokenizer: prompts as token ids).
"""
from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app

PROMPT = [11, 12, 13, 14, 15, 16, 17]
SAMPLED = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def client():
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=1024))
    with TestClient(create_app(engine, ServerLimits(shutdown_grace_s=0.5))) as c:
        yield c


def _choices(client, body: dict) -> list[list[int]]:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return [c["token_ids"] for c in r.json()["choices"]]


@pytest.fixture
def fixed_default_generator():
    """Unseeded draws come from torch's default generator: fixed here (and put back after), so the test's
    unseeded answers are the same on every run."""
    with torch.random.fork_rng():
        torch.manual_seed(74)
        yield


def test_a_seed_of_minus_1_is_no_seed_as_vllm_takes_it(client, fixed_default_generator):
    """Two requests with "seed": -1 drew the same tokens (seed 2**64 - 1's), and so did their n choices on
    every call; unseeded, each draw is its own."""
    first = _choices(client, {**SAMPLED, "seed": -1, "n": 2})
    again = _choices(client, {**SAMPLED, "seed": -1, "n": 2})
    assert all(len(ids) == SAMPLED["max_tokens"] for ids in first + again)
    assert len({tuple(ids) for ids in first + again}) == 4, (first, again)
    # not a seed at all: neither 2**64 - 1's stream (what -1's bits are) nor a repeat of it
    assert first[0] != _choices(client, {**SAMPLED, "seed": (1 << 64) - 1})[0]


def test_a_real_seed_still_repeats_and_a_choices_derived_minus_1_is_a_seed(client):
    """Seed -2 with n=2: choice 1 samples with -1 (seed + j), a seed, and repeats with the request, as choice 0
    of a "seed": -2 request does; choice 1 is 2**64 - 1's stream (-1's two's-complement bits)."""
    body = {**SAMPLED, "seed": -2, "n": 2}
    first, again = _choices(client, body), _choices(client, body)
    assert first == again and first[0] != first[1]
    assert first[1] == _choices(client, {**SAMPLED, "seed": (1 << 64) - 1})[0]
