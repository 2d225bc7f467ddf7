"""Session 70's raise hunt of the command lines (scheduler/replay.py, scheduler/serve.py): an engine built with a kept
L3 (--hicache-storage-persist) adopts the last run's index and deletes it as it reads it (hicache/l3_index.py), so
whatever ends the command must still shut the engine down, or the next run starts with an empty L3. Pinned here:
- SIGTERM mid-replay (`timeout`, a job scheduler's end) killed the process where it was: the index adopted at start
  was lost, the tiers never closed; it now ends the run as SIGINT does (the engine shut down, exit status 143, one
  line on stderr);
- the replay's start line (its announce, on stderr) was printed after the engine was built and before the run's
  try: where it raised (a stderr pipe whose reader went away), the engine was never shut down;
- hicache-serve's start-up raising after the engine was built and before uvicorn runs the app (whose lifespan shuts
  the engine down): a Ctrl-C there, or a raise in create_app, left the tiers open and lost the index."""
from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from scheduler import memory_plan, replay, runner, serve

# the bundled sample on the CPU (tiny preset, L1 4,096 tokens, L3 65,536 tokens = 32 MiB of float32 pages of 16)
SHORT = ["--no-progress", "--max-requests", "6"]


def persisted(tmp_path: Path) -> list[str]:
    return ["--hicache-storage-path", str(tmp_path / "l3"), "--hicache-storage-persist"]


def adopted_pages(tmp_path: Path) -> int:
    """Pages the next replay on the same L3 file adopts (it opens, so the last engine's lock was released)."""
    return replay.run_cli([*SHORT, *persisted(tmp_path)])["metrics"]["storage_adopted_pages"]


@pytest.fixture
def sigterm_noted():
    """A SIGTERM this process gets is noted, not fatal (without the replay's own handler it would kill pytest); the
    handler the test found is put back."""
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: got.append(sig))
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_mid_replay_shuts_the_engine_down_and_keeps_the_l3_index(tmp_path, monkeypatch, capsys,
                                                                        sigterm_noted):
    """SIGTERM arrives at the 20th forward: the run ends (exit 143, one line), the engine shut down first: its log's
    last line whole, its L3 index saved and the file unlocked (the next run adopts it). The handler the process had
    is back after the replay."""
    handler = signal.getsignal(signal.SIGTERM)
    launch, calls = runner.ModelRunner.launch, []

    def launch_then_sigterm(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 20:
            os.kill(os.getpid(), signal.SIGTERM)
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(runner.ModelRunner, "launch", launch_then_sigterm)
    log = tmp_path / "log.jsonl"
    with pytest.raises(SystemExit) as stopped:
        replay.main([*SHORT, *persisted(tmp_path), "--log-json", str(log)])
    assert stopped.value.code == 128 + signal.SIGTERM, "the replay ran on past SIGTERM"
    assert "terminated (SIGTERM)" in capsys.readouterr().err
    assert sigterm_noted == [] and signal.getsignal(signal.SIGTERM) is handler
    assert log.read_bytes().endswith(b"\n")
    assert (tmp_path / "l3.index").exists(), "the engine was not shut down: its adopted index is lost"
    monkeypatch.setattr(runner.ModelRunner, "launch", launch)
    assert adopted_pages(tmp_path) > 0


def test_a_start_line_that_cannot_be_written_still_shuts_the_engine_down(tmp_path, monkeypatch):
    replay.run_cli([*SHORT, *persisted(tmp_path)])
    assert (tmp_path / "l3.index").exists()

    def broken_pipe(status):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(memory_plan, "pools_line", broken_pipe)
    with pytest.raises(BrokenPipeError):
        replay.run_cli([*SHORT, *persisted(tmp_path)])
    assert (tmp_path / "l3.index").exists(), "the engine was not shut down: its adopted index is lost"
    monkeypatch.undo()
    assert adopted_pages(tmp_path) > 0


@pytest.mark.parametrize("fault", [RuntimeError("create_app failed"), KeyboardInterrupt()])
def test_a_server_start_up_failing_after_the_engine_was_built_closes_it(tmp_path, monkeypatch, fault):
    """The engine adopted the last run's L3 index; create_app raises (or Ctrl-C lands there): the engine is
    abandoned as one that never started, the index saved again as it was read and the file unlocked."""
    replay.run_cli([*SHORT, *persisted(tmp_path)])
    assert (tmp_path / "l3.index").exists()

    def failing_create_app(engine, *args, **kwargs):
        assert engine.cache.metrics.storage_adopted_pages > 0
        raise fault

    monkeypatch.setattr(serve, "create_app", failing_create_app)
    argv = ["--model", "tiny", "--device", "cpu", "--port", "0", "--page-size", "16", "--num-pages", "256",
            "--enable-hicache", "--hicache-storage-size-gb", "0.03125", *persisted(tmp_path)]
    if isinstance(fault, KeyboardInterrupt):  # (session 76: a Ctrl-C there is one line and 130, as the replay's and
        # as SIGTERM's there: it went out as a traceback)
        assert serve.main(argv) == 128 + signal.SIGINT
    else:
        with pytest.raises(type(fault)):
            serve.main(argv)
    assert (tmp_path / "l3.index").exists(), "the engine was not closed: its adopted index is lost"
    assert adopted_pages(tmp_path) > 0
