"""The engine's loop task seen from the in-process API's callers: which event loop it belongs to,
and waiting for it to end."""
from __future__ import annotations

import asyncio


def check_loop(task: asyncio.Task | None, loop: asyncio.AbstractEventLoop | None) -> None:
    """Refuse to serve from `loop` (None: no loop runs) while the engine's loop task lives on another
    event loop (regression: start() took that task for its own, and a request queued there, also by
    generate(), waited forever for a loop that never ran again)."""
    if task is not None and not task.done() and task.get_loop() is not loop:
        raise RuntimeError("the engine's loop was started on another event loop and still runs there: "
                           "await engine.stop_loop() (or shutdown()) on that loop first")


async def join_loop(task: asyncio.Task, shield: bool) -> None:
    """Wait for the loop task to end; re-raise its crash. A task cancelled from elsewhere (an
    asyncio.run() that ended while it ran) has nothing to report (regression: shutdown() then raised
    CancelledError, as if its caller had been cancelled). With `shield`, cancelling the caller leaves
    the loop running (regression: a stop_loop() timed out by wait_for cancelled the loop mid-batch,
    and its running requests' streams waited forever)."""
    try:
        await (asyncio.shield(task) if shield else task)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
