"""A Redis L3 write whose packing raised (a bug of this process, not the server's: session 76, the write-side twin of
`test_redis_local_fault_s76.py`). Packing ran inside the write's I/O error handling: the bug was counted as the
write's "eio" in the store's errors and reported as an I/O failure (a backup counted `failures["eio"]`, no traceback),
pointing the operator at the Redis server. It goes out as itself, as a FileStore write's bug does: a driver error.

Tests start `redis-server` on a free loopback port (skipped without the binary)."""
from __future__ import annotations

import pytest

from hicache import storage_redis
from hicache_helpers import make_manager, write_prefix
from redis_server import GEOM, needs_redis, private_server, random_pages, redis_server, server  # noqa: F401
from test_redis import make_store

_FIXTURES = (redis_server, server, private_server)


class LocalBug(Exception):
    pass


def _packing_raises(monkeypatch) -> None:
    def pack_value(*args):
        raise LocalBug("packing a value")
    monkeypatch.setattr(storage_redis, "pack_value", pack_value)


@needs_redis
@pytest.mark.asyncio
async def test_a_bug_packing_a_write_is_no_io_error(server, monkeypatch):
    store = make_store(server.url())
    keys = store.page_keys(list(range(8)), 0, 8)
    _packing_raises(monkeypatch)
    with pytest.raises(LocalBug):
        await store.write_pages(random_pages(GEOM, 2), [0, 1], [0, 1], keys)
    assert store.errors == {}
    assert store.stats()["available"]
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_a_backup_whose_packing_raises_fails_as_a_driver_bug_not_eio(server, monkeypatch):
    mgr = make_manager(storage_backend="redis", storage_url=server.url(), model_id="m")
    _packing_raises(monkeypatch)
    write_prefix(mgr, tuple(range(200, 216)))
    await mgr.drain()
    assert mgr.metrics.failures == {"driver": 1}
    assert mgr.store.errors == {}
    mgr.check_integrity()
    await mgr.close()
