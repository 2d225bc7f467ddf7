"""Session 76: the L1 <-> L2 twin of session 75's settling fix (tests/test_asyncio_s75.py, an abandoned L3 read).

An op's driver awaits its copy through a task over `TransferEngine.wait`; cancelled (an asyncio.run() that ends cancels
every task left), its pages wait for the copy to settle before they are freed (`OpRunner._settle_then_release`). The
settling was handed that task, which asyncio.run() cancels too: a cancelled wait was taken for the copy's end, and the
pages were freed while the copy still ran into them (on a GPU, a DMA; on the CPU, a backup into fragmented L2 pages,
whose last step, an index copy into those pages, runs on a waiter thread: `Transfer.finish`). A later backup could
take the pages and have its KV overwritten by the late copy. The settling now also waits for the copy's completion
itself (`TransferEngine.completion`), a future no asyncio.run() cancels."""
from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import ThreadPoolExecutor

from hicache.faults import FaultInjector
from hicache.ops import OpKind
from hicache.radix import Tier
from test_asyncio_s75 import serves_on_whole
from test_faults import OTHER, PAGE, VOCAB, make_engine, reference, run_one
from test_hierarchy import fragment

LONG = [random.Random(76).randrange(VOCAB) for _ in range(12 * PAGE + 1)]  # 12 pages: more runs than DMAs take


class HeldCopies(ThreadPoolExecutor):
    """A transfer's waiter pool whose completions (`Transfer.complete`, its `finish` included) wait for `gate`;
    `events` gets "copy settled" as each one ends."""

    def __init__(self, events: list[str]) -> None:
        super().__init__(max_workers=2, thread_name_prefix="held-d2h-wait")
        self.gate, self.entered, self.events = threading.Event(), threading.Event(), events

    def submit(self, fn, /, *args, **kwargs):
        def held():
            self.entered.set()
            self.gate.wait(30)
            try:
                return fn(*args, **kwargs)
            finally:
                self.events.append("copy settled")
        return super().submit(held)


def test_an_asyncio_run_ending_while_a_backup_copies_into_fragmented_l2_frees_its_pages_only_once_it_settled(
        monkeypatch):
    """L2 is fragmented (every other page held), so a backup's D2H ends with an index copy into its L2 pages on a
    waiter thread, which is held here; the run ends while it is held, and the copy is let go a moment later from
    another thread: the backup's L2 pages must not be freed before it settled. The engine then serves on, whole."""
    eng = make_engine(FaultInjector(), num_pages=256)
    want = asyncio.run(reference(LONG))
    want_other = asyncio.run(reference(OTHER))
    l2 = eng.cache.allocator(Tier.L2)
    fragmenter = fragment(l2)

    events: list[str] = []
    transfer = eng.cache.transfer
    real_pool, held = transfer._waiters["d2h"], HeldCopies(events)
    monkeypatch.setitem(transfer._waiters, "d2h", held)
    runner, held_claims = eng.cache.runner, set()
    settle_then_release = runner._settle_then_release

    def recording_settle(op, future, *more):  # (keep_locks: a timed-out write's)
        if op.kind is OpKind.BACKUP:
            held_claims.update((tier, claim) for tier, claim in op.payload["claims"].items() if tier is Tier.L2)
        settle_then_release(op, future, *more)
    monkeypatch.setattr(runner, "_settle_then_release", recording_settle)
    release_claim = eng.cache.release_claim

    def watched_release(claim, tier=Tier.L1):
        if (tier, claim) in held_claims:
            events.append("L2 pages freed")
        return release_claim(claim, tier)
    monkeypatch.setattr(eng.cache, "release_claim", watched_release)

    async def main() -> None:
        result = await run_one(eng, LONG)
        assert result.output_ids == want and result.error is None
        while not held.entered.is_set():  # (the backup's copy is under way, held)
            await asyncio.sleep(0.005)
        assert "copy settled" not in events
        threading.Timer(0.2, held.gate.set).start()  # (the copy ends once the run ended; asyncio.run waits for it)
    asyncio.run(main())
    held.shutdown(wait=True)  # (the copy has ended: where the pages went first, it ran into them after)

    assert "L2 pages freed" in events and "copy settled" in events, events
    assert events.index("copy settled") < events.index("L2 pages freed"), events
    monkeypatch.undo()
    assert transfer._waiters["d2h"] is real_pool
    eng.cache.release_claim(fragmenter, Tier.L2)
    serves_on_whole(eng, want_other)
