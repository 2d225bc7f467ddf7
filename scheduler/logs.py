"""Structured logs: structlog JSON lines with a monotonic-ns timestamp, one event per request state
change, batch and operation transition (the timeline tool reads them back). A log is appended to:
each time it is opened (by each engine started with --log-json) a RUN_START_EVENT line comes first,
and the timeline starts every request and operation anew after it (ids restart with each engine).
One process writes a log file: it holds an flock on it, and another process's engine refuses it (two
processes' events interleave, their ids alike, and the timeline merged their requests)."""
from __future__ import annotations

import fcntl
import os
import stat
import sys
import time
from pathlib import Path

import structlog

from hicache.log_gate import drop_below_warning, info_enabled, log_anyway  # noqa: F401  (re-exported)

RUN_START_EVENT = "run_start"


def add_monotonic_ns(_logger, _name, event_dict: dict) -> dict:
    event_dict.setdefault("ts_ns", time.monotonic_ns())
    return event_dict


def _ends_mid_line(path: str) -> bool:
    """Whether the log is a regular file whose last line has no newline (what a crashed run leaves);
    a pipe or terminal (/dev/stdout) is not read."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return False
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:  # (a log this process may append to but not read)
        return False


_SINKS: dict[str, object] = {}  # a log's real path -> this process's open (and locked) file of it


def _forget(path: str) -> None:
    """Close this process's file of the log at `path` (whatever its last buffered line does) and forget it."""
    sink = _SINKS.pop(os.path.realpath(path), None)
    if sink is not None:
        try:
            sink.close()
        except OSError:
            pass


def _sink(path: str):
    """This process's file of the log at `path`, opened to append (line buffered: a crash keeps every event) and
    locked the first time; a ValueError where another process holds it (regression: two replays sharing one log
    made one timeline of both, each request's events merged with its namesake's)."""
    key = os.path.realpath(path)
    sink = _SINKS.get(key)
    if sink is None or sink.closed:
        sink = open(path, "a", buffering=1)
        try:
            if stat.S_ISREG(os.fstat(sink.fileno()).st_mode):  # (not /dev/stdout, a pipe)
                fcntl.flock(sink.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sink.close()
            raise ValueError(f"log_json (--log-json) {path} is being written by another process: give each "
                             "process a log of its own") from None
        except BaseException:  # (ENOLCK on a network file system, EBADF: regression, its file was left open)
            sink.close()
            raise
        _SINKS[key] = sink
    return sink


def logging_state() -> tuple:
    """structlog's configuration and this process's open logs now: what `restore_logging` puts back."""
    return structlog.is_configured(), structlog.get_config(), set(_SINKS)


def restore_logging(state: tuple) -> None:
    """Put structlog's configuration back as `logging_state` found it and close the logs opened since (their locks
    let go): an engine refused after its log was set up (regression: its file stayed locked for the process's life,
    another process's engine refused it, and a later engine of this one without a log wrote into it)."""
    configured, config, sinks = state
    for key in set(_SINKS) - sinks:
        _forget(key)
    if configured:
        structlog.configure(**config)
    else:
        structlog.reset_defaults()


class LogSink:
    """A JSON log's file as structlog writes to it. Once the run's first line is in, a line that cannot be written
    (the disk filled up; a pipe's reader went away; the file was closed) is dropped and counted, with one notice on
    stderr, instead of raising into what it reports on: a request's end, an operation's step, the loop's crash
    handler (regression: a full disk crashed the engine loop, and its clients waited forever). Until then
    (`strict`) it raises, so a log that cannot be written at all is refused at start."""

    def __init__(self, file) -> None:
        self.file, self.strict, self.dropped_writes = file, True, 0

    def write(self, text: str) -> int:
        try:
            return self.file.write(text)
        except (OSError, ValueError) as exc:  # (ValueError: a closed file)
            return self._dropped(exc)

    def flush(self) -> None:
        try:
            self.file.flush()
        except (OSError, ValueError) as exc:
            self._dropped(exc)

    def _dropped(self, exc: Exception) -> int:
        if self.strict:
            raise exc
        self.dropped_writes += 1
        if self.dropped_writes == 1:
            try:
                sys.stderr.write(f"hicache: lines of the log {getattr(self.file, 'name', '?')} are being "
                                 f"dropped: {exc!r}\n")
            except (OSError, ValueError):
                pass
        return 0


class _Stdout:
    """sys.stdout as it is at each write (a test's capture, a caller's redirect), for the quiet log's sink."""
    name = "<stdout>"

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()


def _quiet_sink() -> LogSink:
    sink = LogSink(_Stdout())
    sink.strict = False  # (regression: a warning to a stdout whose reader went away raised into the engine)
    return sink


def configure_logging(log_json_path: str | None) -> LogSink | None:
    """JSON lines appended to `log_json_path` (its directory created) after a RUN_START_EVENT line (its sink
    returned), or quiet (warnings and up to stdout) without one."""
    if log_json_path:
        Path(log_json_path).parent.mkdir(parents=True, exist_ok=True)
        sink = LogSink(_sink(log_json_path))
        structlog.configure(
            processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                        add_monotonic_ns, structlog.processors.format_exc_info,
                        structlog.processors.JSONRenderer()],
            logger_factory=structlog.WriteLoggerFactory(file=sink),
            cache_logger_on_first_use=False,
        )
        try:
            if _ends_mid_line(log_json_path):
                # regression: a run killed mid-line left its last line open, this run's RUN_START_EVENT
                # was glued to it and lost, and the timeline took both runs for one
                sink.write("\n")
            structlog.get_logger().info(RUN_START_EVENT, pid=os.getpid())
        except (OSError, ValueError) as exc:  # (nothing of it can be written: quiet again, and the file let go;
            # regression: the newline's failure, on the full disk that had cut that line, kept it open and locked)
            configure_logging(None)
            _forget(log_json_path)
            raise ValueError(f"log_json (--log-json) {log_json_path} cannot be written: {exc}") from exc
        sink.strict = False
        return sink
    else:
        structlog.configure(
            processors=[drop_below_warning, structlog.processors.add_log_level, add_monotonic_ns,
                        # plain tracebacks: structlog's default with rich installed printed every frame's locals
                        # (regression: a crash's lines carried prompts, a cache_salt, a request's API key)
                        structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)],
            # (named: configure() keeps what it is not given, and warnings went on to an earlier JSON log's file)
            logger_factory=structlog.WriteLoggerFactory(file=_quiet_sink()),
            cache_logger_on_first_use=False,
        )


class OccupancyLog:
    """Each tier's used pages, logged when they moved since the last call: the engine calls it after
    every batch, and once more when its loop stops or it shuts down, past the last batch's backups
    (regression: the timeline showed L2 and L3 emptier than they ended)."""

    def __init__(self, allocators: dict) -> None:
        self.allocators = allocators  # tier -> its page allocator
        self._logged: dict = {}  # tier -> used pages in its last occupancy event

    def __call__(self) -> None:
        if not info_enabled():
            return
        for tier, alloc in self.allocators.items():
            used = alloc.num_pages - alloc.num_free
            if self._logged.get(tier) != used:
                self._logged[tier] = used
                structlog.get_logger("scheduler.engine").info("occupancy", tier=tier.label, used_pages=used,
                                                              capacity_pages=alloc.num_pages)
