"""Session 75's asyncio hygiene hunt: asynchronous work the code hands off, seen from the loop that ends under it.

Pinned here:
- an asyncio.run() that ends (without stop_loop()) while a failed op's pages wait for its abandoned L3 read to settle
  (a read past its deadline: the op FAILED, its private L2 pages held until the read lands, `_settle_then_release`):
  asyncio.run cancels every task left, the settling task too, which took its own cancellation for the read's outcome
  and freed the pages at once, while the read still ran into them (a later backup could take them and have its
  copy overwritten by the late read). The settling now waits for the read whatever cancels it (asyncio.run waits for
  it, as for the engine's loop task's drain), then frees the pages, then lets the cancellation go on;
- a Ctrl-C's KeyboardInterrupt (or a SystemExit) raised in an op's driver goes out of generate() as it should
  (tests/test_raise_cancel_s70.py), but the driver's task kept it unread: asyncio logged "Task exception was never
  retrieved" with the interrupt's traceback, an error, as the task was collected. Its end is now read."""
from __future__ import annotations

import asyncio
import gc
import logging
import threading

import pytest

from hicache.faults import FaultInjector
from hicache.ops import OpKind
from hicache.radix import Tier
from hicache_helpers import ReadGate, assert_whole
from scheduler.request import SamplingParams
from test_faults import OTHER, PROMPT, REUSABLE, make_engine, only_in_l3, reference, run_one
from test_lifecycle_hunt import assert_nothing_queued


def serves_on_whole(eng, want_other: list[int]) -> None:
    """After the settling: the engine serves OTHER (each generate() on a loop of its own) with `want_other`, nothing
    left queued, settling or running, the tiers whole; then it shuts down with no private L2 page."""
    for _ in range(2):
        [result] = eng.generate([OTHER], SamplingParams(max_tokens=4))
        assert result.error is None and result.output_ids == want_other
    assert_nothing_queued(eng)
    assert not eng.cache.runner._settling and not eng.cache.runner._tasks
    assert_whole(eng.cache)
    asyncio.run(eng.shutdown())
    assert eng.cache.allocator(Tier.L2).num_private() == 0


def test_an_asyncio_run_ending_while_a_timed_out_read_settles_frees_its_pages_only_once_it_landed(monkeypatch):
    """A blocking L3 restore whose read is held (ReadGate) fails at its deadline; the request recomputes and the
    run ends while the read is still held. The read is let go a moment later from another thread: its L2 pages must
    not be freed before it settled. The engine then serves on, every tier whole."""
    eng = make_engine(FaultInjector(), prefetch=False, io_timeout_s=0.05, num_pages=256)
    tokens = PROMPT[:REUSABLE]
    want = asyncio.run(reference(PROMPT))

    async def setup() -> None:
        assert (await run_one(eng)).output_ids == want
        await eng.cache.drain()
        only_in_l3(eng, tokens)
        await eng.stop_loop()
    asyncio.run(setup())

    events: list[str] = []
    gate = ReadGate(eng.cache.store)
    gated_read = eng.cache.store.read_pages

    def watched_read(*args, **kwargs):
        future = gated_read(*args, **kwargs)
        future.set_running_or_notify_cancel()  # (as the store's own: I/O under way cannot be recalled)
        future.add_done_callback(lambda _: events.append("read settled"))
        return future
    monkeypatch.setattr(eng.cache.store, "read_pages", watched_read)
    runner, held_claims = eng.cache.runner, set()
    settle_then_release = runner._settle_then_release

    def recording_settle(op, future, *more):  # (keep_locks: a timed-out write's)
        if op.kind is OpKind.RESTORE_L3:  # (the timed-out read's op)
            held_claims.update((tier, claim) for tier, claim in op.payload["claims"].items())
        settle_then_release(op, future, *more)
    monkeypatch.setattr(runner, "_settle_then_release", recording_settle)
    release_claim = eng.cache.release_claim

    def watched_release(claim, tier=Tier.L1):
        if (tier, claim) in held_claims:
            events.append(f"{tier.name} pages freed")
        return release_claim(claim, tier)
    monkeypatch.setattr(eng.cache, "release_claim", watched_release)

    async def main() -> None:
        result = await run_one(eng)
        assert result.output_ids == want and result.error is None
        assert eng.metrics()["failures"] == {"timeout": 1}
        assert runner._settling and "read settled" not in events  # (the read is held: its pages wait for it)
        threading.Timer(0.2, gate.release).start()  # (the read lands once the run ended; asyncio.run waits for it)
    asyncio.run(main())

    assert "L2 pages freed" in events and "read settled" in events
    assert events.index("read settled") < events.index("L2 pages freed"), events
    monkeypatch.undo()
    want_other = asyncio.run(reference(OTHER))
    serves_on_whole(eng, want_other)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_out_of_an_op_driver_leaves_no_task_exception_never_retrieved(monkeypatch, caplog, interrupt):
    """A Ctrl-C's KeyboardInterrupt (or a SystemExit) lands in a backup's driver as it starts the L3 write: it goes
    out of generate() (tests/test_raise_cancel_s70.py), and the driver's task, which holds it, must not be logged
    later as an error, "Task exception was never retrieved" with the interrupt's traceback, as it is collected
    (the engine's loop task's end is read for that reason: `Engine.start`)."""
    eng = make_engine(num_pages=256)
    write_pages, interrupted = eng.cache.store.write_pages, []

    def interrupted_write(*args, **kwargs):
        if not interrupted:
            interrupted.append(True)
            raise interrupt
        return write_pages(*args, **kwargs)
    monkeypatch.setattr(eng.cache.store, "write_pages", interrupted_write)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(interrupt):
            eng.generate([PROMPT, [4, 5, 6, 7]], SamplingParams(max_tokens=200, ignore_eos=True))
        monkeypatch.undo()
        gc.collect()  # (the driver's task, done, is collected: unretrieved, asyncio logs it here)
    assert interrupted
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text
    asyncio.run(eng.shutdown())
