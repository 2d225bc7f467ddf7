"""The status says whether backups to a tier pay off (session 72): `write_reuse` holds each tier's reuse gate
(hicache/reuse.py), so an operator can see why the cost policy stopped writing most backups to L2 or L3 (their
pages were evicted unread) rather than only that the writes stopped. Before, the gate's state was in no status."""
from __future__ import annotations

import asyncio

from hicache.radix import Tier
from test_leftovers2_hunt import engine_counting_l3_writes, l3_writes_over_new_prompts


def test_the_status_says_which_tier_writes_are_throttled_for_no_reuse():
    eng, writes = engine_counting_l3_writes(host_ratio=8.0, storage_ratio=16 / 512)
    before = eng.status()["write_reuse"]
    assert before == {tier: {"evicted_pages": 0.0, "read_pages": 0.0, "productive": True} for tier in ("l2", "l3")}
    try:
        asyncio.run(l3_writes_over_new_prompts(eng, writes, prompts=1, seed=0, unproductive=[Tier.L3]))
        reuse = eng.status()["write_reuse"]
        gate = eng.cache.reuse[Tier.L3]
        assert reuse["l3"] == {"evicted_pages": gate.evicted_pages, "read_pages": 0.0, "productive": False}
        assert reuse["l3"]["evicted_pages"] >= gate.min_evicted_pages
        gate.on_read(int(gate.evicted_pages))  # (its pages read back: it pays off again)
        assert eng.status()["write_reuse"]["l3"]["productive"] is True
        eng.check_integrity()
    finally:
        asyncio.run(eng.shutdown())
