"""Write-back hunt, round 2 (session 31): stalls behind an L3 write. Two prompts sharing a prefix
that L2 lacks back up one after the other (the second waits for the first's D2H, which copies the
shared pages); it waited for the first's whole backup, its L3 write included, so a write_back
eviction that needs both leaves, and a flush of L1, waited for slow storage. Now it starts once
the first's L3 write holds its L2 pages. L3 writes are held here (tests/hicache_helpers.py
`WriteGate`), so whatever completes before the gate opens did not wait for them. The referee:
outputs equal a no-cache engine's, every page reaches L2 and L3 once, every tier whole."""
from __future__ import annotations

import random

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpKind
from hicache.radix import Tier
from hicache_helpers import WriteGate, assert_whole, finish, make_manager, toks, until, write_prefix
from scheduler.request import SamplingParams
from test_prefix_edges_hunt import VOCAB, make_engine, reference


class CountingWriteGate(WriteGate):
    """WriteGate counting the held writes that went through (the gate opened, or its 30 s passed)."""

    def __init__(self, store) -> None:
        super().__init__(store)
        self.through = 0

    def released(self, inner) -> None:
        self.through += 1


def lengths(mgr, *prefixes) -> list[list[int]]:
    return [mgr.tree.match(p, touch=False).lengths for p in prefixes]


def backing_up(mgr, tokens) -> bool:
    """Whether a backup of `tokens` is live (started, not waiting)."""
    return any(op.kind is OpKind.BACKUP and op.payload.get("backup_key") == tuple(tokens)
               for op in mgr.runner.live.values())


# -- a sibling's backup waits for the shared pages' D2H, not for their L3 write -----------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("extension,flush,fail", [(False, False, False), (True, False, False), (False, True, False),
                                                  (False, False, True)])
async def test_a_waiting_backup_starts_once_the_l3_write_it_waited_for_holds_its_l2_pages(extension, flush, fail):
    """Regression: under write_back, two leaves under an unsaved 2-page prefix S (siblings S+a, S+b;
    or, `extension`, S+a and its continuation S+a+b) evicted together: b's backup waited for a's
    (which copies S) to end, L3 write included, so the eviction, and a flush of L1, stalled for
    the L3 write (tens of ms on slow storage). b's backup now starts once a's L3 write holds its
    L2 pages: S is in L2 by then, and b copies only its own page; its L3 write then waits for a's
    (it would write S again), and every page reaches L2 and L3 once. fail: a's L3 write fails, and
    b's writes S with its own page (a's own page stays out of L3, as after any failed write)."""
    faults = FaultInjector()
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=32, write_policy="write_back", faults=faults)
    if fail:
        faults.arm(Fault.EIO_WRITE)  # the first L3 write: a's
    shared = toks((0, 8))
    a = shared + toks((100, 104))
    b = (a if extension else shared) + toks((200, 204))
    write_prefix(mgr, a, seed=1)
    write_prefix(mgr, b, start=len(a) if extension else len(shared), seed=2)
    gate = WriteGate(mgr.store)
    op_a = mgr.runner.start_backup(a)  # (as a write_back eviction's veto or a flush starts it)
    assert op_a is not None and mgr.runner.start_backup(b) is None  # b waits: a copies S
    await until(lambda: op_a.payload["l1_free"].done())  # a's D2H ended; its L3 write is held
    assert backing_up(mgr, b), "b's backup still waits for a's L3 write"
    if flush:  # (before: it waited for a's L3 write, here the gate's 30 s)
        assert await mgr.flush_async(Tier.L1) == 4
    else:
        await until(lambda: lengths(mgr, b)[0][Tier.L2] == len(b))
        claim = mgr.new_claim("pressure")
        assert mgr.alloc_l1(16, claim) is not None, "L1 waits for an L3 write"  # both leaves saved: they go
        mgr.release_claim(claim)
    assert lengths(mgr, a, b) == [[0, len(a), 0], [0, len(b), 0]]
    assert mgr.runner._l3_writing and not gate.gate.is_set()
    gate.release()
    await mgr.drain()
    assert lengths(mgr, a, b) == [[0, len(a), len(shared) if fail else len(a)], [0, len(b), len(b)]]
    distinct = (len(b) if extension else len(shared) + 8) // 4
    pages = {d: mgr.metrics.directions[d].num_bytes // mgr.geometry.bytes_per_page for d in ("d2h", "h2s")}
    assert pages == {"d2h": distinct, "h2s": distinct - fail}, pages  # (a failed write counts nothing)
    assert mgr.metrics.failures == ({"eio": 1} if fail else {})
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_write_back_eviction_of_two_prompts_sharing_a_prefix_waits_for_no_l3_write():
    """End to end (write_back, L3 writes held): two prompts sharing a new 32-token prefix, then a long
    prompt whose L1 room needs both of their leaves. It is served while the first leaf's L3 write
    is still held (before: it waited for that write, the second leaf's backup behind it), outputs
    equal a no-cache engine's, and every page reaches L2 and L3 once the writes go through."""
    rng = random.Random(11)
    shared = [rng.randrange(VOCAB) for _ in range(32)]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(7)] for _ in range(2)]
    long_ = [rng.randrange(VOCAB) for _ in range(100)]
    eng = make_engine(num_pages=32, write_policy="write_back")
    await eng.start()
    gate = CountingWriteGate(eng.cache.store)
    out = await eng.generate_async(prompts, SamplingParams(max_tokens=2))
    [r] = await eng.generate_async([long_], SamplingParams(max_tokens=2))
    assert gate.through == 0, "the long prompt waited for an L3 write"
    assert [o.output_ids for o in out + [r]] == await reference(prompts + [long_], 2)
    gate.release()
    await eng.cache.drain()
    seqs = [p + o.output_ids[:-1] for p, o in zip(prompts, out)]
    for seq in seqs:
        assert eng.cache.tree.match(seq, touch=False).lengths[1:] == [40, 40]
    bytes_per_page = eng.cache.geometry.bytes_per_page
    assert {d: eng.metrics()["directions"][d]["bytes"] // bytes_per_page for d in ("d2h", "h2s")} == \
        {"d2h": 12, "h2s": 12}  # the shared 8 pages once, 2 of each leaf
    assert eng.metrics()["failures"] == {}
    await finish(eng)


# -- an L3 restore whose L1 room write_back is still saving is no failure --------------------------
@pytest.mark.asyncio
async def test_an_l3_restore_waiting_for_write_back_room_counts_no_failure():
    """Regression (write_back, blocking restores: `--disable-hicache-prefetch`): an L3 restore's H2D
    needs L1 room that write_back frees only once the unsaved leaves it evicts are backed up. Its
    allocation found none while those backups ran, and the restore was failed and counted in
    `failures["no_pages"]`, though its read stayed in L2 and its request then restored from there
    (an L3 hit): a failure a dashboard alerts on, counted for write_back's normal course. It now
    waits for that room as a request computing its prompt does: its L3 hit, no failure, outputs
    equal a no-cache engine's."""
    rng = random.Random(3)
    bases = [[rng.randrange(VOCAB) for _ in range(32)] for _ in range(4)]
    eng = make_engine(num_pages=30, write_policy="write_back", prefetch=False)
    await eng.start()
    prompts = [bases[0] + [1]] + [b + [1] for b in bases[1:]] + [bases[0] + [2]]
    outs = await eng.generate_async(prompts[:1], SamplingParams(max_tokens=2))
    await eng.cache.flush_async(Tier.L1)
    await eng.cache.drain()
    eng.cache.flush(Tier.L2)  # bases[0] in L3 only
    for p in prompts[1:4]:  # L1 full of unsaved prefixes
        outs += await eng.generate_async([p], SamplingParams(max_tokens=2))
    assert eng.cache.tree.match(bases[0], touch=False).lengths == [0, 0, 32]
    assert eng.cache.l1.allocator.num_free < 8
    restores0 = eng.metrics()["restores_started"]
    [r] = await eng.generate_async(prompts[4:], SamplingParams(max_tokens=2))
    assert r.cached_tokens == {"l1": 0, "l2": 0, "l3": 32}, "recomputed a prefix L3 held"
    assert [o.output_ids for o in outs + [r]] == await reference(prompts, 2)
    await eng.cache.drain()
    m = eng.metrics()
    assert m["failures"] == {} and m["fallbacks"] == 0, (m["failures"], m["fallbacks"])
    assert m["restores_started"] - restores0 == 1  # (before: the L3 restore, then one from L2)
    await finish(eng)
