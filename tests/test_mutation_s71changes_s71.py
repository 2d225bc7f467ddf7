"""Mutation check of session 71's changes (the background run's failed keep, the engine loop's interrupt, the cost
model's `_guarded` calls, the replay's Ctrl-C and long waits, Redis's suspect keys, the lock-holder referee): the
rules that no test watched, each pinned by the behaviour it protects.

- a background run whose final keep raises: a cancelled end stays "cancelled" (the client asked for it; only a
  completed or incomplete end turns "failed"), and a failed Response carries no `incomplete_details`;
- an interrupt in the engine loop ends the waiting requests too (not only the running ones), and an end that raises
  then does not replace the interrupt (the others still end);
- each guarded cost-model call answers its safe answer (0 pages whole first, no write, no backup) where the cost
  model raises, counted once; a failed `decide` is no policy skip;
- a Ctrl-C that did not come through the runner's cancel says "the run stopped", not that the engine shut down;
- a timed replay's long waits: more than an hour (not exactly one, nor only days) is said, naming the longest, with
  the count of them;
- Redis suspect keys: remembered while the store backs off, retried at the hint refresh (those alone: the prompt's
  clean pages stay), cleared by a deletion or by this store's write, and never holding back other prompts' hints;
- `Engine.check_integrity` passes at every tick of an overlapped L2 restore and an L3 prefetch (ops live, ended with
  their pages held, locks below a split node), and catches a lock a holder lost (held but not locked).
Real throwaway redis-servers for the Redis tests (tests/redis_server.py)."""
from __future__ import annotations

import asyncio
import signal
import time

import pytest

from hicache.radix import Tier
from hicache_helpers import make_manager
from redis_server import needs_redis, random_pages, redis_server, server  # noqa: F401
from scheduler import replay
from scheduler.request import RequestState, SamplingParams
from scheduler.responses_background import BackgroundResponses
from scheduler.responses_store import ResponsesStore
from test_cancel_hunt import make_engine as make_cancel_engine
from test_faults import MAX_TOKENS, PAGE, PROMPT, make_engine, reference, run_one
from test_lifecycle_hunt import assert_nothing_queued
from test_mutation_raise70b_s70 import _l2_only, _raise
from test_mutation_responses69_s69 import _output, _streaming
from test_raise_api2_s71 import _answer
from test_raise_api_s70 import _release_raises_for
from test_raise_cancel_s70 import serves_on
from test_raise_cli_s70 import SHORT
from test_raise_http_s69 import RESPONSE, ASGICall, raise_once, serving
from test_raise_loop_s71 import Replayed, interrupted_run, trace_of
from test_raise_store_s71 import _time_out_one_delete
from test_responses_background import _HangingChoices
from test_responses_background_hunt import _Slot

_FIXTURES = (redis_server, server)
HANG_GUARD_S = 20


# -- a background run's final keep raising ----------------------------------------------------------------------------
def test_a_cancelled_background_run_whose_keep_raises_stays_cancelled():
    """Cancelled mid-stream; keeping its cancelled Response raises: it ends "cancelled" (its last event
    `response.cancelled`), not "failed" as a completed end that could not be kept does."""
    store = ResponsesStore(4)
    out = _output(store, _HangingChoices())

    def keep(*args, **kwargs):
        raise RuntimeError("injected: keep raised")

    async def scenario():
        background = BackgroundResponses(store)
        background.start(out, _Slot(), stream=False)
        run = store.run(out.id)
        await _streaming(run)
        run.keep = keep
        await asyncio.wait_for(run.cancel(), HANG_GUARD_S)
        return run

    run = asyncio.run(scenario())
    assert run.response["status"] == "cancelled" and run.events[-1]["type"] == "response.cancelled"


@pytest.mark.asyncio
async def test_a_failed_keep_of_an_incomplete_response_drops_its_incomplete_details(monkeypatch):
    """The run ended "incomplete" (max_output_tokens) and could not be kept: its failed Response says why it failed,
    and no longer that it was cut at max_output_tokens."""
    async with serving(monkeypatch) as (app, st, eng, queued):
        raise_once(monkeypatch, st.responses, "put", skip=1)
        call = ASGICall(app, "/v1/responses", {**RESPONSE, "background": True})
        assert await call.answer() == 200
        [run] = st.background.running
        await asyncio.wait_for(asyncio.wait([run.task]), HANG_GUARD_S)
        got = st.responses.response(_answer(call)["id"])
        assert got["status"] == "failed" and got["incomplete_details"] is None, got


# -- an interrupt in the engine loop ----------------------------------------------------------------------------------
def test_an_interrupt_ends_waiting_requests_too_and_an_end_that_raises_does_not_replace_it(monkeypatch):
    """One request runs (--max-running-requests 1), two wait; ending the last one raises. The interrupt goes out of
    asyncio.run as it came; the running and the first waiting request end aborted, the broken one failed, each
    with its last event (regression shapes: only running requests aborted; the end's RuntimeError went out)."""
    eng = make_cancel_engine(num_pages=256, max_running_requests=1)
    reqs = interrupted_run(monkeypatch, eng, (PROMPT, [4, 5, 6, 7], [8, 9, 10, 11]), KeyboardInterrupt, at_step=3,
                           before_reading=lambda reqs: _release_raises_for(monkeypatch, eng, reqs[2]))
    assert [r.state for r in reqs] == [RequestState.ABORTED, RequestState.ABORTED, RequestState.FAILED], \
        [(r.rid, r.state) for r in reqs]
    assert all(r.queue.qsize() and r.queue._queue[-1].finished for r in reqs)
    assert_nothing_queued(eng)
    serves_on(eng)


# -- the cost model's guarded calls -----------------------------------------------------------------------------------
class _RaisingDirections(dict):
    def __getitem__(self, key):
        raise ZeroDivisionError("injected: a line gone wrong")


GUARDED = {  # the manager's call: (the cost model's members that raise, the call, its safe answer)
    "whole_first_pages": (("directions",), lambda mgr: mgr.whole_first_pages(4, 8), 0),
    "worth_writing": (("worth_writing",), lambda mgr: mgr.worth_writing("l2", 32), False),
    "backup_worth_its_cost": (("backup_worth_its_cost",), lambda mgr: mgr.backup_worth_its_cost(32), False),
    "backup_pays_off": (("worth_writing", "break_even_read_fraction"), lambda mgr: mgr.backup_pays_off(32), False),
}


@pytest.mark.parametrize("call", sorted(GUARDED))
def test_each_guarded_cost_call_answers_its_safe_answer(call):
    """The cost model raising in `call`: the caller gets no write, no backup, a restore all in layers (0 pages
    whole first), and the failure is counted once (regression shapes: the raise went out to the loop; a write or
    every page whole first as the answer)."""
    mgr = make_manager(policy="cost")
    mgr.overlap_forward_s = 0.01  # (whole_first_pages: a forward was timed)
    members, invoke, safe = GUARDED[call]
    for name in members:
        setattr(mgr.cost, name, _RaisingDirections() if name == "directions" else _raise)
    answer = invoke(mgr)
    assert answer == safe and type(answer) is type(safe), answer
    assert mgr.metrics.failures.get("cost_model") == 1


def test_a_failed_decision_is_no_policy_skip():
    """The prefix in L2 only; the cost model raising as it decides: the request recomputes, counted as a cost model
    failure, not as the policy declining the restore (`policy_skips`)."""
    mgr = make_manager(policy="cost")
    m = _l2_only(mgr)
    skips = mgr.metrics.policy_skips["restore"]
    mgr.cost.decide = _raise
    decision = mgr.decide(m)
    assert decision.tier == "l1" and mgr.metrics.failures.get("cost_model") == 1
    assert mgr.metrics.policy_skips["restore"] == skips


# -- the replay's Ctrl-C and long waits -------------------------------------------------------------------------------
def test_a_ctrl_c_not_from_the_runner_says_the_run_stopped(monkeypatch, capsys):
    """A KeyboardInterrupt out of the run that no cancel of the runner's came before (a second Ctrl-C, in the
    engine's shutdown): exit 130, and the line does not claim the engine shut down."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(replay, "replay", interrupted)
    with pytest.raises(SystemExit) as stopped:
        replay.main(SHORT)
    assert stopped.value.code == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C): the run stopped; no summary" in err and "engine shut down" not in err, err


def _warned(tmp_path, monkeypatch, capsys, timestamps: list[float]) -> str:
    monkeypatch.setattr(replay, "replay", lambda *args, **kwargs: (_ for _ in ()).throw(Replayed()))
    argv = ["--trace", str(trace_of(tmp_path, timestamps)), "--device", "cpu", "--block-tokens", "16",
            "--l1-tokens", "4096", "--l3-tokens", "0", "--no-progress", "--time-scale", "1"]
    with pytest.raises(Replayed):
        replay.run_cli(argv)
    return capsys.readouterr().err


def test_a_wait_of_exactly_an_hour_is_not_said_and_two_hours_is(tmp_path, monkeypatch, capsys):
    hour_ms = 3600 * 1000
    assert "arrives" not in _warned(tmp_path, monkeypatch, capsys, [0, hour_ms, 2 * hour_ms])
    err = _warned(tmp_path, monkeypatch, capsys, [0, 2 * hour_ms, 2 * hour_ms + 10])
    assert ":2: arrives 2.0 h after the request before it" in err and "waits of more than an hour" not in err, err


def test_several_long_waits_name_the_longest_and_count_them(tmp_path, monkeypatch, capsys):
    """Waits of 2 h then 5 h: the line names the 5 h one (line 3) and says there are 2 such waits."""
    hour_ms = 3600 * 1000
    err = _warned(tmp_path, monkeypatch, capsys, [0, 2 * hour_ms, 7 * hour_ms])
    assert ":3: arrives 5.0 h after the request before it" in err, err
    assert "(2 waits of more than an hour in all)" in err, err


# -- Redis suspect keys -----------------------------------------------------------------------------------------------
TOKENS = tuple(range(300, 332))  # 8 pages


async def _redis(url: str, tokens=TOKENS):
    """A manager on Redis (no back-off wait after a failure) and `tokens`' pages written there; their keys."""
    mgr = make_manager(storage_backend="redis", storage_url=url, model_id="m")
    store = mgr.store
    store.backoff_s = (0.0, 0.0)
    keys = store.page_keys(tokens, 0, len(tokens))
    await store.write_pages(random_pages(mgr.geometry, len(keys), seed=1), range(len(keys)), range(len(keys)), keys)
    return mgr, keys


def _hinted(mgr, tokens=TOKENS) -> int:
    return mgr.tree.match(tokens, touch=False).lengths[Tier.L3]


def _delete_never_works(monkeypatch) -> None:
    import redis.asyncio as aioredis
    from redis import exceptions as rexc

    async def delete(self, *keys):
        raise rexc.TimeoutError("Timeout reading from 127.0.0.1")
    monkeypatch.setattr(aioredis.Redis, "delete", delete)


@needs_redis
@pytest.mark.asyncio
async def test_a_failed_suspect_delete_is_retried_at_the_hint_refresh_for_those_keys_alone(server, monkeypatch):
    """A NaN prefix's first 4 pages; their DEL times out once. The prompt's next hint refresh deletes them and hints
    nothing; the prompt's 4 clean pages after them stay in Redis (other instances read them)."""
    mgr, keys = await _redis(server.url())
    store, sync = mgr.store, server.client()
    _time_out_one_delete(monkeypatch)
    store.delete_suspect(keys[:4])
    await store.settle_deletes()
    assert sync.exists(*keys) == 8 and store.counters["suspect_pages_deleted"] == 0
    await store.refresh_hints(mgr, TOKENS)
    assert sync.exists(*keys[:4]) == 0, "the suspect pages were not deleted again"
    assert sync.exists(*keys[4:]) == 4, "clean pages of the prompt were deleted"
    assert store.counters["suspect_pages_deleted"] == 4 and _hinted(mgr) == 0
    await mgr.close()


@needs_redis
@pytest.mark.asyncio
async def test_suspect_keys_asked_while_backed_off_are_never_hinted(server):
    """The store backs off a dead server as the NaN prefix's pages are to be deleted: nothing is sent, but the keys
    are kept; the refresh after the back-off deletes them and hints none (else the next request restored them)."""
    mgr, keys = await _redis(server.url())
    store = mgr.store
    store._down_until = time.monotonic() + 60  # (backing off, as after a dropped connection)
    store.delete_suspect(keys)
    store._down_until = 0.0
    await store.refresh_hints(mgr, TOKENS)
    assert _hinted(mgr) == 0 and server.client().exists(*keys) == 0
    await mgr.close()


@needs_redis
@pytest.mark.asyncio
async def test_pages_written_again_after_their_suspect_delete_are_hinted_again(server):
    """The suspect pages were deleted; another instance then writes that prefix clean: this store hints it again
    (the deleted keys are no longer suspect)."""
    mgr, keys = await _redis(server.url())
    mgr.store.delete_suspect(keys)
    await mgr.store.settle_deletes()
    assert server.client().exists(*keys) == 0
    other, _ = await _redis(server.url())  # (another instance, the same pages)
    await mgr.store.refresh_hints(mgr, TOKENS)
    assert _hinted(mgr) == len(TOKENS)
    await other.close()
    await mgr.close()


@needs_redis
@pytest.mark.asyncio
async def test_undeletable_suspect_keys_hold_back_no_other_prompt_and_a_write_clears_them(server, monkeypatch):
    """DEL never works: prompt A's suspect keys stay. Prompt B (other pages) is hinted whole; once this store writes
    A's pages again (recomputed, clean), A is hinted again too."""
    mgr, keys = await _redis(server.url())
    store = mgr.store
    other_tokens = tuple(range(500, 516))
    other_keys = store.page_keys(other_tokens, 0, 16)
    await store.write_pages(random_pages(mgr.geometry, 4, seed=2), range(4), range(8, 12), other_keys)
    _delete_never_works(monkeypatch)
    store.delete_suspect(keys)
    await store.settle_deletes()
    await store.refresh_hints(mgr, TOKENS)
    assert _hinted(mgr) == 0
    await store.refresh_hints(mgr, other_tokens)
    assert _hinted(mgr, other_tokens) == 16, "a suspect key of another prompt held back this prompt's hints"
    mgr.tree.evict(Tier.L3, store.num_slots)
    await store.write_pages(random_pages(mgr.geometry, 8, seed=3), range(8), range(20, 28), keys)
    await store.refresh_hints(mgr, TOKENS)
    assert _hinted(mgr) == len(TOKENS), "pages this store wrote clean stayed suspect"
    await mgr.close()


# -- the lock-holder referee ------------------------------------------------------------------------------------------
SPLIT = PROMPT[:2 * PAGE] + [7] * (3 * PAGE)  # shares PROMPT's first two pages: PROMPT's node is split below them


@pytest.mark.asyncio
@pytest.mark.parametrize("flushed", ["l1", "l1_l2", "l1_l2_no_prefetch"])
async def test_the_referee_passes_at_every_tick_of_a_restore(flushed):
    """PROMPT cached (below a split node), then L1 (and L2) flushed: its request restores from L2 (layer-ordered,
    overlapped) or L3 (a prefetch, or a parked read). `Engine.check_integrity` at every tick finds each lock held:
    the live ops', an ended restore's pages held for its request, the request's own below the split."""
    eng = make_engine(prefetch=not flushed.endswith("no_prefetch"))
    want = await reference(PROMPT)
    assert (await run_one(eng)).output_ids == want
    assert (await run_one(eng, SPLIT)).error is None
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    if "l2" in flushed:
        eng.cache.flush(Tier.L2)
    real, errors, ticks = eng.admission.settle_overlaps, [], []

    def checked():
        ticks.append(sum(r.locked_node is not None or r.restore_op is not None for r in eng.requests.values()))
        try:
            eng.check_integrity()
        except AssertionError as exc:
            errors.append(str(exc))
        return real()
    eng.admission.settle_overlaps = checked
    out = await run_one(eng)
    assert out.output_ids == want and out.cached_tokens["l1"] == 0, out
    assert sum(ticks) >= 2, "no tick saw the restore or the request's lock"
    assert errors == [], errors[:2]
    await eng.shutdown()


@pytest.mark.asyncio
async def test_the_referee_catches_a_lock_a_running_request_lost():
    """A running request's prefix lock released behind its back (a double release): the request still counts as
    holding it, the tree no longer has it locked: "held but not locked"."""
    eng = make_engine()
    assert (await run_one(eng)).error is None
    await eng.cache.drain()
    await eng.start()
    req = eng.add_request(PROMPT, SamplingParams(max_tokens=MAX_TOKENS))
    assert not (await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)).finished and req.locked_node is not None
    eng.cache.unlock(req.locked_node)
    with pytest.raises(AssertionError, match="held but not locked"):
        eng.check_integrity()
    eng.cache.lock(req.locked_node)
    eng.check_integrity()
    while not (await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)).finished:
        pass
    await eng.shutdown()
