"""vLLM's per-step and per-prompt families on /metrics (scheduler/prom_vllm.py), and whose end-to-end latency
counts:
* vllm:iteration_tokens_total: the tokens of each engine step (one forward): a prefill (chunk)'s computed prompt
  tokens, one per decode row; one observation per step, made as the runner launches it (scheduler/runner.py),
  so its count is the engine's batches and its sum the engine's prefill + decode tokens;
* vllm:request_max_num_generation_tokens: per prompt, the most tokens one of its choices generated, observed
  once, as its last choice ends (vLLM's ParentRequest), with its prompt's n;
* vllm:e2e_request_latency_seconds: every request the engine ended (stop, length, and error: vLLM's finished
  requests), not one a client left (vLLM's abort path records no finished request).
Engines driven directly (tiny, CPU) for the steps; a real server (tests/test_server.py's ServerThread) for the
rest."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.prom import ServerMetrics
from scheduler.request import SamplingParams
from scheduler.server import ServerLimits, create_app
from test_prom_vllm import MODEL, parse, scrape
from test_server import ServerThread

ITERATION = "vllm:iteration_tokens_total"
MAX_GENERATION = "vllm:request_max_num_generation_tokens"
# vLLM V1's (vllm/v1/metrics/loggers.py)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted({**labels, "model_name": MODEL}.items()))), 0.0)


def run_steps(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[dict, dict]:
    """Serve `prompts` (all queued before the loop starts) on `engine`, observed by a ServerMetrics made for it:
    (its samples, the engine's status counters) once every request ended."""
    metrics = ServerMetrics(engine, MODEL)

    async def go():
        reqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
        await engine.start()
        while not all(r.state.done for r in reqs):
            await asyncio.sleep(0.01)
        await engine.shutdown(1.0)
        assert [len(r.output) for r in reqs] == [max_tokens] * len(prompts)

    asyncio.run(go())
    return parse(metrics.render().decode())[0], engine.status()["engine"]


def steps_observed(samples: dict) -> tuple[float, float, dict[int, float]]:
    """(count, sum, cumulative count per bucket bound) of vllm:iteration_tokens_total."""
    buckets = {b: value(samples, f"{ITERATION}_bucket", le=f"{float(b)}") for b in ITERATION_BUCKETS}
    return value(samples, f"{ITERATION}_count"), value(samples, f"{ITERATION}_sum"), buckets


def test_the_families_have_vllms_type_labels_and_buckets():
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=16))
    samples, fams = parse(ServerMetrics(engine, MODEL).render().decode())
    for name, source in ((ITERATION, "hicache_engine_step_tokens"),
                         (MAX_GENERATION, "hicache_request_max_generation_tokens")):
        assert fams[name].type == "histogram", name
        assert fams[name].documentation.startswith("Histogram of"), name
        for s in fams[name].samples:
            assert set(s.labels) == ({"model_name", "le"} if s.name.endswith("_bucket") else {"model_name"}), s
            assert s.labels["model_name"] == MODEL and not s.name.endswith("_created"), s
            hicache_labels = tuple((k, v) for k, v in sorted(s.labels.items()) if k != "model_name")
            assert samples[(source + s.name[len(name):], hicache_labels)] == s.value, s  # (one state, renamed)
    les = [s.labels["le"] for s in fams[ITERATION].samples if s.name.endswith("_bucket")]
    assert les == [f"{float(b)}" for b in ITERATION_BUCKETS] + ["+Inf"]
    les = [s.labels["le"] for s in fams[MAX_GENERATION].samples if s.name.endswith("_bucket")]
    assert les[:6] == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0"] and les[-1] == "+Inf"  # (vLLM's 1-2-5)


def test_a_prefill_then_decode_steps_are_one_observation_each():
    """A prompt of 9 tokens, 4 tokens asked: one prefill step of 9 tokens (its first token), then 3 decode
    steps of its one row."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=48))
    samples, eng = run_steps(engine, [list(range(40, 49))], max_tokens=4)
    count, total, buckets = steps_observed(samples)
    assert (count, total) == (4, 9 + 3)
    assert (buckets[1], buckets[8], buckets[16]) == (3, 3, 4)
    assert (count, total) == (eng["batches"], eng["prefill_tokens"] + eng["decode_tokens"])


def test_a_batch_is_one_observation_of_all_its_rows():
    """Two prompts (5 and 7 tokens) queued together: one prefill step of 12 tokens, then 2 decode steps of
    2 rows each (not one observation per request)."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=48))
    samples, eng = run_steps(engine, [list(range(60, 65)), list(range(70, 77))], max_tokens=3)
    count, total, buckets = steps_observed(samples)
    assert (count, total) == (3, 12 + 2 * 2)
    assert (buckets[1], buckets[8], buckets[16]) == (0, 2, 3)
    assert (count, total) == (eng["batches"], eng["prefill_tokens"] + eng["decode_tokens"])


def test_a_chunked_prefill_is_one_observation_per_chunk():
    """A prompt of 20 tokens over a prefill budget of 8 tokens: chunks of 8, 8 and 4 tokens, each a step."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=48, max_prefill_tokens=8))
    samples, eng = run_steps(engine, [list(range(100, 120))], max_tokens=2)
    count, total, buckets = steps_observed(samples)
    assert (count, total) == (4, 8 + 8 + 4 + 1)
    assert (buckets[1], buckets[8], buckets[16]) == (1, 4, 4)
    assert (count, total) == (eng["batches"], eng["prefill_tokens"] + eng["decode_tokens"])


def test_a_prompts_most_tokens_is_observed_once_as_its_last_choice_ends():
    """ServerMetrics.prompt_choice: a prompt's choices share one tally (made one after another, choice 0
    first); n and the most tokens one of them generated are given only by the one that ends last."""
    metrics = ServerMetrics(Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=16)), MODEL)
    api_req, other = object(), object()
    first, second, third = (metrics.prompt_choice(api_req, 0, choice=j) for j in range(3))
    alone = metrics.prompt_choice(other, 0, choice=0)
    assert first is second is third and alone is not first
    assert [first.ended(3), alone.ended(2), third.ended(7), second.ended(5)] == [None, 2, None, 7]
    # (a prompt index of the same request, or a choice 0, starts the next prompt's tally)
    assert metrics.prompt_choice(other, 1, choice=1) is not alone
    assert metrics.prompt_choice(other, 1, choice=0) is not metrics.prompt_choice(other, 1, choice=0)
    metrics.ended("length", 3, 7, max_tokens=9, n=3, max_generation_tokens=7)
    metrics.ended("length", 3, 2, max_tokens=9, n=1, max_generation_tokens=2)
    samples, _ = parse(metrics.render().decode())
    assert value(samples, f"{MAX_GENERATION}_count") == 2 and value(samples, f"{MAX_GENERATION}_sum") == 7 + 2
    assert value(samples, "vllm:request_params_n_count") == 2 and value(samples, "vllm:request_params_n_sum") == 4


def test_a_prompts_tally_lets_its_request_go_once_its_choices_ended():
    """Regression: ServerMetrics kept the last prompt's request body (its whole prompt) alive until the next
    request came. Once every choice of a prompt ended, the tally lets the body go."""
    import gc
    import weakref

    class Body:  # (a stand-in for the API request model, which can be weakly referenced)
        pass

    metrics = ServerMetrics(Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=16)), MODEL)
    body = Body()
    alive = weakref.ref(body)
    tallies = [metrics.prompt_choice(body, 0, choice=j) for j in range(2)]
    del body
    tallies[0].ended(3)
    gc.collect()
    assert alive() is not None  # (a choice still running: its prompt's tally still needs the body)
    tallies[1].ended(4)
    gc.collect()
    assert alive() is None


@pytest.fixture(scope="module")
def srv():
    config = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256, max_new_tokens_limit=64)
    engine = Engine(config)
    limits = ServerLimits(max_concurrent_requests=64, shutdown_grace_s=2.0, served_model_names=(MODEL,))
    with ServerThread(create_app(engine, limits)) as s:
        s.engine = engine
        yield s


def post(srv, **body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)


def test_the_most_tokens_of_each_prompts_choices_on_the_server(srv):
    """A batch of two prompts, n=3 sampled choices each that stop at any of a third of the vocabulary: one
    observation per prompt (not per choice), of the longest of its choices (its completion tokens)."""
    before, _ = scrape(srv)
    r = post(srv, prompt=[[21, 22, 23], [31, 32, 33, 34]], n=3, max_tokens=24, temperature=1.0, seed=7,
             stop_token_ids=list(range(0, 512, 3)), stream=True, stream_options={
                 "include_usage": True, "continuous_usage_stats": True})
    assert r.status_code == 200, r.text
    tokens = {}  # choice index -> its completion tokens (its last chunk's usage: its own)
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: "):])
            for c in chunk.get("choices") or []:
                tokens[c["index"]] = chunk["usage"]["completion_tokens"]
    per_prompt = [[tokens[i * 3 + j] for j in range(3)] for i in range(2)]
    assert any(len(set(t)) > 1 for t in per_prompt), per_prompt  # (else the max is any choice's)
    after, _ = scrape(srv)

    def delta(name):
        return value(after, name) - value(before, name)
    assert delta(f"{MAX_GENERATION}_count") == 2
    assert delta(f"{MAX_GENERATION}_sum") == sum(max(t) for t in per_prompt)
    assert delta("vllm:request_params_n_count") == 2 and delta("vllm:request_params_n_sum") == 6


def test_a_request_the_engine_failed_counts_its_end_to_end_latency(srv):
    """vLLM observes e2e for every request its engine finished, errors included (only a client's abort is
    left out): a request whose cached prefix is corrupt (NaN K/V) fails, and its latency is observed."""
    from test_sampling_hunt import _poison_l1_prefix
    from test_server import wait_idle

    bad = list(range(11, 20))
    assert post(srv, prompt=bad, max_tokens=2).status_code == 200  # its prefix is now in L1
    wait_idle(srv)
    srv.call(_poison_l1_prefix, srv.engine, bad[:8])
    before, _ = scrape(srv)
    r = post(srv, prompt=bad, max_tokens=4, temperature=0, ignore_eos=True)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
    after, _ = scrape(srv)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)
    assert delta("vllm:request_success_total", finished_reason="error") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_sum") > 0
    wait_idle(srv)
