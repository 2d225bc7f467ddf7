"""Tests of the OpenAI-compatible HTTP server (scheduler.server): a real uvicorn server on a free
loopback port in a background thread, driven by the official `openai` client and by httpx. CPU,
tiny preset, small max_tokens. Completions, bad input, metrics, concurrent streams; shutdown and
clients that leave are in tests/test_server_lifecycle.py. The harness here (ServerThread,
wait_idle, assert_pools_whole, metric_samples) is what the other server test files import."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import ByteTokenizer

MAX_BODY_BYTES = 64 * 1024


class ServerThread:
    """uvicorn serving `app` on its own uvloop loop in a daemon thread, on a port bound here (port 0)."""

    def __init__(self, app) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, loop="uvloop", lifespan="on", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=10)
        self.server = uvicorn.Server(config)
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete,
                                       args=(self.server.serve(sockets=[self.sock]),), daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def call(self, fn, *args):
        """Run fn on the server's loop (engine state is only touched from that loop)."""
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=30)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "server did not stop"
        self.loop.close()


@pytest.fixture(scope="module")
def srv():
    # small L1 (48 pages of 4 tokens) so that concurrent requests evict into L2 (and L3)
    config = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=48, max_new_tokens_limit=64,
                          max_running_requests=32).with_hicache(enable=True, host_ratio=4.0)
    engine = Engine(config)
    limits = ServerLimits(max_concurrent_requests=512, max_body_bytes=MAX_BODY_BYTES, shutdown_grace_s=2.0)
    with ServerThread(create_app(engine, limits)) as s:
        s.engine = engine
        yield s


def metric_samples(url: str) -> dict[tuple, float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def wait_idle(srv, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = httpx.get(srv.url + "/hicache/status").json()
        eng = st["engine"]
        busy = eng["waiting"] + eng["parked"] + eng["running"] + st["server"]["in_flight"]
        pending = sum(v for k, v in st["pending"].items())
        if busy == 0 and pending == 0 and st["tiers"]["l1"]["private_pages"] == 0:
            return st
        assert time.monotonic() < deadline, f"engine not idle: {eng} {st['pending']}"
        time.sleep(0.05)


def assert_pools_whole(srv) -> None:
    st = wait_idle(srv)
    for tier in ("l1", "l2", "l3"):
        t = st["tiers"][tier]
        assert t["private_pages"] == 0, (tier, t)
        assert t["free_pages"] + t["resident_pages"] == t["capacity_pages"], (tier, t)
    srv.call(srv.engine.check_integrity)


# -- completions through the openai client --------------------------------------------------------------
def test_completion_token_ids_and_usage(client):
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    r1 = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    assert r1.object == "text_completion" and r1.model == "tiny"
    choice = r1.choices[0]
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert len(choice.token_ids) == 5 and isinstance(choice.text, str)
    assert r1.usage.prompt_tokens == 9 and r1.usage.completion_tokens == 5 and r1.usage.total_tokens == 14
    # the same prompt again: its two full pages (8 tokens) come from the cache
    r2 = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    assert r2.choices[0].token_ids == choice.token_ids and r2.choices[0].text == choice.text
    tiers = r2.usage.model_extra["cached_tokens_per_tier"]
    assert r2.usage.prompt_tokens_details.cached_tokens == sum(tiers.values()) == 8


def test_completion_text_prompt(client):
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0.7, top_p=0.9, seed=3)
    assert r.usage.prompt_tokens == 5 and len(r.choices[0].token_ids) == 3
    again = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0.7, top_p=0.9, seed=3)
    assert again.choices[0].token_ids == r.choices[0].token_ids  # seeded sampling is reproducible


def test_stop_token_ids(client):
    prompt = [21, 22, 23, 24, 25]
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0).choices[0].token_ids
    stop = full[2]
    first = full.index(stop)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].token_ids == full[:first + 1]
    assert r.choices[0].text == ByteTokenizer(512).decode(full[:first])  # the stop token's text is left out


def test_streaming_matches_non_streaming(client):
    prompt = [31, 32, 33, 34, 35, 36]
    ref = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0).choices[0]
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=6, stream=True, temperature=0,
                                            stream_options={"include_usage": True}))
    *chunks, usage = chunks  # with include_usage OpenAI sends the usage in a last chunk with no choices
    assert [t for c in chunks for t in c.choices[0].token_ids] == ref.token_ids
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)
    assert usage.choices == [] and usage.usage.prompt_tokens == 6 and usage.usage.completion_tokens == 6
    assert "cached_tokens_per_tier" in usage.usage.model_extra


def test_models_health_status(srv):
    import importlib.metadata

    assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    assert httpx.get(srv.url + "/version").json() == {"version": importlib.metadata.version("hicache")}  # (vLLM's)
    assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    st = httpx.get(srv.url + "/hicache/status")
    assert st.status_code == 200 and st.headers["content-type"].startswith("application/json")
    body = st.json()
    assert body["enabled"] and set(body["tiers"]) == {"l1", "l2", "l3"} and body["storage"]["is_temp"]


# -- bad input -----------------------------------------------------------------------------------------
GOOD = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
BAD = [
    ("malformed json", b'{"prompt": [1, 2,', 400, None, "not valid JSON"),
    ("not an object", b"[1, 2, 3]", 400, None, "JSON object"),
    ("max_tokens string", {**GOOD, "max_tokens": "5"}, 400, "max_tokens", "max_tokens"),
    ("prompt number", {**GOOD, "prompt": 5}, 400, "prompt", "prompt"),
    ("prompt bools", {**GOOD, "prompt": [1, True]}, 400, "prompt", "prompt"),
    ("temperature string", {**GOOD, "temperature": "hot"}, 400, "temperature", "temperature"),
    ("stream string", {**GOOD, "stream": "yes"}, 400, "stream", "stream"),
    ("unknown field", {**GOOD, "frobnicate": 1}, 400, "frobnicate", "unknown field 'frobnicate'"),
    ("missing prompt", {"max_tokens": 2}, 400, "prompt", "missing required field 'prompt'"),
    ("negative max_tokens", {**GOOD, "max_tokens": -1}, 400, "max_tokens", ">= 1"),
    ("zero max_tokens", {**GOOD, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("huge max_tokens", {**GOOD, "max_tokens": 10 ** 30}, 400, "max_tokens", "exceeds the limit of 64"),
    ("over-limit max_tokens", {**GOOD, "max_tokens": 65}, 400, "max_tokens", "--max-tokens-limit"),
    ("out-of-vocabulary id", {**GOOD, "prompt": [1, 2, 512]}, 400, "prompt", "outside the vocabulary [0, 512)"),
    ("negative id", {**GOOD, "prompt": [-1]}, 400, "prompt", "outside the vocabulary"),
    ("empty prompt", {**GOOD, "prompt": []}, 400, "prompt", "empty"),
    ("prompt too long", {**GOOD, "prompt": [1] * 300}, 400, "prompt", "exceeds the limit"),
    ("n=0", {**GOOD, "n": 0}, 400, "n", "'n' must be in [1, 16]"),  # (n > 1: tests/test_n_choices.py)
    ("empty stop string", {**GOOD, "stop": ["\n", ""]}, 400, "stop", "empty string"),
    ("top_p zero", {**GOOD, "top_p": 0.0}, 400, "top_p", "top_p"),
    ("nan temperature", b'{"prompt": [1], "temperature": NaN}', 400, "temperature", "finite"),
    ("seed over 64 bits", {**GOOD, "seed": 1 << 64}, 400, "seed", "64-bit integer"),
    ("lone surrogate", b'{"prompt": "ab\\ud800cd", "max_tokens": 2}', 400, "prompt", "not valid Unicode"),
    ("unknown model", {**GOOD, "model": "gpt-5"}, 404, "model", "not served"),
]


@pytest.mark.parametrize("name,body,status,param,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_a_clear_4xx_and_server_keeps_serving(srv, name, body, status, param, needle):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(srv.url + "/v1/completions", headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"], err
    assert err["param"] == param, err
    ok = httpx.post(srv.url + "/v1/completions", json=GOOD, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2


def test_oversized_bodies_get_413(srv):
    big = json.dumps({**GOOD, "prompt": [1] * (MAX_BODY_BYTES // 3)}).encode()
    r = httpx.post(srv.url + "/v1/completions", content=big, timeout=30)  # Content-Length is checked
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: counted while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]
    r = httpx.post(srv.url + "/v1/completions", content=chunked(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert httpx.post(srv.url + "/v1/completions", json=GOOD, timeout=30).status_code == 200


def test_chat_without_template_is_400(srv, client):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "no chat template" in msg and "/v1/completions" in msg
    assert "byte tokenizer" in msg  # (regression: said presets have no tokenizer, though text prompts work)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert httpx.post(srv.url + "/v1/completions", json=GOOD, timeout=30).status_code == 200


def test_unknown_route_and_method_are_json_errors(srv):
    r = httpx.get(srv.url + "/v2/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(srv.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


# -- metrics -------------------------------------------------------------------------------------------
def test_metrics_parse_and_move(srv, client):
    before = metric_samples(srv.url)
    prompt = [41, 42, 43, 44, 45, 46, 47, 48, 49]
    client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=3)  # an L1 hit
    httpx.post(srv.url + "/v1/completions", json={**GOOD, "max_tokens": -5})
    after = metric_samples(srv.url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)
    assert delta("hicache_requests_total", outcome="success") == 2
    assert delta("hicache_requests_total", outcome="rejected") == 1
    assert delta("hicache_time_to_first_token_seconds_count") == 2
    assert delta("hicache_e2e_request_latency_seconds_count") == 2
    assert delta("hicache_prompt_tokens_total") == 18 and delta("hicache_generation_tokens_total") == 6
    assert delta("hicache_hit_tokens_total", tier="l1") >= 8
    assert delta("hicache_recomputed_tokens_total") >= 1
    for d in ("d2h", "h2d", "h2s", "s2h"):
        assert ("hicache_transfer_bytes_total", (("direction", d),)) in after
        assert ("hicache_transfer_gib_per_second", (("direction", d),)) in after
    for tier in ("l1", "l2", "l3"):
        cap = after[("hicache_pool_capacity_pages", (("tier", tier),))]
        assert cap > 0 and 0 <= after[("hicache_pool_used_pages", (("tier", tier),))] <= cap
    assert any(k[0] == "hicache_pending_operations" for k in after)
    assert delta("hicache_engine_overlapped_steps_total", kind="decode_chain") >= 1  # 3 tokens: chained steps
    assert ("hicache_engine_overlapped_steps_total", (("kind", "restore"),)) in after
    assert ("hicache_engine_restore_waits_timed_out_total", ()) in after


# -- concurrency, disconnects, no leaks ------------------------------------------------------------------
PREFIXES = [[(7 * p + k) % 250 + 3 for k in range(8)] for p in range(10)]


def _prompt(i: int) -> list[int]:
    return PREFIXES[i % len(PREFIXES)] + [(13 * i + k) % 500 + 3 for k in range(4)]


async def _stream(client: httpx.AsyncClient, body: dict, disconnect: bool) -> tuple[list[int], str, str | None]:
    ids, text, finish = [], "", None
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            ids += chunk["choices"][0]["token_ids"]
            text += chunk["choices"][0]["text"]
            finish = chunk["choices"][0]["finish_reason"] or finish
            if disconnect:
                break  # leaving the block closes the connection mid-stream
    return ids, text, finish


async def _run_streams(url: str, bodies: list[dict], disconnect: list[bool]):
    limits = httpx.Limits(max_connections=len(bodies) + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as c:
        return await asyncio.gather(*(_stream(c, b, d) for b, d in zip(bodies, disconnect)))


def test_200_concurrent_streams_match_sequential_and_disconnects_leak_nothing(srv):
    n = 200
    bodies = [{"prompt": _prompt(i), "max_tokens": 4, "temperature": 0} for i in range(n)]
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        reference = []
        for b in bodies:  # one by one
            ch = c.post("/v1/completions", json=b).json()["choices"][0]
            reference.append((ch["token_ids"], ch["text"]))

    results = asyncio.run(_run_streams(srv.url, bodies, [False] * n))
    for i, (ids, text, finish) in enumerate(results):
        assert (ids, text) == reference[i], f"request {i} differs"
        assert finish == "length"
    assert_pools_whole(srv)

    aborted_before = httpx.get(srv.url + "/hicache/status").json()["engine"]["aborted"]
    # half of them disconnect after the first chunk (and would run long if they did not)
    disconnect = [i % 2 == 1 for i in range(n)]
    bodies2 = [{**b, "max_tokens": 32} if d else b for b, d in zip(bodies, disconnect)]
    results = asyncio.run(_run_streams(srv.url, bodies2, disconnect))
    for i, (ids, text, finish) in enumerate(results):
        if disconnect[i]:
            assert len(ids) == 1
        else:
            assert (ids, text, finish) == (*reference[i], "length"), f"request {i} differs"
    assert_pools_whole(srv)
    status = httpx.get(srv.url + "/hicache/status").json()
    assert status["engine"]["aborted"] > aborted_before
    assert status["metrics"]["backups_started"] > 0  # L1 was small enough for L2 to be used
    samples = metric_samples(srv.url)
    assert samples[("hicache_requests_total", (("outcome", "aborted"),))] >= 1



@pytest.mark.parametrize("field", ["n", "stream", "echo"])
def test_fields_openai_allows_as_null_take_their_default(srv, field):
    """Clients that send every field, null where unset, got 400s for n, stream and echo."""
    r = httpx.post(srv.url + "/v1/completions", json={**GOOD, field: None}, timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 2


def test_extreme_sampling_values_are_served(srv):
    """temperature 1e-40 and top_p 1e-300 are accepted values; they used to make the sampler raise
    inside the loop and fail every request in flight (and the server after it)."""
    for extra in ({"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-300}):
        r = httpx.post(srv.url + "/v1/completions", json={**GOOD, **extra, "seed": 5}, timeout=30)
        assert r.status_code == 200, r.text
    assert httpx.get(srv.url + "/health").status_code == 200
    assert_pools_whole(srv)


def test_a_500_is_counted_as_failed(srv, monkeypatch):
    def broken(*args, **kw):
        raise RuntimeError("a bug in add_request")
    before = metric_samples(srv.url).get(("hicache_requests_total", (("outcome", "failed"),)), 0.0)
    monkeypatch.setattr(srv.engine, "add_request", broken)
    r = httpx.post(srv.url + "/v1/completions", json=GOOD, timeout=30)
    monkeypatch.undo()
    assert r.status_code == 500
    assert metric_samples(srv.url)[("hicache_requests_total", (("outcome", "failed"),))] == before + 1
    assert httpx.get(srv.url + "/hicache/status").json()["server"]["in_flight"] == 0


def test_default_max_tokens_respects_a_lower_limit():
    engine = Engine(EngineConfig(model="tiny", device="cpu", num_pages=48, max_new_tokens_limit=8))
    with ServerThread(create_app(engine, ServerLimits(max_tokens_limit=8))) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2, 3]}, timeout=30)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) == 8


def test_max_model_len_is_what_a_request_may_use():
    """Regression: /v1/models advertised the L1 pool's tokens (4,400 here), past the model's 4,096
    positions, so a prompt sized by it was refused."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=1100, max_new_tokens_limit=16))
    assert engine.max_kv_tokens < engine.usable_l1_pages * engine.page_size
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
        max_len = httpx.get(s.url + "/v1/models").json()["data"][0]["max_model_len"]
        assert max_len == engine.max_kv_tokens
        prompt = [3 + i % 250 for i in range(max_len - 1)]  # + one generated token: max_len tokens
        r = httpx.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=300)
        assert r.status_code == 200, r.text
        # (the last generated token's K/V is never stored: a prompt of max_len tokens still gets one)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": prompt + [5, 6], "max_tokens": 1}, timeout=300)
        assert r.status_code == 400, r.text


def test_a_request_without_temperature_samples_at_openais_default_of_1(client):
    """Regression: a missing temperature meant greedy, so a seed or a top_p alone changed nothing
    (8 seeds gave one completion); OpenAI's default is 1. The same seed still repeats itself."""
    prompt = [21, 22, 23, 24]
    outs = [client.completions.create(model="tiny", prompt=prompt, max_tokens=8, seed=seed,
                                      extra_body={"ignore_eos": True}).choices[0].token_ids for seed in range(8)]
    assert len({tuple(o) for o in outs}) > 1
    at_1 = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, seed=3, temperature=1.0,
                                     extra_body={"ignore_eos": True}).choices[0].token_ids
    assert at_1 == outs[3]


def test_logprobs_zero_answers_the_sampled_tokens_logprobs(srv):
    """Regression: logprobs 0 was taken as a neutral value and answered with "logprobs": null, where
    OpenAI returns the sampled tokens' logprobs for it (then logprobs were refused; now served: one
    logprob a generated token, no alternatives beyond the sampled token's own entry)."""
    r = httpx.post(srv.url + "/v1/completions", json={**GOOD, "logprobs": 0}, timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(choice["token_ids"]) > 0
    assert all(v <= 0 for v in lp["token_logprobs"]) and all(len(t) == 1 for t in lp["top_logprobs"])
    r = httpx.post(srv.url + "/v1/completions", json={**GOOD, "logprobs": None}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


def test_a_context_refusal_names_the_field_to_lower(srv):
    """The engine's refusal of prompt + max_tokens past the L1 pool names max_tokens where the
    prompt alone fits (it named the prompt either way), and the prompt where it does not."""
    pool_tokens = srv.engine.usable_l1_pages * srv.engine.page_size
    fits = list(range(1, pool_tokens - 8))  # the prompt fits; with 60 new tokens it does not
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": fits, "max_tokens": 60}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    with pytest.raises(RequestError) as exc:  # a prompt longer than the pool: the prompt is what to change
        srv.call(srv.engine.validate, list(range(1, pool_tokens + 8)), SamplingParams(max_tokens=1))
    assert exc.value.param is None
