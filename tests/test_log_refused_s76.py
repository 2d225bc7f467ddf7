"""Session 76: an engine refused after it configured its --log-json file (a checkpoint that is not there, a device
that is not, pools larger than the machine: all found after the log is set up, so that their errors are logged) left
that file open and locked by this process, and structlog's process-wide configuration writing to it: another process
was refused the log ("being written by another process") as long as this one lived, and a later engine of this
process without a log of its own wrote its warnings into the refused one's file. A refused engine now puts back
structlog's configuration as it found it and lets go of the log it opened; a log an earlier engine opened stays."""
from __future__ import annotations

import asyncio
import fcntl
import json

import pytest
import structlog

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.logs import configure_logging
from scheduler.request import SamplingParams


@pytest.fixture
def quiet_logging_after():
    yield
    configure_logging(None)


def _locked_by_this_process(path) -> bool:
    with open(path, "a") as other:  # (an flock is per open file: this open is as another process's)
        try:
            fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(other.fileno(), fcntl.LOCK_UN)
        return False


def _events(path) -> list[str]:
    return [json.loads(line)["event"] for line in path.read_text().splitlines()]


def test_an_engine_refused_after_its_log_was_set_up_lets_it_go(tmp_path, quiet_logging_after):
    configure_logging(None)
    config_before = structlog.get_config()
    log = tmp_path / "refused.jsonl"
    with pytest.raises(ValueError, match="neither a preset"):
        Engine(EngineConfig(model=str(tmp_path / "no-checkpoint"), device="cpu", log_json=str(log)))
    assert not _locked_by_this_process(log), "the refused engine's log stays locked by this process"
    assert structlog.get_config() == config_before
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, log_json=None))

    async def serve() -> None:
        await eng.generate_async([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2))
        structlog.get_logger("test").warning("a_later_warning")
        await eng.shutdown()
    asyncio.run(serve())
    assert _events(log) == ["run_start"], "a later engine without a log wrote into the refused engine's"


def test_a_refused_engine_keeps_an_earlier_engines_log(tmp_path, quiet_logging_after):
    """The log an earlier engine of this process set up (and still writes) stays configured, open and locked."""
    log = tmp_path / "first.jsonl"
    first = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, log_json=str(log)))
    with pytest.raises(ValueError, match="neither a preset"):
        Engine(EngineConfig(model=str(tmp_path / "no-checkpoint"), device="cpu", log_json=str(log)))
    assert _locked_by_this_process(log)

    async def serve() -> None:
        await first.generate_async([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2))
        await first.shutdown()
    asyncio.run(serve())
    assert "request" in _events(log)[2:], _events(log)  # (after the first's and the refused one's run_start)
