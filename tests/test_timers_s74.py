"""Session 74's hunt for timers, deadlines and back-offs (every place the code waits for a time, counts a deadline
or backs off: does it reset, cap, and count only what it should). Pinned here:
- hicache/storage_redis.py `RedisStore._error`: a connection error backs the store off for lo * 2**(n-1) s (at most
  hi), n counting failures in a row. The operations already in flight when a connection dropped each failed after
  it, while the store was backing off, and each counted: 8 ops in flight at one blip made the first back-off
  lo * 2**7 (0.25 s -> the 8 s cap), so one dropped connection took a shared L3 away for 8 s, and the next
  failure after it (a server still restarting) backed off at the cap at once. One failure while already backing
  off is an operation sent before it, as FileStore's ENOSPC back-off already counts it (`_enospc_seen`): it no
  longer counts.
- scheduler/restoring.py `_refresh_then_prefetch`: a shared L3's hint refresh then the request's prefetch, in one
  task. A raise from the prefetch (a bug of ours: the store had answered) was logged "l3_hint_refresh_failed" and
  counted as a `hint_refresh` failure of the store (hicache_operation_failures), sending whoever read the metric
  after the Redis server. Now only the refresh's own failure counts so; the prefetch's is logged as its own
  ("l3_prefetch_failed", with its traceback), and the request still runs (it recomputes what it would have read).
- hicache/operations.py `_io_deadline_s`: an L3 read's deadline, max(io_timeout_s, 4x its predicted time). A read
  past it is learned as taking it (`_await_io`: else a storage slower than its deadline is never timed), so on a
  storage that hangs (a dead NFS mount, a stalled disk) each timed-out read raised the next one's deadline ~1.6x,
  without end: 30 s, 43 s, 69 s, ... ~20 min after 10 timeouts, each a request (an exploration probe, a prefetch)
  waited out before recomputing. Now at most 4x io_timeout_s (a read predicted past that never beats recompute).
  (tests/test_mutation_redis_s64.py's long-outage test now lets each back-off end before its next failure;
  tests/test_mutation_l3_s61.py's deadline test and tests/test_docs_truth_s63.py pin the capped line.)
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
from types import SimpleNamespace

import structlog
from redis import exceptions as rexc

from hicache.linear_cost import LinearCost
from hicache.ops import OpKind, new_op
from hicache.storage import StorageError
from redis_server import GEOM
from scheduler.request import RequestState
from scheduler.restoring import Restoring


def _store(**kw):
    from hicache.storage_redis import RedisStore

    return RedisStore(GEOM, 64, "redis://127.0.0.1:1/0", model_id="m", **kw)  # (connects on first use: never)


def test_ops_in_flight_at_one_dropped_connection_back_off_once_not_once_each():
    store = _store(backoff_s=(5.0, 60.0))
    try:
        first = store._error(rexc.ConnectionError("reset"), "read")
        until = store._down_until
        for _ in range(7):  # the other reads in flight at the same drop, failing while the store backs off
            assert store._error(rexc.ConnectionError("reset"), "read").kind == "eio"
        assert first.kind == "eio" and store._consecutive_failures == 1
        assert store._down_until == until  # (not pushed on to 5 * 2**7 s, the 60 s cap)
        assert store.errors == {"eio": 8}  # every failure is still counted as an error
        assert not store.stats()["available"] and 0 < store.stats()["retry_in_s"] <= 5.0
    finally:
        store.close()


def test_a_failure_after_the_back_off_ended_still_doubles_it(monkeypatch):
    from hicache import storage_redis

    now = [1000.0]
    monkeypatch.setattr(storage_redis.time, "monotonic", lambda: now[0])  # (a fake clock: nothing awaits here)
    store = _store(backoff_s=(0.25, 8.0))
    try:
        store._error(rexc.ConnectionError("refused"), "read")
        assert store._down_until == 1000.25
        now[0] = 1000.25  # the back-off just ended: the next op is sent, and fails
        store._error(asyncio.TimeoutError(), "read")
        assert store._consecutive_failures == 2 and store._down_until == 1000.75
        store._error(rexc.ConnectionError("refused"), "read")  # (no time passed: one in flight beside it)
        assert store._consecutive_failures == 2 and store._down_until == 1000.75
        store._succeeded()
        now[0] = 2000.0
        store._error(rexc.ConnectionError("refused"), "read")  # a new outage starts from lo again
        assert store._consecutive_failures == 1 and store._down_until == 2000.25
    finally:
        store.close()


class _Metrics:
    def __init__(self) -> None:
        self.failures: dict[str, int] = {}

    def count_failure(self, kind: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1


def _restoring(refresh, prefetch):
    """A Restoring's `_refresh_then_prefetch` with its collaborators faked: `refresh` the store's hint query,
    `prefetch` the request's prefetch."""
    woken = []
    owner = SimpleNamespace(cache=SimpleNamespace(refresh_l3_hints=refresh, metrics=_Metrics()),
                            engine=SimpleNamespace(wake_soon=lambda: woken.append(1)),
                            _reusable=lambda req: req.prompt, _prefetch=prefetch)
    return owner, woken


def test_a_raise_in_the_prefetch_is_not_counted_as_the_stores_hint_refresh_failure():
    async def refresh(tokens):  # the store answered
        return None

    def prefetch(req):
        raise KeyError("a bug of the prefetch's")

    owner, woken = _restoring(refresh, prefetch)
    req = SimpleNamespace(rid="r1", state=RequestState.WAITING, prompt=[1, 2, 3])
    with structlog.testing.capture_logs() as logs:
        asyncio.run(asyncio.wait_for(Restoring._refresh_then_prefetch(owner, req), 5.0))
    assert owner.cache.metrics.failures == {}
    events = [e["event"] for e in logs]
    assert "l3_hint_refresh_failed" not in events and "l3_prefetch_failed" in events
    assert woken == [1]  # (the loop is still woken: the request goes on without its prefetch)


def test_a_failed_hint_refresh_still_counts_and_skips_the_prefetch():
    prefetched = []

    async def refresh(tokens):
        raise ConnectionError("down")

    owner, woken = _restoring(refresh, prefetched.append)
    req = SimpleNamespace(rid="r2", state=RequestState.WAITING, prompt=[1, 2, 3])
    with structlog.testing.capture_logs() as logs:
        asyncio.run(asyncio.wait_for(Restoring._refresh_then_prefetch(owner, req), 5.0))
    assert owner.cache.metrics.failures == {"hint_refresh": 1} and prefetched == [] and woken == [1]
    assert [e["event"] for e in logs] == ["l3_hint_refresh_failed"]


def test_a_request_that_ended_while_its_hints_were_fetched_is_not_prefetched():
    """(the done check moved from `_refresh_then_prefetch` into `_prefetch`: still made)"""
    def reusable(req):
        raise AssertionError("an ended request was prefetched")

    owner = SimpleNamespace(cache=SimpleNamespace(has_l3=True, config=SimpleNamespace(prefetch=True, policy="cost")),
                            _reusable=reusable)
    req = SimpleNamespace(rid="r3", state=RequestState.ABORTED, prompt=[1, 2, 3])
    Restoring._prefetch(owner, req)  # (returns at once: nothing else of the owner is there to be used)


def test_reads_timing_out_on_a_hung_storage_do_not_raise_the_next_deadline_without_end():
    from hicache.operations import OpRunner

    timeout_s = 0.001  # (io_timeout_s scaled down: each timed-out read below waits its deadline, a few ms)
    line = LinearCost(prior_slope=1e-9)
    for _ in range(6):
        line.observe(500, 1e-5)  # a healthy storage: 10 us a read
    cost = SimpleNamespace(directions={"s2h": line}, observe_transfer=lambda d, n, s: line.observe(n, s))
    runner = OpRunner(SimpleNamespace(config=SimpleNamespace(io_timeout_s=timeout_s), cost=cost,
                                      geometry=SimpleNamespace(bytes_per_page=100)))
    hung = cf.Future()  # the storage stops answering
    deadlines = []

    async def reads() -> None:
        for _ in range(12):
            op = new_op(1, OpKind.PREFETCH_L3, num_pages=5, num_bytes=500)
            deadlines.append(runner._io_deadline_s(runner._read_bytes(op)))
            try:
                await runner._wait_io(op, hung, "s2h", deadlines[-1])
            except StorageError as exc:
                assert exc.kind == "timeout"

    try:
        asyncio.run(asyncio.wait_for(reads(), 5.0))
    finally:
        hung.set_result(None)
    assert deadlines[0] == timeout_s and deadlines[1] == timeout_s
    assert deadlines[2] > timeout_s  # (still learned as slow: its deadline grows, the cost model prefers recompute)
    assert max(deadlines) == deadlines[-1] == 4 * timeout_s  # (it was 0.1 s: 100x io_timeout_s)
