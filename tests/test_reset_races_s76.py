"""An operator's reset of the prefix cache (POST /reset_prefix_cache: scheduler/api_admin.py `reset_tiers`) issued
while the cache is mid-work (session 76's hunt of admin actions racing the cache's work). Each cell holds an op in
one state, resets, lets the op go, and checks that nothing cached before the reset survives in the tiers it named,
that its reply says so, that every tier is whole, and that the prompt is then recomputed with a no-cache output.
"""
from __future__ import annotations

import asyncio

import pytest

from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import WriteGate, assert_whole, finish, until
from scheduler.api_admin import reset_tiers
from test_faults import PROMPT, REUSABLE, live_in, make_engine, reference, run_one

# an answer that fills no page past the prompt's (its K/V: 25 + 3 - 1 tokens), so the prompt's is the only backup
ANSWER_TOKENS = 3


# -- a backup's L3 write in flight (H2S_PENDING) as L3 is reset with L1 -------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("tiers", [(Tier.L1, Tier.L2, Tier.L3), (Tier.L1, Tier.L3)], ids=["l1,l2,l3", "l1,l3"])
async def test_a_reset_of_l3_waits_for_the_l3_write_in_flight_and_drops_it(tiers):
    """A reset naming L1 and L3 (vLLM's reset_external=true) while a finished request's backup writes its prefix to
    L3 (the write held): the reset waits for that write, as it waits for one still copying to L2, and then drops it.
    Regression: the write's key had left the backups the reset waits for as the write started, so it landed in L3
    after L3's flush (the reply said l3 held 0 pages, the prefix was then served from L3), and its L2 pages, locked
    by the write, stayed through L2's flush too."""
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT, ANSWER_TOKENS)
    gate = WriteGate(eng.cache.store)
    assert (await run_one(eng, max_tokens=ANSWER_TOKENS)).output_ids == want
    await until(lambda: live_in(eng, OpState.H2S_PENDING))
    assert len(eng.cache.runner.live) == 1  # (no backup of an extension, which the reset waits for, through it)
    resetting = asyncio.create_task(reset_tiers(eng.cache, tiers))
    for _ in range(5):  # (the reset goes as far as it goes without the write: it awaits nothing else)
        await asyncio.sleep(0)
    gate.release()
    out = await asyncio.wait_for(resetting, 10)
    await eng.cache.drain()
    lengths = eng.cache.tree.match(PROMPT[:REUSABLE], touch=False).lengths
    assert lengths[Tier.L1] == lengths[Tier.L3] == 0, f"the prefix outlived the reset: {lengths}"
    if Tier.L2 in tiers:
        assert lengths[Tier.L2] == 0, f"the prefix outlived the reset of L2: {lengths}"
    assert out["pages_left"] == {t.label: 0 for t in tiers}, out
    assert out["pages_freed"]["l3"] >= REUSABLE // eng.page_size, out  # (the prompt and its output)
    assert eng.cache.status()["tiers"]["l3"]["resident_pages"] == 0
    assert_whole(eng.cache)
    eng.check_integrity()
    if Tier.L2 in tiers:  # (else L2 serves it, rightly)
        again = await run_one(eng, max_tokens=ANSWER_TOKENS)
        assert again.output_ids == want and sum(again.cached_tokens.values()) == 0, again.cached_tokens
        await eng.cache.drain()
        assert_whole(eng.cache)
    await finish(eng)
