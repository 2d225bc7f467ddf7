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


class Terminated(KeyboardInterrupt):
    """SIGTERM ended the run, as SIGINT does: its engine shut down first."""


def cancels(task: asyncio.Task) -> Callable[[], None]:
    """SIGTERM cancels `task` from now on, as asyncio's runner does at SIGINT. Returns what puts the process's handler
    back; where no handler can be set (not the main thread) it does nothing."""
    loop, previous = asyncio.get_running_loop(), signal.getsignal(signal.SIGTERM)
    try:
        loop.add_signal_handler(signal.SIGTERM, task.cancel, _MESSAGE)
    except (ValueError, RuntimeError, NotImplementedError):
        return lambda: None

    def restore() -> None:
        loop.remove_signal_handler(signal.SIGTERM)
        if previous is not None:  # (removing it left SIG_DFL)
            signal.signal(signal.SIGTERM, previous)
    return restore


@contextlib.contextmanager
def raises_terminated() -> Iterator[None]:
    """SIGTERM raises Terminated in the block (the main thread's only), as Ctrl-C raises KeyboardInterrupt: for work
    no loop runs, which `cancels` cannot reach (the server's engine being built, its kept L3's index adopted: its
    refusal paths save the index again; regression, SIGTERM's default killed the process and the index was lost)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame) -> None:
        raise Terminated()
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(runner: Callable, main: Coroutine):
    """runner(main) (uvloop.run), whose task called `cancels`; Terminated where SIGTERM cancelled it."""
    try:
        return runner(main)
    except asyncio.CancelledError as exc:
        if exc.args != (_MESSAGE,):
            raise
        raise Terminated() from None
