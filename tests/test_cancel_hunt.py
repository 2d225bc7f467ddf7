"""A hunt in cancellation and abort paths (tiny preset, CPU): requests aborted while queued, parked
on an L3 read or a restore, following another request's read, in prefill or decode, or done with
their backup in flight; shutdown with all of those in flight; many aborts at once; a streaming HTTP
client that leaves. Each test checks that the loop serves on, no tier leaks a page, other requests'
outputs equal a no-cache engine's and the metrics count what happened.

The first three failed before their fixes (scheduler/engine.py): an aborted request's L3 read was
cancelled under the requests waiting for it, which read it again; a request aborted while the loop
waited for its blocking restore was admitted, prefilled and sent a token after it; an aborted
request's L3 hint query outlived it and shutdown. The rest guard the first fix the other way round
(a read its own request or no one waits for) and what was checked and found right.
"""
from __future__ import annotations

import asyncio
import json
import random
import shutil
import socket
import time

import httpx
import pytest

from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import ReadGate, WriteGate, assert_whole, capture_op_logs, until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestState, SamplingParams

VOCAB = 512
PAGE = 4
_rng = random.Random(11)
PREFIX = [_rng.randrange(VOCAB) for _ in range(6 * PAGE)]  # 6 reusable pages
FIRST, SECOND = PREFIX + [1], PREFIX + [2]                 # two prompts sharing them
OTHER = [_rng.randrange(VOCAB) for _ in range(3 * PAGE + 2)]
PARAMS = SamplingParams(max_tokens=4)

_REFERENCE: dict = {}


async def reference(prompt: list[int], max_tokens: int = 4) -> list[int]:
    """Greedy output of an engine without any cache."""
    key = (tuple(prompt), max_tokens)
    if key not in _REFERENCE:
        eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=256, page_size=PAGE,
                                  enable_prefix_cache=False))
        [out] = await eng.generate_async([prompt], SamplingParams(max_tokens=max_tokens))
        await eng.shutdown()
        _REFERENCE[key] = out.output_ids
    return _REFERENCE[key]


def make_engine(num_pages: int = 64, max_running_requests: int = 64, max_new_tokens_limit: int = 4096,
                **hicache) -> Engine:
    """All three tiers, restores always taken. No restore overlap: ReadGate's held read hides the
    store's landing and checksum hooks, which a read to be taken on to L1 waits for."""
    hicache.setdefault("transfer_backend", "torch")
    hicache.setdefault("policy", "always")
    config = EngineConfig(model="tiny", device="cpu", num_pages=num_pages, page_size=PAGE, restore_overlap=False,
                          max_running_requests=max_running_requests, max_new_tokens_limit=max_new_tokens_limit,
                          ).with_hicache(enable=True, **hicache)
    return Engine(config)


async def prefix_only_in_l3(eng: Engine) -> None:
    await eng.generate_async([FIRST], PARAMS)
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    eng.cache.flush(Tier.L2)
    assert eng.cache.tree.match(PREFIX, touch=False).lengths == [0, 0, len(PREFIX)]


def s2h_reads(eng: Engine) -> int:
    return eng.metrics()["directions"]["s2h"]["count"]


def final_events(req) -> list:
    events = []
    while not req.queue.empty():
        events.append(req.queue.get_nowait())
    return [ev for ev in events if ev.finished]


async def assert_idle_and_empty(eng: Engine) -> None:
    """Every request ended, every op settled, every tier whole; flushed, every page of every tier is
    free again (one a leaked lock or claim held could not be)."""
    await eng.cache.drain()
    assert not (eng.requests or eng.running or eng.waiting or eng.parked)
    assert_whole(eng.cache)
    for tier in (Tier.L1, Tier.L2, Tier.L3):
        eng.cache.flush(tier)
        await eng.cache.drain()
    for tier, alloc in eng.cache.tree.allocators.items():
        assert alloc.num_free == alloc.num_pages - (eng.held_l1_pages if tier is Tier.L1 else 0), tier


# -- found by this hunt ------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("second_is", ["parked_on_the_read", "queued"])
async def test_an_aborted_requests_read_still_serves_the_request_waiting_for_it(second_is):
    """Regression: FIRST's prefetch reads the shared prefix from L3; SECOND, which needs the same
    pages, waits for that read rather than start its own (parked on it, or still queued behind a
    running request, having skipped its own prefetch for it). Aborting FIRST cancelled the read
    anyway: it landed and was thrown away, and SECOND read the same pages again. The read now goes
    on while another live request waits for it: one read serves SECOND, nothing is cancelled."""
    eng = make_engine(max_running_requests=1 if second_is == "queued" else 64)
    await eng.start()
    want = await reference(SECOND)
    await prefix_only_in_l3(eng)
    reads_before, gate = s2h_reads(eng), ReadGate(eng.cache.store)
    busy = None
    if second_is == "queued":  # the one running slot is taken: FIRST and SECOND stay queued
        busy = eng.add_request(OTHER, SamplingParams(max_tokens=64, ignore_eos=True))
        await until(lambda: busy.state is RequestState.DECODE)
    first = eng.add_request(FIRST, PARAMS)
    second = eng.add_request(SECOND, PARAMS)
    assert first.prefetch_op is not None and second.prefetch_op is None  # (it relies on FIRST's read)
    if second_is == "parked_on_the_read":
        await until(lambda: second.follow_op is first.prefetch_op)
    assert await eng.abort(first.rid)
    await until(lambda: first.state.done)
    gate.release()
    if busy is not None:
        await eng.abort(busy.rid)
    await until(lambda: second.state.done)
    assert second.result().output_ids == want and second.finish_reason == "length"
    assert s2h_reads(eng) - reads_before == 1, "the prefix was read from L3 twice"
    assert eng.metrics()["cancellations"] == 0
    await assert_idle_and_empty(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_request_aborted_during_its_blocking_restore_is_never_prefilled():
    """Regression (--disable-hicache-prefetch): the loop waits for a parked request's L3 restore;
    an abort then only queued, so once the read landed the request was admitted, its tail
    prefilled and its first token sent, after abort() had returned True, and its hit counted. A
    parked request is in no batch: abort() ends it at once, its restore ends cancelled."""
    eng = make_engine(prefetch=False)
    await eng.start()
    await prefix_only_in_l3(eng)
    gate = ReadGate(eng.cache.store)
    prefill_before, metrics_before = eng.stats["prefill_tokens"], eng.metrics()
    with capture_op_logs() as logs:
        req = eng.add_request(SECOND, PARAMS)
        await until(lambda: req.state is RequestState.PARKED)  # the loop now waits for its read
        [op] = eng.cache.runner.live.values()
        assert op.state is OpState.S2H_PENDING
        assert await eng.abort(req.rid)
        gate.release()
        await until(lambda: req.state.done and op.done)
        await eng.cache.drain()
    assert req.result().output_ids == [] and req.finish_reason == "abort"
    assert eng.stats["prefill_tokens"] == prefill_before
    after = eng.metrics()
    assert after["hit_tokens"] == metrics_before["hit_tokens"]
    assert after["recomputed_tokens"] == metrics_before["recomputed_tokens"]
    assert [e["from_state"] for e in logs if e.get("event") == "op" and e["to_state"] == "CANCELLED"] \
        == ["S2H_PENDING"] and after["cancellations"] == 1
    assert (await eng.generate_async([SECOND], PARAMS))[0].output_ids == await reference(SECOND)
    await assert_idle_and_empty(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_an_aborted_requests_l3_hint_query_ends_with_it():
    """Regression (shared L3): a request queued on a shared store first asks it which of its pages
    exist, and waits for the answer. Aborted meanwhile, its query ran on, past shutdown (on a
    closed store), until its timeout counted as a store failure. It is now cancelled with its
    request."""
    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server binary on PATH")
    from redis_server import RedisServer

    server = RedisServer().start()
    try:
        config = EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=PAGE).with_hicache(
            enable=True, policy="always", storage_backend="redis", storage_url=server.url())
        eng = Engine(config)
        store, asked = eng.cache.store, asyncio.Event()
        store.hint_timeout_s = 600.0

        async def unanswered(keys):  # a store that does not answer (yet)
            asked.set()
            await asyncio.Event().wait()
        store.count_present = unanswered
        await eng.start()
        req = eng.add_request(SECOND, PARAMS)
        await asked.wait()
        assert await eng.abort(req.rid)
        await until(lambda: req.state.done)
        await eng.shutdown()
        assert req.hint_task.done(), "the aborted request's hint query outlived shutdown"
        assert "hint_refresh" not in eng.metrics()["failures"]
    finally:
        server.stop()


# -- guards: checked and found right ------------------------------------------------------------------
@pytest.mark.asyncio
async def test_aborting_the_request_that_follows_a_read_leaves_the_read_to_its_own():
    """Guard for the first fix, the other way round: SECOND, parked on FIRST's read, is aborted; the
    read goes on for FIRST, whose output equals a no-cache engine's; nothing is read twice."""
    eng = make_engine()
    await eng.start()
    want = await reference(FIRST)
    await prefix_only_in_l3(eng)
    reads_before, gate = s2h_reads(eng), ReadGate(eng.cache.store)
    first = eng.add_request(FIRST, PARAMS)
    second = eng.add_request(SECOND, PARAMS)
    await until(lambda: second.follow_op is first.prefetch_op is not None)
    assert await eng.abort(second.rid)
    await until(lambda: second.state.done)
    gate.release()
    await until(lambda: first.state.done)
    assert first.result().output_ids == want and first.result().cached_tokens["l3"] == len(PREFIX)
    assert s2h_reads(eng) - reads_before == 1 and eng.metrics()["cancellations"] == 0
    await assert_idle_and_empty(eng)
    await eng.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("both_are", ["parked", "queued"])
async def test_a_read_no_live_request_waits_for_is_cancelled(both_are):
    """Guard for the first fix: FIRST and SECOND, both waiting for FIRST's read (parked, or queued
    behind a running request), are both aborted; the read ends cancelled once it settled, in
    either order and also when both aborts end in one tick, and its L2 pages are free again."""
    eng = make_engine(max_running_requests=1 if both_are == "queued" else 64)
    await eng.start()
    await prefix_only_in_l3(eng)
    gate = ReadGate(eng.cache.store)
    busy = None
    if both_are == "queued":
        busy = eng.add_request(OTHER, SamplingParams(max_tokens=64, ignore_eos=True))
        await until(lambda: busy.state is RequestState.DECODE)
    first = eng.add_request(FIRST, PARAMS)
    second = eng.add_request(SECOND, PARAMS)
    read = first.prefetch_op
    if both_are == "parked":
        await until(lambda: second.follow_op is read)
    for req in (second, first) if both_are == "parked" else (first, second):
        assert await eng.abort(req.rid)
    await until(lambda: first.state.done and second.state.done)
    assert read.payload["cancel"], "a read no one waits for went on"
    gate.release()
    if busy is not None:
        await eng.abort(busy.rid)
    await until(lambda: read.done)
    assert read.state is OpState.CANCELLED and eng.metrics()["cancellations"] == 1
    await assert_idle_and_empty(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_shutdown_with_every_kind_of_request_in_flight_ends_each_once_and_leaks_nothing():
    """At shutdown (no grace): one request parked on a held L3 read and one following it, two
    decoding, one queued behind them, and a finished one whose L3 write is held. Every live one
    ends once, aborted; both held ops end cancelled once their I/O settled; every tier is whole."""
    eng = make_engine(num_pages=200, max_running_requests=2)
    await eng.start()
    await prefix_only_in_l3(eng)
    read_gate = ReadGate(eng.cache.store)
    parked = eng.add_request(FIRST, PARAMS)
    follower = eng.add_request(SECOND, PARAMS)
    await until(lambda: follower.follow_op is not None)
    write_gate = WriteGate(eng.cache.store)
    done = eng.add_request(OTHER, SamplingParams(max_tokens=1))
    await until(lambda: done.state.done)  # its prompt's backup now waits for its L3 write
    long = SamplingParams(max_tokens=150, ignore_eos=True)
    decoding = [eng.add_request([20 + i] * 9, long) for i in range(2)]
    queued = eng.add_request([30] * 9, long)
    await until(lambda: all(r.state is RequestState.DECODE for r in decoding))
    live = [parked, follower, *decoding, queued]
    assert queued.state is RequestState.WAITING and parked.state is follower.state is RequestState.PARKED
    in_io = {OpState.S2H_PENDING, OpState.H2S_PENDING}  # (the running ones' backups too, once their D2H is done)
    await until(lambda: {op.state for op in eng.cache.runner.live.values()} == in_io)
    held = {op.op_id: op.state.name for op in eng.cache.runner.live.values()}
    held_ops = list(eng.cache.runner.live.values())
    with capture_op_logs() as logs:
        closing = asyncio.create_task(eng.shutdown())
        await until(lambda: all(op.payload["cancel"] for op in held_ops))
        read_gate.release()
        write_gate.release()
        await asyncio.wait_for(closing, 30)
    for req in live:
        assert [ev.finish_reason for ev in final_events(req)] == ["abort"], req.rid
    assert done.finish_reason == "length" and eng.stats["aborted"] == len(live)
    cancelled = {e["op_id"]: e["from_state"] for e in logs if e.get("event") == "op" and e["to_state"] == "CANCELLED"}
    assert cancelled == held
    assert eng.metrics()["cancellations"] == len(held) and not eng.metrics()["failures"]
    assert eng._loop_task is None and not eng.requests
    assert_whole(eng.cache)


@pytest.mark.asyncio
async def test_many_aborts_at_once_twice_each_leave_the_others_and_the_tiers_untouched():
    """Thirty requests over four shared prefixes on a small L1 (restores from L2 and L3 in flight);
    every other one is aborted twice, in three bursts (at once; once some of the rest run; once
    some of the last decode), and an unknown id once. Each aborted request ends once; the others'
    outputs equal a no-cache engine's; the loop then serves the next request; flushed, every tier
    is empty."""
    rng = random.Random(3)
    bases = [[rng.randrange(VOCAB) for _ in range(rng.choice([16, 28, 40]))] for _ in range(4)]
    prompts = [bases[i % 4] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))] for i in range(30)]
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=40, page_size=PAGE, max_prefill_tokens=32)
                 .with_hicache(enable=True, transfer_backend="torch", policy="always", host_ratio=1.0,
                               storage_ratio=4.0))
    await eng.start()
    await eng.generate_async(prompts[:8], PARAMS)  # the prefixes now live in L2 and L3 as well
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    aborted_before = eng.stats["aborted"]
    long = SamplingParams(max_tokens=24, ignore_eos=True)
    reqs = [eng.add_request(p, long if i % 2 else PARAMS) for i, p in enumerate(prompts)]
    victims = reqs[1::2]
    bursts = [victims[0::3], victims[1::3], victims[2::3]]
    states_at_abort = set()
    for n, burst in enumerate(bursts):
        if n == 1:
            await until(lambda: any(r.state in (RequestState.PREFILL, RequestState.DECODE) for r in victims[1:]))
        if n == 2:
            await until(lambda: any(r.state is RequestState.DECODE for r in burst))
        for req in burst:
            states_at_abort.add(req.state)
            assert await eng.abort(req.rid)
            await eng.abort(req.rid)  # (True again while the first is pending, False once it ended)
    assert {RequestState.WAITING, RequestState.DECODE} <= states_at_abort
    assert await eng.abort("no-such-request") is False
    await until(lambda: all(r.state.done for r in reqs))
    for req in victims:
        assert [ev.finish_reason for ev in final_events(req)] == ["abort"]
    assert eng.stats["aborted"] - aborted_before == len(victims)
    for i, req in enumerate(reqs):
        if req not in victims:
            assert req.result().output_ids == await reference(prompts[i]), f"request {i} differs"
    assert (await eng.generate_async([prompts[1]], PARAMS))[0].output_ids == await reference(prompts[1])
    assert not eng.metrics()["failures"]
    await assert_idle_and_empty(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_caller_that_stops_iterating_or_is_cancelled_aborts_its_request():
    """The two ways an in-process caller leaves a stream: it breaks out of `async for` without
    closing the generator (it is closed when collected), or its task is cancelled while it waits
    for a token. Both requests end aborted long before their max_tokens, and free their pages."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=512, page_size=PAGE, max_new_tokens_limit=1000))
    await eng.start()
    long = SamplingParams(max_tokens=1000, ignore_eos=True)

    async def leave_after(num_tokens: int, prompt: list[int]) -> None:
        async for ev in eng.submit(prompt, long):
            if ev.index + 1 >= num_tokens:
                break  # (no aclosing: the generator is finalized by the loop)
    await leave_after(2, [1, 2, 3])
    waiting = asyncio.create_task(leave_after(1000, [4, 5, 6]))
    await until(lambda: eng.stats["decode_tokens"] > 4)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await until(lambda: not eng.requests)
    assert eng.stats["aborted"] == 2 and eng.stats["finished"] == 0
    assert eng.stats["decode_tokens"] < 1000
    await eng.stop_loop()
    assert_whole(eng.cache)
    await eng.shutdown()


def _raw_stream(url: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def _until_status(url: str, predicate, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not predicate(status := httpx.get(url + "/hicache/status").json()):
        assert time.monotonic() < deadline, status
        time.sleep(0.02)
    return status


def _asgi_spec(app, version: str):
    """`app` told by its server that it speaks ASGI `version` (Starlette's streams listen for the
    client's disconnect themselves only below 2.4)."""
    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": version}}
        await app(scope, receive, send)
    return wrapped


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
@pytest.mark.parametrize("waiting_as", ["queued", "parked_on_a_read"])
def test_a_stream_whose_client_leaves_before_its_first_token_is_freed_at_once(waiting_as, spec):
    """A streaming request that has no token yet (queued behind a running one, or parked on a held
    L3 read) whose client goes away: its request ends, aborted, while the other still runs (not
    once it would have been admitted or its read landed), its slot is free and it is counted once
    as aborted; once idle, every tier is whole. Under ASGI 2.4 too (regression: Starlette then
    listens for no disconnect, and such a stream ran on until it wrote its first token)."""
    from test_server import ServerThread, metric_samples

    from scheduler.server import ServerLimits, create_app

    engine = make_engine(num_pages=300, max_running_requests=1, max_new_tokens_limit=1000)
    with ServerThread(_asgi_spec(create_app(engine, ServerLimits(shutdown_grace_s=1.0)), spec)) as s:
        gate = None
        if waiting_as == "parked_on_a_read":
            httpx.post(s.url + "/v1/completions", json={"prompt": FIRST, "max_tokens": 2}, timeout=30)
            asyncio.run_coroutine_threadsafe(engine.cache.drain(), s.loop).result(30)
            s.call(lambda: (engine.cache.flush(Tier.L1), engine.cache.flush(Tier.L2)))
            gate = s.call(ReadGate, engine.cache.store)
            body, busy = {"prompt": SECOND, "max_tokens": 4}, None
        else:
            busy = _raw_stream(s.url, {"prompt": OTHER, "max_tokens": 1000, "ignore_eos": True})
            _until_status(s.url, lambda st: st["engine"]["running"] == 1)
            body = {"prompt": FIRST, "max_tokens": 4}
        state = "waiting" if busy is not None else "parked"
        try:
            client = _raw_stream(s.url, body)
            _until_status(s.url, lambda st: st["engine"][state] == 1)
            client.close()
            st = _until_status(s.url, lambda st: st["engine"][state] == 0)
            assert st["engine"]["aborted"] == 1 and st["engine"]["running"] == (busy is not None), st["engine"]
            _until_status(s.url, lambda st: st["server"]["in_flight"] == (busy is not None))
            assert metric_samples(s.url)[("hicache_requests_total", (("outcome", "aborted"),))] == 1
        finally:
            if gate is not None:
                gate.release()
            if busy is not None:
                busy.close()
        st = _until_status(s.url, lambda st: not any(st["engine"][k] for k in ("waiting", "parked", "running"))
                           and not st["server"]["in_flight"] and not any(st["pending"].values()))
        for tier in ("l1", "l2", "l3"):
            t = st["tiers"][tier]
            assert t["private_pages"] == 0 and t["free_pages"] + t["resident_pages"] == t["capacity_pages"], tier
        s.call(engine.check_integrity)
