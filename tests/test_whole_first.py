"""A layer-ordered restore longer than its forward moves the pages that forward does not wait on
first, whole (CacheManager.whole_first_pages, TransferEngine.h2d_layerwise's whole_pages): how
many, and that the engine's output and every tier's accounting stay whole when it does."""
from __future__ import annotations

import pytest

from hicache.radix import Tier
from test_faults import PROMPT, REUSABLE, finish, make_engine, reference, run_one


def test_whole_first_pages_keeps_what_the_forward_hides_in_layers():
    eng = make_engine()
    cache, page_bytes = eng.cache, eng.cache.geometry.bytes_per_page
    assert cache.whole_first_pages(100) == 0  # no forward timed (CPU: no graphs)
    cache.overlap_forward_s = 1e-3
    assert cache.whole_first_pages(100) == 0  # no H2D timed yet: the prior may be far off
    for pages in (50, 100, 200):  # 10 pages a millisecond
        cache.cost.observe_transfer("h2d", pages * page_bytes, pages / 10 * 1e-3)
    # 1 ms of forward hides 10 pages, 12.5 with the margin: 13 in layers
    assert cache.whole_first_pages(100) == 87
    assert cache.whole_first_pages(13) == 0 and cache.whole_first_pages(0) == 0
    cache.overlap_forward_s = 2e-3
    assert cache.whole_first_pages(100) == 75  # a longer forward hides more
    cache.overlap_forward_s = 1e-9
    assert cache.whole_first_pages(100) == 99  # at least one page in layers: the forward waits on its flags
    cache.overlap_forward_s = 1e-3
    # a long tail's forward (+ the recompute prior's 50 us a token: 50 ms for 1,000) hides the whole restore
    assert cache.whole_first_pages(100, tail_tokens=1000) == 0
    assert cache.whole_first_pages(100, tail_tokens=16) == 77  # 1.8 ms: 22.5 pages in layers
    cache.observe_prefill(2000, 0.5)  # a slow first sample moves the intercept, not the tail's cost
    assert cache.cost.directions["recompute"].fixed_s > 0
    assert cache.whole_first_pages(100, tail_tokens=16) == 77


def test_whole_first_can_be_turned_off():
    eng = make_engine(whole_first=False)
    cache = eng.cache
    cache.overlap_forward_s = 1e-3
    cache.cost.observe_transfer("h2d", 100 * cache.geometry.bytes_per_page, 1e-2)
    assert cache.whole_first_pages(100) == 0


@pytest.mark.asyncio
async def test_an_overlapped_restore_with_whole_pages_first_equals_recompute():
    """Every overlapped restore moves all but its last page whole (on the CPU the forward would
    hide them all: the split is forced here); the output and every tier's accounting stay whole."""
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    calls, tails = [], []
    real = eng.cache.transfer.h2d_layerwise
    eng.cache.transfer.h2d_layerwise = lambda host, l1, whole_pages=0: (calls.append(whole_pages),
                                                                        real(host, l1, whole_pages))[1]
    eng.cache.whole_first_pages = lambda n, tail_tokens=0: (tails.append(tail_tokens), n - 1)[1]
    assert (await run_one(eng)).output_ids == want
    for _ in range(2):
        await eng.cache.drain()
        eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
        result = await run_one(eng)
        assert result.output_ids == want and result.cached_tokens["l2"] == REUSABLE
    assert calls == [REUSABLE // eng.page_size - 1] * 2
    assert tails == [len(PROMPT) - REUSABLE] * 2  # the tail the restore's forward computes
    assert eng.stats["restore_overlaps"] == 2
    await finish(eng)
