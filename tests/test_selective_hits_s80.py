"""Bug hunt (session 80) of --hicache-write-policy write_through_selective against SGLang HiCache's meaning: a
prefix is backed up to L2 once it was hit twice, counted per node of the tree (SGLang's `_inc_hit_count` backs up
every node whose own count reaches the threshold), not only where a request's match ends."""
from __future__ import annotations

import random

import pytest

from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager, toks, write_prefix
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams


def l2_tokens(mgr, tokens) -> int:
    return mgr.tree.match(tokens, touch=False).lengths[Tier.L2]


@pytest.mark.asyncio
async def test_a_conversations_history_hit_on_every_turn_is_backed_up():
    """Regression: only the count of the deepest node a match reached was asked. A conversation's next turn
    matches its history through a node its last turn published (hit once), so the history, hit on every turn,
    never reached L2: after four turns under write_through_selective nothing had been backed up, and once L1
    evicted the conversation, every turn recomputed it."""
    cfg = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64)
    eng = Engine(cfg.with_hicache(enable=True, policy="always", host_ratio=4.0, storage_ratio=0.0,
                                  transfer_backend="torch", write_policy="write_through_selective"))
    rng = random.Random(1)
    first_turn = [rng.randrange(500) for _ in range(16)]
    prompt = first_turn
    try:
        for _ in range(3):
            [res] = await eng.generate_async([prompt], SamplingParams(max_tokens=8))
            await eng.cache.drain()
            prompt = prompt + res.output_ids + [rng.randrange(500) for _ in range(8)]
        # the third turn hit the first turn's prompt for the second time
        assert l2_tokens(eng.cache, first_turn) == len(first_turn), "a prefix hit twice was not backed up"
        assert eng.metrics()["backups_started"] >= 1
        assert_whole(eng.cache)
    finally:
        await eng.shutdown()


@pytest.mark.asyncio
async def test_a_shared_prefix_hit_through_two_prompts_is_backed_up_alone():
    """A shared page hit through two prompts (its second hit; each prompt's own page hit once) is backed up
    alone on the second; each prompt's page follows on its own second hit."""
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=0, write_policy="write_through_selective")
    x, y = toks((0, 4), (10, 14)), toks((0, 4), (20, 24))
    write_prefix(mgr, x)
    write_prefix(mgr, y, 4)
    mgr.note_hit(x, mgr.match(x))
    await mgr.drain()
    assert mgr.metrics.backups_started == 0, "backed up on a first hit"
    mgr.note_hit(y, mgr.match(y))
    await mgr.drain()
    assert [l2_tokens(mgr, p) for p in (x, y)] == [4, 4] and mgr.metrics.backups_started == 1
    mgr.note_hit(x, mgr.match(x))
    await mgr.drain()
    assert [l2_tokens(mgr, p) for p in (x, y)] == [8, 4] and mgr.metrics.backups_started == 2
    assert_whole(mgr)
