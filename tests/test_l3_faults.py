"""L3 faults the engine heals from (tests/test_faults.py holds the fault matrix and its harness): pages
a read cannot get back lose their residency and are written again; reads past their deadline
teach the cost model the storage is slow."""
from __future__ import annotations

import os

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager, write_prefix
from test_faults import PROMPT, REUSABLE, finish, make_engine, only_in_l3, reference, run_one


@pytest.mark.asyncio
async def test_l3_pages_a_read_cannot_get_back_are_dropped_and_written_again():
    """The L3 file loses its content (truncated): a read fails "short". Such a failure named no
    slots, so the tree kept the L3 residency, the recompute's backup saw L3 'holding' the prefix and
    skipped it, and every later request of the prefix paid a failed read. Now the slots a failed
    read covered lose their residency, and the next backup writes them again."""
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    tokens = PROMPT[:REUSABLE]
    assert (await run_one(eng)).output_ids == want
    await eng.cache.drain()
    only_in_l3(eng, tokens)
    os.truncate(eng.cache.store.path, 0)
    for _ in range(3):
        assert (await run_one(eng)).output_ids == want
        await eng.cache.drain()
        only_in_l3(eng, tokens)  # written again by the recompute's backup
    m = eng.metrics()
    assert m["failures"].get("short", 0) == 1 and m["storage_missing_pages"] >= 1
    assert m["hit_tokens"]["l3"] > 0  # the rewritten pages were read back
    assert_whole(eng.cache)
    await finish(eng)


@pytest.mark.asyncio
async def test_l3_reads_past_their_deadline_are_learned_as_slow(tmp_path):
    """A read that times out taught the cost model nothing: a storage that became slower than its
    deadline was never timed, and every L3 hit waited the deadline out, then recomputed. Now the
    deadline is learned as the read's time, and the next hit goes to recompute."""
    faults = FaultInjector()
    mgr = make_manager(faults=faults, policy="cost", io_timeout_s=0.2, storage_explore_reads=0,
                       host_explore_transfers=0, restore_explore_every=0, storage_bandwidth_gib_s=20.0,
                       recompute_us_per_token=50.0, storage_path=str(tmp_path / "l3"))
    tokens = tuple(range(32))
    write_prefix(mgr, tokens)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, mgr.l1.num_pages)
    mgr.tree.evict(Tier.L2, mgr.l2.num_pages)
    faults.arm(Fault.SLOW_READ, times=None, delay_s=1.0)
    tiers = []
    for _ in range(4):
        m = mgr.match(tokens)
        tiers.append(mgr.decide(m).tier)
        if tiers[-1] != "l3":
            break
        op = mgr.runner.start_restore(tokens, m, "l3", "r")
        await mgr.runner.wait_op(op)
        assert not op.succeeded
    await mgr.drain()
    assert tiers == ["l3", "l1"]
    assert mgr.cost.directions["s2h"].num_samples == 1
    assert_whole(mgr)
    await mgr.close()
