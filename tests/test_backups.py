"""Backups that overlap: one asked for while a backup of its prefix is in flight waits for it and
copies only the pages beyond, so no page crosses PCIe or reaches L3 twice (hicache/backups.py,
OpRunner.start_backup); and a backup whose copy cannot even be enqueued falls back like a failed one."""
import asyncio

import pytest

from hicache.radix import Tier
from hicache_helpers import assert_whole, hold_copies, make_manager, toks, write_prefix
from test_faults import OTHER, PAGE, PROMPT, TransferGate, finish, make_engine, reference, run_one, until


@pytest.mark.asyncio
async def test_backup_extending_one_in_flight_copies_each_page_once():
    """A request publishes its prompt (backup 1 in flight) and then a longer sequence sharing it
    (backup 2): backup 2 waits for backup 1 and copies only the pages beyond it, so the prefix
    crosses PCIe (and reaches L3) once, not twice."""
    eng = make_engine(num_pages=64)
    await eng.start()
    cache = eng.cache
    gate = TransferGate(eng, "d2h")
    short, long_ = tuple(PROMPT[:4 * PAGE]), tuple(PROMPT[:6 * PAGE])
    claim = cache.new_claim("test")
    pages = cache.alloc_l1(6, claim)
    cache.insert_l1(short, pages[:4], claim, 0)  # publishing starts backup 1 (held by the gate)
    await until(lambda: len(cache.runner.live) == 1)
    cache.insert_l1(long_, pages[4:], claim, 4 * PAGE)  # backup 2 is deferred behind it
    assert cache.runner.start_backup(short[:2 * PAGE]) is None  # a prefix of one in flight: covered
    assert len(cache.runner.live) == 1
    gate.release.set()
    await cache.drain()
    d2h = eng.metrics()["directions"]["d2h"]["bytes"]
    assert d2h == 6 * cache.geometry.bytes_per_page  # 4 + 2 pages, none twice
    assert cache.tree.match(long_, include_storage=True, touch=False).lengths == [6 * PAGE] * 3
    cache.release_claim(claim)
    await finish(eng)


@pytest.mark.asyncio
async def test_backup_whose_copy_cannot_be_enqueued_falls_back_with_accounting_whole(monkeypatch):
    """A device->host copy whose kernel launch raises inside the loop (a bug in a launcher, seen on
    the H200) fails that backup: the request completes with the recompute output, the failure is
    counted, no tier keeps a private page, and the loop keeps serving."""
    import hicache.transfer as transfer_mod

    def broken(*args, **kwargs):
        raise IndexError("tuple index out of range")
    monkeypatch.setattr(transfer_mod, "gather_pages", broken)
    eng = make_engine()
    first = await run_one(eng)
    assert first.output_ids == await reference(PROMPT)
    await eng.cache.drain()
    assert eng.cache.metrics.failures.get("transfer", 0) >= 1
    second = await run_one(eng, OTHER)  # the loop is alive
    assert second.output_ids == await reference(OTHER)
    await finish(eng)


@pytest.mark.asyncio
async def test_a_steps_tokens_reach_their_clients_before_its_backups_start():
    """Regression (session 13, H200): the engine published a finishing request's pages and enqueued
    their write-through backup before the step's other requests got their tokens, so the last of 32
    requests ending together waited ~20 ms behind 31 backups (batch-32 decode with backups at 0.95
    of hicache off, all of it in the last step). Now a step's backups start once its clients ran:
    each of four requests that end in one step sees its finish before any backup of that step
    started, and every page is still backed up (L2 holds each whole sequence)."""
    from scheduler.request import SamplingParams

    eng = make_engine(num_pages=96, storage_ratio=0.0)  # L2 only: a backup ends with its D2H
    await eng.start()
    cache = eng.cache
    prompts = [[(7 * i + j) % 50 + 1 for j in range(2 * PAGE)] for i in range(4)]  # two pages each
    max_tokens = PAGE + 2  # the final publish adds a page beyond the prompt's
    seen = []

    async def one(prompt):
        out = []
        async for ev in eng.submit(prompt, SamplingParams(max_tokens=max_tokens)):
            if ev.token_id is not None:
                out.append(ev.token_id)
            if ev.finished:
                seen.append(cache.metrics.backups_started)
        return out

    outs = await asyncio.gather(*(one(p) for p in prompts))
    await cache.drain()
    after = cache.metrics.backups_started
    assert len(seen) == 4 and max(seen) < after, (seen, after)  # the step's backups came after every finish
    for prompt, out in zip(prompts, outs):
        computed = len(prompt) + len(out) - 1  # the last token has no KV
        aligned = computed - computed % PAGE
        m = cache.tree.match(tuple(prompt + out)[:aligned], include_storage=False, touch=False)
        assert m.lengths[1] == aligned  # Tier.L2: the whole sequence got backed up
    await finish(eng)


@pytest.mark.asyncio
async def test_due_backups_start_before_l1_evicts_their_pages():
    """A backup asked for with `backup_soon` has not started yet; an L1 allocation that must evict
    starts it first, so its pages are locked (not evicted unsaved) and reach L2."""
    eng = make_engine(num_pages=12)
    await eng.start()
    cache = eng.cache
    tokens = tuple(PROMPT[:4 * PAGE])
    claim = cache.new_claim("test")
    pages = cache.alloc_l1(4, claim)
    cache.insert_l1(tokens, pages, claim, 0)  # published; its backup is due, not started
    assert cache.runner.has_due and not cache.runner.live
    other = cache.new_claim("other")
    got = cache.alloc_l1(cache.l1.allocator.num_free + 4, other)  # needs the 4 published pages
    assert got is None  # they are locked by the backup that started first
    assert not cache.runner.has_due and len(cache.runner.live) == 1
    await cache.drain()
    assert cache.tree.match(tokens, include_storage=False, touch=False).lengths[1] == len(tokens)
    cache.release_claim(claim)
    cache.release_claim(other)
    await finish(eng)


@pytest.mark.asyncio
async def test_due_backups_start_before_a_match_returns():
    """A match may lead to a restore from L2 pages, and starting a backup may evict L2 leaves: due
    backups start before `CacheManager.match` walks the tree, never between a match and its use."""
    eng = make_engine(num_pages=32, storage_ratio=0.0)
    await eng.start()
    cache = eng.cache
    due = tuple(PROMPT[:2 * PAGE])
    claim = cache.new_claim("test")
    cache.insert_l1(due, cache.alloc_l1(2, claim), claim, 0)
    assert cache.runner.has_due and not cache.runner.live
    cache.match(tuple(OTHER[:3 * PAGE]))
    assert not cache.runner.has_due and len(cache.runner.live) == 1
    await cache.drain()
    assert cache.tree.match(due, include_storage=False, touch=False).lengths[1] == len(due)
    cache.release_claim(claim)
    await finish(eng)


@pytest.mark.asyncio
async def test_sibling_backups_waiting_on_one_in_flight_all_start():
    """Two continuations of one prefix (K+c, K+d) asked for while K's backup is in flight: both wait
    and both are backed up. The waiting slot used to hold one sequence per key, so d was dropped."""
    mgr = make_manager(l1_pages=32, host_pages=64, storage_pages=0)
    base = toks((1, 9))
    c, d = base + toks((100, 104)), base + toks((200, 204))
    release = hold_copies(mgr)
    write_prefix(mgr, base)
    write_prefix(mgr, c, start=len(base))
    write_prefix(mgr, d, start=len(base))
    assert len(mgr.runner.live) == 1
    release.set()
    await mgr.drain()
    assert_whole(mgr)
    assert [mgr.tree.match(s, touch=False).lengths[Tier.L2] for s in (c, d)] == [len(c), len(d)]
    await mgr.close()


@pytest.mark.asyncio
async def test_write_back_keeps_every_waiting_sibling_until_it_is_saved():
    """write_back: a leaf waiting on its prefix's backup is not evicted unsaved, siblings included."""
    mgr = make_manager(l1_pages=5, host_pages=64, storage_pages=0, write_policy="write_back")
    base = toks((1, 13))
    c, d = base + toks((100, 104)), base + toks((200, 204))
    for seq, start in ((base, 0), (c, len(base)), (d, len(base))):
        write_prefix(mgr, seq, start=start)
    release = hold_copies(mgr)
    assert mgr.runner.start_backup(base) is not None
    claim = mgr.new_claim("pressure")
    mgr.alloc_l1(2, claim)  # L1 is full: evicting c or d must wait for their backups
    lost = [seq for seq in (c, d) if max(mgr.tree.match(seq, touch=False).lengths[:2]) < len(seq)]
    release.set()
    await mgr.drain()
    mgr.release_claim(claim)
    assert_whole(mgr)
    assert not lost
    await mgr.close()
