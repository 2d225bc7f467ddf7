"""Session 70's cancellation hunt over the in-process API's callers: an event loop that ends under the engine (a
synchronous `Engine.generate()` ended by a Ctrl-C, each call being a loop of its own; an asyncio.run() that ends)
must leave the engine able to serve on the next one.
Pinned here:
- a cancellation (asyncio.run's at Ctrl-C) delivered while generate()'s stop_loop drained a backup whose L3 write
  was in flight: the write's settling task was left on the loop, destroyed as the loop closed, and kept in the op
  runner for good: the pages it held never came back, and every later generate() raised ValueError ("The future belongs
  to a different loop") from its drain after running its batch. Now the stop goes on with a cancelling drain
  (the backups not yet written dropped, the copies in flight settled) before the cancellation goes on;
- a KeyboardInterrupt raised in the engine's loop task (a second Ctrl-C lands in whatever code runs) mid-batch:
  stop_loop took only an Exception for a crash and skipped its drain, so the settling of the aborted requests'
  copies was destroyed with the loop, and every later generate() raised the same ValueError. Now the drain runs
  for any crash, then the error is raised;
- an asyncio.run() that streamed a request and ended without stop_loop() (it cancels the engine's loop task) while
  the request's backup was written to L3: the write's settling was destroyed with the loop the same way, and the
  later shutdown() raised that ValueError before it closed the L3 file. Now the cancelled loop task drains (the
  backups not yet written dropped, the copies in flight settled) before it ends, as asyncio.run waits for it;
- a KeyboardInterrupt raised in an op's driver (on the CPU a copy or an L3 write starts on the loop's thread):
  `OpRunner._guard` took only an Exception, and the op was unlisted without ending, its locks and pages held for
  good (check_integrity failed). Now it ends cancelled and its pages are freed, then the interrupt goes on.
Each test checks that the interrupted call raises what interrupted it, that two later generate() calls give the
output of an engine without cache (tests/test_faults.py's reference), and that every tier is whole with nothing
queued or settling."""
from __future__ import annotations

import asyncio

import pytest

from hicache.ops import OpState
from hicache_helpers import WriteGate, assert_whole
from scheduler.request import SamplingParams
from test_faults import OTHER, PROMPT, make_engine, reference
from test_lifecycle_hunt import assert_nothing_queued

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


def serves_on(eng) -> None:
    """Two later generate() calls (each on a loop of its own) give a no-cache engine's tokens; nothing leaks."""
    want = asyncio.run(reference(OTHER))
    for _ in range(2):
        [result] = eng.generate([OTHER], SamplingParams(max_tokens=4))
        assert result.error is None and result.output_ids == want
    assert_nothing_queued(eng)
    assert not eng.cache.runner._settling and not eng.cache.runner._tasks
    assert_whole(eng.cache)
    asyncio.run(eng.shutdown())


def test_a_generate_cancelled_while_a_backup_is_written_leaves_the_engine_serving(monkeypatch):
    """The batch ends; stop_loop drains its backup, whose L3 write is held in flight, and the run is cancelled as
    the write starts (as asyncio.run cancels it at Ctrl-C). The write is let go as the drain is asked to cancel
    (after the call raised, where nothing asks it)."""
    eng = make_engine(num_pages=256)
    gate, drain, draining = WriteGate(eng.cache.store), eng.cache.drain, []
    write_pages, cancelled = eng.cache.store.write_pages, []

    async def drain_of(cancel: bool = False) -> None:
        if cancel:
            gate.release()
        draining.append(asyncio.current_task())
        await drain(cancel=cancel)

    def cancelling_write(*args, **kwargs):
        if draining and not cancelled:
            cancelled.append(True)
            draining[0].get_loop().call_soon_threadsafe(draining[0].cancel)
        return write_pages(*args, **kwargs)
    monkeypatch.setattr(eng.cache, "drain", drain_of)
    monkeypatch.setattr(eng.cache.store, "write_pages", cancelling_write)
    with pytest.raises(asyncio.CancelledError):
        eng.generate([PROMPT], SamplingParams(max_tokens=1))
    assert cancelled
    gate.release()
    monkeypatch.undo()
    serves_on(eng)


def test_a_keyboard_interrupt_in_the_engine_loop_mid_batch_leaves_the_engine_serving(monkeypatch):
    eng = make_engine(num_pages=256)
    after_step, steps = eng.admission.after_step, []

    def interrupted(req, *args, **kwargs):
        steps.append(req.rid)
        if len(steps) == 5:
            raise KeyboardInterrupt
        return after_step(req, *args, **kwargs)
    monkeypatch.setattr(eng.admission, "after_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.generate([PROMPT, [4, 5, 6, 7]], LONG)
    monkeypatch.undo()
    assert eng.stats["aborted"] == 2  # (not left running, unread, for the next call's loop)
    serves_on(eng)


def test_an_asyncio_run_that_forgot_stop_loop_with_a_write_in_flight_leaves_the_engine_serving(monkeypatch):
    """asyncio.run(main) streams a request and ends (cancelling the engine's loop task) while its backup's L3 write
    is held in flight; the write is let go as a drain is asked to cancel (after the run, where nothing asks it).
    A later loop serves, and shutdown() closes the L3 file (it raised ValueError before closing it)."""
    eng = make_engine(num_pages=256)
    gate, drain, writes = WriteGate(eng.cache.store), eng.cache.drain, []
    write_pages = eng.cache.store.write_pages

    async def drain_of(cancel: bool = False) -> None:
        if cancel:
            gate.release()
        await drain(cancel=cancel)

    def counted_write(*args, **kwargs):
        writes.append(True)
        return write_pages(*args, **kwargs)
    monkeypatch.setattr(eng.cache, "drain", drain_of)
    monkeypatch.setattr(eng.cache.store, "write_pages", counted_write)

    async def main() -> None:
        async for _ in eng.submit(PROMPT, SamplingParams(max_tokens=1)):
            pass
        for _ in range(2000):  # (bounded: its backup's write starts)
            if writes:
                return
            await asyncio.sleep(0.01)
    asyncio.run(main())
    assert writes and eng._loop_task.cancelled()
    gate.release()
    monkeypatch.undo()
    serves_on(eng)
    assert eng.cache.store.closed


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_an_op_driver_ends_that_op_cancelled(monkeypatch, interrupt):
    """The interrupt (a Ctrl-C's KeyboardInterrupt, or a SystemExit) lands in a backup's driver as it starts the L3
    write (mid-batch): it goes on out of generate(), the op it hit ends CANCELLED as a cancelled driver's would (its
    pages back, no driver error counted), every other op in flight then ends too, and the engine serves on
    (regression: the op was unlisted unended: check_integrity failed for good, "ops started ... counted as ended")."""
    eng = make_engine(num_pages=256)
    write_pages, live = eng.cache.store.write_pages, []

    def interrupted_write(*args, **kwargs):
        if not live:
            live.extend(eng.cache.runner.live.values())
            raise interrupt
        return write_pages(*args, **kwargs)
    monkeypatch.setattr(eng.cache.store, "write_pages", interrupted_write)
    with pytest.raises(interrupt):
        eng.generate([PROMPT, [4, 5, 6, 7]], LONG)
    monkeypatch.undo()
    assert live, "no op was in flight as the write started"
    assert all(op.done for op in live), [(op.op_id, op.state) for op in live]
    hit = [op for op in live if (op.error or "").startswith("driver interrupted")]
    assert len(hit) == 1 and hit[0].state is OpState.CANCELLED, [(op.state, op.error) for op in live]
    assert interrupt.__name__ in hit[0].error
    serves_on(eng)  # (also: no driver error counted, every tier whole)
