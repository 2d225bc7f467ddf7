"""Command-line helpers of the benchmarks and probes next to it (not a benchmark itself): argparse types for counts
and comma lists (a bad value is argparse's one-line error, exit 2, before any model loads), the --storage-path
checks and the private directory of the L3 file (BenchDir), and what the engine refuses (a RequestError, a
config's ValueError, an OSError on a named path) as the parser's one-line error. No torch import: cheap to load."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import tempfile


# -- argparse types ----------------------------------------------------------------------------------
def _integer(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def int_list(minimum: int = 1, length: int | None = None):
    """An argparse type: a comma list of integers, each >= `minimum` (exactly `length` of them when given), parsed
    strictly: no empty list, no empty item ('1,,2'), no non-integer."""
    def parse(text: str) -> list[int]:
        items = text.split(",")
        if not text.strip() or any(not item.strip() for item in items):
            raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
        values = [_integer(item.strip()) for item in items]
        if length is not None and len(values) != length:
            raise argparse.ArgumentTypeError(f"expected {length} comma-separated integers, got {text!r}")
        if min(values) < minimum:
            raise argparse.ArgumentTypeError(f"each value must be >= {minimum}, got {text!r}")
        return values
    parse.__name__ = "comma list"  # (argparse names the type in its message)
    return parse


def choice_list(choices):
    """An argparse type: a non-empty comma list of names, each one of `choices` (no empty item)."""
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",")]
        if not text.strip() or not all(items):
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)}; got {text!r}")
        bad = [item for item in items if item not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(choices)}")
        return items
    parse.__name__ = "comma list"
    return parse


# -- engine refusals as one-line errors --------------------------------------------------------------
def one_line(exc: BaseException) -> str:
    """An exception's message on one line (an OSError's with its path)."""
    text = str(exc) if not isinstance(exc, OSError) or not exc.filename else f"{exc.strerror}: {exc.filename}"
    return " ".join(text.split()) or type(exc).__name__


@contextlib.contextmanager
def refused_as_usage(p: argparse.ArgumentParser, what: str = ""):
    """Inside: a RequestError / ValueError (a config's or a request's checks) or an OSError becomes `p.error` (one
    line, exit 2), prefixed by `what`. Wrap the up-front checks, not the benchmark (a bug there stays a traceback)."""
    try:
        yield
    except (ValueError, OSError) as exc:
        p.error(f"{what}{': ' if what else ''}{one_line(exc)}")


def check_engine_config(p: argparse.ArgumentParser, make, what: str = "engine config"):
    """`make()` (an EngineConfig, SamplingParams.validate, ...) with a refusal as the parser's one-line error."""
    with refused_as_usage(p, what):
        return make()


def check_device(p: argparse.ArgumentParser, device: str | None) -> None:
    """--device cuda where torch has no CUDA: the parser's error, not the engine's traceback after the parse."""
    if device and device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            p.error(f"--device {device}: CUDA is not available on this machine (try --device cpu)")


def check_fits(p: argparse.ArgumentParser, model: str, shapes, page_size: int, num_pages: int | None) -> None:
    """Each (prompt tokens, new tokens, flags) of `shapes` within the model's positions and an L1 of `num_pages` pages
    (None: the pool is sized otherwise), as the engine's `validate` would refuse it: the parser's error, before any
    model loads (its shapes read from the preset or config.json). The built engine still checks (held pages)."""
    from scheduler.presets import model_config_of
    with refused_as_usage(p, "--model"):
        positions = model_config_of(model).max_position_embeddings
    for prompt, new, flags in shapes:
        kv = prompt + max(new - 1, 0)  # (scheduler.request.kv_tokens: the last new token writes no K/V)
        if kv > positions:
            p.error(f"{flags}: prompt ({prompt}) + max_tokens ({new}) - 1 = {kv} tokens exceeds the model's "
                    f"{positions} positions")
        if num_pages is not None and -(-kv // page_size) > num_pages:
            p.error(f"{flags}: prompt ({prompt}) + max_tokens ({new}) - 1 = {kv} tokens needs {-(-kv // page_size)} "
                    f"pages of {page_size} tokens; the L1 pool has {num_pages}")


def read_json(p: argparse.ArgumentParser, path: str):
    """The JSON in the file `path` (gzipped where it ends in .gz), or the parser's one-line error naming the file: one
    missing, a directory, not JSON (regression: plot_latency and trace_* ended in tracebacks)."""
    import gzip
    import json
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
            return json.load(f)
    except OSError as exc:
        p.error(f"{path}: {exc.strerror}" if exc.filename else f"{path}: {one_line(exc)}")  # (BadGzipFile)
    except (ValueError, EOFError) as exc:  # (JSONDecodeError, UnicodeDecodeError: ValueErrors; a cut gzip: EOFError)
        p.error(f"{path}: not JSON ({one_line(exc)})")


def trace_events(p: argparse.ArgumentParser, path: str) -> list[dict]:
    """A torch.profiler chrome trace's complete events (ph "X" with a name, ts and dur), or the parser's one-line
    error naming the file: one unread, not JSON, JSON without a traceEvents list (regression: KeyError, TypeError)."""
    data = read_json(p, path)
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        p.error(f"{path}: not a chrome trace (no traceEvents list)")
    number = (int, float)
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and isinstance(e.get("name"), str)
            and isinstance(e.get("ts"), number) and isinstance(e.get("dur"), number)]


# -- --storage-path ------------------------------------------------------------------------------------
STORAGE_PATH_HELP = ("the L3 file, created by the benchmark and removed at exit with its PATH.index (a new path in "
                     "an existing directory: an existing file is refused, never overwritten or deleted; default: a "
                     "file in a private directory under the cwd, removed at exit)")


def check_storage_path(p: argparse.ArgumentParser, path: str | None, flag: str = "--storage-path") -> None:
    """A --storage-path the benchmark can create and remove: its directory exists and is writable; neither the path
    nor PATH.index exists (the benchmark removes both at exit, so it refuses files it did not create)."""
    if path is None:
        return
    if not path.strip():
        p.error(f"{flag}: an empty path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        p.error(f"{flag} {path}: its directory does not exist")
    if os.path.isdir(path):
        p.error(f"{flag} {path}: is a directory; give a new file's path (the benchmark creates the file)")
    for existing in (path, path + ".index"):
        if os.path.lexists(existing):
            p.error(f"{flag} {path}: {existing} exists; give a new path (the benchmark creates the L3 file and "
                    "removes it at exit, and never overwrites or deletes a file it did not create)")
    if not os.access(parent, os.W_OK | os.X_OK):
        p.error(f"{flag} {path}: its directory is not writable")


class BenchDir:
    """A private directory on the file system of `storage_path` (default: the current directory) for the L3 file and
    the raw-read probe; removed at close, with the user's `storage_path` and its `PATH.index` (bench_restart's
    persisted index) where they did not exist when it opened (a file it did not create is never deleted)."""

    def __init__(self, storage_path: str | None) -> None:
        self.user_path = storage_path
        self._ours = [q for q in ((storage_path, storage_path + ".index") if storage_path else ())
                      if not os.path.lexists(q)]
        base = os.path.dirname(os.path.abspath(storage_path)) if storage_path else os.getcwd()
        self.dir = tempfile.mkdtemp(prefix=".hicache-bench-", dir=base)

    def l3_path(self, tag: str) -> str:
        return self.user_path or os.path.join(self.dir, f"l3-{tag}.kv")

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        for path in self._ours:
            if os.path.islink(path) or os.path.isfile(path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def fail(message: str, code: int = 2, prog: str | None = None) -> None:
    """Exit with `prog: error: message` on stderr (argparse's form), for what is found after the parse: a flag the
    built engine refuses (code 2), a benchmark whose requests failed (code 1: no figures are printed)."""
    import sys
    prog = prog or os.path.basename(sys.argv[0] or "bench")
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def request_errors(results, what: str = "requests") -> None:
    """Exit 1 naming the first error when any of the engine's results (`.error`) failed: a failed request is no
    measurement (regression: bench_speculative timed failed requests as produced tokens)."""
    bad = [r.error for r in results if getattr(r, "error", None)]
    if bad:
        fail(f"{len(bad)} of {len(results)} {what} failed: {bad[0]}", code=1)


def human_output(as_json: bool):
    """A context in which print() writes the human tables: stdout, or stderr when stdout carries --json's JSON."""
    import sys
    return contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
