"""Session 70's raise hunt on the shared Redis L3 (hicache/storage_redis.py): closing the store's client raises.

redis-py's `Redis.aclose()` raises where a connection cannot be closed within the client's connect timeout
("Timed out closing connection after 2.0"): seen for real with a TLS server (rediss://) that stopped answering,
whose close waits for the server's TLS close_notify. The store closes its client when a loop ends
(`release_loop`: the end of each `Engine.generate` call) and at shutdown (`aclose`). Closing is best effort, the
connections go with the client all the same; pinned here:
- `Engine.shutdown()` raised the client's TimeoutError: the engine was never marked shut down (add_request said
  "shutting down" for good), and the store's helper thread and the model runner's were left running;
- `Engine.generate()` raised it after every request of the batch had finished: the caller lost the results.
Also pinned: a read whose MGET reply holds fewer values than keys fails (the pages past its end went unread).
Monkeypatched on redis-py's real client class, with a real throwaway redis-server (tests/redis_server.py)."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis import exceptions as rexc
from structlog.testing import capture_logs

from hicache.radix import Tier
from redis_server import needs_redis, redis_server, server  # noqa: F401
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams
from test_lifecycle_hunt import assert_nothing_queued, assert_whole
from test_redis_engine import BASE, MAX_TOKENS, P1, P2, engine_config, reference

HANG_GUARD_S = 20  # a call still not back by then would hang its caller


def close_times_out(monkeypatch) -> list[int]:
    """Every Redis client's aclose() raises as redis-py's does where a connection's close times out; returns
    the list its calls are counted in."""
    calls = []

    async def aclose(self, *args, **kwargs):
        calls.append(1)
        raise rexc.TimeoutError("Timed out closing connection after 2.0")

    monkeypatch.setattr(aioredis.Redis, "aclose", aclose)
    return calls


@needs_redis
@pytest.mark.asyncio
async def test_a_shutdown_whose_redis_client_cannot_be_closed_still_shuts_the_engine_down(server, monkeypatch):
    """The client's close raises at shutdown: shutdown ends without that error, the engine is shut down (a new
    request is told so), the store and its helper thread are closed and the tiers' accounting is whole
    (regression: shutdown raised the TimeoutError, `_shut_down` stayed False, and the store's helper pool
    and the model runner's waiter were never shut down)."""
    eng = Engine(engine_config(server.url()))
    out = await asyncio.wait_for(eng.generate_async([P1], SamplingParams(max_tokens=MAX_TOKENS)), HANG_GUARD_S)
    assert [r.output_ids for r in out] == await reference([P1])
    await asyncio.wait_for(eng.stop_loop(), HANG_GUARD_S)  # (its backups drained: its pages are in Redis)
    assert eng.cache.store.stats()["pages_written"] == len(P1) // 4
    calls = close_times_out(monkeypatch)
    await asyncio.wait_for(eng.shutdown(), HANG_GUARD_S)
    assert calls, "the store never closed its client"
    store = eng.cache.store
    assert eng._shut_down and store.closed and store._cpu._shutdown
    with pytest.raises(RequestError, match="has shut down"):
        eng.add_request(P1, SamplingParams(max_tokens=2))
    assert_nothing_queued(eng)
    assert_whole(eng)


@needs_redis
def test_a_generate_call_whose_redis_client_cannot_be_closed_returns_its_results(server, monkeypatch):
    """`Engine.generate` closes the client of its own loop at its end; where that close raises, the batch's
    results are returned all the same (regression: the TimeoutError replaced them) and the close is one warning;
    the next call, on a loop and a client of its own, restores the prefix the first one wrote."""
    eng = Engine(engine_config(server.url(), prefetch=False))
    calls = close_times_out(monkeypatch)
    with capture_logs() as logs:
        out = eng.generate([P1], SamplingParams(max_tokens=MAX_TOKENS))
    assert calls and [r.output_ids for r in out] == asyncio.run(reference([P1]))
    warned = [e for e in logs if e["event"] == "l3_redis_close_failed"]
    assert len(warned) == 1 and "Timed out closing" in warned[0]["error"], warned
    monkeypatch.undo()
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)  # (only L3 holds the shared prefix now)
    eng.cache.tree.evict(Tier.L2, eng.cache.l2.num_pages)
    out = eng.generate([P2], SamplingParams(max_tokens=MAX_TOKENS))
    assert [r.output_ids for r in out] == asyncio.run(reference([P2]))
    assert eng.metrics()["hit_tokens"]["l3"] == len(BASE) - len(BASE) % 4
    assert_whole(eng)
    asyncio.run(eng.shutdown())


@needs_redis
def test_a_read_whose_reply_holds_fewer_values_than_keys_fails_and_recomputes(server, monkeypatch):
    """A reply to MGET with fewer values than keys (a misbehaving proxy): the read fails ("eio") and the request
    recomputes (regression: the values were zipped with the keys, the pages past the reply's end were never written
    and the read reported success: they were restored as whatever the host pages held)."""
    eng = Engine(engine_config(server.url(), prefetch=False))
    assert [r.output_ids for r in eng.generate([P1], SamplingParams(max_tokens=MAX_TOKENS))] == asyncio.run(
        reference([P1]))
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)  # (only L3 holds the shared prefix now)
    eng.cache.tree.evict(Tier.L2, eng.cache.l2.num_pages)
    real_mget = aioredis.Redis.mget

    async def short_mget(self, *args, **kwargs):
        return (await real_mget(self, *args, **kwargs))[:-1]
    monkeypatch.setattr(aioredis.Redis, "mget", short_mget)
    out = eng.generate([P2], SamplingParams(max_tokens=MAX_TOKENS))
    assert [r.output_ids for r in out] == asyncio.run(reference([P2]))
    metrics = eng.metrics()
    assert metrics["hit_tokens"]["l3"] == 0 and metrics["failures"]["eio"] >= 1
    assert_whole(eng)
    asyncio.run(eng.shutdown())
