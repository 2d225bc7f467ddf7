"""Structured logs: structlog JSON lines with a monotonic-ns timestamp, one event per request state
change, batch and operation transition (the timeline tool reads them back)."""
from __future__ import annotations

import time

import structlog

from hicache.log_gate import drop_below_warning, info_enabled  # noqa: F401  (re-exported)


def add_monotonic_ns(_logger, _name, event_dict: dict) -> dict:
    event_dict.setdefault("ts_ns", time.monotonic_ns())
    return event_dict


def configure_logging(log_json_path: str | None) -> None:
    """JSON lines to `log_json_path` (append), or quiet (warnings and up to stderr) without one."""
    if log_json_path:
        sink = open(log_json_path, "a", buffering=1)  # line buffered: a crash keeps every event
        structlog.configure(
            processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                        add_monotonic_ns, structlog.processors.format_exc_info,
                        structlog.processors.JSONRenderer()],
            logger_factory=structlog.WriteLoggerFactory(file=sink),
            cache_logger_on_first_use=False,
        )
    else:
        structlog.configure(
            processors=[drop_below_warning, structlog.processors.add_log_level, add_monotonic_ns,
                        structlog.dev.ConsoleRenderer(colors=False)],
            cache_logger_on_first_use=False,
        )
