"""vLLM's token counters and latency histograms as a dashboard reads them while requests run (session 80's hunt
of vLLM parity). vLLM counts `vllm:generation_tokens_total` per engine iteration, so vLLM's Grafana panel
rate(vllm:generation_tokens_total[1m]) is the live generation throughput; its latency histograms' buckets reach
2560 s (TTFT) and 7680 s (e2e, queue, phases), so a quantile of requests that took minutes is not clipped.

A real server (tests/test_server.py's ServerThread, tiny CPU engine). The engine is held between two steps by
a gate on its runner's `collect` (an await: the server's loop, /metrics too, runs on while it waits)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.prom import ServerMetrics
from scheduler.server import ServerLimits, create_app
from test_prom_vllm import MODEL, parse, scrape
from test_server import ServerThread

PROMPT = [41, 42, 43, 44, 45, 46, 47]


class Gate:
    """Holds the engine loop in its runner's `collect` (between steps) while `closed`."""

    def __init__(self, engine: Engine) -> None:
        self.closed, self.waiting, self.opened = False, False, None
        collect = engine.runner.collect

        async def held(handle):
            if self.closed:
                self.opened = self.opened or asyncio.Event()
                self.waiting = True
                await self.opened.wait()
                self.waiting = False
            return await collect(handle)
        engine.runner.collect = held

    def open(self) -> None:  # (on the server's loop)
        self.closed = False
        if self.opened is not None:
            self.opened.set()
            self.opened = None


@pytest.fixture(scope="module")
def srv():
    config = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=400, max_new_tokens_limit=1000,
                          max_running_requests=4)
    engine = Engine(config)
    limits = ServerLimits(max_concurrent_requests=16, shutdown_grace_s=2.0, served_model_names=(MODEL,))
    with ServerThread(create_app(engine, limits)) as s:
        s.engine, s.gate = engine, Gate(engine)
        yield s


def deltas(before: dict, after: dict):
    def delta(name, **labels):
        key = (name, tuple(sorted({**labels, "model_name": MODEL}.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)
    return delta


def _until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _held_mid_stream(srv, lines) -> int:
    """Reads the stream's first token chunk, then holds the engine between two steps: the tokens received."""
    for line in lines:
        if line.startswith("data: "):
            received = len(json.loads(line[6:])["choices"][0]["token_ids"])
            break
    srv.call(setattr, srv.gate, "closed", True)
    _until(lambda: srv.call(getattr, srv.gate, "waiting"))
    return received


def test_generated_tokens_are_counted_as_they_come_not_when_the_request_ends(srv):
    """A long stream held part-way: the tokens it sent so far are in vllm:generation_tokens_total already
    (regression: counted only as the request ended, so a dashboard's generation throughput read 0 during a long
    generation and then one spike); once it ended, its tokens counted once, as its usage and its histogram say."""
    before, _ = scrape(srv)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    usage = None
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            received = _held_mid_stream(srv, lines)
            live = srv.call(lambda: [len(q.output) for q in srv.engine.requests.values()])
            assert len(live) == 1 and live[0] < 400, live  # (still running)
            during, _ = scrape(srv)
            counted = deltas(before, during)("vllm:generation_tokens_total")
            assert received <= counted <= live[0]
            hicache = ("hicache_generation_tokens_total", ())
            assert during[hicache] - before[hicache] == counted
            srv.call(srv.gate.open)
            for line in lines:
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
    finally:
        srv.call(srv.gate.open)
    assert usage is not None and usage["completion_tokens"] == 400
    after, _ = scrape(srv)
    delta = deltas(before, after)
    assert delta("vllm:generation_tokens_total") == 400 == delta("vllm:request_generation_tokens_sum")


def test_a_stream_left_mid_way_counts_the_engines_tokens_once(srv):
    """A client that leaves a held stream: its engine request's tokens (those it made, read or not) counted
    once in the counter, as in the per-request histogram."""
    _until(lambda: not srv.call(lambda: len(srv.engine.requests)))
    before, _ = scrape(srv)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            _held_mid_stream(srv, r.iter_lines())
    finally:
        srv.call(srv.gate.open)
    _until(lambda: not srv.call(lambda: len(srv.engine.requests)))
    _until(lambda: deltas(before, scrape(srv)[0])("vllm:request_success_total", finished_reason="abort") == 1)
    delta = deltas(before, scrape(srv)[0])
    made = delta("vllm:request_generation_tokens_sum")
    assert 0 < made < 400
    assert delta("vllm:generation_tokens_total") == made


# vLLM's largest finite bucket of each latency family (vllm/v1/metrics/loggers.py)
VLLM_TOP_BUCKET_S = {
    "vllm:time_to_first_token_seconds": 2560.0, "vllm:e2e_request_latency_seconds": 7680.0,
    "vllm:request_queue_time_seconds": 7680.0, "vllm:request_prefill_time_seconds": 7680.0,
    "vllm:request_decode_time_seconds": 7680.0, "vllm:request_inference_time_seconds": 7680.0,
    "vllm:inter_token_latency_seconds": 80.0, "vllm:time_per_output_token_seconds": 80.0,
    "vllm:request_time_per_output_token_seconds": 80.0,
}


def _bucket_of(fam, seconds: float) -> float:
    """The upper bound histogram_quantile gives a family holding one sample of `seconds`: its first bucket that
    counts it (+Inf: the quantile is clipped to the largest finite bound, whatever the sample was)."""
    for s in fam.samples:
        if s.name.endswith("_bucket") and s.value >= 1:
            return float(s.labels["le"])
    raise AssertionError(f"{fam.name} counted no sample of {seconds}")


def test_requests_of_minutes_land_in_a_finite_bucket_as_vllms_do():
    """A generation of 15 minutes (a reasoning model's long answer), queued 5 minutes first: each latency family
    puts it in a finite bucket, as vLLM's buckets do (regression: they ended at 120 s, so histogram_quantile read
    120 s for every request longer, a p99 of "2 minutes" for requests of 20; the token gaps' ended at 10 s)."""
    metrics = ServerMetrics(Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=16)), MODEL)
    queued_s, first_token_s, decode_s = 300.0, 330.0, 900.0
    metrics.ttft.observe(first_token_s)
    metrics.queue.observe(queued_s)
    metrics.e2e.observe(first_token_s + decode_s)
    metrics.itl.observe(30.0)  # (a request preempted, or held behind a restore, between two of its tokens)
    metrics.tpot.observe(30.0)
    metrics.ended("length", 3, 4, max_tokens=4, n=1, span_s=(queued_s, first_token_s, first_token_s + decode_s))
    _, fams = parse(metrics.render().decode())
    seen = {"vllm:time_to_first_token_seconds": first_token_s, "vllm:request_queue_time_seconds": queued_s,
            "vllm:e2e_request_latency_seconds": first_token_s + decode_s,
            "vllm:request_prefill_time_seconds": first_token_s - queued_s, "vllm:request_decode_time_seconds": decode_s,
            "vllm:request_inference_time_seconds": first_token_s + decode_s - queued_s,
            "vllm:inter_token_latency_seconds": 30.0, "vllm:time_per_output_token_seconds": 30.0,
            "vllm:request_time_per_output_token_seconds": 30.0}
    for name, seconds in seen.items():
        bound = _bucket_of(fams[name], seconds)
        assert seconds <= bound < float("inf") and bound <= 4 * seconds, (name, seconds, bound)
        bounds = [float(s.labels["le"]) for s in fams[name].samples if s.name.endswith("_bucket")]
        assert max(b for b in bounds if b != float("inf")) >= VLLM_TOP_BUCKET_S[name], name
