"""A cache used after close() (a library user's), session 76: close() shuts the transfer engine's waiter threads
down, and a fragmented D2H completes on one of them (on the CPU its index copy into the L2 pages runs there). A backup
started after close() whose L2 pages are fragmented then failed counted as a `transfer` failure (the pool's "cannot
schedule new futures after shutdown") and its workspace stayed busy for good. It is refused as it is submitted,
`closed`, as a closed L3's read or write is (test_lifecycle_s74.py): no workspace taken, the tiers whole."""
from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager, write_prefix

TOKENS = tuple(range(40))  # 10 pages of 4 tokens


def _fragment_l2(mgr) -> int:
    """Hold every other L2 page (public claim API), so the next backup's L2 pages form more runs than one
    DMA plan takes (the CPU index copy at completion). Returns the claim holding them."""
    claim = mgr.new_claim("holder", Tier.L2)
    pages = mgr.alloc_pages(Tier.L2, mgr.l2.num_pages, claim)
    mgr.free_pages(Tier.L2, pages[::2], claim)
    return claim


@pytest.mark.asyncio
async def test_a_fragmented_backup_after_close_fails_closed_and_gives_its_workspace_back():
    mgr = make_manager(write_policy="write_through", storage_pages=0)
    claim = _fragment_l2(mgr)
    await mgr.close()
    with capture_logs():
        assert write_prefix(mgr, TOKENS) is not None  # (write-through: its backup starts)
        await mgr.drain()
    mgr.release_claim(claim, Tier.L2)
    assert mgr.metrics.failures == {"closed": 1}
    assert mgr.match(TOKENS).lengths[Tier.L2] == 0
    assert not [ws for ws in mgr.transfer.workspaces if ws.busy], "a workspace left busy"
    assert_whole(mgr)
