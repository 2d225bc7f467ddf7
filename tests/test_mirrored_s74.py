"""Guards fixed on one side of a mirrored pair, pinned on the other side too (session 74's hunt).

RedisStore's read and write (hicache/storage_redis.py): a read ends an outage as soon as one of its round trips
is answered, before a missing page fails it (regression, tests/test_redis_hunt.py). Its write counted only a
write whose every chunk was stored: one whose first chunk the server took and whose next it refused (OOM under
maxmemory with noeviction) left the outage on, so `status()` said the server unavailable while it answered, and
the next connection blip backed off as if it had never come back. A stand-in client answers here (no server)."""
from __future__ import annotations

import pytest
import redis.exceptions as rexc

from redis_server import GEOM, random_pages, refused_url


class _FirstChunkOnly:
    """A client whose server stores the first MSET and refuses the next ones with OOM."""

    def __init__(self) -> None:
        self.msets = 0

    async def mset(self, mapping: dict) -> bool:
        self.msets += 1
        if self.msets > 1:
            raise rexc.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
        return True


@pytest.mark.asyncio
async def test_a_write_the_server_answered_ends_the_outage():
    from hicache.storage import StorageError
    from hicache.storage_redis import RedisStore
    store = RedisStore(GEOM, 64, refused_url(), model_id="test", backoff_s=(0.0, 0.0),
                       chunk_bytes=1)  # (one page a chunk: two round trips)
    try:
        src = random_pages(GEOM, 2)
        keys = store.page_keys(list(range(8)), 0, 8)
        with pytest.raises(StorageError):  # nothing listens: an outage
            await store.write_pages(src, [0, 1], [0, 1], keys)
        assert not store.stats()["available"]
        fake = _FirstChunkOnly()
        store._client = lambda: fake  # back, and short of memory after one chunk
        with pytest.raises(StorageError) as exc:
            await store.write_pages(src, [0, 1], [0, 1], keys)
        assert exc.value.kind == "enospc" and fake.msets == 2
        assert store.stats()["available"] and store._consecutive_failures == 0
    finally:
        store.close()
