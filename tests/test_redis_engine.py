"""Engines sharing one Redis: a prefix one process computed is restored by another; deleted
keys, a full Redis and a stopped Redis leave outputs equal to recompute with failures counted; pages of
one model never serve another."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import subprocess
import sys

import pytest
from structlog.testing import capture_logs

from hicache.radix import Tier
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from redis_server import REPO, needs_redis, private_server, redis_server, server  # noqa: F401

# ---- engines sharing one Redis --------------------------------------------------------------------
VOCAB = 512
RNG = random.Random(7)
BASE = [RNG.randrange(VOCAB) for _ in range(41)]
P1 = BASE + [1, 2, 3]
P2 = BASE + [7, 8, 9, 10]
MAX_TOKENS = 4


def engine_config(url: str, *, seed: int = 0, prefetch: bool = True, num_pages: int = 64) -> EngineConfig:
    return EngineConfig(model="tiny", num_pages=num_pages, page_size=4, seed=seed).with_hicache(
        enable=True, policy="always", storage_backend="redis", storage_url=url, prefetch=prefetch)


_REFERENCE: dict = {}


async def reference(prompts, seed: int = 0) -> list[list[int]]:
    """Outputs of an engine without any cache (recompute)."""
    key = (tuple(map(tuple, prompts)), seed)
    if key not in _REFERENCE:
        eng = Engine(EngineConfig(model="tiny", num_pages=256, page_size=4, seed=seed, enable_prefix_cache=False))
        out = await eng.generate_async(prompts, SamplingParams(max_tokens=MAX_TOKENS))
        await eng.shutdown()
        _REFERENCE[key] = [r.output_ids for r in out]
    return _REFERENCE[key]


async def serve(eng: Engine, prompts) -> list[list[int]]:
    out = await eng.generate_async(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    await eng.stop_loop()  # drains backups: pages are in Redis (or failed) when this returns
    assert all(r.error is None for r in out)
    eng.check_integrity()
    assert eng.cache.l1.allocator.num_private() == 0
    return [r.output_ids for r in out]


async def serve_once(config: EngineConfig, prompts) -> list[list[int]]:
    eng = Engine(config)
    try:
        return await serve(eng, prompts)
    finally:
        await eng.shutdown()


WORKER = r"""
import asyncio, json, sys
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
args = json.loads(sys.argv[1])
sys.stdin.readline()  # imports done; serve when told to (so two instances can import in parallel)

async def main():
    cfg = EngineConfig(model="tiny", num_pages=64, page_size=4, seed=args["seed"]).with_hicache(
        enable=True, policy="always", storage_backend="redis", storage_url=args["url"], prefetch=args["prefetch"])
    eng = Engine(cfg)
    out = await eng.generate_async(args["prompts"], SamplingParams(max_tokens=args["max_tokens"]))
    await eng.stop_loop()  # backups drained: this instance's pages are in Redis
    eng.check_integrity()
    res = {"outputs": [r.output_ids for r in out], "metrics": eng.metrics(), "storage": eng.status()["storage"]}
    await eng.shutdown()
    print("RESULT " + json.dumps(res), flush=True)

asyncio.run(main())
"""


def start_instance(url: str, prompts, *, seed: int = 0, prefetch: bool = True) -> subprocess.Popen:
    """A serving instance in a fresh process; it imports, then waits for serve_instance()."""
    args = json.dumps({"url": url, "prompts": prompts, "seed": seed, "prefetch": prefetch, "max_tokens": MAX_TOKENS})
    return subprocess.Popen([sys.executable, "-c", WORKER, args], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def serve_instance(proc: subprocess.Popen) -> dict:
    try:
        stdout, stderr = proc.communicate("go\n", timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-4000:]
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@needs_redis
@pytest.mark.asyncio
async def test_two_processes_share_pages(server):
    url = server.url()
    proc_a = start_instance(url, [P1])
    proc_b = start_instance(url, [P2], prefetch=False)  # without prefetch its hit is counted as L3
    a = serve_instance(proc_a)
    assert a["outputs"] == await reference([P1])
    assert a["storage"]["pages_written"] == len(P1) // 4 and not a["metrics"]["failures"]
    b = serve_instance(proc_b)  # a fresh process: only Redis knows the prefix
    assert b["outputs"] == await reference([P2])
    assert b["metrics"]["hit_tokens"]["l3"] == 40  # BASE's 10 full pages, written by A
    assert b["metrics"]["restores_done"] == 1 and b["storage"]["hint_pages_found"] == 10
    assert not b["metrics"]["failures"]
    c = Engine(engine_config(url))  # with prefetch, the L3 pages are promoted to L2 while queued
    assert await serve(c, [P2]) == await reference([P2])
    hits = c.metrics()["hit_tokens"]
    assert c.metrics()["promotions"] == 1 and hits["l2"] + hits["l3"] == 44  # B wrote P2's last page
    await c.shutdown()


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("prefetch", [True, False])
async def test_keys_deleted_after_hints_fall_back(server, prefetch):
    url, sync = server.url(), server.client()
    assert await serve_once(engine_config(url), [P1]) == await reference([P1])
    b = Engine(engine_config(url, prefetch=prefetch))
    store = b.cache.store
    refresh = store.refresh_hints

    async def refresh_then_flush(mgr, tokens):
        await refresh(mgr, tokens)
        sync.flushdb()  # the hints are in the tree; the pages are gone before anyone reads them

    store.refresh_hints = refresh_then_flush
    assert await serve(b, [P2]) == await reference([P2])
    m = b.metrics()
    assert store.counters["hint_pages_published"] == 10 and m["failures"].get("missing", 0) == 1
    assert m["storage_missing_pages"] >= 1 and m["fallbacks"] >= 1 and m["hit_tokens"]["l3"] == 0
    # the request recomputed, and its write-through put the pages back (under the same keys)
    assert b.cache.match(P2[:-1]).lengths[Tier.L3] == 44
    assert sync.exists(*store.page_keys(P2, 0, 44)) == 11
    await b.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_stale_hints_are_dropped_by_the_next_refresh(server):
    url, sync = server.url(), server.client()
    assert await serve_once(engine_config(url), [P1]) == await reference([P1])
    b = Engine(engine_config(url))
    tokens = P2[:-1]
    await b.cache.refresh_l3_hints(tokens)
    assert b.cache.match(tokens).lengths[Tier.L3] == 40
    keys = b.cache.store.page_keys(tokens, 0, 40)
    sync.delete(*keys[6:])
    await b.cache.refresh_l3_hints(tokens)
    assert b.cache.match(tokens).lengths[Tier.L3] == 24
    assert b.cache.store.counters["stale_hints_dropped"] == 4
    b.check_integrity()
    assert await serve(b, [P2]) == await reference([P2])
    assert not b.metrics()["failures"]
    await b.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_full_redis_noeviction_fails_writes(private_server):
    url, sync = private_server.url(), private_server.client()
    sync.config_set("maxmemory-policy", "noeviction")
    sync.config_set("maxmemory", 1)  # already over: every write is refused with OOM
    a = Engine(engine_config(url))
    assert await serve(a, [P1, P2]) == await reference([P1, P2])
    m = a.metrics()
    assert m["failures"].get("enospc", 0) >= 1 and a.cache.store.errors["enospc"] >= 1
    assert a.cache.match(P1).lengths[Tier.L3] == 0  # nothing that failed was published
    assert sync.dbsize() == 0
    sync.config_set("maxmemory", 0)
    assert await serve(a, [BASE + [5] * 8]) == await reference([BASE + [5] * 8])  # writes work again
    assert sync.dbsize() > 0
    await a.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_lru_eviction_makes_reads_miss(private_server):
    url, sync = private_server.url(), private_server.client()
    assert await serve_once(engine_config(url), [P1]) == await reference([P1])
    b = Engine(engine_config(url, prefetch=False))
    store = b.cache.store
    refresh = store.refresh_hints
    keys = store.page_keys(P2, 0, 40)

    async def refresh_then_fill(mgr, tokens):
        await refresh(mgr, tokens)
        used = sync.info("memory")["used_memory"]
        sync.config_set("maxmemory-policy", "allkeys-lru")
        sync.config_set("maxmemory", used + 200_000)
        for i in range(100):  # newer data pushes the (older) pages out
            sync.set(f"junk:{i}", os.urandom(20_000))
        assert sync.exists(*keys) < len(keys)

    store.refresh_hints = refresh_then_fill
    assert await serve(b, [P2]) == await reference([P2])
    m = b.metrics()
    assert m["failures"].get("missing", 0) == 1 and m["fallbacks"] >= 1 and m["hit_tokens"]["l3"] == 0
    await b.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_redis_stopped_mid_run(private_server):
    url = private_server.url()
    a = Engine(engine_config(url))
    a.cache.store.backoff_s = (0.05, 0.2)
    assert await serve(a, [P1]) == await reference([P1])
    private_server.stop()
    prompts = [BASE[:20] + [3] * 12, [9] * 30]
    assert await serve(a, prompts) == await reference(prompts)  # recomputed; backups to L3 fail
    m = a.metrics()
    assert m["failures"].get("eio", 0) >= 1 or m["failures"].get("hint_refresh", 0) >= 1
    assert a.cache.store.errors["eio"] >= 1
    private_server.start()  # same port, empty: a restarted cache
    await asyncio.sleep(0.25)  # past the back-off
    p3 = [11] * 17 + BASE[:23]
    assert await serve(a, [p3]) == await reference([p3])
    assert private_server.client().dbsize() == 10  # new writes land again
    b = Engine(engine_config(url, prefetch=False))
    assert await serve(b, [p3[:36] + [1, 2]]) == await reference([p3[:36] + [1, 2]])
    assert b.metrics()["hit_tokens"]["l3"] == 36 and not b.metrics()["failures"]
    await a.shutdown()
    await b.shutdown()


@needs_redis
def test_engine_generate_calls_run_on_fresh_loops(server):
    """Engine.generate() runs each call on a new event loop: the store follows with a new client."""
    eng = Engine(engine_config(server.url()))
    prompts = [[P1], [P2], [P1]]
    outs = [eng.generate(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts]
    ref = Engine(EngineConfig(model="tiny", num_pages=256, page_size=4, enable_prefix_cache=False))
    assert [o[0].output_ids for o in outs] == [ref.generate(p, SamplingParams(max_tokens=MAX_TOKENS))[0].output_ids
                                               for p in prompts]
    st = eng.status()["storage"]
    assert st["errors"] == {} and server.client().dbsize() == 13  # P1's 11 pages, P2's own last 2
    assert st["hint_queries"] == 2 and st["hints_not_needed"] == 1  # P1 again: all in L1, no query
    assert not eng.metrics()["failures"]


@needs_redis
@pytest.mark.asyncio
async def test_other_model_gets_no_hits(server):
    url = server.url()
    assert await serve_once(engine_config(url, seed=0), [P1]) == await reference([P1])
    other = Engine(engine_config(url, seed=1))
    assert await serve(other, [P2]) == await reference([P2], seed=1)
    m = other.metrics()
    assert m["hit_tokens"]["l3"] == m["hit_tokens"]["l2"] == 0 and m["directions"]["s2h"]["count"] == 0
    assert other.cache.store.counters["hint_pages_found"] == 0
    await other.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_the_cost_policy_keeps_writing_pages_other_instances_read(server, monkeypatch):
    """Dropping a local hint of a shared page was counted as an L3 eviction without read-back (the
    page stays in Redis for other instances): a writer whose pages only others read decided L3
    writes did not pay and wrote every 16th backup."""
    hint_table_pages = 32
    cfg = EngineConfig(model="tiny", num_pages=64, page_size=4).with_hicache(
        enable=True, storage_backend="redis", storage_url=server.url(),
        storage_size_gb=hint_table_pages * 2048 / (1 << 30))  # the default policy: cost
    writer = Engine(cfg)
    assert writer.cache.allocator(Tier.L3).num_pages == hint_table_pages
    # the gate under test is L3's reuse; the priced ones compare CPU timings (a 40-token backup's D2H with its
    # recompute), which a loaded machine can tip either way (regression: refused under load, 0 pages written)
    monkeypatch.setattr(writer.cache.cost, "backup_worth_its_cost", lambda new_tokens: True)
    monkeypatch.setattr(writer.cache.cost, "worth_writing", lambda tier, num_tokens, **kwargs: True)
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(41)] for _ in range(40)]
    client = server.client()
    written = []
    for p in prompts:
        before = client.dbsize()
        await writer.generate_async([p], SamplingParams(max_tokens=2))
        await writer.stop_loop()
        written.append(client.dbsize() - before)
    await writer.shutdown()
    assert written == [10] * len(prompts)  # every prompt's 10 full pages reach the shared store


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy,grace_s", [("write_back", 30), ("write_through", 30), ("write_through", 0.5)])
async def test_a_shutdown_saves_its_pages_for_other_instances_within_its_grace(server, write_policy, grace_s):
    """Session 39. Regression: `shutdown()` cancelled the backups under way, so the pages of the last
    requests never reached the shared Redis; under write_back no page L1 had not evicted ever did. Now
    what a shared L3 would lose is saved within what is left of the grace: the next instance hits it. A
    grace too short for it cancels the rest, with a warning."""
    rng = random.Random(f"shutdown-{write_policy}")
    prompt = [rng.randrange(VOCAB) for _ in range(45)]  # (a prefix no other test wrote)
    cfg = dataclasses.replace(engine_config(server.url()), hicache=dataclasses.replace(
        engine_config(server.url()).hicache, write_policy=write_policy))
    first = Engine(cfg)
    write = first.cache.store._write

    async def slow_write(*args):  # (so that its writes are still under way as the shutdown starts)
        await asyncio.sleep(0.3 if grace_s > 1 else 1.5)
        return await write(*args)

    first.cache.store._write = slow_write
    out = (await first.generate_async([prompt], SamplingParams(max_tokens=MAX_TOKENS)))[0].output_ids
    assert [out] == await reference([prompt])
    with capture_logs() as logs:
        await first.shutdown(grace_s=grace_s)  # (no stop_loop first: that drains backups itself)
    assert any(e["event"] == "l3_save_timed_out" for e in logs) == (grace_s < 1), logs
    if grace_s < 1:  # the rest was cancelled: the tiers whole, the last page unsaved
        first.check_integrity()
        return
    follow_up = prompt + out[:MAX_TOKENS - 1] + [5]  # its 12 full pages: the last one holds generated tokens
    second = Engine(cfg)
    assert await serve(second, [follow_up]) == await reference([follow_up])
    assert second.metrics()["hit_tokens"]["l3"] == 48  # (44: the last page's backup waited for the
    await second.shutdown()                            # prompt's, and the shutdown dropped it)
