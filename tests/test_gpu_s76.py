"""GPU-only (skipped without CUDA): session 76's transfer fixes on the device path, where every L1 <-> L2 copy's
completion runs on a waiter thread (its CUDA event synchronized there). A backup started after `close()` is refused
`closed` as it is submitted (the waiters are shut down: it counted a `transfer` failure and kept the workspace for
good). An `asyncio.run()` that ends while a backup's copy is in flight frees the backup's L2 pages only once the copy
settled (its completion future, not a task over `wait` that the run's end cancels). Session 76's device run
(the refusal then at the copy's wait) hung in the first test, so each has a 60 s bound (pytest-timeout: a hang fails
with its stacks). Session 77's: the second took the CUDA graphs' scratch page for a leak (now `held_l1_pages`), and in
the suite twice hung at its run's end (the drain turning over something done; unexplained), then passed three times;
its held copies are let go on a failure too, or the run's end waits 30 s per copy. The CPU twins:
`test_closed_transfer_s76.py`, `test_settle_copy_s76.py`."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from structlog.testing import capture_logs

from hicache.config import HiCacheConfig
from hicache.geometry import KVGeometry
from hicache.manager import CacheManager
from hicache.ops import OpKind
from hicache.radix import Tier
from hicache_helpers import assert_whole, write_prefix
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from test_faults import MAX_TOKENS, OTHER, PAGE
from test_hierarchy import fragment
from test_settle_copy_s76 import LONG, HeldCopies

pytestmark = pytest.mark.gpu

TOKENS = tuple(range(48))  # 12 pages of 4 tokens


def _manager(device: str = "cuda") -> CacheManager:
    """A write-through manager with 16 L1 and 32 L2 pages, no L3."""
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4, dtype=torch.bfloat16)
    cfg = HiCacheConfig(enable=True, host_size_gb=32 * geometry.bytes_per_page / (1 << 30), storage_ratio=0.0,
                        policy="always", write_policy="write_through")
    mgr = CacheManager(geometry, 16, device, cfg)
    assert mgr.l2.num_pages == 32
    return mgr


@pytest.mark.timeout(60)
def test_a_backup_after_close_fails_closed_and_gives_its_workspace_back(device: str = "cuda"):
    async def main() -> CacheManager:
        mgr = _manager(device)
        claim = fragment(mgr.allocator(Tier.L2))  # (the CPU's D2H needs a waiter only into fragmented pages)
        await mgr.close()
        with capture_logs():
            assert write_prefix(mgr, TOKENS) is not None  # (write-through: its backup starts)
            await mgr.drain()
        mgr.allocator(Tier.L2).free(mgr.allocator(Tier.L2).pages_of(claim), claim)
        return mgr
    mgr = asyncio.run(main())
    assert mgr.metrics.failures == {"closed": 1}
    assert mgr.match(TOKENS).lengths[Tier.L2] == 0
    assert not [ws for ws in mgr.transfer.workspaces if ws.busy], "a workspace left busy"
    assert_whole(mgr)


@pytest.mark.timeout(60)
def test_an_asyncio_run_ending_under_a_backups_copy_frees_its_l2_pages_once_it_settled(monkeypatch,
                                                                                       device: str = "cuda"):
    """test_settle_copy_s76's case on the device: the run ends while the backup's D2H completion is held on its waiter
    thread; the backup's L2 pages are freed only after it settled, and the engine then serves on, whole."""
    plain = Engine(EngineConfig(model="tiny", device=device, num_pages=256, page_size=PAGE,
                                enable_prefix_cache=False))
    [want] = plain.generate([LONG], SamplingParams(max_tokens=MAX_TOKENS))
    [want_other] = plain.generate([OTHER], SamplingParams(max_tokens=4))
    asyncio.run(plain.shutdown())
    eng = Engine(EngineConfig(model="tiny", device=device, num_pages=256, page_size=PAGE).with_hicache(
        enable=True, policy="always"))
    fragmenter = fragment(eng.cache.allocator(Tier.L2))
    events: list[str] = []
    transfer, held = eng.cache.transfer, HeldCopies(events)
    monkeypatch.setitem(transfer._waiters, "d2h", held)
    runner, held_claims = eng.cache.runner, set()
    settle_then_release = runner._settle_then_release

    def recording_settle(op, future, *more):  # (keep_locks: a timed-out write's)
        if op.kind is OpKind.BACKUP:
            held_claims.update(c for tier, c in op.payload["claims"].items() if tier is Tier.L2)
        settle_then_release(op, future, *more)
    monkeypatch.setattr(runner, "_settle_then_release", recording_settle)
    release_claim = eng.cache.release_claim

    def watched_release(c, tier=Tier.L1):
        if tier is Tier.L2 and c in held_claims:
            events.append("L2 pages freed")
        return release_claim(c, tier)
    monkeypatch.setattr(eng.cache, "release_claim", watched_release)

    async def main() -> None:
        try:
            [result] = await eng.generate_async([LONG], SamplingParams(max_tokens=MAX_TOKENS))
            assert result.error is None and result.output_ids == want.output_ids, (result.error, want.output_ids)
            while not held.entered.is_set():  # (the backup's copy is under way, its completion held)
                await asyncio.sleep(0.005)
            assert "copy settled" not in events
        finally:  # (released once the run has ended; on a failure too, or the run's end waits 30 s per held copy)
            threading.Timer(0.2, held.gate.set).start()
    asyncio.run(main())
    held.shutdown(wait=True)
    assert "L2 pages freed" in events and "copy settled" in events, events
    assert events.index("copy settled") < events.index("L2 pages freed"), events
    monkeypatch.undo()
    eng.cache.allocator(Tier.L2).free(eng.cache.allocator(Tier.L2).pages_of(fragmenter), fragmenter)
    for _ in range(2):
        [result] = eng.generate([OTHER], SamplingParams(max_tokens=4))
        assert result.error is None and result.output_ids == want_other.output_ids
    assert not runner._settling and not runner._tasks
    assert_whole(eng.cache, held_l1_pages=eng.held_l1_pages)  # (the CUDA graphs' scratch page is the engine's)
    asyncio.run(eng.shutdown())
