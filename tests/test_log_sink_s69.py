"""--log-json on a disk that fills up (scheduler/logs.py `LogSink`): once the run's first line is in, a line that
cannot be written is dropped and counted, with one notice on stderr, and the engine serves on (regression: the
full disk's OSError rose out of a request's or an operation's log line, crashed the loop and left clients
waiting). A log that cannot be written at all is refused at start, and the process's logging is quiet again.
The full disk is Linux's /dev/full, whose every write fails with ENOSPC. tests/test_raise_hunt_s69.py pins the
engine's side: a logger that raises anyway (an in-process user's own structlog setup) loses lines, not clients."""
from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
import structlog

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.logs import info_enabled
from scheduler.request import SamplingParams

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
HANG_GUARD_S = 20


@pytest.fixture
def saved_logging():
    saved = structlog.get_config()
    try:
        yield
    finally:
        structlog.configure(**saved)


def _config(log_json: str) -> EngineConfig:
    return EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, max_new_tokens_limit=64,
                        log_json=log_json).with_hicache(enable=True, policy="always", host_ratio=2.0)


def test_a_log_that_cannot_be_written_at_all_is_refused_at_start(saved_logging, tmp_path):
    with pytest.raises(ValueError, match="/dev/full cannot be written"):
        Engine(_config("/dev/full"))
    assert not info_enabled()  # (quiet again: nothing more goes to the file)
    structlog.get_logger().warning("still logs")  # (no raise)
    eng = Engine(_config(str(tmp_path / "log.jsonl")))
    assert eng.log_sink is not None and eng.log_sink.dropped_writes == 0
    asyncio.run(eng.shutdown())


@pytest.mark.asyncio
async def test_a_disk_that_fills_up_drops_log_lines_and_the_engine_serves_on(saved_logging, tmp_path, capfd):
    eng = Engine(_config(str(tmp_path / "log.jsonl")))
    prompts = [list(range(1, 26)), list(range(40, 61)), list(range(1, 26)) + [7, 7]]
    first = [ev async for ev in eng.submit(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))]
    sink, written = eng.log_sink, eng.log_sink.file
    full = open("/dev/full", "w", buffering=1)
    try:
        sink.file = full  # (the disk fills up)
        reqs = [eng.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
        for req in reqs:
            ev = await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)
            while not ev.finished:
                ev = await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)
            assert ev.finish_reason == "length" and len(req.output) == 6
        assert sink.dropped_writes > 0
        sink.file = written  # (room again: lines are written again)
    finally:
        with contextlib.suppress(OSError):  # (what it still buffers cannot be written either)
            full.close()
    assert reqs[0].output == [ev.token_id for ev in first if ev.token_id is not None] + reqs[0].output[4:]
    assert capfd.readouterr().err.count("are being dropped") == 1  # (one notice, not one a line)
    await eng.shutdown()
    eng.check_integrity()
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert '"finished"' in lines[-1] or any('"occupancy"' in line for line in lines[-5:])  # (written again)
