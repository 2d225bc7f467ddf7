"""Bug hunt on eviction and the write policies across the three tiers (session 29): LRU order per
tier and across tiers, locked and in-flight pages, write_through / write_through_selective /
write_back at the tiers' edges (failed backups, tiny or full tiers, page sizes 1 to 8), and the
accounting afterwards (every tier whole, evictions counted as they happened, outputs equal a
no-cache engine's)."""
from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hicache.faults import Fault, FaultInjector
from hicache.radix import TIERS, Tier
from hicache_helpers import assert_whole, make_manager, toks, write_prefix
from scheduler.request import SamplingParams
from test_prefix_edges_hunt import VOCAB, make_engine, reference


def lengths(mgr, *prefixes) -> list[list[int]]:
    """Per prefix, its resident length per tier (no touch)."""
    return [mgr.tree.match(p, touch=False).lengths for p in prefixes]


async def write_evicting(mgr, tokens, attempts: int = 4) -> list[int]:
    """write_prefix, retried after a drain while write_back evictions wait for their backups."""
    for _ in range(attempts):
        pages = write_prefix(mgr, tokens)
        await mgr.drain()
        if pages is not None:
            return pages
    raise AssertionError(f"no L1 room for {len(tokens)} tokens after {attempts} attempts")


# -- write_back: a failed backup marks its leaf only until the leaf is used again ------------------
@pytest.mark.asyncio
async def test_write_back_backs_up_a_leaf_used_again_since_its_backup_failed():
    """Regression: under write_back a leaf whose backup failed is evicted unsaved on the next ask
    (so a request waiting for pages is not held by copies that keep failing); but the mark stayed
    until that ask came, however much later. A prefix whose backup failed once, then was used again
    (a hit: another leaf went instead) and became LRU much later, was dropped from every tier
    without a backup being tried, though copies worked again."""
    faults = FaultInjector()
    mgr = make_manager(l1_pages=4, host_pages=8, storage_pages=0, write_policy="write_back", faults=faults)
    a, b, c, d = toks((0, 8)), toks((100, 108)), toks((200, 208)), toks((300, 308))
    write_prefix(mgr, a)
    write_prefix(mgr, b)  # L1 full: a (LRU), b
    mgr.match(b)
    faults.arm(Fault.TRANSFER_RAISE, times=1)
    assert write_prefix(mgr, c) is None  # a's backup starts (the eviction waits for it) and fails
    await mgr.drain()
    assert mgr.metrics.failures == {"transfer": 1}
    mgr.match(a)  # a hit: a is the most recent now, b (backed up) makes room for c
    await write_evicting(mgr, c)
    assert lengths(mgr, a, b, c) == [[8, 0, 0], [0, 8, 0], [8, 0, 0]]
    mgr.match(c)  # later a is the LRU leaf: its backup is tried again before it goes
    await write_evicting(mgr, d)
    assert lengths(mgr, a, d) == [[0, 8, 0], [8, 0, 0]], "a went unsaved: its old failure was held against it"
    assert mgr.metrics.evictions_pages["l1"] == 4 and mgr.metrics.backups_done == 2
    assert_whole(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize("page_size,retries", [(1, 0), (4, 0), (4, 2)])
async def test_write_back_backs_up_only_the_lru_leaves_an_eviction_needs(page_size, retries):
    """Regression: a write_back eviction vetoes an unsaved leaf and starts its backup, but the
    vetoed pages did not count towards what the eviction was asked to free, so it went on vetoing
    every unsaved leaf of L1: one page wanted, the whole of L1 copied to L2 (the write policy became
    write-through at every eviction, hot prefixes included). Likewise each retry of the allocation
    while that backup ran (the engine retries every tick) started the next leaf's."""
    mgr = make_manager(l1_pages=8 * 4 // page_size, host_pages=64, storage_pages=0, page_size=page_size,
                       write_policy="write_back")
    prefixes = [toks((i * 100, i * 100 + 8)) for i in range(4)]  # 8 tokens each: L1 full
    for p in prefixes:
        write_prefix(mgr, p)
    for _ in range(1 + retries):  # one page: the LRU leaf's backup (the retries come while it runs)
        assert write_prefix(mgr, toks((900, 900 + page_size))) is None
    await mgr.drain()
    assert lengths(mgr, *prefixes) == [[8, 8, 0]] + [[8, 0, 0]] * 3, "hot leaves were copied too"
    await write_evicting(mgr, toks((900, 900 + page_size)))
    assert lengths(mgr, *prefixes) == [[0, 8, 0]] + [[8, 0, 0]] * 3
    assert mgr.metrics.backups_started == 1 and mgr.metrics.evictions_pages["l1"] == 8 // page_size
    assert_whole(mgr)


# -- LRU across tiers: a backup is not a use ---------------------------------------------------------
@pytest.mark.asyncio
async def test_a_write_back_backup_keeps_its_prefixs_last_use_in_l2():
    """Regression: a backup published its pages in L2 stamped "now", as if the prefix had just been
    used. Under write_back a prefix is backed up as it leaves L1, i.e. when it is the coldest, so
    it became the most recent of L2 and L2 evicted a prefix used after it instead."""
    mgr = make_manager(l1_pages=4, host_pages=4, storage_pages=0, write_policy="write_back")
    a, b, c, d, e = (toks((i * 100, i * 100 + 8)) for i in range(5))
    write_prefix(mgr, b)
    mgr.runner.start_backup(b)  # b in L1 and L2 (as after a restore)
    await mgr.drain()
    write_prefix(mgr, a)
    mgr.match(a)
    mgr.match(b)  # used after a: a is the coldest prefix
    await write_evicting(mgr, c)  # a is backed up as it leaves L1
    mgr.match(c)
    await write_evicting(mgr, d)  # b leaves L1 (saved already)
    mgr.match(d)
    await write_evicting(mgr, e)  # c is backed up: L2 (a, b) drops its least recently used
    assert lengths(mgr, a, b) == [[0, 0, 0], [0, 8, 0]], "L2 kept the colder prefix"
    assert mgr.metrics.evictions_pages == {"l1": 6, "l2": 2, "l3": 0}
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_an_l3_write_keeps_its_prefixs_last_use_in_l3():
    """The same for L3: pages written from L2 take the prefix's last use, not the time of the write
    (regression: a prefix written to L3 late, when L2 evicted it, outlived hotter ones there)."""
    mgr = make_manager(l1_pages=4, host_pages=4, storage_pages=4, write_policy="write_back")
    a, b, c, d, e = (toks((i * 100, i * 100 + 8)) for i in range(5))
    write_prefix(mgr, b)
    mgr.runner.start_backup(b)  # b in every tier
    await mgr.drain()
    write_prefix(mgr, a)
    mgr.match(a)
    mgr.match(b)
    await write_evicting(mgr, c)  # a: backed up to L2 and L3 as it leaves L1
    mgr.match(c)
    await write_evicting(mgr, d)
    mgr.match(d)
    await write_evicting(mgr, e)  # c is written to L3: L3 (a, b) drops its least recently used
    assert [m[Tier.L3] for m in lengths(mgr, a, b, c)] == [0, 8, 8], "L3 kept the colder prefix"
    assert_whole(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize("tier", [Tier.L2, Tier.L3])
async def test_an_l1_hit_refreshes_the_prefix_in_the_lower_tiers(tier):
    """Guard: a hit walks the prefix once and refreshes it in every tier that holds it, so a prefix
    served from L1 is not the first to leave L2 or L3 (each tier holds two of the three prefixes)."""
    mgr = make_manager(l1_pages=16, host_pages=4 if tier is Tier.L2 else 32,
                       storage_pages=4 if tier is Tier.L3 else 64)
    a, b, c = (toks((i * 100, i * 100 + 8)) for i in range(3))
    for p in (a, b):
        write_prefix(mgr, p)
        await mgr.drain()
    mgr.match(a)  # an L1 hit, after b was written
    write_prefix(mgr, c)  # its backup makes room in `tier`: b goes, not a
    await mgr.drain()
    assert [m[tier] for m in lengths(mgr, a, b, c)] == [8, 0, 8]
    assert mgr.metrics.evictions_pages[tier.label] == 2
    assert_whole(mgr)


# -- property: mixed policies through tiny tiers, with aborts and flushes ----------------------------
async def _tiny_tier_workload(seed: int, page_size: int, l1_pages: int, host_pages: int, storage_pages: int,
                              write_policy: str, prefetch: bool) -> None:
    rng = random.Random(seed)
    page_bytes = 2 * 2 * page_size * 2 * 16 * 4  # tiny preset, float32
    eng = make_engine(page_size=page_size, num_pages=l1_pages, storage=bool(storage_pages),
                      write_policy=write_policy, prefetch=prefetch, host_size_gb=host_pages * page_bytes / (1 << 30),
                      storage_size_gb=storage_pages * page_bytes / (1 << 30) if storage_pages else None)
    cache = eng.cache
    left_tree = {t: 0 for t in TIERS}  # pages that left the tree, by eviction or by drop
    dropped = {t: 0 for t in TIERS}
    for t, alloc in cache.tree.allocators.items():
        def counted(pages, _free=alloc.free_from_tree, _t=t):
            left_tree[_t] += len(pages)
            _free(pages)
        alloc.free_from_tree = counted
    on_drop = cache.tree.on_drop

    def counted_drop(t, pages):
        dropped[t] += len(pages)
        on_drop(t, pages)
    cache.tree.on_drop = counted_drop
    await eng.start()
    limit = (l1_pages - 1) * page_size
    families = [[rng.randrange(VOCAB) for _ in range(rng.randrange(page_size, limit // 2))] for _ in range(3)]
    done = []

    async def one(prompt: list[int], max_tokens: int, abort_after: int | None) -> None:
        req = eng.add_request(prompt, SamplingParams(max_tokens=max_tokens))
        if abort_after is not None:  # loop turns before the client goes away
            for _ in range(abort_after):
                await asyncio.sleep(0)
            await eng.abort(req.rid)
        while not req.state.done:
            if (await req.queue.get()).finished:
                break
        done.append((prompt, req.result()))

    for _ in range(5):  # bursts of a family's prefixes (+ a new tail), then maybe an operator's flush
        burst = []
        for _ in range(rng.randrange(1, 5)):
            family = rng.choice(families)
            prompt = family[:rng.randrange(1, len(family) + 1)] + [rng.randrange(VOCAB) for _ in
                                                                    range(rng.randrange(0, 2 * page_size))]
            burst.append(one(prompt[:limit - 8], rng.randrange(1, 5), rng.choice([None, None, None, 0, 2, 6])))
        await asyncio.gather(*burst)
        if rng.random() < 0.4:
            await cache.drain()
            cache.flush(rng.choice(list(cache.tree.allocators)))
    await eng.stop_loop()
    await cache.drain()
    assert_whole(cache)
    metrics = eng.metrics()
    for t in cache.tree.allocators:
        status = cache.tier_status(t)
        assert status["free_pages"] + status["resident_pages"] + status["private_pages"] == status["capacity_pages"]
        assert metrics["evictions_pages"][t.label] == left_tree[t] - dropped[t], (t, metrics["evictions_pages"])
    want = await reference([p for p, _ in done], 4, page_size)
    for (prompt, r), expected in zip(done, want):
        assert r.output_ids == expected[: len(r.output_ids)], (len(prompt), r.cached_tokens)
        assert r.finish_reason in ("length", "abort"), (r.finish_reason, r.error)
    await eng.shutdown()


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2 ** 16), page_size=st.sampled_from([1, 4, 8]), l1_tokens=st.sampled_from([48, 96]),
       host_pages=st.sampled_from([2, 4, 16]), storage_pages=st.sampled_from([0, 3, 16]),
       write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
       prefetch=st.booleans())
def test_tiny_tiers_under_every_write_policy_equal_recompute_and_count_every_eviction(
        seed, page_size, l1_tokens, host_pages, storage_pages, write_policy, prefetch):
    """Families of prompts (prefixes of one another, new tails), some aborted after a few loop turns,
    with operator flushes, through tiny tiers under every write policy: outputs equal a no-cache
    engine's, every tier is whole (free + resident + private = capacity, nothing locked) and the
    evictions counted per tier are the pages that left the tree other than by a drop."""
    asyncio.run(_tiny_tier_workload(seed, page_size, max(8, l1_tokens // page_size), host_pages, storage_pages,
                                    write_policy, prefetch))
