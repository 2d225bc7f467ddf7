"""Session 76: hicache-serve's forced exit (scheduler/serve.py `_Server`).
- A second SIGTERM (a supervisor's, during a long graceful shutdown) did nothing: uvicorn forces its exit at a second
  SIGINT only, so the server waited out the whole --shutdown-grace-s for the streams in flight.
- A forced exit (two Ctrl-Cs) skipped the app's lifespan shutdown: asyncio.run then cancelled the engine's shutdown
  and every open stream's handler, each logged with a traceback.
Now a second SIGINT or SIGTERM ends the engine's grace at once: its requests are aborted, the engine shuts down
(its tiers closed, a kept L3's index saved for the next start), and the handlers end without a traceback."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from hicache.l3_index import index_path
from scheduler.request import SamplingParams
from test_restart_signals_s75 import FLAGS, PROMPT, _config, _keep

# the server's command line, each forward made slow: a long stream is still running when the signals come
_SLOW_SERVER = textwrap.dedent("""
    import sys, time
    from scheduler import runner, serve
    launch = runner.ModelRunner.launch
    def slow(self, *args, **kwargs):
        time.sleep(1.0)
        return launch(self, *args, **kwargs)
    runner.ModelRunner.launch = slow
    sys.exit(serve.main(sys.argv[1:]))
""")


def _wait_for(log_path, pattern: str, proc) -> re.Match:
    deadline = time.monotonic() + 120
    while True:
        text = log_path.read_text()
        if m := re.search(pattern, text):
            return m
        assert proc.poll() is None and time.monotonic() < deadline, text[-3000:]
        time.sleep(0.05)


MAX_TOKENS = 150  # (within the 48 pages of 4 tokens of L1, with the prompt)
STREAM_PROMPT = list(range(5, 38))  # 8 whole pages of 4 tokens, none of PROMPT's


def _stream(url: str, lines: list[str]) -> None:
    """A completion streamed until the server ends it (its 150 tokens take minutes here: past the wait below)."""
    try:
        body = {"prompt": STREAM_PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                lines.append(line)
    except httpx.HTTPError as exc:
        lines.append(repr(exc))


@pytest.mark.parametrize("signals", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGINT)],
                         ids=["sigterm-twice", "ctrl-c-twice"])
def test_a_second_signal_forces_the_exit_and_the_engine_still_closes(tmp_path, signals):
    path = tmp_path / "l3.kv"
    kept = asyncio.run(_keep(path))
    assert kept >= 8 and os.path.exists(index_path(str(path)))
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-c", _SLOW_SERVER, *FLAGS, "--hicache-storage-path", str(path), "--port", "0",
           "--shutdown-grace-s", "600", "--disable-access-log"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd())
    try:
        url = _wait_for(log_path, r"Uvicorn running on (http://127\.0\.0\.1:\d+)", proc).group(1)
        lines: list[str] = []
        client = threading.Thread(target=_stream, args=(url, lines))
        client.start()
        while not any(line.startswith("data: {") for line in lines):
            assert client.is_alive(), lines
            time.sleep(0.05)
        proc.send_signal(signals[0])
        _wait_for(log_path, "Waiting for connections to close", proc)  # (the grace: 600 s for the stream)
        proc.send_signal(signals[1])
        try:
            status = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail("the second signal did not force the exit: the server waits out its grace")
        client.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log_path.read_text()
    assert status == 0, out[-3000:]
    assert "Traceback" not in out and "Exception in ASGI application" not in out, out[-5000:]
    assert not client.is_alive() and sum(line.startswith("data: {") for line in lines) < MAX_TOKENS, lines[-3:]
    assert os.path.exists(index_path(str(path))), "the engine was not closed: its adopted index is lost"

    async def next_start() -> tuple[int, list[int]]:
        from scheduler.engine import Engine
        eng = Engine(_config(path))
        pages = eng.metrics()["storage_adopted_pages"]
        outs = await eng.generate_async([PROMPT, STREAM_PROMPT], SamplingParams(max_tokens=1))
        eng.cache.check_integrity()
        await eng.shutdown()
        return pages, [out.cached_tokens.get("l3", 0) for out in outs]
    pages, (kept_l3_tokens, stream_l3_tokens) = asyncio.run(next_start())
    # the kept pages, whole and readable; and the stream's prompt where its write-through backup's L3 write ended
    # before the forced exit's drain cancelled it: both are right, the second where the signal came a step later (a
    # loaded machine: session 77, `assert 16 == 8` when this expected the kept pages alone); nothing else adopted
    assert kept_l3_tokens == kept * 4 and stream_l3_tokens in (0, len(STREAM_PROMPT) // 4 * 4), (
        kept_l3_tokens, stream_l3_tokens)
    assert pages == kept + stream_l3_tokens // 4, (pages, kept, stream_l3_tokens)


# -- a Ctrl-C while the server starts ----------------------------------------------------------------
SERVE = ["--model", "tiny", "--device", "cpu", "--port", "0", "--page-size", "16", "--num-pages", "256",
         "--enable-hicache", "--hicache-storage-size-gb", "0.03125"]


def test_ctrl_c_while_the_server_starts_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    """A Ctrl-C as the engine is built (a long load, a GPU's graph capture) went out of hicache-serve as a
    KeyboardInterrupt: a traceback, where SIGTERM there is one line and 143, and the replay's Ctrl-C one line and 130.
    The engine is still closed first (the index it adopted saved again)."""
    from scheduler import engine as engine_module
    from scheduler import replay, serve
    from test_raise_cli_s70 import SHORT, adopted_pages, persisted

    replay.run_cli([*SHORT, *persisted(tmp_path)])
    assert (tmp_path / "l3.index").exists()
    admission = engine_module.Admission

    def ctrl_c_then_admission(*args, **kwargs):  # (past the cache: its index adopted)
        os.kill(os.getpid(), signal.SIGINT)
        return admission(*args, **kwargs)

    monkeypatch.setattr(engine_module, "Admission", ctrl_c_then_admission)
    monkeypatch.setattr(serve._Server, "run", lambda self: pytest.fail("the server ran on past Ctrl-C"))
    try:
        status = serve.main([*SERVE, *persisted(tmp_path)])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while starting went out of hicache-serve (a traceback)")
    err = capsys.readouterr().err
    assert status == 128 + signal.SIGINT, err
    assert "hicache-serve: interrupted (Ctrl-C) while starting" in err and "Traceback" not in err
    assert (tmp_path / "l3.index").exists(), "the engine was not closed: its adopted index is lost"
    monkeypatch.undo()
    assert adopted_pages(tmp_path) > 0
