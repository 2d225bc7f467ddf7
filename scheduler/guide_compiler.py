"""Where structured outputs' grammars are compiled (scheduler/guided.py `Guides`): the limits a grammar is held to
before llguidance sees it, the threads of a deep stack that compile them, and the compiled matchers kept, by count and
by size.

llguidance recurses along a grammar's chains of rules and of a schema's `$ref`s: on a thread of the default 8 MiB
stack a chain of ~3,000 Lark rules or ~1,000 `$defs` overflowed it, a segfault that took the server and every
client's stream with it (session 52). So compiles run on threads of COMPILE_STACK_BYTES (their pages are taken only
as used), and a grammar of more than MAX_GRAMMAR_RULES rules, or a schema of more than MAX_SCHEMA_DEFS definitions
or `$ref`s, is refused first (a 400), far inside what that stack holds. An integer bound past 64 bits is refused too:
llguidance clamps it (minimum 1e20 gave 9223372036854775807, below it). So is a regex (a schema's "pattern" too)
that ends in a lone backslash: llguidance dropped it and matched the rest, another regex.
"""
from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

COMPILE_STACK_BYTES, COMPILE_THREADS = 256 << 20, 4
MAX_GRAMMAR_RULES = 1000  # a Lark grammar's rule and terminal definitions
MAX_SCHEMA_DEFS = 500  # a JSON schema's definitions ("$defs", "definitions"), and its "$ref"s: the links of its chains
KEPT_MATCHERS, KEPT_SPEC_CHARS = 64, 4 << 20  # matchers kept: at most this many, of specs of this much text
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_LARK_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?\d+)?[ \t]*:", re.M)


def check_limits(kind: str, value: str) -> None:
    """ValueError where a spec's grammar is past what is compiled here (the module doc)."""
    if kind == "grammar" and (rules := len(_LARK_DEFINITION.findall(value))) > MAX_GRAMMAR_RULES:
        raise ValueError(f"a grammar of {rules} rules: at most {MAX_GRAMMAR_RULES} are compiled")
    if kind == "regex":
        _check_pattern(value)
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except RecursionError:  # (nested past Python's parser: llguidance's own limit refuses it, a 400)
            return
        _check_schema(schema)


def _check_schema(schema: Any) -> None:
    """Refuses a schema past the limits: its integer bounds, its definitions and its "$ref"s (regression: a chain
    of $refs through "#/properties/..." passed with no definition counted; 2,000 links took ~8 s of a compile
    thread and overflowed a default stack, session 66)."""
    definitions = refs = 0
    stack = [schema]  # (iterative: a schema nested past Python's stack is llguidance's to refuse)
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key in ("$defs", "definitions"):
            if isinstance(node.get(key), dict):
                definitions += len(node[key])
        refs += isinstance(node.get("$ref"), str)
        named = node.get("patternProperties")  # (a regex per key)
        for pattern in [node.get("pattern"), *(named if isinstance(named, dict) else ())]:
            if isinstance(pattern, str):
                _check_pattern(pattern)
        kind = node.get("type")
        if kind == "integer" or isinstance(kind, list) and "integer" in kind:
            for key in _BOUNDS:
                bound = node.get(key)
                number = isinstance(bound, (int, float)) and not isinstance(bound, bool)
                if number and not INT64_MIN <= bound <= INT64_MAX:
                    raise ValueError(f"an integer's {key} of {bound} is outside the 64-bit range structured outputs "
                                     f"hold")
        stack.extend(node.values())
    if definitions > MAX_SCHEMA_DEFS:
        raise ValueError(f"a schema of {definitions} definitions: at most {MAX_SCHEMA_DEFS} are compiled")
    if refs > MAX_SCHEMA_DEFS:
        raise ValueError(f"a schema of {refs} $refs: at most {MAX_SCHEMA_DEFS} are compiled")


def _check_pattern(pattern: str) -> None:
    """Refuses a regex that ends in a lone backslash, an escape of nothing (Python's re and Rust's regex refuse it):
    llguidance dropped it and matched the rest (regression: guided_regex "ab$\\" answered "ab", and a schema's
    "pattern" "^ab\\" let any string starting "ab" through)."""
    if (len(pattern) - len(pattern.rstrip("\\"))) % 2:
        raise ValueError(f"the regex {pattern!r} ends in a lone backslash (an escape of nothing)")


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _compiler() -> ThreadPoolExecutor:
    """The compile threads, COMPILE_THREADS of them (one slow schema does not hold another client's grammar), made
    once, at once, with COMPILE_STACK_BYTES of stack: threading.stack_size applies to the threads made while it is
    set, so they are made under a lock, and the size put back (regression: two first compiles at once could keep a
    pool of default stacks, or leave the process's size at 256 MiB for every thread after)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="hicache-grammar")
                started = threading.Barrier(COMPILE_THREADS + 1)
                try:
                    for _ in range(COMPILE_THREADS):  # (each thread made now: a pool makes one per task it waits on)
                        pool.submit(started.wait)
                    started.wait()
                except BaseException:  # a thread not made ("can't start new thread"): those made wait no more, and
                    # end (regression: they waited on the barrier for good, and the process hung at its exit,
                    # which joins a pool's threads)
                    started.abort()
                    pool.shutdown(wait=False)
                    raise
            finally:
                threading.stack_size(previous)
            _pool = pool
        return _pool


def _forget_pool() -> None:
    """In a forked child the pool's threads are gone (regression: its first compile waited for them forever)."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def on_compile_thread(fn: Callable, *args):
    """fn(*args) on a compile thread, waited for (its exception raised here)."""
    return _compiler().submit(fn, *args).result()


class MatcherCache:
    """Compiled matchers by spec, the least recently used dropped past KEPT_MATCHERS of them or KEPT_SPEC_CHARS of
    spec text (a matcher's memory follows its grammar's size: a 1.25 MB regex's was ~33 MB, and 64 of them were
    kept, as an lru_cache of 64 keeps them). Thread-safe: the server compiles off its loop; a spec compiled by two
    at once is compiled twice, one kept."""

    def __init__(self, compile_spec: Callable) -> None:
        self._compile, self._lock = compile_spec, threading.Lock()
        self._kept: OrderedDict = OrderedDict()
        self._chars = self.hits = self.misses = 0

    def __call__(self, spec):
        with self._lock:
            if spec in self._kept:
                self.hits += 1
                self._kept.move_to_end(spec)
                return self._kept[spec]
            self.misses += 1
        matcher = self._compile(spec)
        with self._lock:
            if spec not in self._kept:
                self._kept[spec] = matcher
                self._chars += len(spec.value)
            while len(self._kept) > 1 and (len(self._kept) > KEPT_MATCHERS or self._chars > KEPT_SPEC_CHARS):
                dropped, _ = self._kept.popitem(last=False)
                self._chars -= len(dropped.value)
        return matcher

    def cache_clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._chars = self.hits = self.misses = 0

    def cache_info(self) -> functools._CacheInfo:
        return functools._CacheInfo(self.hits, self.misses, KEPT_MATCHERS, len(self._kept))
