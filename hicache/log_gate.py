"""Whether info-level events go anywhere. The quiet configuration (scheduler/logs.py, no
--log-json) drops them in its first processor, `drop_below_warning`, rather than in a filtering
wrapper, so structlog.testing.capture_logs() (which swaps the processors) still sees everything.
A dropped event still costs ~12 us (the lazy logger binds, the processor raises), so the per-step
and per-transition events check `info_enabled()` (~1 us) before they are built."""
from __future__ import annotations

import structlog

_QUIET = {"debug", "info"}


def drop_below_warning(_logger, method_name: str, event_dict: dict) -> dict:
    """Only warnings and errors pass."""
    if method_name in _QUIET:
        raise structlog.DropEvent
    return event_dict


def log_anyway(method, event: str, **fields) -> None:
    """`method(event, **fields)` (a structlog logger's info, warning or exception) where what follows must run
    whether or not the line is written: a logger that raises (a full disk, a closed pipe, an in-process user's
    own structlog setup) loses the line, not that step (regression: an operation's transition whose line
    raised left its locks and pages held; a crash handler's, every client waiting)."""
    try:
        method(event, **fields)
    except Exception:
        pass


def info_enabled() -> bool:
    """False only under the quiet configuration; a JSON log and capture_logs() make it True."""
    processors = structlog.get_config()["processors"]
    return not processors or processors[0] is not drop_below_warning
