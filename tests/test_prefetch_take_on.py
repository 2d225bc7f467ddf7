"""An L3 prefetch taken on to L1 while its checksums run (`Admission._take_landed`, `take_to_l1`): the
request's tail forward starts behind the landed read's H2D, its output counts once the checksums
passed; when those checksums start (after the landing, after the forward's launch, the driver's
fallback); the prefetch decision's credit for the H2D the forward hides; failures and aborts on the
way. Restores of L2 hits overlapped with the forward: tests/test_restore_overlap.py.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import assert_whole, capture_op_logs, flip_l3_byte, op_transitions
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from test_faults import (PAGE, PARAMS, PROMPT, REUSABLE, TransferGate, finish, make_engine, only_in_l3, reference,
                         run_one, until)


# -- a prefetch taken on to L1 while its checksums run (Admission._take_landed) -----------------
async def _prefix_only_in_l3(faults: FaultInjector, **hicache) -> Engine:
    """An engine that served PROMPT once, then lost it from L1 and L2; the next request's prefetch
    finds it in L3 only, and its checksums take 0.3 s (SLOW_VERIFY) after the bytes landed."""
    eng = make_engine(faults, **hicache)
    await eng.start()
    await run_one(eng)
    eng.cache.runner.start_backup(PROMPT[:REUSABLE])  # (selective write-through backs nothing up itself)
    await eng.cache.drain()
    only_in_l3(eng, PROMPT[:REUSABLE])
    faults.arm(Fault.SLOW_VERIFY, times=None, delay_s=0.3)
    return eng


@pytest.mark.asyncio
async def test_prefetch_taken_on_to_l1_overlaps_its_checksums_with_the_forward():
    """The request takes its prefetch on to L1 as soon as the read landed: the tail's forward runs
    while the checksums are still being computed, and its output counts once they passed."""
    faults = FaultInjector()
    eng = await _prefix_only_in_l3(faults)
    want = await reference(PROMPT)
    with capture_op_logs() as logs:
        result = await run_one(eng)
    assert result.output_ids == want
    assert result.cached_tokens == {"l1": 0, "l2": 0, "l3": REUSABLE}
    assert eng.stats["restore_overlaps"] == 1
    assert list(op_transitions(logs, "prefetch_l3").values()) == [
        ["L3", "S2H_PENDING", "S2H_LANDED", "H2D_VERIFYING", "H2D_PENDING", "L1_L2_L3"]]
    [verified] = [e for e in logs if e.get("event") == "op" and e["op_event"] == "S2H_DONE"]
    first_forward = next(e for e in logs if e.get("event") == "batch")
    assert first_forward["end_ns"] < verified["ts_ns"]  # the forward did not wait for the checksums
    assert eng.metrics()["hit_tokens"]["l3"] == REUSABLE and eng.metrics()["fallbacks"] == 0
    await eng.cache.drain()
    assert eng.cache.tree.match(PROMPT[:REUSABLE], touch=False).lengths == [REUSABLE] * 3  # all published
    # the read was verified after its landing (its request ran alone): the cost model learned the
    # landing, not the 0.3 s the checksums took under the forward (regression, session 18)
    (_, read_s), = eng.cache.cost.directions["s2h"]._samples
    s2h = eng.metrics()["directions"]["s2h"]
    # read_s = queue wait + landing; service_s = landing + the wait for the launch + the checksums (it
    # starts at the first worker, so the queue wait, milliseconds on a loaded CI machine, is not in it)
    assert 0.3 <= s2h["service_s"]
    assert read_s - s2h["queue_wait_s"] <= s2h["service_s"] - 0.3  # learned without the checksums' 0.3 s
    await finish(eng)


@pytest.mark.asyncio
async def test_a_taken_prefetch_starts_its_checksums_once_its_forward_was_launched(monkeypatch):
    """The landed read's checksums wait for the launch of the forward that takes it on
    (`Restoring.restore_launched`): on the H200 the verify threads hashing beside the loop had made
    the take-on's H2D enqueue ~1 ms and the launch after it ~1 ms slower (session 22). With the
    driver's fallback far away, only the launch can have started them."""
    import hicache.restores as restores_mod
    monkeypatch.setattr(restores_mod, "HOLD_CHECKS_MAX_S", 30.0)
    faults = FaultInjector()
    eng = await _prefix_only_in_l3(faults)
    faults.disarm(Fault.SLOW_VERIFY)
    want = await reference(PROMPT)
    events: list[str] = []
    verify, launch = eng.cache.store._verify, eng.runner.launch
    monkeypatch.setattr(eng.cache.store, "_verify", lambda *args: (events.append("verify"), verify(*args))[1])

    def spy(batch, *args, **kwargs):
        events.append("launch behind a restore" if batch.wait_restore else "launch")
        return launch(batch, *args, **kwargs)
    monkeypatch.setattr(eng.runner, "launch", spy)
    t0 = time.perf_counter()
    result = await run_one(eng)
    assert time.perf_counter() - t0 < 10.0  # not the fallback's 30 s
    assert result.output_ids == want and result.cached_tokens == {"l1": 0, "l2": 0, "l3": REUSABLE}
    assert events[0] == "launch behind a restore" and "verify" in events
    await finish(eng)


@pytest.mark.parametrize("fallback_s", [0.005, None])
@pytest.mark.asyncio
async def test_a_landed_prefetch_no_one_takes_on_verifies_after_the_drivers_fallback(monkeypatch, fallback_s):
    """A prefetch expected to be taken on whose request never comes to take it (here the loop is
    stopped) still verifies and publishes its L2 pages: its driver starts the held checksums
    HOLD_CHECKS_MAX_S after the landing. (None: no fallback within the test, the read stays held.)"""
    import hicache.restores as restores_mod
    monkeypatch.setattr(restores_mod, "HOLD_CHECKS_MAX_S", fallback_s or 3600.0)
    faults = FaultInjector()
    eng = await _prefix_only_in_l3(faults)
    faults.disarm(Fault.SLOW_VERIFY)
    await eng.stop_loop()
    req = eng.add_request(PROMPT, PARAMS)
    op = req.prefetch_op
    assert op is not None and op.payload["read"]._start_held is not None  # its checksums are held
    await until(lambda: op.state is not OpState.S2H_PENDING)
    if fallback_s is None:
        await asyncio.sleep(0.3)
        assert op.state is OpState.S2H_LANDED and not op.done
        eng.cache.runner.start_checks(op)
    await until(lambda: op.done)
    assert op.succeeded
    assert eng.cache.tree.match(PROMPT[:REUSABLE], touch=False).lengths[Tier.L2] == REUSABLE
    await eng.start()
    result = await run_one(eng)  # (its own request: now an L2 hit)
    assert result.output_ids == await reference(PROMPT)
    await until(lambda: req.state.done)
    await finish(eng)


@pytest.mark.asyncio
async def test_taken_prefetch_with_a_bad_checksum_discards_the_forward_and_recomputes():
    faults = FaultInjector()
    eng = await _prefix_only_in_l3(faults, write_policy="write_through_selective")
    want = await reference(PROMPT)
    tokens = PROMPT[:REUSABLE]
    flip_l3_byte(eng.cache, eng.cache.tree.match(tokens, touch=False).pages[Tier.L3][2])
    with capture_op_logs() as logs:
        result = await run_one(eng)
        await eng.cache.drain()
    assert result.output_ids == want
    assert result.cached_tokens == {"l1": 0, "l2": 0, "l3": 0}  # recomputed
    [failed] = [e for e in logs if e.get("event") == "op" and e["to_state"] == "FAILED"]
    assert failed["kind"] == "prefetch_l3" and failed["from_state"] == "H2D_VERIFYING"
    assert any(e.get("state") == "restore_overlap_discarded" for e in logs)
    assert eng.metrics()["failures"] == {"checksum": 1}
    assert eng.metrics()["hit_tokens"]["l3"] == 0
    m = eng.cache.tree.match(tokens, touch=False)
    assert m.lengths[Tier.L3] <= 2 * PAGE  # the corrupt page lost its L3 residency
    assert m.lengths[Tier.L2] == 0  # nothing unverified was published
    assert_whole(eng.cache)
    assert (await run_one(eng)).output_ids == want
    await finish(eng)


@pytest.mark.asyncio
async def test_abort_while_a_taken_prefetch_verifies_frees_its_pages_after_the_copy():
    faults = FaultInjector()
    eng = await _prefix_only_in_l3(faults)
    want = await reference(PROMPT)
    with capture_op_logs() as logs:
        task = asyncio.create_task(run_one(eng, max_tokens=64))
        await until(lambda: any(op.state is OpState.H2D_VERIFYING for op in eng.cache.runner.live.values()))
        [op] = eng.cache.runner.live.values()
        assert await eng.abort(op.request_id)
        result = await task
        await eng.cache.drain()
    assert result.finish_reason == "abort"
    [cancelled] = [e for e in logs if e.get("event") == "op" and e["to_state"] == "CANCELLED"]
    assert cancelled["op_id"] == op.op_id and cancelled["from_state"] == "H2D_PENDING"
    assert_whole(eng.cache)
    # the verified L2 pages were published; the cancelled L1 copy was not
    assert eng.cache.tree.match(PROMPT[:REUSABLE], touch=False).lengths[:2] == [0, REUSABLE]
    assert (await run_one(eng)).output_ids == want
    await finish(eng)


@pytest.mark.asyncio
async def test_prefetch_is_not_taken_without_restore_overlap():
    faults = FaultInjector()
    config = EngineConfig(model="tiny", device="cpu", num_pages=48, page_size=PAGE,
                          restore_overlap=False).with_hicache(enable=True, policy="always")
    eng = Engine(config, faults=faults)
    await eng.start()
    await run_one(eng)
    await eng.cache.drain()
    only_in_l3(eng, PROMPT[:REUSABLE])
    faults.arm(Fault.SLOW_VERIFY, times=None, delay_s=0.1)
    with capture_op_logs() as logs:
        result = await run_one(eng)
    assert result.output_ids == await reference(PROMPT)
    assert list(op_transitions(logs, "prefetch_l3").values()) == [["L3", "S2H_PENDING", "S2H_LANDED", "L2_L3"]]
    assert result.cached_tokens["l2"] + result.cached_tokens["l3"] == REUSABLE
    await finish(eng)


async def served_then_only_in_l3(restore_overlap: bool, policy: str, max_prefill_tokens: int = 2048,
                                 **hicache) -> Engine:
    """An engine (the given restore overlap, policy and prefill chunk) that served PROMPT once and backed
    its prefix up to L3, then lost it from L1 and L2: the next request's prefetch finds it in L3 only."""
    config = EngineConfig(model="tiny", device="cpu", num_pages=48, page_size=PAGE, max_prefill_tokens=max_prefill_tokens,
                          restore_overlap=restore_overlap).with_hicache(enable=True, policy=policy,
                                                                        transfer_backend="torch", **hicache)
    eng = Engine(config, faults=FaultInjector())
    await eng.start()
    await run_one(eng)
    eng.cache.runner.start_backup(PROMPT[:REUSABLE])
    await eng.cache.drain()
    only_in_l3(eng, PROMPT[:REUSABLE])
    return eng


@pytest.mark.parametrize("overlap,prefetch", [(True, True), (False, True), (True, False)])
@pytest.mark.asyncio
async def test_the_prefetch_decision_credits_an_h2d_the_forward_will_hide(overlap, prefetch):
    """Regression (session 17's note): the cost policy charged an L3 prefetch's H2D in full though a
    request running alone takes the prefetch on to L1 under its tail's forward, so it recomputed
    hits that a read would have served faster. Here the read alone beats recompute, the read plus
    a serial H2D does not, and the forward (its fixed cost) hides the H2D: with restore overlap the
    prefetch is started and the hit served from L3; without, it is recomputed. So is it without
    prefetches: an L3 restore started at admission reads, then copies (regression, session 18: it
    got the credit too)."""
    eng = await served_then_only_in_l3(overlap, "cost", prefetch=prefetch)
    cost = eng.cache.cost
    cost.learning = False  # the costs below, fixed: no exploration, no new samples
    per_byte = 1.0 / (REUSABLE * cost.bytes_per_token)
    dirs = cost.directions
    dirs["recompute"].fixed_s, dirs["recompute"].slope = 5e-3, 1e-3 / REUSABLE  # recompute: 1 ms
    dirs["s2h"].fixed_s, dirs["s2h"].slope = 0.0, 0.6e-3 * per_byte             # read: 0.6 ms
    dirs["h2d"].fixed_s, dirs["h2d"].slope = 0.0, 0.6e-3 * per_byte             # H2D: 0.6 ms < 5 ms forward
    with capture_op_logs() as logs:
        result = await run_one(eng)
    assert result.output_ids == await reference(PROMPT)
    prefetches = op_transitions(logs, "prefetch_l3")
    if overlap and prefetch:
        assert len(prefetches) == 1 and result.cached_tokens == {"l1": 0, "l2": 0, "l3": REUSABLE}
    else:
        assert not prefetches and not op_transitions(logs, "restore_l3")
        assert result.cached_tokens == {"l1": 0, "l2": 0, "l3": 0}
    await finish(eng)


@pytest.mark.parametrize("overlap,max_bytes,capable", [(True, None, True), (False, None, True), (True, 0, True),
                                                       (True, None, False)])
@pytest.mark.asyncio
async def test_a_prefetch_expected_to_be_taken_on_verifies_after_landing(overlap, max_bytes, capable, monkeypatch):
    """A prefetch for a request that would run alone with restore overlap on is taken on to L1 once
    its bytes land, so its read asks the file store to start the checksums only then
    (`hold_checks`, once the forward was launched: hashing beside the read slowed the landing,
    session 18, and beside the take-on and the launch slowed those, session 22), unless the
    read is longer than VERIFY_AFTER_LANDING_MAX_BYTES (its checksums would outlast the H2D and the
    forward), or the store does not land bytes before verifying them (`can_check_after_landing`: a
    Redis store verifies each value as it loads it). Otherwise the checksums run beside the read,
    which then completes soonest."""
    from hicache.storage import FileStore
    monkeypatch.setattr(FileStore, "can_check_after_landing", capable)
    if max_bytes is not None:
        import hicache.restores as restores_mod
        monkeypatch.setattr(restores_mod, "VERIFY_AFTER_LANDING_MAX_BYTES", max_bytes)
    eng = await served_then_only_in_l3(overlap, "always")
    store, reads = eng.cache.store, []
    read_pages = store.read_pages

    def spy(*args, **kwargs):
        reads.append(kwargs)
        return read_pages(*args, **kwargs)
    store.read_pages = spy
    result = await run_one(eng)
    assert result.output_ids == await reference(PROMPT)
    assert result.cached_tokens["l2"] + result.cached_tokens["l3"] == REUSABLE
    after_landing = overlap and max_bytes is None and capable
    assert [r.get("hold_checks", False) or r.get("checksums_after_landing", False)
            for r in reads] == [after_landing]
    await finish(eng)


async def _fails_with_its_h2d_held(eng, gate, kind: str):
    """PROMPT's request, whose taken prefetch fails (`kind`) while `gate` holds its H2D: its pages wait for
    that copy (one op settling) until the gate opens; returns the request's result."""
    task = asyncio.create_task(run_one(eng))
    await until(lambda: eng.cache.metrics.failures.get(kind))
    await asyncio.sleep(0.05)
    assert eng.cache.runner.pending_counts()["settling"] == 1  # its pages wait for the H2D held back
    gate.release.set()
    return await task


@pytest.mark.asyncio
async def test_a_driver_that_raises_with_a_copy_in_flight_keeps_its_pages_until_it_settled(monkeypatch):
    """A driver bug (here: publishing the verified L2 pages raises) while its H2D still runs: the op
    freed its L1 pages at once, and a copy still landing could write into pages already reused."""
    faults = FaultInjector()
    eng = await _prefix_only_in_l3(faults)
    gate = TransferGate(eng, "h2d")
    runner, real_publish = eng.cache.runner, eng.cache.runner._publish

    def publish(op, tokens, tier, *args, **kw):
        if tier is Tier.L2 and op.payload.get("transfer") is not None:  # a taken prefetch, its H2D enqueued
            raise RuntimeError("a bug while the H2D still runs")
        return real_publish(op, tokens, tier, *args, **kw)
    monkeypatch.setattr(runner, "_publish", publish)
    with capture_op_logs():
        result = await _fails_with_its_h2d_held(eng, gate, "driver")
    assert result.output_ids == await reference(PROMPT)  # recomputed
    await eng.stop_loop()
    await eng.cache.drain()
    assert runner.pending_counts()["settling"] == 0 and eng.cache.metrics.failures["driver"] == 1
    assert_whole(eng.cache, driver_errors=1)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_taken_prefetch_whose_checksum_fails_with_its_h2d_in_flight_keeps_its_pages_until_it_settled():
    """A bad checksum found while the taken prefetch's H2D still runs: its L1 pages are freed only once that
    copy settled (a copy still landing could write into pages already reused; operations.py's P26 of session
    61's mutation check: `_storage_failed` released them at once)."""
    faults = FaultInjector()
    eng = await _prefix_only_in_l3(faults, write_policy="write_through_selective")
    flip_l3_byte(eng.cache, eng.cache.tree.match(PROMPT[:REUSABLE], touch=False).pages[Tier.L3][2])
    gate, runner = TransferGate(eng, "h2d"), eng.cache.runner
    result = await _fails_with_its_h2d_held(eng, gate, "checksum")
    assert result.output_ids == await reference(PROMPT) and result.cached_tokens["l3"] == 0  # recomputed
    await eng.cache.drain()
    assert runner.pending_counts()["settling"] == 0
    assert_whole(eng.cache)
    await finish(eng)


async def _held_prefetch(monkeypatch, prompts_first=()):
    """An engine whose loop is stopped, PROMPT's prefix only in L3, no driver fallback within the
    test (HOLD_CHECKS_MAX_S far away), and `prompts_first` queued before PROMPT; returns the engine
    and PROMPT's request, whose prefetch read has landed with its checksums held for a take-on."""
    import hicache.restores as restores_mod
    monkeypatch.setattr(restores_mod, "HOLD_CHECKS_MAX_S", 3600.0)
    faults = FaultInjector()
    eng = await _prefix_only_in_l3(faults)
    faults.disarm(Fault.SLOW_VERIFY)
    await eng.stop_loop()
    for prompt in prompts_first:
        eng.add_request(prompt, PARAMS)
    req = eng.add_request(PROMPT, PARAMS)
    op = req.prefetch_op
    assert op is not None and op.payload["read"]._start_held is not None  # held for the take-on
    await until(lambda: op.state is OpState.S2H_LANDED)
    return eng, req, op


@pytest.mark.asyncio
async def test_a_landed_prefetch_its_request_declines_verifies_at_once(monkeypatch):
    """A request that does not run alone (another prompt shares its prefill batch) cannot take its
    landed prefetch on (`_take_landed`): the held checksums start right then, not at the driver's
    fallback. (Offered the landed read again once alone, it may still take it on while they run.)"""
    other = [7 + i for i in range(3 * PAGE)]  # a prompt with nothing cached, admitted first
    eng, req, op = await _held_prefetch(monkeypatch, prompts_first=[other])
    held_after_decline = []
    take = eng.admission._take_landed

    def spy(r, alone, budget):
        taken = take(r, alone, budget)
        if not taken:
            held_after_decline.append(bool(eng.cache.store._held))
        return taken
    monkeypatch.setattr(eng.admission, "_take_landed", spy)
    await eng.start()
    await until(lambda: req.state.done)
    assert held_after_decline and not held_after_decline[0]
    assert op.succeeded and req.output == await reference(PROMPT)
    assert req.hit_tokens["l3"] == REUSABLE
    await finish(eng)


@pytest.mark.asyncio
async def test_an_abort_between_landing_and_take_on_releases_the_held_read(monkeypatch):
    """Regression (session 23): a request aborted after its prefetch's read landed, and before it
    could take it on, left the read's checksums held until the driver's fallback: `cancel` now
    starts them, and the cancelled prefetch settles with every tier's accounting whole."""
    eng, req, op = await _held_prefetch(monkeypatch)
    assert await eng.abort(req.rid)
    await until(lambda: op.done, timeout_s=5.0)
    assert not op.succeeded
    await eng.cache.drain()
    assert not eng.cache.store._held
    assert_whole(eng.cache)
    await eng.start()
    assert (await run_one(eng)).output_ids == await reference(PROMPT)
    await finish(eng)
