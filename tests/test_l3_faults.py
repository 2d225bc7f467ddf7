"""L3 reads: faults the engine heals from (tests/test_faults.py holds the fault matrix and its
harness): pages a read cannot get back lose their residency and are written again; reads past their
deadline teach the cost model the storage is slow; what a read whose start L2 still holds is
counted as; and a request parked on a slow read does not hold up others' decode."""
from __future__ import annotations

import asyncio
import os

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.radix import Tier
from hicache_helpers import assert_whole, capture_op_logs, make_manager, write_prefix
from test_faults import OTHER, PROMPT, REUSABLE, finish, make_engine, only_in_l3, reference, run_one, until


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


def _only_start_in_l2(mgr, tokens, l2_tokens: int) -> None:
    """Evict `tokens` from L1, and from L2 all but its first `l2_tokens` (L3 holds all of it)."""
    mgr.tree.match(tokens[:l2_tokens], touch=False)  # split the node there
    mgr.tree.evict(Tier.L1, mgr.l1.num_pages)
    mgr.tree.evict(Tier.L2, (len(tokens) - l2_tokens) // mgr.page_size)
    assert mgr.tree.match(tokens, touch=False).lengths == [0, l2_tokens, len(tokens)]


@pytest.mark.asyncio
async def test_an_l3_restore_whose_start_l2_holds_counts_only_what_it_read(tmp_path):
    """Regression (session 23's review): an L3 restore reads [l2, l3) but counted its longest copy,
    [l1, l3), as read from L3 (the reuse gate saw L3 more productive than it was), and a read past
    its deadline taught the cost model those bytes in the deadline (storage faster than it is)."""
    faults = FaultInjector()
    mgr = make_manager(faults=faults, io_timeout_s=0.2, storage_path=str(tmp_path / "l3"))
    tokens = tuple(range(32))
    write_prefix(mgr, tokens)
    await mgr.drain()
    _only_start_in_l2(mgr, tokens, 16)
    read_pages = (32 - 16) // mgr.page_size
    before = mgr.reuse[Tier.L3].read_pages
    op = mgr.runner.start_restore(tokens, mgr.match(tokens), "l3", "r")
    await mgr.runner.wait_op(op)
    assert op.succeeded and op.num_pages == 32 // mgr.page_size
    assert mgr.reuse[Tier.L3].read_pages - before == read_pages
    _only_start_in_l2(mgr, tokens, 16)
    faults.arm(Fault.SLOW_READ, times=None, delay_s=1.0)
    learned = []
    observe = mgr.cost.observe_transfer
    mgr.cost.observe_transfer = lambda d, num_bytes, s: (learned.append((d, num_bytes)), observe(d, num_bytes, s))
    op = mgr.runner.start_restore(tokens, mgr.match(tokens), "l3", "r")
    await mgr.runner.wait_op(op)
    assert not op.succeeded
    assert ("s2h", read_pages * mgr.geometry.bytes_per_page) in learned
    await mgr.drain()
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_request_restored_from_l3_and_l2_counts_each_part_in_its_tier():
    """Regression (session 23): a request whose prefix's start was still in L2 and the rest only in
    L3 reported every restored token as an L3 hit; the L2 part is an L2 hit."""
    eng = make_engine(prefetch=False)
    await eng.start()
    want = await reference(PROMPT)
    assert (await run_one(eng)).output_ids == want
    eng.cache.runner.start_backup(PROMPT[:REUSABLE])
    await eng.cache.drain()
    half = REUSABLE // 2
    _only_start_in_l2(eng.cache, tuple(PROMPT[:REUSABLE]), half)
    result = await run_one(eng)
    assert result.output_ids == want
    assert result.cached_tokens == {"l1": 0, "l2": half, "l3": REUSABLE - half}
    await finish(eng)


# -- a parked restore does not block decode ------------------------------------------------------
@pytest.mark.asyncio
async def test_parked_restore_does_not_block_decode():
    faults = FaultInjector()
    eng = make_engine(faults, num_pages=96)
    await eng.start()
    tokens = PROMPT[:REUSABLE]
    await run_one(eng)
    await eng.cache.drain()
    only_in_l3(eng, tokens)
    assert eng.metrics()["restore_overlapped_s"] == 0.0  # backups alone are not restores
    faults.arm(Fault.SLOW_READ, delay_s=0.3)
    with capture_op_logs() as logs:
        decoding = asyncio.create_task(run_one(eng, OTHER, max_tokens=300))
        await until(lambda: any(e.get("event") == "batch" and e["kind"] == "decode" for e in logs))
        restoring = await run_one(eng)
        other = await decoding
    assert restoring.output_ids == await reference(PROMPT)
    assert restoring.cached_tokens["l3"] == REUSABLE
    assert other.output_ids == await reference(OTHER, 300)
    # the promotion: into L2_L3, or (taken on to L1 while verifying) out of H2D_VERIFYING
    [promotion] = [e for e in logs if e.get("event") == "op" and e["kind"] == "prefetch_l3"
                   and e["op_event"] == "S2H_DONE"]
    [start] = [e for e in logs if e.get("event") == "op" and e["op_id"] == promotion["op_id"]
               and e["to_state"] == "S2H_PENDING"]
    decode_during = [e for e in logs if e.get("event") == "batch" and e["kind"] == "decode"
                     and start["ts_ns"] < e["start_ns"] and e["end_ns"] < promotion["ts_ns"]]
    assert len(decode_during) >= 5, "decode stalled while the L3 read was pending"
    # counted once per instant: at most the union of the decode batches' spans (regression, session
    # 23: a chained decode step starts before the one before it ends, and their overlapping spans
    # were summed: 0.62 s for a 0.32 s restore)
    union_ns, reach_ns = 0, 0
    spans = [(e["start_ns"], e["end_ns"]) for e in logs if e.get("event") == "batch" and e["kind"] == "decode"]
    for a, b in sorted(spans):
        union_ns += max(0, b - max(a, reach_ns))
        reach_ns = max(reach_ns, b)
    assert 0 < eng.metrics()["restore_overlapped_s"] <= union_ns / 1e9 + 1e-6
    await finish(eng)
