"""Mutation check of session 70's raise-hunt code (tests/test_raise_*_s70.py): the rules of that fault handling that
no test watched, each pinned by the behaviour it protects.

- an op whose start raises (`OpRunner._not_started`): with an error that is not a RuntimeError too (a bug's
  ValueError), it counts under its own kind (backups / restores / prefetches started: Prometheus' counters), its
  FAILED transition is logged (the op log and the timeline see it end), and its own "op_start_error" line raising
  does not skip its clean-up; a write-through backup asked with no running loop (a sync caller of insert_l1) is
  not started (it was, and failed so);
- `take_to_l1`'s fallback gives back the L1 lock it took on the request's L1 prefix, and its log line raising does
  not crash the engine loop;
- an L3 read whose later task cannot be queued queues nothing after it (a task queued after the failure reads into
  the op's pages after its future already failed and its pages were freed: storage.py `_submit`);
- `Engine._settle_aborts` with the loop running: the aborted requests after the one whose end raised end "abort",
  not "error" (the loop crash's fail-over); `end_broken` for a `finish` that raised before it did anything: the
  request leaves the queues, counts as failed, drops its penalty state, and `aborting` is left empty;
- a stream whose "stream_failed" line raises still ends with its error event and [DONE]; a Responses stream failed
  by a bug carries the error in its `response.failed` Response;
- the quiet log writes to sys.stdout as it is at each write and flushes each line (a pipe's reader sees it at once).
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import threading

import pytest
import structlog
import torch

import scheduler.choices as choices
import scheduler.responses_output as responses_output

from hicache import storage
from hicache.geometry import KVGeometry
from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager, toks, write_prefix
from scheduler.logs import configure_logging
from scheduler.request import RequestState, SamplingParams
from test_faults import PROMPT, REUSABLE, reference
from test_lifecycle_hunt import assert_nothing_queued
from test_lifecycle_hunt import make_engine as make_plain_engine
from test_log_sink_s69 import saved_logging  # noqa: F401  (a fixture)
from test_raise_api_s70 import sse_events
from test_raise_cache_s70 import RaiseOnce, _output, served_then_only_in_l3
from test_raise_http_s69 import RESPONSE, ASGICall, ends, raise_once, serving

HANG_GUARD_S = 20


@contextlib.contextmanager
def unloggable(*events: str):
    """structlog set up to record every event dict and raise OSError on the lines named `events` (a full disk, an
    exception renderer that fails); yields the list of records."""
    saved, seen = structlog.get_config(), []

    def refuse(_logger, _method, event_dict):
        seen.append(dict(event_dict))
        if event_dict.get("event") in events:
            raise OSError(errno.ENOSPC, "No space left on device")
        raise structlog.DropEvent
    structlog.configure(processors=[refuse], cache_logger_on_first_use=False)
    try:
        yield seen
    finally:
        structlog.configure(**saved)


def _started(mgr) -> dict[str, int]:
    m = mgr.metrics
    return {"backup": m.backups_started, "restore": m.restores_started, "prefetch": m.prefetches_started}


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["backup", "restore_l2", "restore_l3", "prefetch"])
async def test_an_op_start_that_raises_a_bug_is_counted_failed_under_its_kind(kind):
    """A start raising ValueError (not only RuntimeError) is given back; the op counts as started under its kind
    and failed as a driver error, its FAILED transition is logged, and its own "op_start_error" line raising does
    not skip that."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=64)
    tokens = toks((1, 33))
    if kind != "backup":
        write_prefix(mgr, tokens)
        await mgr.drain()
        mgr.tree.evict(Tier.L1, 10 ** 9)
        if kind != "restore_l2":
            mgr.tree.evict(Tier.L2, 10 ** 9)
    before = _started(mgr)
    if kind == "backup":
        fault = RaiseOnce(mgr.transfer, "d2h", ValueError("a bug"))
    elif kind == "restore_l2":
        fault = RaiseOnce(mgr.transfer, "h2d", ValueError("a bug"))
    else:
        fault = RaiseOnce(mgr.store, "read_pages", ValueError("a bug"))
    with unloggable("op_start_error") as seen:
        if kind == "backup":
            assert write_prefix(mgr, tokens) is not None  # (its write-through backup starts here)
        else:
            m = mgr.match(tokens)
            source = {"restore_l2": "l2", "restore_l3": "l3"}.get(kind, kind)
            assert mgr.runner.start_restore(tokens, m, source, "req") is None
    assert fault.calls == 1
    failed = [e for e in seen if e.get("event") == "op" and e.get("to_state") == "FAILED"]
    assert len(failed) == 1 and failed[0]["error"].startswith("not started: ValueError"), failed
    counted = {k: n - before[k] for k, n in _started(mgr).items()}
    assert counted == {k: int(kind.startswith(k)) for k in counted}, counted
    await mgr.drain()
    assert_whole(mgr, driver_errors=1)
    await mgr.close()


def test_a_write_through_backup_asked_with_no_running_loop_is_not_started():
    """insert_l1 from synchronous code (no running loop) asks for a write-through backup: none starts and none fails
    (regression: it was started, could not make its future with no loop, and failed as a driver error; before
    session 70 the error escaped insert_l1 with the op's locks and L2 pages held). A deferred one (the engine's
    `defer_backups`) stays due, and the next drain, in a loop, starts it."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    assert write_prefix(mgr, toks((1, 33))) is not None
    assert mgr.metrics.backups_started == 0 and not mgr.runner.has_due
    assert_whole(mgr)
    mgr.defer_backups = True
    tokens = toks((40, 72))
    assert write_prefix(mgr, tokens) is not None
    assert mgr.metrics.backups_started == 0 and mgr.runner.has_due
    asyncio.run(mgr.drain())
    assert mgr.metrics.backups_started == 1 and not mgr.runner.has_due
    assert mgr.tree.match(tokens, touch=False).lengths[Tier.L2] == len(tokens)
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_a_take_on_that_raises_over_an_l1_prefix_gives_its_lock_back():
    """The request's first pages are in L1, the rest only in L3: its prefetch is taken on to L1 from that prefix,
    whose lock the take-on adds. Its copy raising (and its log line raising too) leaves the request to be restored
    from L2 once landed, and that lock is given back (regression shape: the node stayed locked for good)."""
    eng, want = await served_then_only_in_l3()
    head = PROMPT[:8] + [3]  # (its restore puts PROMPT[:8] back in L1 and L2)
    assert await _output(eng, head) == await reference(head)
    await eng.cache.drain()
    assert eng.cache.tree.match(PROMPT[:REUSABLE], touch=False).lengths == [8, 8, REUSABLE]
    fault = RaiseOnce(eng.cache.transfer, "h2d_layerwise")
    with unloggable("take_to_l1_error") as seen:
        assert await _output(eng, PROMPT) == want
    assert fault.calls >= 1 and any(e.get("event") == "take_to_l1_error" for e in seen), "the take-on never raised"
    await eng.cache.drain()
    assert_whole(eng.cache)
    await eng.shutdown()


def test_a_read_whose_task_cannot_be_queued_queues_none_after_it(monkeypatch):
    """The read fails once the tasks queued before the failed one ended, with none still to run (regression shape:
    the later tasks were queued, and read into the host pages after the op's future had failed)."""
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
    with storage.FileStore(geometry, num_slots=16, io_workers=4) as store:
        src = torch.randn(geometry.page_major_shape(8))
        slots = [0, 1, 4, 5, 9, 12]  # (fragmented: a task per extent)
        store.write_pages(src, range(6), slots).result(timeout=10)
        first, later = threading.Event(), threading.Event()
        submits, queued, started, ended = [], [], [], []
        real_submit, real_task = store._pool.submit, store._run_task

        def submit(*args):
            submits.append(1)
            if len(submits) == 2:
                raise RuntimeError("can't start new thread")
            queued.append(1)
            return real_submit(*args)

        def held_task(*args):
            started.append(1)
            assert (first if len(started) == 1 else later).wait(HANG_GUARD_S)  # (any later one waits)
            try:
                return real_task(*args)
            finally:
                ended.append(1)
        monkeypatch.setattr(store._pool, "submit", submit)
        monkeypatch.setattr(store, "_run_task", held_task)
        future = store.read_pages(slots, torch.zeros_like(src), range(6))
        first.set()
        try:
            with pytest.raises(RuntimeError, match="can't start new thread"):
                future.result(timeout=HANG_GUARD_S)
            assert len(ended) == len(queued), f"{len(queued) - len(ended)} queued tasks still to read into its pages"
        finally:
            later.set()


@pytest.mark.asyncio
async def test_aborts_settled_by_the_running_loop_end_the_others_aborted(monkeypatch):
    """Three decoding requests aborted in one tick; ending the first one the loop settles raises (every time). That
    one ends "error" and the loop crashes with its error, but the others end "abort" as asked (regression shape:
    they were left live and failed "error" by the crash's fail-over)."""
    eng = make_plain_engine()
    await eng.start()
    reqs = [eng.add_request([1 + i, 2, 3, 4, 5, 6], SamplingParams(max_tokens=500, ignore_eos=True)) for i in range(3)]
    for req in reqs:
        assert not (await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)).finished
    real, victim = eng.admission.release, []

    def release(req, *args, **kw):
        if not victim:
            victim.append(req)
        if req is victim[0]:
            raise RuntimeError("injected: release raised")
        return real(req, *args, **kw)
    monkeypatch.setattr(eng.admission, "release", release)
    for req in reqs:
        await eng.abort(req.rid)
    ended = {req.rid: await ends(req) for req in reqs}
    assert victim and ended.pop(victim[0].rid) == "error"
    assert list(ended.values()) == ["abort", "abort"], ended
    monkeypatch.undo()
    with contextlib.suppress(RuntimeError):  # (the loop's crash, re-raised)
        await asyncio.wait_for(eng.shutdown(), HANG_GUARD_S)


@pytest.mark.asyncio
async def test_an_abort_whose_finish_raises_at_once_still_ends_the_request(monkeypatch):
    """`finish` raising before it did anything (no queue left, no state set): the request still leaves the queues,
    ends FAILED (counted) with an "error" event, its penalty state dropped, and nothing is left `aborting`."""
    eng = make_plain_engine()
    await eng.start()
    reqs = [eng.add_request([1 + i, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(2)]
    await eng.stop_loop()
    victim = reqs[0]
    victim.penalty_state = sentinel = object()  # (a request's device tensors, as a decoding one holds)
    real = eng.finish

    def finish(req, *args, **kw):
        if req is victim:
            raise RuntimeError("injected: finish raised")
        return real(req, *args, **kw)
    monkeypatch.setattr(eng, "finish", finish)
    with pytest.raises(RuntimeError, match="injected"):
        await eng.abort(victim.rid)
    assert not eng.aborting
    assert await ends(victim) == "error" and victim.state is RequestState.FAILED
    assert victim.penalty_state is not sentinel and eng.stats["failed"] == 1
    assert victim not in eng.waiting and victim.rid not in eng.requests
    await eng.abort(reqs[1].rid)
    assert await ends(reqs[1]) == "abort"
    assert_nothing_queued(eng)
    monkeypatch.undo()
    await asyncio.wait_for(eng.shutdown(), HANG_GUARD_S)


@pytest.mark.asyncio
async def test_a_stream_whose_failure_line_raises_still_ends_with_error_and_done(monkeypatch):
    """A chunk's building raises mid-stream and so does the "stream_failed" line that reports it: the stream still
    ends with its internal_error event and [DONE], its places freed (regression shape: the log's raise cut it)."""
    async with serving(monkeypatch) as (app, st, eng, queued):
        raise_once(monkeypatch, choices.Choices, "_chunk", skip=1)
        with unloggable("stream_failed"):
            call = ASGICall(app, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 16,
                                                     "ignore_eos": True, "stream": True})
            assert await call.answer() == 200
        assert call.task.done() and call.task.exception() is None, "the app raised: the connection was cut"
        events = [data for _, data in sse_events(call)]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "internal_error", events[-2:]
        assert st.in_flight == 0


@pytest.mark.asyncio
async def test_a_responses_stream_failed_by_a_bug_carries_the_error_in_its_response(monkeypatch):
    """The Responses stream's own events raise: its last event, `response.failed`, holds a Response whose `error`
    names the bug (as a background response's failed Response does), not only the `error` event before it."""
    async with serving(monkeypatch) as (app, st, eng, queued):
        raise_once(monkeypatch, responses_output, "sse_block", skip=3)
        call = ASGICall(app, "/v1/responses", {**RESPONSE, "stream": True})
        assert await call.answer() == 200
        name, last = sse_events(call)[-1]
        response = json.loads(last)["response"]
        assert name == "response.failed" and response["status"] == "failed"
        assert response["error"]["code"] == "server_error", response["error"]
        assert "injected: sse_block raised" in response["error"]["message"], response["error"]


def test_the_quiet_log_follows_a_redirected_stdout_and_flushes_each_line(saved_logging):
    """A warning goes to sys.stdout as it is when written (a redirect made after logging was set up), and reaches a
    pipe's reader at once (block-buffered, as a pipe is: each line flushed, as structlog's PrintLogger did)."""
    configure_logging(None)
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    out = os.fdopen(write_fd, "w")
    try:
        with contextlib.redirect_stdout(out):
            structlog.get_logger("test").warning("to_the_pipe", n=1)
            try:
                data = os.read(read_fd, 1 << 16)
            except BlockingIOError:
                data = b""
    finally:
        out.close()
        os.close(read_fd)
    assert b"to_the_pipe" in data, "the warning never reached the redirected stdout's reader"
