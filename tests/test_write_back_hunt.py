"""Bug hunt on the write_back write policy end to end (session 30): L1 pages reach L2 only when L1
evicts them (then on to L3 as configured). An operator's flush of L1, eviction under pressure
(hits found again below, nothing lost, no stall, outputs equal a no-cache engine's), L3 behind a
small L2, faults and aborts during a write-back backup, shutdown with unsaved pages, and the
metrics (backups counted once, bytes moved, hit tokens per tier)."""
from __future__ import annotations

import random

import pytest
import torch

from hicache.radix import Tier
from hicache_helpers import assert_whole, l1_bytes, make_manager, toks, write_prefix
from scheduler.request import SamplingParams
from test_prefix_edges_hunt import VOCAB, make_engine, reference


def lengths(mgr, *prefixes) -> list[list[int]]:
    return [mgr.tree.match(p, touch=False).lengths for p in prefixes]


# -- a flush of L1 writes unsaved pages back first ---------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("storage_pages", [0, 64])
async def test_a_flush_of_l1_under_write_back_writes_unsaved_pages_back_first(storage_pages):
    """Regression: under write_back a prefix reaches L2 only when L1 evicts it, through the eviction's
    veto; `flush(Tier.L1)` evicted without it, so an operator's (or a benchmark's) flush of L1 dropped
    every unsaved prefix from every tier, where a write_through flush keeps it in L2. A write-back
    cache's flush writes dirty data back, then invalidates: after `flush_async` the prefixes are in
    L2 (and L3), byte for byte, and nothing is left in L1."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=storage_pages, write_policy="write_back")
    a, b = toks((0, 16)), toks((0, 8)) + toks((100, 112))  # a shared 2-page prefix, two leaves
    write_prefix(mgr, a, seed=1)
    write_prefix(mgr, b, 8, seed=2)
    want = {p: l1_bytes(mgr, p) for p in (a, b)}
    assert lengths(mgr, a, b) == [[16, 0, 0], [20, 0, 0]]
    freed = await mgr.flush_async(Tier.L1)
    assert freed == 7
    await mgr.drain()  # (the L3 writes go on after the flush)
    low = 16 if storage_pages else 0
    assert lengths(mgr, a, b) == [[0, 16, low], [0, 20, 20 if storage_pages else 0]], "unsaved pages were dropped"
    for p in (a, b):
        m = mgr.tree.match(p, touch=False)
        got = mgr.l2.page_buffer[m.pages[Tier.L2]].permute(1, 2, 0, 3, 4, 5).contiguous().view(torch.uint8)
        assert torch.equal(got, want[p].view(torch.uint8))
    assert mgr.metrics.backups_started == 2 and mgr.metrics.evictions_pages["l1"] == 7
    assert mgr.metrics.directions["d2h"].num_bytes == 7 * mgr.geometry.bytes_per_page  # each page once
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_a_synchronous_flush_of_l1_under_write_back_keeps_unsaved_pages_until_saved():
    """The synchronous flush (callable where nothing can be awaited) cannot wait for a copy: under
    write_back it evicts what L2 already holds, starts the backups of what it lacks and keeps
    those pages in L1 (regression: it dropped them from every tier). Once they are saved, the next
    flush empties L1 and the prefixes are hits in L2."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0, write_policy="write_back")
    a, b = toks((0, 16)), toks((200, 212))
    write_prefix(mgr, a)
    mgr.runner.start_backup(a)  # a saved already (as after a restore), b not
    await mgr.drain()
    write_prefix(mgr, b)
    assert mgr.flush(Tier.L1) == 4  # a goes, b's backup starts
    assert lengths(mgr, a, b) == [[0, 16, 0], [12, 0, 0]], "the unsaved prefix was dropped"
    await mgr.drain()
    assert mgr.flush(Tier.L1) == 3
    assert lengths(mgr, a, b) == [[0, 16, 0], [0, 12, 0]]
    assert mgr.metrics.backups_started == 2 and mgr.metrics.evictions_pages == {"l1": 7, "l2": 0, "l3": 0}
    assert_whole(mgr)


# -- a page L3 holds is saved ------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_write_back_evicts_an_l1_leaf_that_l3_holds_without_copying_it_again():
    """Regression: the write_back eviction veto took a leaf for unsaved whenever L2 lacked it, also
    when L3 held it (a prefix restored from L3 that L2 then evicted, the common case behind a small
    L2): L1 then waited for a D2H of pages already saved, which evicted other prefixes from L2 to
    hold them (the replay of 8 prefixes through L1 24 / L2 16 / L3 64 pages: 22 backups, 176 pages
    copied, against write_through's 8 and 64, for the same hits). Nothing is lost when L1 evicts
    a page L3 holds: it goes at once, as under write_through."""
    mgr = make_manager(l1_pages=4, host_pages=8, storage_pages=16, write_policy="write_back")
    a, b, c = toks((0, 8)), toks((100, 108)), toks((200, 208))
    write_prefix(mgr, a)
    mgr.runner.start_backup(a)  # a in every tier (as after an L3 restore) ...
    await mgr.drain()
    mgr.tree.evict(Tier.L2, 2)  # ... then L2 evicted it
    write_prefix(mgr, b)
    mgr.match(b)
    assert lengths(mgr, a, b) == [[8, 0, 8], [8, 0, 0]]
    assert write_prefix(mgr, c) is not None, "L1 waited for a backup of a prefix L3 holds"
    assert lengths(mgr, a, b, c) == [[0, 0, 8], [8, 0, 0], [8, 0, 0]]
    assert mgr.metrics.backups_started == 1 and mgr.metrics.directions["d2h"].count == 1
    await mgr.drain()
    assert_whole(mgr)


def _bench_common():
    import importlib.util
    import sys
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    if str(scripts) not in sys.path:
        sys.path.insert(0, str(scripts))
    spec = importlib.util.spec_from_file_location("bench_common", scripts / "bench_common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.asyncio
async def test_a_benchmarks_reset_under_write_back_forces_the_tier_below():
    """The benchmarks force a tier by emptying those above it (scripts/bench_common.py `evict`):
    under write_back that dropped the prefix from every tier, so a forced L2 or L3 run recomputed.
    Now it is written back first: emptying L1 leaves an L2 hit, emptying L1 and L2 an L3 hit, and
    the outputs equal a no-cache engine's."""
    evict = _bench_common().evict
    rng = random.Random(5)
    prefix = [rng.randrange(VOCAB) for _ in range(32)]
    prompts = [prefix + [1], prefix + [2], prefix + [3]]
    eng = make_engine(num_pages=64, write_policy="write_back")
    await eng.start()
    outs = [(await eng.generate_async([prompts[0]], SamplingParams(max_tokens=3)))[0]]
    for tiers, hit in ((("l1",), "l2"), (("l1", "l2"), "l3")):
        await evict(eng, tiers)
        [r] = await eng.generate_async([prompts[len(outs)]], SamplingParams(max_tokens=3))
        assert r.cached_tokens[hit] == 32, (tiers, r.cached_tokens)
        outs.append(r)
    assert [r.output_ids for r in outs] == await reference(prompts, 3)
    await eng.stop_loop()
    await eng.cache.drain()
    assert_whole(eng.cache)
    await eng.shutdown()


# -- a restore that needs L1 room which write_back is still saving waits for it ------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("prefetch", [True, False])
async def test_a_restore_waits_for_write_back_room_instead_of_recomputing(prefetch):
    """Regression: under write_back the L1 room a restore needs comes from unsaved leaves, which are
    backed up before they go; the restore's L1 allocation failed while those backups ran, and the
    request fell back to recomputing a prefix that L2 held (every L2 hit once L1 was full of unsaved
    prefixes, the steady state of write_back). A request computing its prompt waits for those pages;
    one restoring waits for them likewise, then restores."""
    rng = random.Random(0)
    bases = [[rng.randrange(VOCAB) for _ in range(32)] for _ in range(4)]
    eng = make_engine(num_pages=30, storage=False, write_policy="write_back", prefetch=prefetch)
    await eng.start()
    prompts = [bases[0] + [1]] + [b + [1] for b in bases[1:]] + [bases[0] + [2]]
    outs = await eng.generate_async(prompts[:1], SamplingParams(max_tokens=2))
    await eng.cache.flush_async(Tier.L1)  # bases[0] in L2 only
    for p in prompts[1:4]:  # L1 full of unsaved prefixes
        outs += await eng.generate_async([p], SamplingParams(max_tokens=2))
    assert eng.cache.l1.allocator.num_free < 8
    [r] = await eng.generate_async(prompts[4:], SamplingParams(max_tokens=2))
    assert r.cached_tokens == {"l1": 0, "l2": 32, "l3": 0}, "recomputed a prefix L2 held"
    assert eng.metrics()["fallbacks"] == 0
    assert [o.output_ids for o in outs + [r]] == await reference(prompts, 2)
    await eng.stop_loop()
    await eng.cache.drain()
    assert_whole(eng.cache)
    await eng.shutdown()
