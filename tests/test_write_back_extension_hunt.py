"""Write-back hunt, round 3 (session 31): a backup extending one whose L3 write is in flight. Asked for
only once that write started (a continuation of a prompt whose leaf write_back is saving), it waited
for the whole L3 write, so a write_back eviction of the continuation stalled on slow storage. Its
prefix is in L2 by then, locked by that write: it now starts its own D2H at once, and only its L3
write waits for the one in flight (it would write the shared pages again). L3 writes are held here
(tests/hicache_helpers.py `WriteGate`), so whatever completes before the gate opens did not wait for
them. The referee: every page reaches L2 and L3 once, every tier whole."""
from __future__ import annotations

import pytest

from hicache.ops import OpState
from hicache_helpers import WriteGate, assert_whole, make_manager, toks, until, write_prefix


def lengths(mgr, *prefixes) -> list[list[int]]:
    return [mgr.tree.match(p, touch=False).lengths for p in prefixes]


def pages_moved(mgr) -> dict[str, int]:
    return {d: mgr.metrics.directions[d].num_bytes // mgr.geometry.bytes_per_page for d in ("d2h", "h2s")}


@pytest.mark.asyncio
async def test_an_extension_asked_for_during_its_prefixs_l3_write_is_saved_without_waiting_for_it():
    """Regression (write_back): a's backup is writing L3 (held) when its continuation e = a + 2 pages
    is asked for (an eviction's veto). e waited for a's whole backup: its leaf stayed unsaved in L1
    and the eviction needing it stalled for the L3 write. Now e copies its own 2 pages to L2 at once
    (a's are there, locked by the write) and L1 may evict it; its L3 write waits for a's (both write
    from a's first page on) and then writes only e's pages: each page goes to L2 and L3 once."""
    mgr = make_manager(l1_pages=4, host_pages=32, storage_pages=32, write_policy="write_back")
    a = toks((0, 8))
    e = a + toks((100, 108))
    write_prefix(mgr, a, seed=1)
    gate = WriteGate(mgr.store)
    op_a = mgr.runner.start_backup(a)  # (as a write_back eviction's veto or a flush starts it)
    assert op_a is not None
    await until(lambda: op_a.state is OpState.H2S_PENDING)  # a's L3 write started, held
    write_prefix(mgr, e, start=len(a), seed=2)
    op_e = mgr.runner.start_backup(e)
    assert op_e is not None, "e's backup waits for a's L3 write"
    await until(lambda: op_e.payload["l1_free"].done())  # e's D2H ended
    assert lengths(mgr, e) == [[len(e), len(e), 0]]
    assert list(mgr.runner._l3_writing) == [op_a.op_id]  # e's L3 write waits for a's
    claim = mgr.new_claim("pressure")
    assert mgr.alloc_l1(4, claim) is not None, "L1 waits for an L3 write"  # both leaves saved: they go
    mgr.release_claim(claim)
    assert not gate.gate.is_set() and op_a.state is OpState.H2S_PENDING
    gate.release()
    await mgr.drain()
    assert lengths(mgr, a, e) == [[0, len(a), len(a)], [0, len(e), len(e)]]
    assert pages_moved(mgr) == {"d2h": 4, "h2s": 4}
    assert mgr.metrics.failures == {} and not mgr.metrics.policy_skips.get("write_l2")
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_an_extension_finding_l2_full_of_locked_pages_waits_for_the_l3_write_it_extends():
    """Guard (write_back): as above, but L2 is full of pages locked by L3 writes in flight (a's and
    another prompt x's). e's backup finds no L2 room: as a backup waiting for a's does, it waits for
    a's L3 write to end (its L1 leaf kept, write_back's veto) rather than being skipped and its leaf
    evicted unsaved; once a's write ended it is saved to L2 and L3."""
    mgr = make_manager(l1_pages=16, host_pages=3, storage_pages=32, write_policy="write_back")
    a, x = toks((0, 8)), toks((50, 54))
    e = a + toks((100, 104))
    write_prefix(mgr, a, seed=1)
    write_prefix(mgr, x, seed=3)
    x_gate = WriteGate(mgr.store)
    op_x = mgr.runner.start_backup(x)
    assert op_x is not None
    await until(lambda: op_x.state is OpState.H2S_PENDING)
    a_gate = WriteGate(mgr.store)  # (a's write is held by both gates, x's by x_gate only)
    op_a = mgr.runner.start_backup(a)
    assert op_a is not None
    await until(lambda: op_a.state is OpState.H2S_PENDING)  # L2: 3 pages, all locked
    write_prefix(mgr, e, start=len(a), seed=2)
    assert mgr.runner.start_backup(e) is None
    assert mgr.runner._deferred == {a: [e]}, "e's leaf would go unsaved"
    assert not mgr.metrics.policy_skips.get("write_l2")
    x_gate.release()
    await until(lambda: op_x.done)  # x's L2 page may go now: room for e's once a's write ended
    a_gate.release()
    await mgr.drain()
    assert lengths(mgr, e) == [[len(e), len(e), len(e)]]
    assert pages_moved(mgr) == {"d2h": 4, "h2s": 4}
    assert mgr.metrics.failures == {}
    assert_whole(mgr)
    await mgr.close()
