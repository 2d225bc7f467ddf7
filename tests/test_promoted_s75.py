"""A request's prefetch promotes the tail of its L3 hit to L2; its later L2 restore scores the promoted part as L3's
hit (per-tier `cached_tokens`, the cost model's outcome per source). Where L2 (and L3) lost that tail between the
prefetch and the admission, the restore ends early: it counted min(promoted, restored) tokens as L3's, and so the
head L2 had held all along as L3's too (scheduler/restoring.py; `Request.promoted_in` now counts the range the
read promoted, not its length)."""
from __future__ import annotations

import pytest

from hicache.radix import Tier
from hicache_helpers import assert_whole
from test_faults import PARAMS, PAGE, PROMPT, REUSABLE, make_engine, reference, run_one, until


def _lengths(eng) -> list[int]:
    return eng.cache.tree.match(PROMPT[:REUSABLE], touch=False).lengths


def _evict_until(eng, tier: Tier, tokens: int) -> None:
    while _lengths(eng)[tier] > tokens:
        assert eng.cache.tree.evict(tier, 1) > 0


@pytest.mark.asyncio
async def test_an_l2_restore_after_the_prefetched_tail_was_evicted_counts_only_what_the_read_brought():
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    for end in (2 * PAGE + 1, 4 * PAGE + 1):  # nodes that end at 2 and 4 pages, so that tails can leave alone
        await run_one(eng, PROMPT[:end])
    assert (await run_one(eng)).output_ids == want
    await eng.cache.drain()
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    _evict_until(eng, Tier.L2, 2 * PAGE)
    assert _lengths(eng) == [0, 2 * PAGE, REUSABLE]
    await eng.stop_loop()  # (the prefetch lands before admission sees the request)
    req = eng.add_request(PROMPT, PARAMS)
    assert req.prefetch_op is not None
    await until(lambda: req.prefetch_op.done)
    assert req.prefetch_op.succeeded and _lengths(eng) == [0, REUSABLE, REUSABLE]
    _evict_until(eng, Tier.L2, 4 * PAGE)  # the read's last two pages leave L2, and L3: L2's restore ends at 4 pages
    _evict_until(eng, Tier.L3, 4 * PAGE)
    await eng.start()
    await until(lambda: req.state.done)
    assert req.output == want
    # pages 0-1 were L2's before the read; pages 2-3 came from L3 by it (the count was l3: 16, l2: 0)
    assert req.served_hit_tokens == {"l1": 0, "l2": 2 * PAGE, "l3": 2 * PAGE}, req.served_hit_tokens
    await eng.cache.drain()
    assert_whole(eng.cache)
    await eng.shutdown()
