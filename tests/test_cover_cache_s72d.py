"""Cache rules that no test ran (session 72 coverage hunt): a HiCacheConfig naming an unknown storage backend,
the redis backend without its URL, or negative storage explore reads is refused naming the flag (a Python caller
builds the config without the CLI's checks); and a flush of L1 (write-back's flush before a shutdown's save) while
a restore is in flight ends without waiting for or tripping over the restore, whose prefix still reads back byte
for byte."""
from __future__ import annotations

import asyncio
import re

import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.radix import Tier
from hicache_helpers import assert_whole, l1_bytes, make_manager, write_prefix


@pytest.mark.parametrize("fields,says", [
    ({"storage_backend": "bogus"}, "unknown --hicache-storage-backend 'bogus'"),
    ({"storage_backend": "redis"}, "--hicache-storage-backend redis needs --hicache-storage-url redis://HOST:PORT/DB"),
    ({"storage_explore_reads": -1}, "--hicache-storage-explore-reads must be >= 0"),
], ids=["unknown-backend", "redis-without-url", "negative-explore-reads"])
def test_a_storage_config_that_cannot_work_is_refused_naming_the_flag(fields, says):
    with pytest.raises(ValueError, match=f"^{re.escape(says)}$"):
        HiCacheConfig(enable=True, **fields)
    if fields == {"storage_backend": "redis"}:  # (a disabled cache needs no URL)
        HiCacheConfig(enable=False, **fields)


@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
async def test_a_flush_of_l1_beside_a_restore_in_flight_ends_and_the_restore_lands(write_policy):
    """The restore (L2 -> L1) is live as the flush looks for the backups it waits for: the flush skips it (a
    restore has no L1 source to free) and backs up B (unsaved in L1 under write_back; write-through's backup)."""
    mgr = make_manager(write_policy=write_policy, storage_pages=0)
    a, b = tuple(range(100, 116)), tuple(range(500, 508))
    write_prefix(mgr, a, seed=1)
    await mgr.drain()
    want = l1_bytes(mgr, a)
    await asyncio.wait_for(mgr.flush_async(Tier.L1), 20)  # (write_back: saved to L2 first)
    assert mgr.tree.match(a, touch=False).lengths[:2] == [0, 16]
    write_prefix(mgr, b, seed=2)
    op = mgr.runner.start_restore(a, mgr.match(a), "l2", "r")
    assert op is not None and op.op_id in mgr.runner.live and not op.done
    await asyncio.wait_for(mgr.flush_async(Tier.L1), 20)
    await asyncio.wait_for(mgr.runner.wait_op(op), 20)
    await mgr.drain()
    assert op.succeeded  # (its pages published in L1 may have gone with the flush: it waited for B's backup)
    assert mgr.tree.match(b, touch=False).lengths[:2] == [0, 8]
    if mgr.tree.match(a, touch=False).lengths[Tier.L1] < 16:
        again = mgr.runner.start_restore(a, mgr.match(a), "l2", "r2")
        await asyncio.wait_for(mgr.runner.wait_op(again), 20)
        await mgr.drain()
    assert torch.equal(l1_bytes(mgr, a), want)
    assert_whole(mgr)
    await mgr.close()
