"""Session 77's hunt for what grows as the public objects are made, used and shut down many times in one process, and
for what a constructor that fails part-way leaves behind (tiny preset, CPU). Pinned here:
- scheduler/generation.py `eos_id`: an lru_cache of 8 keyed by the tokenizer kept the last 8 tokenizers alive after
  their apps and engines were gone (create_app looks the EOS up once per app), as session 58 found the reasoning
  markers' and request templates' caches did: ~33 MB each at Qwen3's vocabulary.
- scheduler/engine_lifecycle.py `Engine.shutdown`: an engine with `log_json` kept its log open and locked after its
  shutdown, for the process's life (session 76 let a refused engine's go, not a shut-down one's), and structlog still
  wrote to it: a process restarting its engine with a new log each time held one more open file a restart, another
  process was refused the old log ("being written by another process"), and a later engine without a log wrote its
  events into the old one."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import weakref

import pytest

from scheduler.engine import Engine
from scheduler.logs import configure_logging
from scheduler.request import SamplingParams
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from server_fixtures import tiny_config
from test_log_refused_s76 import _locked_by_this_process
from test_server_text import _write_byte_level_tokenizer


def test_an_app_made_and_dropped_keeps_no_tokenizer(tmp_path):
    _write_byte_level_tokenizer(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    engine = Engine(tiny_config())
    app = create_app(engine, ServerLimits(), tokenizer=tok)
    gone = weakref.ref(tok)
    del engine, app, tok
    gc.collect()
    assert gone() is None, "the dropped app's tokenizer is still alive"


@pytest.fixture
def quiet_logging():
    configure_logging(None)
    yield
    configure_logging(None)


def _served_and_shut_down(**config) -> None:
    engine = Engine(tiny_config(num_pages=64, **config))

    async def serve() -> None:
        await engine.generate_async([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2))
        await engine.shutdown()
    asyncio.run(serve())


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_an_engine_shut_down_lets_its_log_go(tmp_path, quiet_logging):
    logs = [tmp_path / f"run{i}.jsonl" for i in range(4)]
    _served_and_shut_down(log_json=str(logs[0]))
    files = _open_files()
    for log in logs[1:]:  # (an engine restarted with a log of its own each time)
        _served_and_shut_down(log_json=str(log))
    assert _open_files() == files, "each engine shut down keeps its log open"
    assert not any(_locked_by_this_process(log) for log in logs), "a shut-down engine's log stays locked"
    lines = logs[-1].read_text().splitlines()
    assert "request" in [json.loads(line)["event"] for line in lines]
    _served_and_shut_down()  # (no log of its own)
    assert logs[-1].read_text().splitlines() == lines, "a later engine without a log wrote into an earlier one's"


def test_a_log_two_engines_share_stays_until_the_last_shuts_down(tmp_path, quiet_logging):
    log = tmp_path / "shared.jsonl"
    first = Engine(tiny_config(num_pages=64, log_json=str(log)))
    second = Engine(tiny_config(num_pages=64, log_json=str(log)))

    async def serve(engine: Engine) -> None:
        await engine.generate_async([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2))
        await engine.shutdown()
    asyncio.run(serve(second))
    assert _locked_by_this_process(log)
    ended = len(log.read_text().splitlines())
    asyncio.run(serve(first))
    assert len(log.read_text().splitlines()) > ended, "the first engine's events no longer reach the log"
    assert not _locked_by_this_process(log)
