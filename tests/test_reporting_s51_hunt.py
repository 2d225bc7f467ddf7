"""Regressions from session 51's hunt of what the engine reports against what happened."""
from __future__ import annotations

import pytest

from hicache.radix import Tier
from hicache_helpers import assert_whole, capture_op_logs, make_manager, toks, write_prefix


@pytest.mark.asyncio
async def test_a_backup_s_l3_write_logs_its_own_size_not_its_d2h_s():
    """A prefix whose start L3 holds but L2 lost: its backup copies the whole of it to L2 (6 pages) and writes only
    what L3 lacks (2 pages). The op's H2S events carried the D2H's size, so the log and the timeline claimed L3 writes
    of 6 pages that never happened (the h2s bytes in the metrics said 2)."""
    mgr = make_manager(write_policy="write_through")
    a = toks((0, 16))  # 4 pages of 4 tokens
    write_prefix(mgr, a)
    await mgr.drain()
    assert mgr.tree.match(a, touch=False).lengths[Tier.L3] == len(a)
    mgr.flush(Tier.L2)
    h2s_before = mgr.metrics.directions["h2s"].num_bytes
    ab = a + toks((100, 108))
    with capture_op_logs() as logs:
        write_prefix(mgr, ab, start=len(a))
        await mgr.drain()
    events = [e for e in logs if e.get("event") == "op" and e["kind"] == "backup"]
    d2h = [e for e in events if e["to_state"] == "D2H_PENDING" or e["from_state"] == "D2H_PENDING"]
    h2s = [e for e in events if e["to_state"] == "H2S_PENDING" or e["from_state"] == "H2S_PENDING"]
    assert len(d2h) == 2 and all(e["pages"] == 6 for e in d2h), d2h
    assert len(h2s) == 2 and all(e["pages"] == 2 and e["bytes"] == 2 * mgr.geometry.bytes_per_page for e in h2s), h2s
    assert mgr.metrics.directions["h2s"].num_bytes - h2s_before == 2 * mgr.geometry.bytes_per_page
    assert_whole(mgr)
    await mgr.close()
