"""A Redis L3 read whose reply arrived but whose unpacking raised (a bug of this process, not the server's: session 76).
The unpacking ran inside the read's I/O error handling: the bug was counted as the read's "eio" in the store's
errors, reported as an I/O failure (a restore counted `failures["eio"]`, no traceback), and where reads were refused
meanwhile it was taken for that refusal (every slot of the read named bad, its hints dropped). It surfaces as itself,
as a FileStore read's bug does: a driver error, not an I/O one.

Tests start `redis-server` on a free loopback port (skipped without the binary)."""
from __future__ import annotations

import pytest
import torch

from hicache import storage_redis
from hicache.radix import Tier
from hicache_helpers import make_manager, write_prefix
from redis_server import GEOM, needs_redis, private_server, random_pages, redis_server, server  # noqa: F401
from test_redis import make_store

_FIXTURES = (redis_server, server, private_server)


class LocalBug(Exception):
    pass


def _unpacking_raises(monkeypatch, store=None) -> None:
    """Checking a reply's value raises (a bug of this process); with `store`, its reads are refused meanwhile."""
    def check_value(*args):
        if store is not None:
            store.refusals.reads = "refused meanwhile (another read saw a limit lowered)"
        raise LocalBug("unpacking a reply")
    monkeypatch.setattr(storage_redis, "check_value", check_value)


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("refused_meanwhile", [False, True])
async def test_a_bug_unpacking_a_read_is_no_io_error(server, monkeypatch, refused_meanwhile):
    store = make_store(server.url())
    keys = store.page_keys(list(range(8)), 0, 8)
    await store.write_pages(random_pages(GEOM, 2), [0, 1], [0, 1], keys)
    _unpacking_raises(monkeypatch, store if refused_meanwhile else None)
    with pytest.raises(LocalBug):
        await store.read_pages([0, 1], torch.zeros(GEOM.page_major_shape(2), dtype=GEOM.dtype), [0, 1], keys)
    assert store.errors == {}
    assert store.stats()["available"]
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_a_restore_whose_read_unpacking_raises_fails_as_a_driver_bug_not_eio(server, monkeypatch):
    mgr = make_manager(storage_backend="redis", storage_url=server.url(), model_id="m")
    tokens = tuple(range(200, 216))
    write_prefix(mgr, tokens)
    await mgr.drain()
    await mgr.flush_async(Tier.L1)
    await mgr.flush_async(Tier.L2)
    match = mgr.match(tokens + (1,))
    assert match.lengths == [0, 0, 16]
    _unpacking_raises(monkeypatch)
    assert mgr.runner.start_restore(tokens, match, "l3", None) is not None
    await mgr.drain()
    assert mgr.metrics.failures == {"driver": 1}
    assert mgr.store.errors == {}
    mgr.check_integrity()
    await mgr.close()


BUSY_SCRIPT = "local t0 = redis.call('TIME') repeat local t = redis.call('TIME') until " \
              "(t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > tonumber(ARGV[1])"


@needs_redis
@pytest.mark.asyncio
async def test_a_large_read_in_flight_when_the_store_is_closed_fails_closed(server):
    """A read of a chunk large enough to unpack on the helper thread, in flight when close() shuts that thread
    down: it fails "closed" (regression: the helper's refusal was counted as the read's "eio"; with unpacking out of
    the I/O error handling above, it would have gone out as a bug)."""
    import asyncio
    import threading
    from hicache.storage import StorageError
    from hicache.storage_redis import OFFLOAD_BYTES, RedisStore

    n = OFFLOAD_BYTES // GEOM.bytes_per_page
    store = RedisStore(GEOM, n, server.url(), model_id="test")
    keys = store.page_keys(list(range(4 * n)), 0, 4 * n)
    await store.write_pages(random_pages(GEOM, n), list(range(n)), list(range(n)), keys)  # (its connection pooled)
    busy = threading.Thread(target=server.client().eval, args=(BUSY_SCRIPT, 0, 1_000_000))
    busy.start()  # the server runs a 1 s script: the read's reply waits for it
    await asyncio.sleep(0.05)
    read = store.read_pages(list(range(n)), torch.zeros(GEOM.page_major_shape(n), dtype=GEOM.dtype),
                            list(range(n)), keys)
    await asyncio.sleep(0.05)  # (its MGET sent)
    store.close()
    with pytest.raises(StorageError) as info:
        await read
    busy.join()
    assert info.value.kind == "closed"
    assert "eio" not in store.errors
