"""vLLM's metric names on /metrics (scheduler/prom_vllm.py), for dashboards, alerts and autoscalers built on
vLLM's: each family there with vLLM's type and its `model_name` label (the served name), saying what the
hicache_ family it is rendered from says after a streamed, a non-streamed, a one-token and a stopped request;
the per-request latencies (TPOT of requests with >= 2 tokens, one inter-token gap per token after the first)
and the request-length histograms; the queue gauges and KV-cache usage read from the engine (vLLM's usage:
pages neither free nor evictable). A real server (tests/test_server.py's ServerThread, tiny CPU engine)."""
from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.prom import ServerMetrics
from scheduler.request import SamplingParams
from scheduler.server import ServerLimits, create_app
from test_server import ServerThread

MODEL = "served-name"
# vLLM's family -> (its type, the hicache_ family it is rendered from, or None: read from the engine)
FAMILIES = {
    "vllm:num_requests_running": ("gauge", None),
    "vllm:num_requests_waiting": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:gpu_cache_usage_perc": ("gauge", None),
    "vllm:num_preemptions": ("counter", None),
    "vllm:prefix_cache_queries": ("counter", None),
    "vllm:prefix_cache_hits": ("counter", None),
    "vllm:prompt_tokens": ("counter", "hicache_prompt_tokens"),
    "vllm:generation_tokens": ("counter", "hicache_generation_tokens"),
    "vllm:request_success": ("counter", "hicache_requests_finished"),
    "vllm:time_to_first_token_seconds": ("histogram", "hicache_time_to_first_token_seconds"),
    "vllm:e2e_request_latency_seconds": ("histogram", "hicache_e2e_request_latency_seconds"),
    "vllm:request_queue_time_seconds": ("histogram", "hicache_request_queue_time_seconds"),
    "vllm:request_time_per_output_token_seconds": ("histogram", "hicache_time_per_output_token_seconds"),
    "vllm:inter_token_latency_seconds": ("histogram", "hicache_inter_token_latency_seconds"),
    "vllm:time_per_output_token_seconds": ("histogram", "hicache_inter_token_latency_seconds"),
    "vllm:request_prompt_tokens": ("histogram", "hicache_request_prompt_tokens"),
    "vllm:request_generation_tokens": ("histogram", "hicache_request_generation_tokens"),
    "vllm:request_prefill_time_seconds": ("histogram", "hicache_request_prefill_time_seconds"),
    "vllm:request_decode_time_seconds": ("histogram", "hicache_request_decode_time_seconds"),
    "vllm:request_inference_time_seconds": ("histogram", "hicache_request_inference_time_seconds"),
    "vllm:request_params_n": ("histogram", "hicache_request_params_n"),
    "vllm:request_params_max_tokens": ("histogram", "hicache_request_params_max_tokens"),
}
REASONS = ("stop", "length", "abort", "error")


@pytest.fixture(scope="module")
def srv():
    config = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=48, max_new_tokens_limit=64,
                          max_running_requests=32).with_hicache(enable=True, host_ratio=4.0)
    engine = Engine(config)
    limits = ServerLimits(max_concurrent_requests=64, shutdown_grace_s=2.0, served_model_names=(MODEL,))
    with ServerThread(create_app(engine, limits)) as s:
        s.engine = engine
        yield s


def parse(text: str) -> tuple[dict, dict]:
    """(samples by (name, sorted labels), families by name) of one exposition."""
    samples, fams = {}, {}
    for fam in text_string_to_metric_families(text):
        fams[fam.name] = fam
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, fams


def scrape(srv) -> tuple[dict, dict]:
    return parse(httpx.get(srv.url + "/metrics").text)


def complete(srv, **body) -> tuple[str, int, int]:
    """(finish_reason, completion tokens, prompt tokens) of one completion, streamed or not."""
    body = {"model": MODEL, "temperature": 0, **body}
    if not body.get("stream"):
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"], out["usage"]["prompt_tokens"]
    body["stream_options"] = {"include_usage": True}
    reason = usage = None
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices") or []:
                reason = choice.get("finish_reason") or reason
            usage = chunk.get("usage") or usage
    return reason, usage["completion_tokens"], usage["prompt_tokens"]


def assert_rendered_from_hicache(samples: dict, fams: dict) -> None:
    """Each vllm: family rendered from a hicache_ one has exactly its samples, labelled model_name (one
    state: no family is observed twice)."""
    for name, (_, source) in FAMILIES.items():
        if source is None:
            continue
        theirs = {}
        for s in fams[name].samples:
            labels = {("finish_reason" if k == "finished_reason" else k): v for k, v in s.labels.items()}
            assert labels.pop("model_name") == MODEL, s
            theirs[(source + s.name[len(name):], tuple(sorted(labels.items())))] = s.value
        ours = {k: v for k, v in samples.items() if k[0].startswith(source + "_") and not k[0].endswith("_created")}
        assert theirs == ours, name


def test_every_vllm_family_is_there_with_the_served_model_name(srv):
    samples, fams = scrape(srv)
    for name, (typ, _) in FAMILIES.items():
        assert name in fams, f"/metrics has no {name}"
        assert fams[name].type == typ, name
        assert fams[name].samples, name
        for s in fams[name].samples:
            assert s.labels.get("model_name") == MODEL, s
            assert not s.name.endswith("_created"), s  # (vLLM exports none)
    for reason in REASONS:  # every finished_reason there from the start
        assert ("vllm:request_success_total", (("finished_reason", reason), ("model_name", MODEL))) in samples
    assert_rendered_from_hicache(samples, fams)


def test_vllm_families_say_what_hicaches_say_after_requests(srv):
    before, _ = scrape(srv)
    prompt = [41, 42, 43, 44, 45, 46, 47, 48, 49]
    runs = [complete(srv, prompt=prompt, max_tokens=5, ignore_eos=True),               # non-streamed, at max_tokens
            complete(srv, prompt=prompt, max_tokens=4, ignore_eos=True, stream=True),  # streamed, an L1 hit
            complete(srv, prompt=[7, 8, 9], max_tokens=1, ignore_eos=True)]            # one token: no TPOT
    greedy = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5,
                        "temperature": 0, "ignore_eos": True}, timeout=30).json()["choices"][0]["token_ids"]
    runs.append(("length", 5, len(prompt)))  # (that greedy reference)
    runs.append(complete(srv, prompt=prompt, max_tokens=5, stop_token_ids=[greedy[1]], stream=True))
    after, fams = scrape(srv)
    assert [r[0] for r in runs[:4]] == ["length"] * 4 and runs[4][0] == "stop", runs
    assert runs[4][1] == greedy.index(greedy[1]) + 1  # (stopped at its stop token, which it counts)

    def delta(name, **labels):
        key = (name, tuple(sorted({**labels, "model_name": MODEL}.items())))
        return after[key] - before.get(key, 0.0)

    def hdelta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    tokens, prompts = [r[1] for r in runs], [r[2] for r in runs]
    for reason in REASONS:
        want = sum(r[0] == reason for r in runs)
        assert delta("vllm:request_success_total", finished_reason=reason) == want, reason
        assert hdelta("hicache_requests_finished_total", finish_reason=reason) == want, reason
    assert delta("vllm:generation_tokens_total") == sum(tokens) == hdelta("hicache_generation_tokens_total")
    assert delta("vllm:request_generation_tokens_sum") == sum(tokens)
    assert delta("vllm:prompt_tokens_total") == sum(prompts) == delta("vllm:request_prompt_tokens_sum")
    for name in ("vllm:request_generation_tokens", "vllm:request_prompt_tokens", "vllm:e2e_request_latency_seconds",
                 "vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds"):
        assert delta(f"{name}_count") == len(runs), name
    # TPOT: one per finished request of >= 2 tokens; inter-token latency: one per token after the first
    assert delta("vllm:request_time_per_output_token_seconds_count") == sum(t >= 2 for t in tokens)
    assert delta("vllm:inter_token_latency_seconds_count") == sum(t - 1 for t in tokens)
    assert delta("vllm:time_per_output_token_seconds_count") == sum(t - 1 for t in tokens)
    assert delta("vllm:request_time_per_output_token_seconds_sum") > 0
    # prefix cache: the tiers' hits, of the prompt tokens queried (hits + recomputed)
    hits = sum(after[("hicache_hit_tokens_total", (("tier", t),))] for t in ("l1", "l2", "l3"))
    assert after[("vllm:prefix_cache_hits_total", (("model_name", MODEL),))] == hits
    assert after[("vllm:prefix_cache_queries_total", (("model_name", MODEL),))] == hits + after[
        ("hicache_recomputed_tokens_total", ())]
    assert delta("vllm:prefix_cache_hits_total") >= 8  # (the repeated prompt's two full pages)
    assert delta("vllm:prefix_cache_queries_total") == sum(prompts)
    assert_rendered_from_hicache(after, fams)


def test_tpot_is_observed_only_for_two_tokens_or_more(srv):
    before, _ = scrape(srv)
    assert complete(srv, prompt=[5, 6, 7, 8], max_tokens=1, ignore_eos=True)[:2] == ("length", 1)
    mid, _ = scrape(srv)
    assert complete(srv, prompt=[5, 6, 7, 9], max_tokens=2, ignore_eos=True)[:2] == ("length", 2)
    after, _ = scrape(srv)
    for name in ("hicache_time_per_output_token_seconds_count", "hicache_inter_token_latency_seconds_count"):
        assert mid[(name, ())] == before[(name, ())], name
        assert after[(name, ())] == mid[(name, ())] + 1, name
    assert mid[("hicache_time_to_first_token_seconds_count", ())] == before[
        ("hicache_time_to_first_token_seconds_count", ())] + 1


def gauge(samples: dict, name: str, model: str) -> float:
    return samples[(name, (("model_name", model),))]


def test_waiting_and_running_gauges_read_the_engines_queues():
    """Requests queued on an engine whose loop has not started wait: vLLM's waiting gauge counts them, as
    hicache_engine_requests does; nothing runs, no L1 page is held. Without a served name the label is the model."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=48))
    for i in range(2):
        engine.add_request([3 + i, 4, 5], SamplingParams(max_tokens=2))
    samples, _ = parse(ServerMetrics(engine).render().decode())
    assert gauge(samples, "vllm:num_requests_waiting", "tiny") == 2
    assert samples[("hicache_engine_requests", (("state", "waiting"),))] == 2
    assert gauge(samples, "vllm:num_requests_running", "tiny") == 0
    assert gauge(samples, "vllm:kv_cache_usage_perc", "tiny") == 0.0
    assert gauge(samples, "vllm:gpu_cache_usage_perc", "tiny") == 0.0


def test_gauges_map_the_engine_status_as_vllm_means_them(monkeypatch):
    """Waiting: queued and parked (waiting on a restore); running: admitted. KV-cache usage: L1 pages neither
    free nor evictable (vLLM's free blocks include cached ones no request holds), of its capacity."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=48))
    status = engine.status()
    status["engine"].update(waiting=2, parked=1, running=3)
    cap = status["tiers"]["l1"]["capacity_pages"]
    status["tiers"]["l1"].update(free_pages=cap // 4, evictable_pages=cap // 2)
    monkeypatch.setattr(engine, "status", lambda: status)
    samples, _ = parse(ServerMetrics(engine, "m").render().decode())
    assert gauge(samples, "vllm:num_requests_waiting", "m") == 3
    assert gauge(samples, "vllm:num_requests_running", "m") == 3
    want = (cap - cap // 4 - cap // 2) / cap
    assert gauge(samples, "vllm:kv_cache_usage_perc", "m") == pytest.approx(want)
    assert gauge(samples, "vllm:gpu_cache_usage_perc", "m") == pytest.approx(want)


def test_a_requests_queue_time_ends_where_its_first_prefill_starts():
    """Request.scheduled_s: set once, at the first prefill's start (what vllm:request_queue_time_seconds
    measures from arrival); a request queued behind a full batch waits longer than the first admitted."""
    import asyncio

    engine = Engine(EngineConfig(model="tiny", device="cpu", max_running_requests=1))

    async def run():
        await engine.start()
        reqs = [engine.add_request([5, 6, 7, i], SamplingParams(max_tokens=3)) for i in range(2)]
        for r in reqs:
            while not r.state.done:
                await asyncio.sleep(0.01)
        await engine.shutdown(1.0)
        return reqs

    first, second = asyncio.run(run())
    for r in (first, second):
        assert r.arrival_s <= r.scheduled_s <= r.first_token_s
    assert second.scheduled_s >= first.finish_s  # (one running request at a time: it waited for the first)
