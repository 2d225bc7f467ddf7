"""Session 73's hunt for state a handled failure leaves behind (the class of the day's GPU bug: a failed CUDA call
handled, its per-thread "last error" left set for the next, unrelated kernel), on the CPU side. Pinned here:
- scheduler/guide_compiler.py `_compiler`: the compile pool's threads are made at once, each waiting on a barrier
  until all are made. A thread that could not be made ("can't start new thread": 256 MiB stacks under a ulimit or a
  strict overcommit) raised out of the compile, which is handled (the request fails; the next compile makes a pool
  again), but the threads made before it waited on the barrier for good: each such failure leaked them, and the
  process could never exit (its exit joins every pool's threads).
- scheduler/engine.py `Engine.__init__`: on the CPU it sets torch's intra-op threads (cpu_threads, 1 by default) for
  the process, then loads the model and sizes the pools. An engine refused there (a mistyped model path, a
  directory with no checkpoint, a pool past the machine's memory, a raise in its build: a ValueError or RuntimeError
  its caller handles and goes on from) left the process's torch on that one thread: the caller's own CPU work ran on
  one core from then on.
- scheduler/logs.py `configure_logging`: a --log-json file that a run left cut mid-line (a full disk cuts it) gets a
  newline first. Where that newline could not be written (the disk still full), the OSError went out with the file
  kept open and locked by this process: another process's engine was refused it for as long as this one lived,
  where the run's first line failing lets it go (and says "cannot be written", a ValueError, as that does)."""
from __future__ import annotations

import errno
import fcntl
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import structlog
import torch

from scheduler import guide_compiler, logs
from scheduler.config import EngineConfig
from scheduler.engine import Engine


def test_a_compile_pool_that_could_not_make_its_threads_leaves_none_waiting(monkeypatch):
    made, barriers = [], []

    class ThreadsRunOut(ThreadPoolExecutor):  # the third thread cannot be made
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            made.append(self)

        def submit(self, fn, *args, **kw):
            barriers.append(getattr(fn, "__self__", None))
            if len(self._threads) >= 2:
                raise RuntimeError("can't start new thread")
            return super().submit(fn, *args, **kw)

    monkeypatch.setattr(guide_compiler, "_pool", None)
    monkeypatch.setattr(guide_compiler, "ThreadPoolExecutor", ThreadsRunOut)
    before = threading.stack_size()
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            guide_compiler.on_compile_thread(abs, -3)
        assert guide_compiler._pool is None and threading.stack_size() == before  # (as before: kept out, put back)
        [pool] = made
        threads = list(pool._threads)
        assert len(threads) == 2
        deadline = time.monotonic() + 5
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        assert not stuck, f"compile threads left waiting for good (the process cannot exit): {stuck}"
    finally:  # (on the unfixed code: let them go, or this test process would hang at its exit)
        for barrier in barriers:
            if isinstance(barrier, threading.Barrier):
                barrier.abort()
        for pool in made:
            pool.shutdown(wait=False)


def _build_raises(*_args) -> None:
    raise RuntimeError("build failed")


@pytest.mark.parametrize("refused", ["a-model-path-mistyped", "a-directory-with-no-checkpoint", "its-build-raising"])
def test_an_engine_refused_leaves_the_process_torch_threads_as_they_were(tmp_path, monkeypatch, refused):
    model = {"a-model-path-mistyped": str(tmp_path / "no-such-model"),
             "a-directory-with-no-checkpoint": str(tmp_path)}.get(refused, "tiny")
    if refused == "its-build-raising":  # (past the model and the cache: a device error, a bug)
        monkeypatch.setattr(Engine, "_build", _build_raises)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises((ValueError, RuntimeError)):
            Engine(EngineConfig(model=model, device="cpu", num_pages=64, cpu_threads=1))
        assert torch.get_num_threads() == 2, "an engine that was never made set the process's torch threads"
    finally:
        torch.set_num_threads(before)


def test_a_log_cut_mid_line_whose_newline_cannot_be_written_is_let_go(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    path.write_text('{"event": "run_start"}\n{"event": "bat')  # (the run before, cut by the full disk)
    real_write = logs.LogSink.write

    def disk_still_full(sink, text: str) -> int:
        if sink.strict:  # (until the run's first line is in)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(sink, text)

    monkeypatch.setattr(logs.LogSink, "write", disk_still_full)
    saved = structlog.get_config()
    try:
        with pytest.raises(ValueError, match="cannot be written"):
            Engine(EngineConfig(model="tiny", device="cpu", num_pages=64, log_json=str(path)))
    finally:
        structlog.configure(**saved)
    with open(path, "a") as other:  # (what another process's engine does: `logs._sink`)
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # (BlockingIOError while this process holds it)
