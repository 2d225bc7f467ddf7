"""Session 71's raise hunt on the L3 stores (hicache/storage_redis.py, hicache/redis_hints.py) and the cache's
referee.

Pinned here:
- A NaN prefix's pages that could not be deleted from the shared Redis L3 (DEL refused by an application ACL, or
  one DEL timing out) stayed findable: the next hint refresh published them again, the next request restored them
  and failed too (and, with DEL refused, every later request for the prompt, on every instance). Now the store
  remembers the keys it could not delete: a hint refresh asks again to delete them and never publishes them, so
  the next request recomputes; the clean pages its backup writes over them clear them.
- The prefix-hint script (EVALSHA, loaded again on NOSCRIPT) whose reload was flushed before its EVALSHA (a
  SCRIPT FLUSH racing the reload) was taken for scripting refused: hint queries used EXISTS (no TOUCH) on that
  client for good, with a wrong "l3_redis_no_scripting" warning. Now that query alone is answered with EXISTS
  and the next one runs the script again.
- The referee: `Engine.check_integrity` did not compare the locks on the tree with their holders, so a release
  that skipped its unlock (the prefix never evictable again) passed every engine test's check. Now it does.
Real throwaway redis-servers (tests/redis_server.py); one internal call monkeypatched where that is the fault.
"""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis import exceptions as rexc
from structlog.testing import capture_logs

from hicache.radix import Tier
from redis_server import GEOM, needs_redis, random_pages, redis_server, server  # noqa: F401
from scheduler.request import SamplingParams
from test_faults import MAX_TOKENS, PROMPT, REUSABLE, make_engine, reference, run_one
from test_nan_prefix_hunt import _failed_nan, assert_whole
from test_nan_redis_hunt import _poison_lower_tiers, assert_recomputed_after_the_nan
from test_redis import make_store

HANG_GUARD_S = 20  # a request with no next event by then would wait forever
APP_NO_DEL = ("ACL", "SETUSER", "nodel", "reset", "on", ">pw", "~hicache:*", "+@all", "-@dangerous", "-del",
              "-unlink")


def _url(how: str, server) -> str:
    """The engine's URL: the server's own, or (how="acl") an application user the server refuses DEL."""
    if how != "acl":
        return server.url()
    server.client().execute_command(*APP_NO_DEL)
    return f"redis://nodel:pw@127.0.0.1:{server.port}/0"


def _time_out_one_delete(monkeypatch) -> None:
    real_delete = aioredis.Redis.delete

    async def delete(self, *keys):
        monkeypatch.setattr(aioredis.Redis, "delete", real_delete)  # (once)
        raise rexc.TimeoutError("Timeout reading from 127.0.0.1")
    monkeypatch.setattr(aioredis.Redis, "delete", delete)


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["acl", "timeout"])
async def test_a_nan_prefix_whose_redis_delete_fails_is_not_restored_again(server, monkeypatch, how):
    """NaN pages (valid checksums) of a prefix only Redis holds: the request restoring them fails and the prefix
    leaves the tree; the DEL of its keys fails (refused by the server's ACL, or timing out once). The next two
    requests for the prompt get the no-cache output, only the first request failed, and the prefix's keys in Redis
    end up holding clean pages (regression: the next hint refresh found the NaN pages, the next request restored
    them and failed too; with DEL refused, every request for the prompt did)."""
    want = await reference(PROMPT)
    try:
        eng = make_engine(storage_backend="redis", storage_url=_url(how, server))
        store = eng.cache.store
        store.backoff_s = (0.0, 0.0)  # (a timeout backs off: the next request would only skip its hint query)
        assert (await run_one(eng)).output_ids == want
        await eng.cache.drain()
        await _poison_lower_tiers(eng)
        if how == "timeout":
            _time_out_one_delete(monkeypatch)
        bad = await run_one(eng)
        assert bad.cached_tokens["l3"] == REUSABLE and _failed_nan(bad), (bad.cached_tokens, bad.error)
        await eng.cache.drain()
        await store.settle_deletes()
        assert store.errors.get("eio", 0) >= 1 and store.counters["suspect_pages_deleted"] == 0
        await assert_recomputed_after_the_nan(eng, want)
        assert_whole(eng)
        await eng.shutdown()
    finally:
        if how == "acl":
            server.client().execute_command("ACL", "DELUSER", "nodel")
    other = make_engine(storage_backend="redis", storage_url=server.url())  # (the pages in Redis are clean)
    assert (await run_one(other)).output_ids == want and not other.metrics()["failures"]
    await other.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_a_script_flush_racing_the_hint_script_s_reload_does_not_turn_scripting_off(server, monkeypatch):
    """The hint script's EVALSHA finds no script (a SCRIPT FLUSH, a restarted server): redis-py loads it and sends
    EVALSHA again, which a second flush between the two also refuses (NOSCRIPT again). That query is answered with
    EXISTS and the next one runs the script again (regression: taken for scripting refused, the store's client
    used EXISTS for good, TOUCH no longer kept the prefix young, and "l3_redis_no_scripting" was logged)."""
    sync = server.client()
    store = make_store(server.url())
    keys = store.page_keys(list(range(12)), 0, 12)
    await store.write_pages(random_pages(GEOM, 3), range(3), range(3), keys)
    assert await store.count_present(keys) == 3
    real_load = aioredis.Redis.script_load

    async def load_then_flushed(self, script):
        monkeypatch.setattr(aioredis.Redis, "script_load", real_load)  # (once)
        sha = await real_load(self, script)
        sync.script_flush()
        return sha
    sync.script_flush()
    monkeypatch.setattr(aioredis.Redis, "script_load", load_then_flushed)
    with capture_logs() as logs:
        assert await store.count_present(keys) == 3
        sync.delete(keys[1])
        calls = sync.info("commandstats")["cmdstat_evalsha"]["calls"]
        assert await store.count_present(keys) == 1
    assert sync.info("commandstats")["cmdstat_evalsha"]["calls"] > calls, "hint queries no longer run the script"
    assert store._script_ok and not [e for e in logs if e["event"] == "l3_redis_no_scripting"], logs
    await store.aclose()


@pytest.mark.asyncio
async def test_the_referee_catches_a_lock_that_no_request_or_op_holds():
    """`Engine.check_integrity` compares the locks on the tree with their holders (live requests' shared prefixes,
    ops' sources, restores' pages held for their requests). A request that skipped one unlock (moving its lock
    down its prefix) left a node locked for good (never evictable) and the check passed (regression watch: the
    tree's own check only sees lock counts that agree with each other). With a request running, it passes."""
    eng = make_engine()
    want = await reference(PROMPT)
    assert (await run_one(eng)).output_ids == want
    await eng.cache.drain()
    await eng.start()
    req = eng.add_request(PROMPT, SamplingParams(max_tokens=MAX_TOKENS))
    assert not (await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)).finished and req.locked_node is not None
    eng.check_integrity()  # (running: the lock on its prefix is its own)
    while not (await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)).finished:
        pass
    await eng.cache.drain()
    eng.check_integrity()
    real_unlock, skipped = eng.cache.unlock, []

    def unlock(node, tier=Tier.L1):
        if not skipped and node is not None and node is not eng.cache.tree.root:
            skipped.append(node)  # (a release that forgot its unlock, once)
            return
        real_unlock(node, tier)
    eng.cache.unlock = unlock
    assert (await run_one(eng)).output_ids == want
    await eng.cache.drain()
    assert skipped and skipped[0].locks[Tier.L1] > 0  # the leak: nothing will ever unlock it
    with pytest.raises(AssertionError, match="locks held by no holder"):
        eng.check_integrity()
    eng.cache.unlock = real_unlock
    real_unlock(skipped[0])
    eng.check_integrity()
    await eng.shutdown()
