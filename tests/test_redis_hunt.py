"""The Redis L3 as operators run it (hicache/storage_redis.py): a hung server, the start-up line that
says why a server cannot be used, restricted ACL users, what `status()` says during an outage, a
server without a memory limit, and a server killed or restarted under an engine with reads in flight.

Tests that need a server start `redis-server` on a free loopback port (skipped without the binary);
the others stand in for a hung server with an asyncio socket that never answers."""
from __future__ import annotations

import asyncio
import gc
import os
import re
import signal
import warnings

import pytest

from hicache.radix import Tier
from hicache.storage import StorageError
from hicache_helpers import capture_op_logs
from redis_server import (GEOM, RedisServer, free_port, needs_redis, private_server, random_pages,  # noqa: F401
                          redis_server, refused_url, server)
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from test_redis_engine import BASE, P1, P2, engine_config, reference, serve, serve_once


def make_store(url: str, **kw):
    from hicache.storage_redis import RedisStore
    return RedisStore(GEOM, 64, url, model_id="test", **kw)


def start_events(logs: list[dict]) -> dict[str, dict]:
    return {e["event"]: e for e in logs if e["event"].startswith("l3_redis_")}


# ---- a hung server --------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("what", ["write", "read", "exists"])
async def test_a_command_that_timed_out_is_not_sent_again(what):
    """regression: the client retried a command that timed out on a fresh connection, so a hung Redis
    (stopped, swapping, or a port that accepts and never answers) held every read and write twice
    its socket timeout (10 s at the default 5 s) before the request recomputed. Retrying a dropped
    connection stays (a restarted server's first command finds its pooled connection closed)."""
    port = free_port()
    # (the connect's timeout generous: the kernel accepts at once, but a loaded machine that held this loop past a
    # 0.2 s connect timeout failed the command before the server saw it; random-order run, session 71)
    store = make_store(f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.2, connect_timeout_s=5)  # probe: refused
    connections = []

    async def never_answer(reader, writer):
        connections.append(writer)
        await reader.read()  # until the client hangs up

    hung = await asyncio.start_server(never_answer, "127.0.0.1", port)
    try:
        src = random_pages(GEOM, 2)
        keys = store.page_keys(list(range(8)), 0, 8)
        with pytest.raises(StorageError) as exc:
            if what == "write":
                await store.write_pages(src, [0, 1], [0, 1], keys)
            elif what == "read":
                await store.read_pages([0, 1], src, [0, 1], keys)
            else:
                await store.count_present(keys)
        assert exc.value.kind == "eio" and "Timeout" in str(exc.value)
        assert len(connections) == 1
        assert store.errors == {"eio": 1} and not store.stats()["available"]
    finally:
        for writer in connections:
            writer.close()
        hung.close()
        await store.aclose()


# ---- the start-up line ----------------------------------------------------------------------------
@needs_redis
@pytest.mark.parametrize("case, reason", [
    ("refused", "connection refused"),
    ("wrong password", "invalid username-password pair"),
    ("no password", "authentication required|already authenticated"),  # (RESP2 / RESP3 handshake)
    ("database out of range", "DB index is out of range"),
])
def test_an_unusable_server_is_named_with_its_reason_at_start(private_server, case, reason):
    """regression: the start-up warning carried redis-py 8's repr of the error, "network:ConnectionError",
    "auth:AuthenticationError" or "server:ResponseError": which of refused / wrong password / no such
    database it was, the operator could not tell."""
    private_server.client().config_set("requirepass", "s3cret")
    port = private_server.port
    url = {"refused": refused_url(),
           "wrong password": f"redis://:wrong@127.0.0.1:{port}/0",
           "no password": f"redis://127.0.0.1:{port}/0",
           "database out of range": f"redis://:s3cret@127.0.0.1:{port}/99"}[case]
    with capture_op_logs() as logs:
        make_store(url).close()
    events = start_events(logs)
    assert "l3_redis_connected" not in events
    warning = events["l3_redis_unreachable"]
    assert re.search(reason, warning["error"], re.IGNORECASE) and "s3cret" not in str(warning)


@needs_redis
@pytest.mark.asyncio
async def test_a_user_without_admin_commands_is_not_reported_unreachable(server):
    """regression: the start-up probe asked for INFO, which the usual application ACL ("+@all
    -@dangerous") refuses, and warned "l3_redis_unreachable" for a store that then worked."""
    server.client().execute_command("ACL", "SETUSER", "app", "reset", "on", ">pw", "~hicache:*", "+@all", "-@dangerous")
    try:
        with capture_op_logs() as logs:
            store = make_store(f"redis://app:pw@127.0.0.1:{server.port}/0")
        events = start_events(logs)
        assert "l3_redis_unreachable" not in events and "l3_redis_connected" in events
        src = random_pages(GEOM, 2)
        keys = store.page_keys(list(range(8)), 0, 8)
        await store.write_pages(src, [0, 1], [0, 1], keys)
        assert await store.count_present(keys) == 2
        await store.aclose()
    finally:
        server.client().execute_command("ACL", "DELUSER", "app")


@needs_redis
@pytest.mark.parametrize("maxmemory, policy, warned", [
    (0, "noeviction", True), (0, "allkeys-lru", True), (64 << 20, "noeviction", True),
    (64 << 20, "volatile-lru", True), (64 << 20, "allkeys-lru", False)])
def test_a_server_that_never_evicts_is_warned_of_at_start(private_server, maxmemory, policy, warned):
    """Redis's defaults (no maxmemory, noeviction) keep every page written: the server grows until the
    host runs out of memory, or, with a limit, refuses every write once full while the pages in it
    are never replaced (volatile-* policies evict only keys with a TTL, and pages have none).
    Nothing said so: the operator learned it from the OOM killer or an L3 that stopped taking new
    prefixes."""
    private_server.client().config_set("maxmemory", maxmemory)
    private_server.client().config_set("maxmemory-policy", policy)
    with capture_op_logs() as logs:
        make_store(private_server.url()).close()
    events = start_events(logs)
    assert "l3_redis_connected" in events and ("l3_redis_never_evicts" in events) == warned


# ---- status during an outage ----------------------------------------------------------------------
@needs_redis
@pytest.mark.asyncio
async def test_status_says_unavailable_until_the_server_answers_again():
    """regression: `available` only meant "not backing off": once the back-off window had passed it
    said True for a server that was still down; and a read that reached the server but missed a page
    did not end the outage, so the next blip backed off as if the server had never come back."""
    port = free_port()
    store = make_store(f"redis://127.0.0.1:{port}/0", backoff_s=(0.0, 0.0))  # the window passes at once
    src = random_pages(GEOM, 2)
    keys = store.page_keys(list(range(8)), 0, 8)
    for _ in range(2):
        with pytest.raises(StorageError):
            await store.write_pages(src, [0, 1], [0, 1], keys)
    assert store.errors == {"eio": 2} and store.stats()["retry_in_s"] == 0.0
    assert not store.stats()["available"]
    server = RedisServer(port=port).start()  # back, and empty: the read finds nothing
    try:
        with pytest.raises(StorageError) as exc:
            await store.read_pages([0, 1], src, [0, 1], keys)
        assert exc.value.kind == "missing"
        assert store.stats()["available"] and store._consecutive_failures == 0
    finally:
        await store.aclose()
        server.stop()


# ---- engines: a server killed or restarted with reads in flight ------------------------------------
@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("prefetch", [True, False])
async def test_server_killed_with_a_read_in_flight_then_restarted(private_server, prefetch):
    """The server stops answering while a restore's read is on the wire (SIGSTOP), then dies: the
    request recomputes, nothing leaks; restarted empty, stale hints are dropped and pages land
    again for a second engine."""
    url = private_server.url()
    assert await serve_once(engine_config(url), [P1]) == await reference([P1])
    b = fast_backoff_engine(engine_config(url, prefetch=prefetch))
    store = b.cache.store
    refresh = store.refresh_hints

    async def refresh_then_hang(mgr, tokens):
        await refresh(mgr, tokens)
        os.kill(private_server.proc.pid, signal.SIGSTOP)  # the read that follows waits on the socket
        asyncio.get_running_loop().call_later(0.2, private_server.stop)

    store.refresh_hints = refresh_then_hang
    assert await serve(b, [P2]) == await reference([P2])
    store.refresh_hints = refresh
    m = b.metrics()
    assert m["failures"].get("eio", 0) >= 1 and m["fallbacks"] >= 1 and m["hit_tokens"]["l3"] == 0
    assert store.errors["eio"] >= 1 and store.stats()["in_flight"] == 0
    private_server.start()  # same port, empty
    await asyncio.sleep(0.06)  # past the back-off
    p3 = BASE[:24] + [5] * 18
    assert await serve(b, [p3]) == await reference([p3])
    assert store.counters["stale_hints_dropped"] >= 1  # P2's prefix: its hints pointed at the dead server
    assert private_server.client().dbsize() >= len(p3) // 4  # new writes land again
    c = fast_backoff_engine(engine_config(url, prefetch=False))
    assert await serve(c, [p3[:36] + [1, 2]]) == await reference([p3[:36] + [1, 2]])
    assert c.metrics()["hit_tokens"]["l3"] == 36 and not c.metrics()["failures"]
    assert c.cache.match(p3[:36]).lengths[Tier.L3] == 36
    await b.shutdown()
    await c.shutdown()


def fast_backoff_engine(config) -> Engine:
    eng = Engine(config)
    eng.cache.store.backoff_s = (0.05, 0.05)
    return eng


@needs_redis
def test_generate_calls_leave_no_redis_connection_to_the_garbage_collector(server):
    """Each `Engine.generate` runs on a loop of its own; the Redis client that loop opened is closed
    when it ends (regression: it was dropped unclosed, a ResourceWarning per call at collection). Only
    connections to this test's server count, after a collection of what earlier tests left (regression: a
    random order failed it on another test's connection, collected here)."""
    eng = Engine(engine_config(server.url()))
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for prompt in (P1, P2, P1 + [5]):
            eng.generate([prompt], SamplingParams(max_tokens=2))
        gc.collect()
    leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)
              and f"port={server.port}," in str(w.message)]
    assert not leaked, leaked[:2]
    assert eng.cache.store.stats()["pages_written"] > 0  # (the calls did reach the server)
    asyncio.run(eng.shutdown())
