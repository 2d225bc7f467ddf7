"""Hunt: prompt logprobs (SamplingParams.prompt_logprobs) and /v1/completions' `echo` against references
(the dense forward's log_softmax; the same request without prompt logprobs; vLLM's response shape), where
such a request meets chunked prefill beside cache hits, restores, aborts and the sampling options.
CPU, tiny preset."""
from __future__ import annotations

import asyncio
import dataclasses
import math
import time

import pytest
import torch

from hicache.radix import Tier
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from test_echo_prompt_logprobs import GREEDY, _post, _stream

A = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # 17 tokens: 4 full pages of 4 and one more
B = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]


def make_engine(**kw) -> Engine:
    hicache = kw.pop("hicache", None)
    config = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=kw.pop("num_pages", 128), **kw)
    return Engine(config.with_hicache(**hicache) if hicache else config)


def reference(eng: Engine, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the dense forward's logits [N, V]: row i is the distribution of token i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(eng.model.forward_dense(torch.tensor(prompt)).float(), dim=-1)


def check(eng: Engine, prompt: list[int], got, k: int) -> None:
    ref = reference(eng, prompt)
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        lp, row = got[i], ref[i - 1]
        assert math.isclose(lp.logprob, float(row[prompt[i]]), abs_tol=1e-4), i
        assert [t for t, _ in lp.top] == torch.topk(row, k).indices.tolist(), i


def plain_outputs(prompts, params) -> list[list[int]]:
    """What a fresh engine (no cache, no chunking) generates for each prompt: the reference tokens."""
    return [r.output_ids for r in make_engine().generate(prompts, params)]


async def result_of(eng: Engine, prompt, params, delay_s: float = 0.0):
    await asyncio.sleep(delay_s)
    req = eng.add_request(prompt, params)
    while True:
        ev = await req.queue.get()
        if ev.finished:
            return req.result()


def run_at_once(eng: Engine, jobs, warm=()) -> list:
    """Warm the cache with `warm` prompts, then submit `jobs` ((prompt, params, delay_s)) at once."""
    async def go():
        await eng.start()
        for prompt in warm:
            await result_of(eng, prompt, SamplingParams(max_tokens=1))
        out = await asyncio.gather(*(result_of(eng, p, s, d) for p, s, d in jobs))
        await eng.stop_loop()
        return out
    return asyncio.run(go())


def check_all(eng: Engine, jobs, results, k: int) -> None:
    """Each job's tokens are the fresh engine's; a prompt-logprobs job's entries are the dense reference's
    and it took nothing from the cache."""
    want = plain_outputs([p for p, _, _ in jobs], SamplingParams(max_tokens=max(s.max_tokens for _, s, _ in jobs)))
    for (prompt, params, _), res, tokens in zip(jobs, results, want):
        assert res.error is None and res.output_ids == tokens[:params.max_tokens], (prompt, params)
        if params.prompt_logprobs is None:
            assert res.prompt_logprobs is None
        else:
            check(eng, prompt, res.prompt_logprobs, k)
            assert res.cached_tokens == {"l1": 0, "l2": 0, "l3": 0}
    eng.check_integrity()


# -- beside other requests --------------------------------------------------------------------------------
G = SamplingParams(max_tokens=4)
P = SamplingParams(max_tokens=4, prompt_logprobs=3)
P0 = SamplingParams(max_tokens=0, prompt_logprobs=3)


@pytest.mark.parametrize("budget", [3, 5])
def test_chunks_share_prefill_batches_with_l1_hits_staggered(budget):
    """Small prefill budgets: the prompt-logprobs requests' chunks ride in batches with requests that hit
    the prefix in L1 (warmed, and published by the prompt-logprobs requests themselves), arriving together
    and a little apart; overlap scheduling on (the default)."""
    eng = make_engine(max_prefill_tokens=budget)
    jobs = [(A + [60, 61], G, 0), (A, P, 0), (A, G, 0), (A[:9], P, 0.001), (A + [70], P0, 0.002), (B, G, 0.003),
            (A[:13], G, 0)]
    check_all(eng, jobs, run_at_once(eng, jobs, warm=[A[:12]]), 3)
    assert eng.metrics()["hit_tokens"]["l1"] > 0


@pytest.mark.parametrize("jobs", [
    [(A, P, 0), (A, G, 0)], [(A, G, 0), (A, P, 0)], [(A, P0, 0), (A, G, 0)], [(A, G, 0), (A, P0, 0)],
    [(A[:9], P, 0), (A, G, 0)], [(A, G, 0), (A[:9], P, 0)], [(A[:9], G, 0), (A, P, 0)]],
    ids=["P-then-plain", "plain-then-P", "P0-then-plain", "plain-then-P0", "P-prefix", "P-prefix-second", "P-longer"])
def test_the_same_prompt_at_once_with_and_without_prompt_logprobs(jobs):
    """One admitted onto the pages the other publishes chunk by chunk, or publishing pages the tree already
    holds (then it switches to the tree's copies mid-prefill: `Admission._publish`)."""
    for budget in (4, 64):
        eng = make_engine(max_prefill_tokens=budget)
        check_all(eng, jobs, run_at_once(eng, jobs), 3)


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_chunks_beside_l2_restores(write_policy):
    """A and B evicted to L2: plain requests restore them while prompt-logprobs requests over the same
    prefixes (or another) recompute theirs in the same prefill batches."""
    eng = make_engine(max_prefill_tokens=4, num_pages=24,
                      hicache=dict(enable=True, host_ratio=4.0, policy="always", write_policy=write_policy))
    jobs = [(A + [60, 61], G, 0), ([90 + i for i in range(14)], P, 0), (B + [3], G, 0), (A[:10], P, 0), (B, P0, 0)]

    async def go():
        await eng.start()
        for prompt in (A, B):
            await result_of(eng, prompt, SamplingParams(max_tokens=1))
        await eng.cache.flush_async(Tier.L1)
        out = await asyncio.gather(*(result_of(eng, p, s, d) for p, s, d in jobs))
        await eng.stop_loop()
        return out

    results = asyncio.run(go())
    check_all(eng, jobs, results, 3)
    assert eng.metrics()["hit_tokens"]["l2"] > 0 and eng.metrics()["restores_done"] > 0


def test_an_abort_between_chunks_keeps_what_ran():
    """Aborted between prefill chunks: its prompt logprobs so far are the reference's, the pages it published
    serve the next request, and nothing leaks."""
    eng = make_engine(max_prefill_tokens=4)

    async def go():
        await eng.start()
        req = eng.add_request(A, P)
        while req.cached_len < 8:
            assert not req.state.done, req.result()
            await asyncio.sleep(0)
        await eng.abort(req.rid)
        while not (await req.queue.get()).finished:
            pass
        eng.check_integrity()
        after = await result_of(eng, A, G)
        await eng.stop_loop()
        return req.result(), after

    aborted, after = asyncio.run(go())
    assert aborted.finish_reason == "abort" and 8 < len(aborted.prompt_logprobs) < len(A)
    check(eng, A[:len(aborted.prompt_logprobs)], aborted.prompt_logprobs, 3)
    assert after.cached_tokens["l1"] >= 8 and after.output_ids == plain_outputs([A], G)[0]
    eng.check_integrity()


def test_penalties_bias_and_min_tokens_leave_prompt_logprobs_raw():
    """As vLLM: the prompt's entries are the raw logits' log_softmax, whatever penalties, logit_bias and
    min_tokens do to the sampled rows; the tokens and their logprobs are those without prompt logprobs."""
    params = SamplingParams(max_tokens=6, logprobs=2, repetition_penalty=1.5, presence_penalty=1.0,
                            logit_bias={A[3]: 100.0, 7: -100.0}, min_tokens=3, temperature=0.8, seed=11, top_k=20)
    plain = make_engine().generate([A], params)[0]
    eng = make_engine(max_prefill_tokens=5)
    res, other = eng.generate([A, B], [dataclasses.replace(params, prompt_logprobs=3),
                                       SamplingParams(max_tokens=3, frequency_penalty=2.0)])
    assert res.output_ids == plain.output_ids
    for got, want in zip(res.logprobs, plain.logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    check(eng, A, res.prompt_logprobs, 3)
    assert other.output_ids == plain_outputs([B], SamplingParams(max_tokens=3, frequency_penalty=2.0))[0]
    eng.check_integrity()


def test_rows_in_slices_with_several_ks_in_one_batch(monkeypatch):
    """Logits made a few rows at a time (PROMPT_LOGITS_SLICE_BYTES), one batch of requests asking 0, 5 and
    20 alternatives, none, and one of a one-token prompt (its entries: the first None alone)."""
    import scheduler.sampling as sampling
    eng = make_engine()
    monkeypatch.setattr(sampling, "PROMPT_LOGITS_SLICE_BYTES", 4 * eng.vocab_size * 3)  # 3 rows a slice
    prompts, ks = [A, A[:16], [7], B, A[:2]], [0, 5, 3, None, 20]
    results = eng.generate(prompts, [SamplingParams(max_tokens=2, prompt_logprobs=k) for k in ks])
    for prompt, k, res, want in zip(prompts, ks, results, plain_outputs(prompts, SamplingParams(max_tokens=2))):
        assert res.output_ids == want
        if k is None:
            assert res.prompt_logprobs is None
        else:
            check(eng, prompt, res.prompt_logprobs, k)
    eng.check_integrity()


# -- the cost model ---------------------------------------------------------------------------------------
def test_a_prompt_logprobs_prefill_teaches_the_cost_model_nothing():
    """Its forward also makes every prompt row's logits (~1.3x a prefill on the 8B shape) and it takes no
    cached prefix whatever the tiers hold: neither the recompute line (`observe_prefill`) nor the "l1"
    outcome residual (`score_outcome`) may learn from it; a plain request's prefill still teaches both."""
    eng = make_engine(hicache=dict(enable=True, host_ratio=2.0))
    cost = eng.cache.cost

    def samples() -> tuple[int, int]:
        return cost.directions["recompute"].num_samples, cost.outcomes.state()["l1"]["samples"]

    eng.generate([A], SamplingParams(max_tokens=1, prompt_logprobs=1))  # alone: one batch, one sequence
    assert samples() == (0, 0)
    eng.generate([B], SamplingParams(max_tokens=1))
    assert samples() == (1, 1)
    eng.check_integrity()


# -- validation -----------------------------------------------------------------------------------------
class _ChatTokenizer:
    chat_template = "(any)"

    def apply_chat_template(self, messages: list[dict], **_) -> list[int]:
        return [1, 2, 3]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_chats_max_tokens_0_is_refused_without_pointing_at_echo(field):
    """A chat has no `echo` (an unknown field there): its 400 for max_tokens 0 must not offer it as the way."""
    from scheduler.api_inputs import parse_prompts
    from scheduler.api_models import APIError

    with pytest.raises(APIError) as err:
        parse_prompts({"messages": [{"role": "user", "content": "hi"}], field: 0}, True, tokenizer=_ChatTokenizer(),
                      served_names={"tiny"}, model_name="tiny", vocab_size=512, prompt_limit=64, max_tokens_limit=64)
    assert err.value.status == 400 and err.value.param == field
    assert "echo" not in err.value.message and ">= 1" in err.value.message


# -- HTTP -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv():
    from scheduler.server import ServerLimits, create_app
    from scheduler.tokenizer import ByteTokenizer
    from test_server import ServerThread

    engine = make_engine(num_pages=64, max_new_tokens_limit=64, max_prefill_tokens=4)
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=ByteTokenizer(512))) as s:
        s.engine = engine
        yield s


def test_echo_stop_strings_match_the_generated_text_only(srv):
    """A stop string in the echoed prompt, or one the prompt's end and the completion's start would make
    together, never matches; one in the generated text ends it there, the prompt still ahead."""
    prompt = "Hello there"
    generated = _post(srv, {"prompt": prompt, "max_tokens": 6})["choices"][0]["text"]
    for stop in (["ll", "the"], ["e" + generated[0]]):
        for choice in (_post(srv, {"prompt": prompt, "max_tokens": 6, "echo": True, "stop": stop})["choices"][0],
                       _stream(srv, {"prompt": prompt, "max_tokens": 6, "echo": True, "stop": stop})[-1]["choices"][0]):
            assert choice["finish_reason"] == "length"
    body = {"prompt": prompt, "max_tokens": 6, "echo": True, "stop": [generated[1:3]], "logprobs": 1}
    choice = _post(srv, body)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == prompt + generated[:1]
    assert choice["logprobs"]["tokens"][:len(prompt)] == list(prompt)
    chunks = [c["choices"][0] for c in _stream(srv, body) if c["choices"]]
    assert "".join(c["text"] for c in chunks) == choice["text"] and chunks[-1]["finish_reason"] == "stop"
    srv.call(srv.engine.check_integrity)


def test_streamed_prefills_alone_of_a_batch_with_usage(srv):
    """max_tokens 0 with echo, streamed, for a batch whose second prompt is one token (its entries: the first
    None alone), logprobs 0, include_usage: one finished chunk per prompt, then the usage (no completion)."""
    from scheduler.tokenizer import ByteTokenizer
    tok = ByteTokenizer(512)
    chunks = _stream(srv, {"prompt": [tok.encode("Hi!"), tok.encode("A")], "max_tokens": 0, "echo": True, "logprobs": 0,
                           "stream_options": {"include_usage": True}})
    *choices, usage = chunks
    by_index = {c["choices"][0]["index"]: c["choices"][0] for c in choices}
    assert len(choices) == 2 and by_index.keys() == {0, 1}
    assert by_index[0]["text"] == "Hi!" and by_index[1]["text"] == "A"
    assert all(c["finish_reason"] == "length" and c["token_ids"] == [] for c in by_index.values())
    assert by_index[1]["logprobs"] == {"tokens": ["A"], "token_logprobs": [None], "top_logprobs": [None],
                                       "text_offset": [0]}
    lps = by_index[0]["logprobs"]
    assert lps["token_logprobs"][0] is None and len(lps["top_logprobs"][2]) == 1 and lps["text_offset"] == [0, 1, 2]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 4 and usage["usage"]["completion_tokens"] == 0


def test_a_client_gone_mid_prefill_of_a_streamed_echo_frees_everything(srv):
    import httpx
    body = {**GREEDY, "prompt": "y" * 60, "max_tokens": 60, "echo": True, "logprobs": 2, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200  # (gone before its first chunk: the prefill runs 15 chunks of 4 tokens)
    deadline = time.monotonic() + 30
    while srv.call(lambda: srv.engine.requests or srv.engine.running):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert srv.call(lambda: srv.engine.stats["aborted"]) >= 1
    srv.call(srv.engine.check_integrity)
