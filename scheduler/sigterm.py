"""SIGTERM ends a command's run as Ctrl-C does (scheduler/replay.py): the run's task is cancelled, so its engine
shuts down (its tiers closed, a kept L3's index saved) before the process ends, where the signal's default killed it
mid-run (regression: SIGTERM, from `timeout` or a job scheduler, lost the index the run had adopted at its start)."""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator

EXIT_STATUS = 128 + signal.SIGTERM  # (the shell's status of a process SIGTERM killed)
_MESSAGE = "SIGTERM"  # the run's cancel message at SIGTERM
_received = False  # SIGTERM cancelled the run under way (`run`); a later cancel (a Ctrl-C's) ends it with its message


class Terminated(KeyboardInterrupt):
    """SIGTERM ended the run, as SIGINT does: its engine shut down first."""


def cancels(task: asyncio.Task) -> Callable[[], None]:
    """SIGTERM cancels `task` from now on, as asyncio's runner does at SIGINT. Returns what puts the process's handler
    back; where no handler can be set (not the main thread) it does nothing."""
    loop, previous = asyncio.get_running_loop(), signal.getsignal(signal.SIGTERM)
    try:
        loop.add_signal_handler(signal.SIGTERM, _terminate, task)
    except (ValueError, RuntimeError, NotImplementedError):
        return lambda: None

    def restore() -> None:
        loop.remove_signal_handler(signal.SIGTERM)
        if previous is not None:  # (removing it left SIG_DFL)
            signal.signal(signal.SIGTERM, previous)
    return restore


@contextlib.contextmanager
def raises() -> Iterator[None]:
    """SIGTERM raises Terminated in the block (synchronous work with no loop to cancel: hicache-serve's start-up, whose
    half-built engine then closes, as at Ctrl-C), where its default killed the process; the handler found is put back
    after it. Nothing outside the main thread (no handler can be set there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(sig, frame) -> None:
        raise Terminated()
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(task: asyncio.Task) -> None:
    global _received
    _received = True
    task.cancel(_MESSAGE)


def run(runner: Callable, main: Coroutine):
    """runner(main) (uvloop.run), whose task called `cancels`; Terminated where SIGTERM cancelled it, also where a
    Ctrl-C then cancelled its shutdown again (regression: that cancel's CancelledError went out: traceback, exit 1)."""
    global _received
    _received = False
    try:
        return runner(main)
    except asyncio.CancelledError as exc:
        if exc.args != (_MESSAGE,) and not _received:
            raise
        raise Terminated() from None
