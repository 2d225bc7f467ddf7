"""vLLM's per-request phase and parameter histograms on /metrics (scheduler/prom_vllm.py): prefill (first
prefill's start to first token), decode (first token to last) and inference (first prefill's start to last
token) time, observed once as each engine request ends that got a first token, from the same three instants
(so prefill + decode = inference, and decode is the sum of that request's inter-token gaps); the n of each
prompt (once per prompt, not per choice) and the max_tokens of each engine request; request_success by
finished_reason. After requests of n=2, a batch of two prompts, a stop, a length and two aborts (one running,
one still queued: it has no phase). A real server (tests/test_server.py's ServerThread, tiny CPU engine)."""
from __future__ import annotations

import socket
import time

import httpx
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.prom import ServerMetrics
from scheduler.server import ServerLimits, create_app
from test_prom_vllm import MODEL, complete, parse, scrape
from test_server import ServerThread

PHASES = ("vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
          "vllm:request_inference_time_seconds")
PARAMS = ("vllm:request_params_n", "vllm:request_params_max_tokens")
N_BUCKETS = ("1.0", "2.0", "5.0", "10.0", "20.0", "+Inf")  # vLLM's
PROMPT = [41, 42, 43, 44, 45, 46, 47]


@pytest.fixture(scope="module")
def srv():
    config = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=400, max_new_tokens_limit=1000,
                          max_running_requests=1)
    engine = Engine(config)
    limits = ServerLimits(max_concurrent_requests=64, shutdown_grace_s=2.0, served_model_names=(MODEL,))
    with ServerThread(create_app(engine, limits)) as s:
        yield s


def post(srv, **body) -> dict:
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def deltas(before: dict, after: dict):
    def delta(name, **labels):
        key = (name, tuple(sorted({**labels, "model_name": MODEL}.items())))
        return after[key] - before.get(key, 0.0)
    return delta


def until(srv, predicate, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not predicate(status := httpx.get(srv.url + "/hicache/status").json()):
        assert time.monotonic() < deadline, status
        time.sleep(0.02)
    return status


def assert_phases_add_up(delta, requests: int) -> None:
    """Each phase once per request that got a first token; prefill + decode = inference (the same three
    instants); decode is the sum of the inter-token gaps (each request's tokens as the server read them),
    and the queue time plus prefill is within the time to first token (which counts from the HTTP arrival)."""
    for name in PHASES:
        assert delta(f"{name}_count") == requests, name
    prefill, decode, inference = (delta(f"{name}_sum") for name in PHASES)
    assert prefill > 0 and decode > 0
    assert prefill + decode == pytest.approx(inference, rel=1e-9, abs=1e-9)
    assert decode == pytest.approx(delta("vllm:inter_token_latency_seconds_sum"), rel=1e-9, abs=1e-9)
    assert delta("vllm:request_queue_time_seconds_sum") + prefill <= delta("vllm:time_to_first_token_seconds_sum")


def test_the_new_families_are_there_with_vllms_types_labels_and_n_buckets(srv):
    samples, fams = scrape(srv)
    for name in PHASES + PARAMS:
        assert fams[name].type == "histogram", name
        assert fams[name].documentation.startswith("Histogram of"), name
        for s in fams[name].samples:
            assert set(s.labels) == ({"model_name", "le"} if s.name.endswith("_bucket") else {"model_name"}), s
            assert s.labels["model_name"] == MODEL, s
            assert not s.name.endswith("_created"), s
    assert [s.labels["le"] for s in fams["vllm:request_params_n"].samples if s.name.endswith("_bucket")] == list(
        N_BUCKETS)
    assert fams["vllm:request_success"].type == "counter"
    assert {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples} == {
        "stop", "length", "abort", "error"}
    for s in fams["vllm:request_success"].samples:
        assert set(s.labels) == {"model_name", "finished_reason"}, s


def test_phases_n_and_max_tokens_after_requests_that_finish(srv):
    before, _ = scrape(srv)
    two = post(srv, prompt=PROMPT, n=2, max_tokens=3, ignore_eos=True)           # one prompt, two choices
    batch = post(srv, prompt=[PROMPT, [7, 8, 9]], max_tokens=5, ignore_eos=True)  # two prompts, n=1
    greedy = post(srv, prompt=PROMPT, max_tokens=4, ignore_eos=True)["choices"][0]["token_ids"]
    stopped = complete(srv, prompt=PROMPT, max_tokens=9, stop_token_ids=[greedy[1]], stream=True)
    after, _ = scrape(srv)
    delta = deltas(before, after)
    assert [c["finish_reason"] for r in (two, batch) for c in r["choices"]] == ["length"] * 4
    assert stopped[0] == "stop" and stopped[1] < 9

    assert delta("vllm:request_success_total", finished_reason="length") == 5
    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    # n: once per prompt (the n=2 request's once, the batch's twice), not once per choice
    assert delta("vllm:request_params_n_count") == 5
    assert delta("vllm:request_params_n_sum") == 2 + 1 + 1 + 1 + 1
    assert delta("vllm:request_params_n_bucket", le="1.0") == 4
    assert delta("vllm:request_params_n_bucket", le="2.0") == 5
    # max_tokens: once per engine request (each choice)
    assert delta("vllm:request_params_max_tokens_count") == 6
    assert delta("vllm:request_params_max_tokens_sum") == 3 + 3 + 5 + 5 + 4 + 9
    assert delta("vllm:request_params_max_tokens_bucket", le="2.0") == 0
    assert delta("vllm:request_params_max_tokens_bucket", le="5.0") == 5
    assert_phases_add_up(delta, 6)
    assert delta("vllm:request_decode_time_seconds_count") == delta("vllm:e2e_request_latency_seconds_count")


def _raw_stream(srv, body: dict) -> socket.socket:
    host, port = srv.url.removeprefix("http://").split(":")
    data = httpx.Request("POST", "/", json={"model": MODEL, **body, "stream": True}).read()
    sock = socket.create_connection((host, int(port)), timeout=30)  # (a recv that never ends fails the test)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def test_aborts_count_their_params_and_only_a_started_one_its_phases(srv):
    """A running stream whose client leaves after its first token: aborted, with its phases (vLLM's
    CompletedTiming); one still queued behind it when its client leaves: aborted, no phase (no first token)."""
    until(srv, lambda st: not st["engine"]["running"] and not st["server"]["in_flight"])
    before, _ = scrape(srv)
    busy = _raw_stream(srv, {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True})
    try:
        seen = b""
        while seen.count(b"data: ") < 3:  # (its first tokens read by the server and sent)
            seen += busy.recv(65536)
        queued = _raw_stream(srv, {"prompt": [5, 6, 7], "max_tokens": 8})
        until(srv, lambda st: st["engine"]["waiting"] == 1)
        queued.close()
        until(srv, lambda st: st["engine"]["waiting"] == 0 and st["server"]["in_flight"] == 1)
    finally:
        busy.close()
    until(srv, lambda st: not st["engine"]["running"] and not st["server"]["in_flight"])
    after, _ = scrape(srv)
    delta = deltas(before, after)
    assert delta("vllm:request_success_total", finished_reason="abort") == 2
    assert delta("vllm:request_params_max_tokens_count") == 2
    assert delta("vllm:request_params_max_tokens_sum") == 1000 + 8
    assert delta("vllm:request_params_n_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 0  # (hicache's: finished requests only)
    assert_phases_add_up(delta, 1)


def test_a_phase_is_the_gap_between_its_instants():
    """ServerMetrics.ended: prefill, decode and inference from (first prefill's start, first token, last
    token); none without a first token; max_tokens 0 (a prefill alone) not observed (vLLM's rule); n only
    where given (a prompt's first choice)."""
    metrics = ServerMetrics(Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=16)), MODEL)
    metrics.ended("length", 3, 4, max_tokens=4, n=2, span_s=(10.0, 10.25, 11.0))
    metrics.ended("abort", 3, 0, max_tokens=0, span_s=None)
    samples, _ = parse(metrics.render().decode())
    value = deltas({}, samples)
    assert [value(f"{name}_sum") for name in PHASES] == [0.25, 0.75, 1.0]
    assert [value(f"{name}_count") for name in PHASES] == [1, 1, 1]
    assert value("vllm:request_params_max_tokens_count") == 1 and value("vllm:request_params_max_tokens_sum") == 4
    assert value("vllm:request_params_n_count") == 1 and value("vllm:request_params_n_sum") == 2
    assert value("vllm:request_success_total", finished_reason="abort") == 1
