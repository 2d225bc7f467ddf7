"""The quiet log (no --log-json: warnings and up to stdout) where stdout cannot be written: a pipe whose reader went
away (`hicache ... | head`), a closed stdout. Its lines are dropped with one notice on stderr, like --log-json's on
a full disk (tests/test_log_sink_s69.py), instead of raising into what they report on (regression: the quiet log
wrote through structlog's PrintLogger, and a warning at an engine's start - an unreadable L3 index - raised
BrokenPipeError out of the Engine's constructor)."""
from __future__ import annotations

import asyncio
import os

import pytest
import structlog

from hicache.l3_index import index_path
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.logs import configure_logging
from scheduler.request import SamplingParams


@pytest.fixture
def broken_stdout(monkeypatch):
    """A pipe whose reader is gone (each write raises BrokenPipeError: Python ignores SIGPIPE), for a test to make
    sys.stdout (in its body: pytest's capture sets sys.stdout again between a fixture and the test)."""
    saved = structlog.get_config()
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    pipe = os.fdopen(write_fd, "w", buffering=1)
    configure_logging(None)
    try:
        yield lambda: monkeypatch.setattr("sys.stdout", pipe)
    finally:
        monkeypatch.undo()
        try:
            pipe.close()
        except BrokenPipeError:  # (its buffer's flush)
            pass
        structlog.configure(**saved)


def test_a_warning_to_a_broken_stdout_is_dropped_with_one_notice(broken_stdout, capfd):
    broken_stdout()
    with pytest.raises(BrokenPipeError):  # (the pipe is broken indeed)
        print("x", flush=True)
    log = structlog.get_logger("test")
    log.warning("first", n=1)
    log.error("second", n=2)
    log.info("below warning")  # (not written at all)
    assert capfd.readouterr().err.count("are being dropped") == 1


def test_an_engine_starts_and_serves_with_a_warning_to_a_broken_stdout(broken_stdout, tmp_path):
    store = str(tmp_path / "l3.kv")
    with open(index_path(store), "wb") as f:
        f.write(b"not an index")  # (the engine warns l3_index_ignored as it starts)
    broken_stdout()
    config = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, max_new_tokens_limit=16).with_hicache(
        enable=True, policy="always", host_ratio=2.0, storage_path=store, storage_persist=True)
    eng = Engine(config)

    async def serve() -> list:
        try:
            return [ev async for ev in eng.submit(list(range(1, 30)), SamplingParams(max_tokens=4, ignore_eos=True))]
        finally:
            await eng.shutdown()

    events = asyncio.run(serve())
    assert events[-1].finished and events[-1].finish_reason == "length" and len(events) == 5
    eng.cache.check_integrity()
