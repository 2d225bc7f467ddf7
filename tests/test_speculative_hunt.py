"""Speculative decoding (scheduler/speculative.py) around the engine: a speculating request aborted mid-run leaks
no page; vLLM's spec_decode counters on /metrics, only with --speculative-config; the prefix cache after
speculation holds the K/V greedy decoding would have written (a rejected draft's never reaches the tree)."""
from __future__ import annotations

import asyncio
import contextlib
import random

import httpx
import pytest
import torch

from hicache.radix import Tier
from hicache_helpers import assert_whole
from scheduler.engine import Engine
from scheduler.prom import ServerMetrics
from scheduler.request import RequestState, SamplingParams
from scheduler.server import ServerLimits, create_app
from scheduler.speculative import SpeculativeConfig
from test_prom_vllm import parse
from test_server import ServerThread
from test_speculative import SPEC, VOCAB, looping_prompts, make_engine, record_steps, spec_stats

MODEL = "spec-model"


@pytest.fixture(scope="module")
def looping() -> list[list[int]]:
    """Prompts whose greedy continuation is drafted, and a draft accepted, at their first decode step."""
    return looping_prompts(7, 20, 8, 32, need=2)


@pytest.fixture(scope="module")
def reference(looping) -> list[list[int]]:
    return [r.output_ids for r in make_engine().generate(looping[:2], SamplingParams(max_tokens=40))]


# -- abort ---------------------------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["close_stream", "abort"])
async def test_aborting_a_speculating_request_leaks_nothing(looping, reference, how):
    eng = make_engine(SPEC, num_pages=96)
    await eng.start()
    long_params = SamplingParams(max_tokens=300)

    async def aborted():
        got = []
        if how == "close_stream":
            async with contextlib.aclosing(eng.submit(looping[0], long_params)) as stream:
                async for ev in stream:
                    assert not ev.finished
                    got.append(ev.token_id)
                    if len(got) >= 6 and spec_stats(eng)["accepted_tokens"] > 0:
                        break  # closing the stream aborts the request
            return got, "abort"
        req = eng.add_request(looping[0], long_params)
        while True:
            ev = await req.queue.get()
            if ev.finished:
                return got, ev.finish_reason
            got.append(ev.token_id)
            if len(got) == 6:
                assert spec_stats(eng)["drafts"] > 0  # (it speculated before it is aborted)
                assert await eng.abort(req.rid)

    async def other():
        async with contextlib.aclosing(eng.submit(looping[1], SamplingParams(max_tokens=16))) as stream:
            return [ev.token_id async for ev in stream if ev.token_id is not None]

    (got, reason), done = await asyncio.gather(aborted(), other())
    await eng.stop_loop()
    assert reason == "abort" and eng.stats["aborted"] == 1
    assert got == reference[0][:len(got)] and 6 <= len(got) < 40
    assert done == reference[1][:16]
    assert not eng.running and not eng.requests
    assert_whole(eng.cache)  # integrity; every L1 page free or the tree's, none locked
    l1 = eng.status()["tiers"]["l1"]
    assert l1["private_pages"] == 0 and l1["free_pages"] + l1["evictable_pages"] == l1["capacity_pages"]
    await eng.shutdown()


# -- Prometheus ----------------------------------------------------------------------------------------------
SPEC_FAMILIES = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


def test_spec_decode_counters_on_metrics_say_what_the_engine_counted(looping):
    engine = make_engine(SPEC)
    limits = ServerLimits(max_concurrent_requests=8, shutdown_grace_s=1.0, served_model_names=(MODEL,))
    with ServerThread(create_app(engine, limits)) as srv:
        before, fams = parse(httpx.get(srv.url + "/metrics").text)
        for name in SPEC_FAMILIES:  # there from the start, as counters
            assert fams[name].type == "counter", name
        assert before[("vllm:spec_decode_num_drafts_total", (("model_name", MODEL),))] == 0
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": looping[0], "max_tokens": 16,
                                                          "temperature": 0, "ignore_eos": True}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16
        after, _ = parse(httpx.get(srv.url + "/metrics").text)
        stats = srv.call(engine.status)["engine"]["speculative"]
    label = (("model_name", MODEL),)
    assert stats["drafts"] > 0 and stats["accepted_tokens"] > 0
    assert after[("vllm:spec_decode_num_drafts_total", label)] == stats["drafts"]
    assert after[("vllm:spec_decode_num_draft_tokens_total", label)] == stats["draft_tokens"]
    assert after[("vllm:spec_decode_num_accepted_tokens_total", label)] == stats["accepted_tokens"]
    for pos in range(SPEC.num_speculative_tokens):
        key = ("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("model_name", MODEL), ("position", str(pos))))
        assert after[key] == stats["accepted_per_pos"][pos], pos
    assert after[("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                  (("model_name", MODEL), ("position", "0")))] > 0
    # generated tokens are the answer's, not the rows verified
    gen = ("vllm:generation_tokens_total", label)
    assert after[gen] - before.get(gen, 0.0) == 16


def test_no_spec_decode_counters_without_speculation():
    engine = make_engine()
    engine.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(max_tokens=4))
    text = ServerMetrics(engine, MODEL).render().decode()
    assert "vllm:generation_tokens" in text and "spec_decode" not in text
    assert "speculative" not in engine.status()["engine"]


# -- the prefix cache after speculation ---------------------------------------------------------------------
def tree_kv(eng: Engine, tokens: list[int]) -> torch.Tensor:
    m = eng.cache.tree.match(tokens, include_storage=False, touch=False)
    return eng.cache.l1.kv[:, :, m.pages[Tier.L1]].float().clone(), m.lengths[Tier.L1]


def test_the_prefix_cache_after_speculation_holds_greedy_decodings_kv(looping, monkeypatch):
    spec, plain = make_engine(SPEC), make_engine()
    steps = record_steps(monkeypatch)
    params = SamplingParams(max_tokens=21)
    p = looping[0]
    [first] = spec.generate([p], params)
    [want] = plain.generate([p], params)
    assert first.output_ids == want.output_ids
    assert any(len(s.yielded) - 1 < len(s.draft) for s in steps), "no draft rejected: the case is not there"
    q = p + first.output_ids  # its prompt and answer: every page of them but the last token's is in the tree
    known = len(q) - 1 - (len(q) - 1) % 4
    kv_spec, n_spec = tree_kv(spec, q)
    kv_plain, n_plain = tree_kv(plain, q)
    assert n_spec == n_plain == known > len(p)
    torch.testing.assert_close(kv_spec, kv_plain, atol=1e-4, rtol=1e-4)  # (greedy decoding's K/V, no draft's)
    again, follow = spec.generate([p, q], SamplingParams(max_tokens=8))
    want_again, want_follow = plain.generate([p, q], SamplingParams(max_tokens=8))
    assert again.output_ids == want_again.output_ids == first.output_ids[:8]
    assert follow.output_ids == want_follow.output_ids
    assert again.cached_tokens["l1"] == want_again.cached_tokens["l1"] == len(p) - 1 - (len(p) - 1) % 4
    assert follow.cached_tokens["l1"] == want_follow.cached_tokens["l1"] == known
    spec.check_integrity()
    assert_whole(spec.cache)


def test_decode_steps_chain_while_no_draft_can_come_and_stop_when_one_can(looping, reference):
    """Session 47: on the H200 a greedy request that never drafted decoded 2-6 % slower with speculation on, every
    step unchained. Now the step after the one in flight chains unless some eligible request's last
    prompt_lookup_min - 1 tokens occurred before (a 1-gram lookup: always unchained)."""
    rng = random.Random(3)
    fresh = [[rng.randrange(VOCAB) for _ in range(30)] for _ in range(3)]
    params = SamplingParams(max_tokens=24)
    plain = [r.output_ids for r in make_engine().generate(fresh, params)]
    strict = make_engine(SpeculativeConfig(4, prompt_lookup_max=4, prompt_lookup_min=4, draft_policy="always"))
    assert [r.output_ids for r in strict.generate(fresh, params)] == plain
    assert strict.stats["chained_steps"] > 0
    ones = make_engine(SpeculativeConfig(4, prompt_lookup_max=4, prompt_lookup_min=1, draft_policy="always"))
    assert [r.output_ids for r in ones.generate(fresh, params)] == plain
    assert ones.stats["chained_steps"] == 0
    # an answer that loops still speculates under the strict lookup, chained between its verify steps
    got = [r.output_ids for r in strict.generate(looping[:2], SamplingParams(max_tokens=40))]
    assert got == reference and spec_stats(strict)["accepted_tokens"] > 0
    strict.check_integrity()


def test_a_greedy_request_is_not_left_out_of_the_plain_steps_chained_after_its_verify_step(monkeypatch):
    """Session 47. After a verify step the next decode step is the others' (a sampled request's); it chained, and
    the chain went on with the others alone while no draft could come: the greedy request waited for the sampled
    one's every token. Now a chain that leaves a decoding request out ends, and the next step takes both."""
    from scheduler.speculative import Speculator
    rng = random.Random(11)
    greedy_prompt, sampled_prompt = ([rng.randrange(VOCAB) for _ in range(30)] for _ in range(2))
    eng = make_engine(SpeculativeConfig(4, prompt_lookup_max=4, prompt_lookup_min=4, draft_policy="always"))
    drafted = []

    def draft_once(self, req, k):  # one (wrong) draft for the greedy request once both decode, none after
        both = sum(r.state is RequestState.DECODE for r in eng.running) == 2
        if req.params.temperature == 0.0 and both and not drafted:
            drafted.append(req.rid)
            return [0]
        return []
    monkeypatch.setattr(Speculator, "draft", draft_once)

    async def run():
        greedy_tokens_when_sampled_ended = []

        async def sampled():
            async for ev in eng.submit(sampled_prompt, SamplingParams(max_tokens=30, temperature=0.8, seed=1)):
                if ev.finished:
                    greedy_tokens_when_sampled_ended.append(len(greedy_req.output))
        greedy_stream = eng.submit(greedy_prompt, SamplingParams(max_tokens=40))
        first = await greedy_stream.__anext__()  # its prefill's token: it decodes from now on
        greedy_req = eng.requests[first.rid]
        task = asyncio.create_task(sampled())
        async for _ in greedy_stream:
            pass
        await task
        await eng.shutdown()
        return greedy_tokens_when_sampled_ended[0]
    greedy_tokens = asyncio.run(run())
    assert drafted and spec_stats(eng)["verify_steps"] == 1
    assert greedy_tokens >= 20  # (it decoded beside the sampled one; it had 5 with the bug)
    eng.check_integrity()
