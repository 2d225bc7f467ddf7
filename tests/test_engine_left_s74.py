"""Session 74's engine/cache leftovers. Pinned here:
- scheduler/engine.py `Engine.__init__` and hicache/manager.py `CacheManager.__init__`: an engine refused part-way
  (its build raising: a CUDA error, a graph capture, a bug; or its cache's build: an L3 index unreadable) kept its
  weights, L1 pool and (pinned) L2 buffer allocated through reference cycles (the engine's admission and the cache's
  wakeup refer back to the engine; the cache's tree callbacks, cost policy and op runner to the cache) until the
  cyclic gc ran: a retry with fixed arguments in the same process found that much less GPU memory. The checks run
  with the cyclic gc off, so only reference counting frees them.
- scheduler/logs.py `_sink`: a --log-json file whose lock failed with an OSError other than "held by another process"
  (ENOLCK on a network file system, EBADF) stayed open: one file handle leaked per try.
Not changed (see the session's report): hicache/redis_hints.py `_suspect` (bounded by the NaN pages seen; dropping a
key would hint a possibly stale page), and a refused request's LRU touch (`validate` runs before any match).
"""
from __future__ import annotations

import errno
import gc
import weakref

import pytest

from hicache import manager
from scheduler import logs
from scheduler.config import EngineConfig
from scheduler.engine import Engine


def _config() -> EngineConfig:
    return EngineConfig(model="tiny", device="cpu", num_pages=64).with_hicache(enable=True, transfer_backend="torch")


def _kept_after_refusal(config: EngineConfig, refs: dict[str, weakref.ref]) -> list[str]:
    """What of `refs` (filled as the engine is built) is still alive right after its refusal, with the cyclic gc off
    (checked before it is back on: its next allocation may run it)."""
    gc.disable()
    try:
        try:
            Engine(config)
        except RuntimeError as exc:
            assert "build failed" in str(exc)
        else:
            raise AssertionError("the engine was not refused")
        return [name for name, ref in refs.items() if ref() is not None]
    finally:
        gc.enable()


def test_an_engine_refused_in_its_build_frees_its_pools_and_weights_at_once(monkeypatch):
    refs: dict[str, weakref.ref] = {}
    real_build = Engine._build

    def build_then_raise(eng: Engine, *args) -> None:
        real_build(eng, *args)  # (every cycle made: admission, the cache's wakeup, its op runner)
        refs.update(engine=weakref.ref(eng), cache=weakref.ref(eng.cache), l1_kv=weakref.ref(eng.cache.l1.kv),
                    l2_buffer=weakref.ref(eng.cache.l2.page_buffer),
                    weights=weakref.ref(next(eng.model.parameters())))
        raise RuntimeError("build failed")

    monkeypatch.setattr(Engine, "_build", build_then_raise)
    kept = _kept_after_refusal(_config(), refs)
    assert len(refs) == 5
    assert not kept, f"kept until the cyclic gc runs: {kept}"


def test_a_cache_refused_in_its_build_frees_its_pools_at_once(monkeypatch):
    refs: dict[str, weakref.ref] = {}

    def op_runner_raises(mgr: manager.CacheManager):  # (its last part: the tree, cost policy are made)
        refs.update(cache=weakref.ref(mgr), l1_kv=weakref.ref(mgr.l1.kv), l2_buffer=weakref.ref(mgr.l2.page_buffer))
        raise RuntimeError("build failed")

    monkeypatch.setattr(manager, "OpRunner", op_runner_raises)
    kept = _kept_after_refusal(_config(), refs)
    assert len(refs) == 3
    assert not kept, f"kept until the cyclic gc runs: {kept}"


def test_a_log_whose_lock_fails_otherwise_is_closed(tmp_path, monkeypatch):
    opened = []

    def open_kept(*args, **kw):
        opened.append(open(*args, **kw))
        return opened[-1]

    def flock_unsupported(*_args) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(logs, "open", open_kept, raising=False)
    monkeypatch.setattr(logs.fcntl, "flock", flock_unsupported)
    path = tmp_path / "log.jsonl"
    for _ in range(2):
        with pytest.raises(OSError, match="No locks available"):
            logs._sink(str(path))
    assert len(opened) == 2
    assert all(f.closed for f in opened), "the log's file was left open (a file handle leaked per try)"
    assert str(path.resolve()) not in logs._SINKS
