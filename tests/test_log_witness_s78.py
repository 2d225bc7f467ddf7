"""Session 78's hunt: the structured log as a witness of what happened (--log-json read back against the truth).
Pinned here:
- scheduler/server.py `_ServerState._shutdown`: the server's line for a shutdown that raised (`engine_shutdown_failed`,
  or `engine_shutdown_after_loop_crash`) was logged after `Engine.shutdown()` had let its --log-json go: the line, with
  the traceback naming what failed, went to stdout, and the JSON log held no trace of why hicache-serve exited 1.
  Now the server lets the log go itself once it wrote that line and its background responses ended."""
from __future__ import annotations

import json

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.logs import configure_logging
from scheduler.request import SamplingParams
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import ByteTokenizer
from test_log_refused_s76 import _locked_by_this_process


@pytest.fixture
def quiet_logging():
    configure_logging(None)
    yield
    configure_logging(None)


def _events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.asyncio
@pytest.mark.parametrize("crash", [False, True])
async def test_a_servers_failed_shutdown_is_in_its_json_log(tmp_path, monkeypatch, quiet_logging, crash):
    log = tmp_path / "serve.jsonl"
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, log_json=str(log)))
    app = create_app(eng, ServerLimits(shutdown_grace_s=0.0), tokenizer=ByteTokenizer(eng.vocab_size))

    async def broken_close() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async with app.router.lifespan_context(app):
        if crash:
            def broken():
                raise RuntimeError("injected scheduler bug")
            monkeypatch.setattr(eng.admission, "decode_batch", broken)
            out = await eng.generate_async([[1, 2, 3]], SamplingParams(max_tokens=4))
            assert out[0].finish_reason == "error"
        monkeypatch.setattr(eng.cache, "close", broken_close)
    events = _events(log)
    want = "engine_shutdown_after_loop_crash" if crash else "engine_shutdown_failed"
    [line] = [e for e in events if e["event"] == want]
    assert line["level"] == "error" and "illegal memory access" in line["exception"]
    assert ("engine_loop_crashed" in [e["event"] for e in events]) == crash
    # and the log is still let go once the server is done with it
    assert not _locked_by_this_process(log)
    structlog_lines = len(log.read_text().splitlines())
    Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64))  # (no log of its own)
    assert len(log.read_text().splitlines()) == structlog_lines


def test_the_quiet_logs_tracebacks_show_no_frames_locals(quiet_logging, capfd):
    """Without --log-json, a logged exception's traceback goes to stdout as Python prints it, without each frame's
    local variables (structlog's default formatter, rich's, printed them: a request's prompt, its cache_salt, an
    API key compared in the frame that raised)."""
    import structlog

    def check(api_key: str) -> None:
        prompt = " ".join(("the", "private", "prompt"))  # noqa: F841 (a local the traceback must not show)
        raise ValueError("refused")
    try:
        check("-".join(("sk", "secret", "123")))  # (built: the source lines a traceback quotes hold neither)
    except ValueError:
        structlog.get_logger().exception("request_work_failed")
    out = capfd.readouterr().out
    assert "request_work_failed" in out and "Traceback" in out and "ValueError: refused" in out, out
    assert "sk-secret-123" not in out and "the private prompt" not in out, out
