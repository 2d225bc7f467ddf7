"""A storage that stops answering (session 76's hunt: every wait on L3 bounded). A file L3 on a network file system
that hangs (no error, no reply) held an L3 write for good: the backup waited on it with no deadline, so its L2 pages
stayed locked by the write (an L2 full of them skipped every later backup), and an operator's reset of L3
(`POST /reset_prefix_cache` with `reset_external`, which waits for the L3 writes in flight) never replied. A write
past its deadline (`io_timeout_s`, as a read's) now fails as a `timeout`; its slots stay reserved until the write
settles (a late write must not land in slots given to another), then are freed, unreadable."""
from __future__ import annotations

import asyncio

import pytest
import torch

from hicache.ops import OpState
from hicache.radix import Tier
from hicache.redis_values import HEADER
from hicache_helpers import WriteGate, assert_whole, make_manager, until, write_prefix
from redis_server import needs_redis, private_server  # noqa: F401
from scheduler.api_admin import reset_tiers

TOKENS = tuple(range(16))  # 4 pages of 4 tokens
DEADLINE_S = 0.3
BOUND_S = 10.0  # what a test waits at most for what the deadline ends (the gate itself lets go after 30 s)


def writing(mgr):
    """The live backup whose L3 write is in flight, or None."""
    return next((op for op in mgr.runner.live.values() if op.state is OpState.H2S_PENDING), None)


async def held_write(mgr):
    """`TOKENS` published in L1 and backed up to L2, its L3 write started and held -> (the gate, the backup)."""
    gate = WriteGate(mgr.store)
    write_prefix(mgr, TOKENS)
    await until(lambda: writing(mgr) is not None)
    return gate, writing(mgr)


@pytest.mark.asyncio
async def test_an_l3_write_that_hangs_fails_at_its_deadline_and_keeps_its_slots_until_it_settles():
    mgr = make_manager(write_policy="write_through", io_timeout_s=DEADLINE_S)
    gate, op = await held_write(mgr)
    await asyncio.wait_for(mgr.runner.wait_op(op), BOUND_S)
    assert op.state is OpState.FAILED and "timeout" in op.error, op.error
    assert mgr.metrics.failures == {"timeout": 1}
    m = mgr.tree.match(TOKENS, include_storage=True, touch=False)
    assert m.lengths == [16, 16, 0], m.lengths  # (published in L2, nothing in L3)
    assert all(n.locks[Tier.L2] == 0 for n in m.path), "the hung write still locks its L2 pages"
    l3 = mgr.allocator(Tier.L3)
    assert l3.num_private() == 4, "the slots the late write lands in were given back while it runs"
    gate.release()  # (the storage answers again: the write lands late)
    await asyncio.wait_for(mgr.drain(), BOUND_S)
    assert l3.num_private() == 0 and l3.num_free == l3.num_pages
    assert not any(mgr.store.exists(range(l3.num_pages))), "a late write left readable slots no prefix owns"
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_reset_of_l3_replies_while_an_l3_write_hangs():
    """vLLM's reset_external=true resets L1 and L3 and waits for the L3 writes in flight: its reply came never."""
    mgr = make_manager(write_policy="write_through", io_timeout_s=DEADLINE_S)
    gate, _ = await held_write(mgr)
    out = await asyncio.wait_for(reset_tiers(mgr, (Tier.L1, Tier.L3)), BOUND_S)
    assert out["pages_left"] == {"l1": 0, "l3": 0}, out
    assert mgr.metrics.failures == {"timeout": 1}
    gate.release()
    await asyncio.wait_for(mgr.drain(), BOUND_S)
    assert mgr.tree.match(TOKENS, include_storage=True, touch=False).lengths == [0, 16, 0]
    assert_whole(mgr)
    await mgr.close()


# -- a shared Redis L3 whose server stalls under a write that outlasts its deadline ------------------------------------
BUSY_SCRIPT = "local t0 = redis.call('TIME') repeat local t = redis.call('TIME') until " \
              "(t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > tonumber(ARGV[1])"
STALL_S = 1.5  # the server answers nothing for this long (a Lua busy loop): past the deadline, within its timeouts


@needs_redis
@pytest.mark.asyncio
async def test_a_redis_write_past_its_deadline_stores_no_other_prefix_kv_under_its_keys(private_server):
    """A write to Redis sends a chunk at a time, each packed from its L2 pages as it goes. Past its deadline, the
    failed backup must keep those pages until the write settled: given back, L2 reused them for another prompt, and
    the chunks sent after the server answered again stored that prompt's KV under this one's keys (their checksums
    bound to the keys, so every instance restored it as this prefix's: a wrong answer). A file's slots are private
    and freed unreadable, so there the pages go at the deadline (the test above)."""
    import threading

    mgr = make_manager(host_pages=4, storage_backend="redis", storage_url=private_server.url(), model_id="m",
                       write_policy="write_through", io_timeout_s=DEADLINE_S)
    mgr.store.pages_per_chunk = 1  # (one MSET a page: the later pages are packed after the server answers)
    stall = threading.Thread(target=lambda: private_server.client().eval(BUSY_SCRIPT, 0, int(STALL_S * 1e6)))
    stall.start()
    try:
        await asyncio.sleep(0.1)  # (the busy loop runs: the write's first MSET waits for it)
        l1_pages = write_prefix(mgr, TOKENS)
        want = mgr.l1.kv[:, :, l1_pages].permute(2, 0, 1, 3, 4, 5).contiguous().view(torch.uint8).clone()
        await until(lambda: writing(mgr) is not None)
        await asyncio.wait_for(mgr.runner.wait_op(writing(mgr)), BOUND_S)
        assert mgr.metrics.failures == {"timeout": 1}
        mgr.tree.check_lock_holders(mgr.runner.lock_holds())  # (the engine's check: the settling write holds them)
        write_prefix(mgr, tuple(range(500, 516)), seed=1)  # (its backup wants every L2 page)
    finally:
        await asyncio.get_running_loop().run_in_executor(None, stall.join)
    await asyncio.wait_for(mgr.drain(), BOUND_S)
    keys = mgr.store.page_keys(TOKENS, 0, len(TOKENS))
    for i, value in enumerate(private_server.client().mget(keys)):
        assert value is None or value[HEADER.size:] == want[i].numpy().tobytes(), \
            f"page {i} of the prompt is stored in Redis with another prompt's KV"
    assert_whole(mgr)
    await mgr.close()
