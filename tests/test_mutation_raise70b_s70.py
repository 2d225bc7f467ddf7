"""Mutation check of session 70's second raise-hunt batch (the cost model's guard, the L1 lock taken with the claim,
SIGTERM in the replay, hicache-serve's start-up clean-up): the rules that no test watched, each pinned by the
behaviour it protects.

- a cost model that raises as it decides leaves the request to recompute: no restore op starts (the fallback
  Decision is "l1"; the hit counters alone did not show a restore that ran uncounted); the read estimate it prices
  with (`reading_s`, the s2h line) raising is guarded too; each failure writes one `cost_model_failed` line naming
  the call, and that line raising (log_anyway) still leaves the caller its safe answer;
- an overlapped admission (`_admit_overlapped`) whose `new_claim` raises leaves its L1 prefix unlocked;
- SIGTERM in the replay: a run off the main thread (no handler can be set there) runs as before; `Terminated` is
  a KeyboardInterrupt (a caller's `except Exception` does not swallow it); the process's handler is put back even
  where the engine's shutdown and its tiers' close both raised, and the loop's entry is taken off (an asyncio loop's
  close would set SIG_DFL); a progress bar that cannot be built still shuts the engine down (its kept L3's index
  saved);
- a deferred write-through backup stays due through a match from synchronous code (`start_due` with no loop);
- hicache-serve's start-up raising after the engine was built closes the model runner too (its thread)."""
from __future__ import annotations

import asyncio
import io
import signal
import sys
import threading

import pytest

from hicache.manager import CacheManager
from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager, toks, write_prefix
from scheduler import replay, serve, sigterm
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.loop_task import crash_of
from scheduler.replay import ReplayItem
from scheduler.request import SamplingParams
from test_faults import PROMPT, reference
from test_faults import make_engine as make_faults_engine
from test_mutation_raise70_s70 import unloggable
from test_raise_admit_s70 import RaiseOnce, _end, _l1_hit_over_l2
from test_raise_cli_s70 import SHORT, adopted_pages, persisted

HANG_GUARD_S = 20


# -- the cost model's guard -------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_cost_model_that_raises_as_it_decides_starts_no_restore():
    """The prefix is in L2 only and the policy would restore it: the cost model raising as it decides leaves the
    request to recompute (no restore op is started), with the no-cache output."""
    eng = make_faults_engine()
    await eng.start()
    want = await reference(PROMPT)
    assert await _end(eng.add_request(PROMPT, SamplingParams(max_tokens=4))) == ("length", want)
    await eng.cache.drain()
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    started = eng.cache.metrics.restores_started
    fault = RaiseOnce(eng.cache.cost, "decide", RuntimeError("a bug in the cost model"))
    assert await _end(eng.add_request(PROMPT, SamplingParams(max_tokens=4))) == ("length", want)
    assert fault.calls >= 1 and eng.cache.metrics.failures.get("cost_model") == 1
    assert eng.cache.metrics.restores_started == started, "a restore ran on the failed decision"
    assert crash_of(eng._loop_task) is None
    await eng.cache.drain()
    assert_whole(eng.cache)
    await eng.shutdown()


def _l2_only(mgr: CacheManager):
    """A 32-token prefix in L2 only (written in a loop: its write-through backup needs one), and its match."""
    tokens = toks((1, 33))

    async def write():
        assert write_prefix(mgr, tokens) is not None
        await mgr.drain()
    asyncio.run(write())
    mgr.tree.evict(Tier.L1, 10 ** 9)
    m = mgr.match(tokens)
    assert m.lengths[:2] == [0, 32]
    return m


def _raise(*args, **kwargs):
    raise OverflowError("math range error")


CALLS = {  # the manager's call, what raises in it
    "decide": lambda mgr, m: (mgr.cost, "decide", lambda: mgr.decide(m)),
    "observe_prefill": lambda mgr, m: (mgr.cost, "observe_prefill", lambda: mgr.observe_prefill(32, 0.01)),
    "observe_outcome": lambda mgr, m: (mgr.cost, "observe_outcome", lambda: mgr.observe_outcome("l2", ((), 0), 0.01)),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_each_cost_model_failure_is_one_line_naming_its_call_and_that_line_may_raise(call):
    """The cost model raising in `call`: one `cost_model_failed` line names the call, the failure is counted once,
    and the caller gets its safe answer (a decision to recompute) even where writing that line raised."""
    mgr = make_manager(policy="cost")
    m = _l2_only(mgr)
    obj, name, invoke = CALLS[call](mgr, m)
    setattr(obj, name, _raise)
    with unloggable("cost_model_failed") as seen:
        result = invoke()
    lines = [e for e in seen if e.get("event") == "cost_model_failed"]
    assert [e.get("call") for e in lines] == [call], seen
    assert mgr.metrics.failures.get("cost_model") == 1
    if call == "decide":
        assert result.tier == "l1" and result.restore_tokens == 0


def test_a_read_estimate_that_raises_as_the_cost_model_decides_is_its_failure():
    """With GPU work queued beside the request (hidden_s), the decision prices the storage reads in flight
    (`runner.reading_s`, the cost model's s2h line): that raising is the cost model's failure too, not the loop's."""
    mgr = make_manager(policy="cost")
    m = _l2_only(mgr)
    mgr.runner.reading_s = _raise
    decision = mgr.decide(m, hidden_s=0.5)
    assert decision.tier == "l1" and decision.restore_tokens == 0
    assert mgr.metrics.failures.get("cost_model") == 1


# -- the L1 lock taken with the claim ---------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_an_overlapped_admission_whose_claim_raises_leaves_no_l1_prefix_locked():
    """The request's L1 prefix is locked with its claim in `_admit_overlapped` too: `new_claim` raising there crashes
    the loop (as designed) and leaves that prefix unlocked (regression shape: locked before the claim, for good)."""
    eng = make_faults_engine()
    await eng.start()
    prompt = await _l1_hit_over_l2(eng)
    real_admit = eng.admission._admit_overlapped

    def admit_overlapped(*args, **kwargs):  # (the fault armed for this call only)
        fault = RaiseOnce(eng.cache, "new_claim", RuntimeError("a bug in admission"))
        try:
            return real_admit(*args, **kwargs)
        finally:
            eng.cache.new_claim = fault.real
            overlapped.append(fault.calls)
    overlapped = []
    eng.admission._admit_overlapped = admit_overlapped
    assert (await _end(eng.add_request(prompt, SamplingParams(max_tokens=4))))[0] == "error"
    assert overlapped == [1] and isinstance(crash_of(eng._loop_task), RuntimeError)
    eng.admission._admit_overlapped = real_admit
    await eng.start()
    assert await _end(eng.add_request(PROMPT, SamplingParams(max_tokens=4))) == ("length", await reference(PROMPT))
    await eng.cache.drain()
    assert_whole(eng.cache)  # (no node locked)
    await eng.shutdown()


# -- SIGTERM in the replay --------------------------------------------------------------------------------------------
def test_a_replay_off_the_main_thread_runs_without_a_sigterm_handler():
    """No signal handler can be set off the main thread (uvloop: ValueError): the replay runs as it did."""
    handler, got = signal.getsignal(signal.SIGTERM), []

    def run():
        try:
            got.append(replay.run_cli(SHORT))
        except BaseException as exc:  # (SystemExit too: the replay refused)
            got.append(exc)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    assert len(got) == 1 and isinstance(got[0], dict), got
    assert got[0]["completed"] == 6
    assert signal.getsignal(signal.SIGTERM) is handler


def test_a_run_sigterm_ended_is_a_keyboard_interrupt():
    """`sigterm.run` turns the run's SIGTERM cancel into Terminated, which a caller's `except Exception` lets through
    (as Ctrl-C's KeyboardInterrupt); any other cancel is re-raised as it is."""
    def cancelled(message):
        def runner(main):
            main.close()
            raise asyncio.CancelledError(message)
        return runner

    async def main():
        pass
    with pytest.raises(KeyboardInterrupt):
        try:
            sigterm.run(cancelled("SIGTERM"), main())
        except Exception:  # (what a caller's handler of errors catches)
            pytest.fail("Terminated was caught as an error")
    with pytest.raises(asyncio.CancelledError):
        sigterm.run(cancelled("other"), main())


def test_the_sigterm_handler_is_put_back_when_shutdown_and_close_both_raise(monkeypatch):
    """The engine's shutdown raises (a crashed loop re-raises there) and so does the tiers' close after it: the error
    surfaces and the process's SIGTERM handler is the one it had (regression shape: the loop's was left, and its
    closing left SIG_DFL)."""
    def noted(sig, frame):
        pass
    previous = signal.signal(signal.SIGTERM, noted)
    real_shutdown, real_close = Engine.shutdown, CacheManager.close

    async def shutdown(self, *args, **kwargs):
        await real_shutdown(self, *args, **kwargs)
        raise RuntimeError("the loop crashed")

    async def close(self):
        await real_close(self)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(Engine, "shutdown", shutdown)
    monkeypatch.setattr(CacheManager, "close", close)
    try:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            replay.run_cli(SHORT)
        assert signal.getsignal(signal.SIGTERM) is noted
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_replay_run_on_an_asyncio_loop_leaves_the_sigterm_handler_as_it_found_it():
    """replay_async run by asyncio (a library's caller; the CLI runs it on uvloop) sets its SIGTERM handler on that loop
    and takes it off as it ends: once the loop closed, the process's handler is the one it had (regression shape:
    the loop's entry left, its close set SIG_DFL and a later SIGTERM killed the caller's process)."""
    def noted(sig, frame):
        pass
    previous = signal.signal(signal.SIGTERM, noted)
    try:
        items = [ReplayItem(i, i + 1, 0.0, [i + 1] * 8, 4) for i in range(2)]
        run = asyncio.run(replay.replay_async(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64),
                                              items))
        assert run["engine_crash"] is None and all(not o.error for o in run["outcomes"])
        assert signal.getsignal(signal.SIGTERM) is noted
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_bar_that_cannot_be_built_still_shuts_the_engine_down(tmp_path, monkeypatch):
    """On a terminal the replay builds a progress bar once the engine is built: that raising (a terminal gone) still
    shuts the engine down, its kept L3's index saved for the next run."""
    replay.run_cli([*SHORT, *persisted(tmp_path)])
    assert (tmp_path / "l3.index").exists()

    def no_bar(*args, **kwargs):
        raise BrokenPipeError("the terminal went away")
    monkeypatch.setattr("tqdm.tqdm", no_bar)
    monkeypatch.setattr(sys, "stderr", _Terminal())  # (tqdm's stream)
    with pytest.raises(BrokenPipeError):
        replay.run_cli([*SHORT[1:], *persisted(tmp_path)])  # (without --no-progress)
    monkeypatch.undo()
    assert (tmp_path / "l3.index").exists(), "the engine was not shut down: its adopted index is lost"
    assert adopted_pages(tmp_path) > 0


# -- write-through backups asked with no running loop ---------------------------------------------------------------
def test_a_deferred_backup_stays_due_through_a_synchronous_match():
    """A deferred backup asked from synchronous code stays due; a match from synchronous code (which starts the due
    backups first) cannot start it with no loop to drive its copy, and must keep it due, not drop it: the next drain,
    in a loop, starts it."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    mgr.defer_backups = True
    tokens = toks((40, 72))
    assert write_prefix(mgr, tokens) is not None and mgr.runner.has_due
    assert mgr.match(tokens).lengths[Tier.L1] == len(tokens)  # (start_due with no loop)
    assert mgr.runner.has_due and mgr.metrics.backups_started == 0, "the due backup was dropped"
    asyncio.run(mgr.drain())
    assert mgr.metrics.backups_started == 1 and not mgr.runner.has_due
    assert mgr.tree.match(tokens, touch=False).lengths[Tier.L2] == len(tokens)


# -- hicache-serve's start-up -----------------------------------------------------------------------------------------
def test_a_server_start_up_failing_after_the_engine_was_built_closes_its_model_runner(monkeypatch):
    built = []

    def failing_create_app(engine, *args, **kwargs):
        built.append(engine)
        raise RuntimeError("create_app failed")
    monkeypatch.setattr(serve, "create_app", failing_create_app)
    with pytest.raises(RuntimeError, match="create_app failed"):
        serve.main(["--model", "tiny", "--device", "cpu", "--port", "0", "--page-size", "16", "--num-pages", "64"])
    assert len(built) == 1 and built[0].runner._waiter._shutdown, "the model runner's thread was left running"
