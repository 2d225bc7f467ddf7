"""Session 69's raise hunt: the engine's own logging raising (a full disk, a stdout pipe whose reader went away,
an in-process user's own structlog setup) must leave no client waiting forever and no tier open.

A plain structlog WriteLogger writes each line straight to its file, so on a full disk every log call raises
OSError(ENOSPC); --log-json's own sink now drops such lines instead (tests/test_log_sink_s69.py), and these
tests configure a plain one, as a user of the in-process API may. Pinned here:
- the loop's crash handler logged the crash before failing the live requests: that log raised too, and
  `fail_live_requests` never ran, so every live client waited forever;
- `fail_live_requests` logged a request it could not fail cleanly: that log raised, and every later request
  was left waiting forever;
- `add_request` logged "queued" after queuing the request: the caller got the error, the request ran on
  unasked for (nobody would read or abort it);
- `shutdown` logged the tiers' occupancy before closing them: the L3 file and copy threads stayed open and
  the engine was never marked shut down."""
from __future__ import annotations

import asyncio
import errno

import pytest
import structlog

from scheduler.request import SamplingParams
from test_lifecycle_hunt import assert_nothing_queued, assert_whole, make_engine

HANG_GUARD_S = 20  # a client with no last event by then would wait forever


class LogFile:
    """A log file whose disk fills up when `full` is set: each write then raises ENOSPC."""

    def __init__(self) -> None:
        self.full = False
        self.lines = 0

    def write(self, text: str) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.lines += 1
        return len(text)

    def flush(self) -> None:
        pass


@pytest.fixture
def log_file():
    """structlog configured as --log-json configures it (scheduler/logs.py), but writing to a LogFile plainly."""
    saved = structlog.get_config()
    sink = LogFile()
    structlog.configure(processors=[structlog.processors.add_log_level, structlog.processors.format_exc_info,
                                    structlog.processors.JSONRenderer()],
                        logger_factory=structlog.WriteLoggerFactory(file=sink), cache_logger_on_first_use=False)
    try:
        yield sink
    finally:
        structlog.configure(**saved)


async def _last_event(req):
    """Its final event, or None where none came within the hang guard (reported as a plain assertion: a
    TimeoutError's chain through asyncio's frames crashed pytest's report on Python 3.11)."""
    try:
        ev = await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)
        while not ev.finished:
            ev = await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)
    except asyncio.TimeoutError:
        return None
    return ev


@pytest.mark.asyncio
async def test_a_full_log_disk_fails_every_live_request_instead_of_leaving_them_waiting(log_file):
    """The disk fills while three requests are queued: the loop's next log line raises and crashes it. Each
    client gets its final error event (regression: the crash handler's own log line raised, and no request
    was failed; with that fixed, fail_live_requests' log line raised after the first request), the crash
    surfaces at shutdown() and the tiers' accounting is whole."""
    eng = make_engine()
    await eng.start()
    reqs = [eng.add_request([1 + i, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
            for i in range(3)]
    log_file.full = True
    for req in reqs:
        ev = await _last_event(req)
        assert ev is not None, f"{req.rid} got no final event: its client waits forever"
        assert ev.finish_reason == "error" and "No space left" in ev.error, ev
    assert all(req.queue.empty() for req in reqs)
    assert eng.stats["failed"] == 3
    with pytest.raises(OSError, match="No space left"):
        await eng.shutdown()
    assert eng._shut_down
    assert_nothing_queued(eng)
    assert_whole(eng)


@pytest.mark.asyncio
async def test_a_request_whose_queueing_cannot_be_logged_is_not_left_running(log_file):
    """add_request raised (its "queued" line could not be written): the caller was told it failed, so it must
    not run (regression: it stayed queued and ran to max_tokens with no client). The engine serves on."""
    eng = make_engine()
    await eng.start()
    log_file.full = True
    with pytest.raises(OSError, match="No space left"):
        eng.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True))
    assert_nothing_queued(eng)
    log_file.full = False
    ev = await _last_event(eng.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert ev.finish_reason == "length"
    assert eng.stats["finished"] == 1 and eng.stats["aborted"] + eng.stats["failed"] == 0
    await eng.shutdown()
    assert_whole(eng)


@pytest.mark.asyncio
async def test_a_shutdown_whose_last_log_line_fails_still_closes_the_tiers(log_file):
    """shutdown() logs the tiers' occupancy before it closes them: where that line cannot be written, the
    tiers are closed all the same and the engine is shut down (regression: the L3 file and its I/O threads
    stayed open, and `_shut_down` was never set)."""
    eng = make_engine()
    ev = await _last_event((await _started(eng)).add_request([1, 2, 3, 4, 5, 6, 7, 8, 9],
                                                             SamplingParams(max_tokens=3, ignore_eos=True)))
    assert ev.finish_reason == "length"
    log_file.full = True
    try:
        await eng.shutdown()
    except OSError:
        pass  # (a log line that could not be written may be reported: the tiers must close all the same)
    assert eng._shut_down
    assert eng.cache.store.closed
    assert_nothing_queued(eng)


async def _started(eng):
    await eng.start()
    return eng


@pytest.mark.asyncio
async def test_a_full_log_disk_leaves_no_operation_half_done(log_file):
    """Every operation transition is logged (hicache/ops.py `apply`), after the op's state moved: when that line
    raised, a backup's driver died between its state and its bookkeeping, and its failure handler's own log
    line raised too, so its locks and pages were never released and it was never counted as ended
    (check_integrity: "ops started, counted as ended"). The disk fills while backups run."""
    eng = make_engine()
    await eng.start()
    first = await _last_event(eng.add_request(list(range(1, 30)), SamplingParams(max_tokens=3, ignore_eos=True)))
    assert first.finish_reason == "length"
    req = eng.add_request(list(range(1, 30)) + [7, 7, 7, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    log_file.full = True
    ev = await _last_event(req)
    assert ev is not None, "no final event: its client waits forever"
    with pytest.raises(OSError, match="No space left"):
        await eng.shutdown()
    assert_nothing_queued(eng)
    assert_whole(eng)
