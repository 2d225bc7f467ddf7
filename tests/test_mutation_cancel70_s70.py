"""Mutation check of session 70's cancellation change (5627f5b: `OpRunner._guard` taking a KeyboardInterrupt or
SystemExit, `stop_loop(cancel_ops=...)`, the cancelled loop task's drain, generate()'s cancelling stop, the failed
cost decision that is no policy skip): the rules that no test watched, each pinned by the behaviour it protects.

- an interrupt raised in an op's driver (Ctrl-C's KeyboardInterrupt, or a SystemExit: `sys.exit()` from a signal
  handler) ends that op CANCELLED ("driver interrupted"), not FAILED and not left unended: integrity alone did not
  show it (the op is unlisted and counted in `cancellations` either way), nor a SystemExit left to escape `_guard`
  through a test that raised only KeyboardInterrupt (pinned by tests/test_raise_cancel_s70.py's op-driver test,
  parametrised over both since);
- `stop_loop(cancel_ops=True)` on a crashed loop drops the backups queued, as on a loop that stopped cleanly
  (the crash branch's drain took the flag too: a test reached only the clean one);
- a generate() cancelled while its stop_loop drains stops with a drain that cancels: the backup whose L3 write was
  in flight ends CANCELLED, not written on (tests/test_raise_cancel_s70.py let the write go only when a drain asked
  to cancel, else after its gate's 30 s timeout: a drain that did not cancel passed there, 30 s late);
- the engine's loop task cancelled by an asyncio.run() that forgot stop_loop() drains cancelling: the backups
  queued are dropped, none started as the loop ends (its drain not cancelling passed the same way).

A real bug found, fixed in scheduler/batch_api.py (its regression test is the last here): a KeyboardInterrupt (a
second Ctrl-C: asyncio.Runner's SIGINT handler raises it once the first one cancelled the run) raised in generate()'s
own code as its stop_loop drains a backup whose L3 write is in flight. generate()'s finally ran the cancelling stop
only for a CancelledError: the interrupt went on at once, asyncio.run's clean-up cancelled the backup's driver, and
the settling its cancel queued was destroyed with the loop: the pages it held never came back and every later
generate() raised ValueError ("The future belongs to a different loop") from its drain. (Where
the interrupt lands while the loop waits idle, it leaves the loop, the run is cancelled and the fix covers it.)"""
from __future__ import annotations

import asyncio

import pytest

from hicache.ops import OpState
from scheduler.loop_task import crash_of
from scheduler.request import SamplingParams
from test_faults import PROMPT, make_engine
from hicache_helpers import WriteGate
from test_raise_admit_s70 import _end
from test_raise_cancel_s70 import serves_on


@pytest.mark.asyncio
async def test_a_cancelling_stop_of_a_crashed_loop_drops_the_backups_queued(monkeypatch):
    """A request ends and its backup is queued (not started: `start_due` held off); the loop then crashes on the
    next request. `stop_loop(cancel_ops=True)` raises the crash after a drain that drops that backup (none
    starts), as its drain on a loop that stopped cleanly does; a later start serves and the tiers are whole."""
    eng = make_engine(num_pages=256)
    await eng.start()
    runner = eng.cache.runner
    monkeypatch.setattr(runner, "start_due", lambda: None)
    assert (await _end(eng.add_request(PROMPT, SamplingParams(max_tokens=1))))[0] == "length"
    assert runner.has_due
    started = eng.cache.metrics.backups_started

    def crash(*args, **kwargs):
        raise RuntimeError("a bug in the loop")
    monkeypatch.setattr(eng.admission, "after_step", crash)
    assert (await _end(eng.add_request([4, 5, 6, 7], SamplingParams(max_tokens=4))))[0] == "error"
    assert isinstance(crash_of(eng._loop_task), RuntimeError)
    monkeypatch.undo()
    assert runner.has_due  # (the crash started nothing)
    with pytest.raises(RuntimeError, match="a bug in the loop"):
        await eng.stop_loop(cancel_ops=True)
    assert not runner.has_due, "the backups queued were left due"
    assert eng.cache.metrics.backups_started == started, "a cancelling stop started the backups queued"
    await eng.start()
    assert (await _end(eng.add_request(PROMPT, SamplingParams(max_tokens=1))))[0] == "length"
    await eng.stop_loop()
    eng.check_integrity()
    await eng.shutdown()


def test_a_generate_cancelled_as_it_drains_cancels_the_backup_being_written(monkeypatch):
    """The batch ends; stop_loop drains its backup, whose L3 write is held in flight, and the run is cancelled as
    the write starts (as asyncio.run cancels it at Ctrl-C). The write is let go as the next drain begins (the stop
    that follows the cancellation): that drain asked the backup to stop, so it ends CANCELLED once its write
    settled, not published as done."""
    eng = make_engine(num_pages=256)
    gate, drain, draining = WriteGate(eng.cache.store), eng.cache.drain, []
    write_pages, live = eng.cache.store.write_pages, []

    async def drain_of(cancel: bool = False) -> None:
        draining.append(asyncio.current_task())
        if len(draining) == 2:
            gate.release()  # (no await before the drain asks the ops to stop)
        await drain(cancel=cancel)

    def cancelling_write(*args, **kwargs):
        if draining and not live:
            live.extend(eng.cache.runner.live.values())
            draining[0].get_loop().call_soon_threadsafe(draining[0].cancel)
        return write_pages(*args, **kwargs)
    monkeypatch.setattr(eng.cache, "drain", drain_of)
    monkeypatch.setattr(eng.cache.store, "write_pages", cancelling_write)
    done = eng.cache.metrics.backups_done
    with pytest.raises(asyncio.CancelledError):
        eng.generate([PROMPT], SamplingParams(max_tokens=1))
    gate.release()
    monkeypatch.undo()
    assert len(draining) >= 2 and len(live) == 1
    assert live[0].state is OpState.CANCELLED, live[0].state
    assert eng.cache.metrics.backups_done == done
    serves_on(eng)


def test_an_asyncio_run_that_forgot_stop_loop_drops_the_backups_queued(monkeypatch):
    """asyncio.run(main) serves a request and ends without stop_loop() while the request's backup is queued (not
    started: `start_due` held off until main returns): the loop task's drain, as asyncio.run cancels it, drops it
    rather than starting a backup on a loop that is ending. A later loop serves."""
    eng = make_engine(num_pages=256)
    runner = eng.cache.runner

    async def main() -> None:
        monkeypatch.setattr(runner, "start_due", lambda: None)
        async for _ in eng.submit(PROMPT, SamplingParams(max_tokens=1)):
            pass
        assert runner.has_due
        monkeypatch.undo()
    started = eng.cache.metrics.backups_started
    asyncio.run(main())
    assert eng._loop_task.cancelled()
    assert not runner.has_due, "the backups queued were left due"
    assert eng.cache.metrics.backups_started == started, "the ending loop started the backups queued"
    serves_on(eng)


def test_a_keyboard_interrupt_in_generates_drain_leaves_the_engine_serving(monkeypatch):
    """The batch ends and stop_loop drains its backup, whose L3 write is held in flight; a KeyboardInterrupt is
    raised in the run's own code as that drain waits (the drain's wait is a task of its own here, so that the
    interrupt lands in the run's coroutine). It goes on out of generate(); the write is let go as a drain is asked
    to cancel, else after the call. The engine serves on."""
    eng = make_engine(num_pages=256)
    gate, drain, calls, writing, waits = WriteGate(eng.cache.store), eng.cache.drain, [], [], []
    write_pages = eng.cache.store.write_pages

    async def drain_of(cancel: bool = False) -> None:
        calls.append(cancel)
        if len(calls) == 1:  # (the first drain: stop_loop's, not cancelling)
            writing.append((asyncio.get_running_loop(), asyncio.Event()))
            waits.append(asyncio.ensure_future(drain(cancel=cancel)))  # (kept; asyncio.run's clean-up cancels it)
            await writing[0][1].wait()
            raise KeyboardInterrupt
        if cancel:
            gate.release()
        await drain(cancel=cancel)

    def signalling_write(*args, **kwargs):
        if writing:
            loop, started = writing[0]
            loop.call_soon_threadsafe(started.set)
        return write_pages(*args, **kwargs)
    monkeypatch.setattr(eng.cache, "drain", drain_of)
    monkeypatch.setattr(eng.cache.store, "write_pages", signalling_write)
    with pytest.raises(KeyboardInterrupt):
        eng.generate([PROMPT], SamplingParams(max_tokens=1))
    gate.release()
    monkeypatch.undo()
    serves_on(eng)
