"""The engine's loop task seen from the in-process API's callers: which event loop it belongs to,
and waiting for it to end."""
from __future__ import annotations

import asyncio

import structlog

from scheduler.logs import log_anyway

log = structlog.get_logger("scheduler.engine")


def check_loop(task: asyncio.Task | None, loop: asyncio.AbstractEventLoop | None) -> None:
    """Refuse to serve from `loop` (None: no loop runs) while the engine's loop task lives on another
    event loop (regression: start() took that task for its own, and a request queued there, also by
    generate(), waited forever for a loop that never ran again)."""
    if task is not None and not task.done() and task.get_loop().is_closed():  # (regression: "still runs there")
        raise RuntimeError("the event loop the engine's loop ran on was closed while it ran, and its requests and "
                           "copies with it: this engine cannot serve again; build a new one (await "
                           "engine.stop_loop() or shutdown() before closing a loop you manage)")
    if task is not None and not task.done() and task.get_loop() is not loop:
        raise RuntimeError("the engine's loop was started on another event loop and still runs there: "
                           "await engine.stop_loop() (or shutdown()) on that loop first (one thread at a time)")


def check_caller(task: asyncio.Task | None) -> None:
    """`check_loop` for add_request, which runs outside any event loop too: refused from another event loop, and
    from a thread with none while the loop task's runs (in another thread: regression, the request was queued where
    that loop, woken by a thread-unsafe Event.set, never saw it, and it waited forever); taken with none running
    (between two run_until_complete() calls of the loop's own thread)."""
    running = asyncio._get_running_loop()
    if running is not None or (task is not None and not task.done()
                               and (task.get_loop().is_running() or task.get_loop().is_closed())):
        check_loop(task, running)


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


def crash_of(task: asyncio.Task | None) -> BaseException | None:
    """What the loop task died of; None while it runs, once it stopped cleanly or was cancelled."""
    if task is None or not task.done() or task.cancelled():
        return None
    return task.exception()


def fail_live_requests(engine, exc: BaseException) -> None:
    """The loop crashed: end every live request FAILED, so that no client waits forever. Failing one
    may raise too (the state that crashed the loop is its own): that request still gets its final
    event, and the others are failed (regression: the first such error left every later client waiting)."""
    from scheduler.request import RequestState

    error = f"engine loop crashed: {exc!r}"
    for req in list(engine.requests.values()):
        if req.state.done:
            continue
        try:
            engine.finish(req, RequestState.FAILED, "error", error)
        except Exception:
            log_anyway(log.exception, "failing_request_after_loop_crash", rid=req.rid)  # (the log may be what raised)
            end_broken(engine, req, error)


def end_broken(engine, req, error: str) -> None:
    """`engine.finish(req, ...)` raised: the request still leaves the queues and gets its last event, FAILED with
    `error` (its pages and locks are what broke: left as they are), unless finish sent that event already (only
    logging its end raised)."""
    from scheduler.request import RequestState, TokenEvent

    if engine.requests.get(req.rid) is not req:
        return
    for queue in (engine.running, engine.waiting, engine.parked):
        if req in queue:
            queue.remove(req)
    if not req.state.done:
        req.state, req.finish_reason, req.error = RequestState.FAILED, "error", error
        engine.stats["failed"] += 1
    req.penalty_state = None  # (its device tensors go now, as Engine.finish frees them)
    req.emit(TokenEvent(req.rid, None, len(req.output), finished=True, finish_reason="error", error=error))
    engine.requests.pop(req.rid, None)
