"""A failed L3 read drops only what it must: the pages from the first corrupt or missing one on (and
everything under them), not the valid pages before it on the same tree node."""
from __future__ import annotations

import pytest

from hicache.ops import OpState
from hicache.radix import Tier
from hicache.storage_redis import HEADER
from hicache_helpers import assert_whole, flip_l3_byte, make_manager, write_prefix
from redis_server import needs_redis, redis_server, server  # noqa: F401
from test_faults import PAGE, PROMPT, REUSABLE, finish, make_engine, only_in_l3, reference, run_one


@pytest.mark.asyncio
async def test_a_corrupt_l3_page_keeps_the_valid_pages_before_it():
    """Regression: one corrupt page at position 3 of a 6-page L3-only node dropped all 6 pages
    (and storage_missing_pages counted 6): the next request recomputed a prefix whose first 3
    pages L3 still held correctly. Now the node is split there and only pages 3.. leave L3."""
    mgr = make_manager()
    tokens = tuple(range(24))
    write_prefix(mgr, tokens)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 100)
    m = mgr.tree.match(tokens, touch=False)
    assert m.lengths == [0, 0, 24] and len(m.path) == 1  # one node
    flip_l3_byte(mgr, m.pages[Tier.L3][3])
    op = mgr.runner.start_restore(tokens, m, "l3", "r")
    await mgr.drain()
    assert op.state is OpState.FAILED and "checksum" in op.error
    assert mgr.tree.match(tokens, touch=False).lengths == [0, 0, 12]
    assert mgr.metrics.storage_missing_pages == 3
    assert mgr.tree.num_resident_pages[Tier.L3] == 3
    assert_whole(mgr)
    # the kept pages still read back (their own checksums pass)
    m = mgr.tree.match(tokens, touch=False)
    op = mgr.runner.start_restore(tokens, m, "l3", "r2")
    await mgr.drain()
    assert op.succeeded and mgr.tree.match(tokens, touch=False).lengths == [12, 12, 12]
    assert_whole(mgr)
    await mgr.close()


async def _served_then_only_in_l3(eng) -> tuple[list[int], tuple[int, ...]]:
    """Start `eng`, serve PROMPT once (checked against the no-cache output) and leave its prefix in
    L3 only: (that output, the prefix)."""
    await eng.start()
    want = await reference(PROMPT)
    tokens = tuple(PROMPT[:REUSABLE])
    assert (await run_one(eng)).output_ids == want
    await eng.cache.drain()
    only_in_l3(eng, tokens)
    return want, tokens


@pytest.mark.asyncio
async def test_after_a_corrupt_l3_page_the_prefix_before_it_is_still_an_l3_hit():
    """Through the engine: after a read of an L3-only prompt fails on its page k, the next request
    for that prompt gets an L3 hit of its first k pages (it got none), with the output of an engine
    without any cache."""
    k = 2
    eng = make_engine()
    want, tokens = await _served_then_only_in_l3(eng)
    m = eng.cache.tree.match(tokens, touch=False)
    before = eng.cache.tree.num_resident_pages[Tier.L3]  # the prompt's pages and the answer's
    flip_l3_byte(eng.cache, int(m.pages[Tier.L3][k]))
    op = eng.cache.runner.start_restore(tokens, m, "l3", None)
    await eng.cache.drain()
    assert op.state is OpState.FAILED
    assert eng.cache.tree.match(tokens, touch=False).lengths == [0, 0, k * PAGE]
    assert eng.cache.tree.num_resident_pages[Tier.L3] == k
    out = await run_one(eng)
    assert out.output_ids == want
    assert out.cached_tokens.get("l3", 0) == k * PAGE, out.cached_tokens
    m = eng.metrics()
    assert m["failures"] == {"checksum": 1}
    assert m["storage_missing_pages"] == before - k
    await finish(eng)


@needs_redis
@pytest.mark.asyncio
async def test_a_corrupt_redis_page_keeps_the_hints_before_it(server):
    """The same through Redis: a corrupt value at page k of an L3-only prompt dropped every hint of
    its node, and counted all of them in storage_missing_pages, though Redis still held the first k
    pages (the next request's hint query published them again, under new slots). Now the hints
    before page k stay; the next request gets them as an L3 hit, with no new hint published."""
    k = 3
    eng = make_engine(storage_backend="redis", storage_url=server.url(), prefetch=False)
    want, tokens = await _served_then_only_in_l3(eng)
    before = eng.cache.tree.num_resident_pages[Tier.L3]
    key = eng.cache.store.page_keys(tokens, 0, len(tokens))[k]
    client = server.client()
    at = HEADER.size + 5  # a payload byte: the value's checksum fails
    client.setrange(key, at, bytes([client.getrange(key, at, at)[0] ^ 0xFF]))
    m = eng.cache.tree.match(tokens, touch=False)
    op = eng.cache.runner.start_restore(tokens, m, "l3", None)
    await eng.cache.drain()
    assert op.state is OpState.FAILED and "checksum" in op.error
    assert eng.cache.tree.match(tokens, touch=False).lengths == [0, 0, k * PAGE]
    published = eng.status()["storage"]["hint_pages_published"]
    out = await run_one(eng)
    assert out.output_ids == want
    assert out.cached_tokens.get("l3", 0) == k * PAGE, out.cached_tokens
    metrics, storage = eng.metrics(), eng.status()["storage"]
    assert metrics["failures"] == {"checksum": 1}
    assert metrics["storage_missing_pages"] == before - k
    assert storage["hint_pages_published"] == published  # the first k pages' hints were kept
    await finish(eng)
