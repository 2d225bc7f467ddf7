"""Session 75's hunt of signals and process exit (scheduler/replay.py, scheduler/serve.py, scheduler/sigterm.py):
- a Ctrl-C during the replay's shutdown that SIGTERM began went out as a CancelledError (traceback, exit status 1);
- SIGTERM during hicache-serve's start-up, once its cache had adopted a kept L3's index and before uvicorn took the
  signal, killed the process: the index, deleted as it was read, was lost."""
from __future__ import annotations

import os
import signal

import pytest

from scheduler import engine as engine_module
from scheduler import replay, runner, serve
from scheduler.engine import Engine
from test_raise_cli_s70 import SHORT, adopted_pages, persisted, sigterm_noted  # noqa: F401 (a fixture)


def test_ctrl_c_during_the_shutdown_sigterm_began_exits_143_with_one_line(tmp_path, monkeypatch, capsys, sigterm_noted):
    """SIGTERM mid-replay (`timeout`'s) starts the engine's shutdown; a Ctrl-C lands in it (the user, tired of waiting
    for a kept L3's save): the Ctrl-C's cancel went out of the command as a CancelledError, a traceback and exit status
    1. Now the run ends as SIGTERM's (exit 143, one line), the engine's shutdown having closed the tiers (the index
    saved: the next run adopts it)."""
    launch, calls = runner.ModelRunner.launch, []
    shutdown = Engine.shutdown

    def launch_then_sigterm(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 20:
            os.kill(os.getpid(), signal.SIGTERM)
        return launch(self, *args, **kwargs)

    async def shutdown_then_sigint(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return await shutdown(self, *args, **kwargs)

    monkeypatch.setattr(runner.ModelRunner, "launch", launch_then_sigterm)
    monkeypatch.setattr(Engine, "shutdown", shutdown_then_sigint)
    try:
        with pytest.raises(SystemExit) as stopped:
            replay.main([*SHORT, *persisted(tmp_path)])
    except BaseException as exc:
        pytest.fail(f"SIGTERM then Ctrl-C ended the replay with {exc!r}")
    assert stopped.value.code == 128 + signal.SIGTERM
    assert "terminated (SIGTERM): the engine shut down, its tiers closed" in capsys.readouterr().err
    monkeypatch.undo()
    assert adopted_pages(tmp_path) > 0


# -- the server's start-up ------------------------------------------------------------------------
SERVE = ["--model", "tiny", "--device", "cpu", "--port", "0", "--page-size", "16", "--num-pages", "256",
         "--enable-hicache", "--hicache-storage-size-gb", "0.03125"]


@pytest.mark.parametrize("where", ["building the engine", "making the app"])
def test_sigterm_while_the_server_starts_closes_the_engine_and_keeps_the_l3_index(tmp_path, monkeypatch, capsys,
                                                                                 sigterm_noted, where):
    """SIGTERM (a rollout's) reaches hicache-serve after its cache adopted the last run's L3 index (deleted as it is
    read) and before uvicorn takes the signal (a GPU's kernel calibration and graph capture, the app's making): its
    default killed the process there and the next start found an empty L3. Now it ends the start-up as Ctrl-C does
    there (the engine closed, the index saved again): exit status 143 and one line."""
    replay.run_cli([*SHORT, *persisted(tmp_path)])
    assert (tmp_path / "l3.index").exists()
    handler = signal.getsignal(signal.SIGTERM)

    def sigterm_in(real):
        def wrapped(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*args, **kwargs)
        return wrapped

    if where == "building the engine":  # (past the cache: CUDA graphs are captured about here on a GPU)
        monkeypatch.setattr(engine_module, "Admission", sigterm_in(engine_module.Admission))
    else:
        monkeypatch.setattr(serve, "create_app", sigterm_in(serve.create_app))
    monkeypatch.setattr(serve._Server, "run", lambda self: pytest.fail("the server ran on past SIGTERM"))
    assert serve.main([*SERVE, *persisted(tmp_path)]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "hicache-serve: terminated (SIGTERM) while starting" in err and "Traceback" not in err
    assert sigterm_noted == [] and signal.getsignal(signal.SIGTERM) is handler
    assert (tmp_path / "l3.index").exists(), "the engine was not closed: its adopted index is lost"
    monkeypatch.undo()
    assert adopted_pages(tmp_path) > 0
