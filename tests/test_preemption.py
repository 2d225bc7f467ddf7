"""Preemption (scheduler/reservations.py): with decode_reserve_ratio below 1 admission reserves less than a request
may use, more requests run at once, and one that outgrows L1 preempts the newest in decode, which resumes from its
K/V in the prefix cache. What each request streams is what it streams without preemption (the same tokens, each
once, in order), the tiers' accounting stays whole, and a request reports the hits of its first admission."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import threading

import pytest
import structlog
import torch

from hicache.faults import Fault, FaultInjector
from hicache.radix import Tier
from scheduler.config import EngineConfig, add_engine_args, config_from_args
from scheduler.engine import Engine
from scheduler.guided import GuidedSpec
from scheduler.replay import ReplayItem, format_summary, replay_async, summarize
from scheduler.request import RequestState, SamplingParams
from scheduler.speculative import SpeculativeConfig
from scheduler.timeline import build_timeline, read_events


def mixed_params(i: int) -> SamplingParams:
    """Greedy, seeded, penalized, with logprobs, guided, min_tokens with EOS allowed, prompt logprobs, in turn."""
    kinds = [{}, {"temperature": 1.0, "seed": i},
             {"temperature": 0.8, "top_p": 0.9, "seed": 100 + i, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
             {"logprobs": 3, "temperature": 1.0, "seed": 7 + i},
             {"guided": GuidedSpec("regex", "[a-z ]{10,60}"), "temperature": 1.0, "seed": i},
             {"min_tokens": 30, "temperature": 1.0, "seed": i, "ignore_eos": False},
             {"prompt_logprobs": 2, "temperature": 1.0, "seed": 50 + i}]
    return SamplingParams(**{"max_tokens": 50, "ignore_eos": True, **kinds[i % len(kinds)]})


def config(ratio: float, variant: str = "plain", **kw) -> EngineConfig:
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=2,
                             draft_policy="always") if variant == "spec" else None
    cfg = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, decode_reserve_ratio=ratio,
                       speculative=spec, **kw)
    if variant == "l2":  # (preempted K/V evicted from L1 comes back from L2)
        cfg = cfg.with_hicache(enable=True, policy="always", host_ratio=4.0, transfer_backend="torch")
    return cfg


def prompt_of(i: int, variant: str = "plain") -> list[int]:
    return [5, 6, 7, 8] * 6 if variant == "spec" else [(i * 13 + j * 7) % 200 + 1 for j in range(20 + i)]


async def run_all(cfg: EngineConfig, prompts, params) -> tuple[Engine, list]:
    eng = Engine(cfg)
    await eng.start()
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while not all(r.state.done for r in reqs):
        await asyncio.sleep(0.002)
    await eng.cache.drain()
    eng.cache.check_integrity()
    return eng, reqs


def streamed(req) -> list[tuple[int | None, int, bool]]:
    events = []
    while not req.queue.empty():
        ev = req.queue.get_nowait()
        events.append((ev.token_id, ev.index, ev.finished))
    return events


@pytest.mark.parametrize("variant", ["plain", "l2", "spec"])
@pytest.mark.asyncio
async def test_preempted_requests_stream_what_they_would_without_preemption(variant):
    prompts = [prompt_of(i, variant) for i in range(12)]
    params = [mixed_params(i) for i in range(12)]
    whole, whole_reqs = await run_all(config(1.0, variant), prompts, params)
    short, short_reqs = await run_all(config(0.0, variant), prompts, params)
    try:
        assert whole.stats["preempted"] == 0  # (ratio 1: every page a request may use is reserved)
        assert short.stats["preempted"] > 0
        assert sum(r.preemptions for r in short_reqs) == short.stats["preempted"]
        for a, b in zip(whole_reqs, short_reqs):
            assert (b.finish_reason, b.error) == (a.finish_reason, a.error) and b.state is RequestState.FINISHED
            assert b.output == a.output
            assert [lp.logprob for lp in b.output_logprobs] == pytest.approx([lp.logprob for lp in a.output_logprobs],
                                                                             abs=1e-4)
            assert len(b.prompt_logprobs) == len(a.prompt_logprobs)  # (computed once: not again as it resumed)
            assert [lp and lp.logprob for lp in b.prompt_logprobs] == pytest.approx(
                [lp and lp.logprob for lp in a.prompt_logprobs], abs=1e-4)
            events = streamed(b)
            assert [e[:2] for e in events[:-1]] == [(t, i) for i, t in enumerate(b.output)]  # each token once
            assert events[-1] == (None, len(b.output), True)
            assert b.resumed_tokens == 0 and b.state.done
        if variant == "l2":
            assert short.cache.metrics.restores_done > 0  # (some resumed from L2)
        if variant != "spec":  # (one prompt: how much of it later requests hit depends on how many run at once)
            # the prompts' hits and computed tokens alone (regression, session 54's hunt: vllm:prefix_cache_queries
            # and the replay's totals counted each resumption's tokens again)
            assert short.cache.metrics.hit_tokens == whole.cache.metrics.hit_tokens
            assert short.cache.metrics.recomputed_tokens == whole.cache.metrics.recomputed_tokens
            assert [r.recomputed_tokens for r in short_reqs] == [r.recomputed_tokens for r in whole_reqs]
        assert short.stats["preempted_recomputed_tokens"] > 0 == whole.stats["preempted_recomputed_tokens"]
    finally:
        await whole.shutdown()
        await short.shutdown()


@pytest.mark.asyncio
async def test_a_smaller_reservation_runs_more_requests_at_once():
    """Eight prompts of 8 tokens, max_tokens 100, in 64 pages of 4: each reserves 27 pages at ratio 1 (two run at
    once); at 0.25 each reserves 9, and more run until one outgrows L1."""
    peaks = {}
    for ratio in (1.0, 0.25):
        eng = Engine(config(ratio))
        launch, peak = eng._launch, [0]

        def counted(work, chain=None, launch=launch, peak=peak, eng=eng):
            peak[0] = max(peak[0], len(eng.running))
            return launch(work, chain)
        eng._launch = counted
        await eng.start()
        reqs = [eng.add_request([i + 1] * 8, SamplingParams(max_tokens=100, ignore_eos=True)) for i in range(8)]
        while not all(r.state.done for r in reqs):
            await asyncio.sleep(0.002)
        eng.cache.check_integrity()
        assert all(len(r.output) == 100 and r.finish_reason == "length" for r in reqs)
        peaks[ratio] = peak[0]
        await eng.shutdown()
    assert peaks[1.0] == 2
    assert peaks[0.25] >= 5


@pytest.mark.asyncio
async def test_the_victim_is_the_least_urgent_then_newest_request_in_decode():
    eng = Engine(dataclasses.replace(config(0.0), scheduling_policy="priority"))
    chosen, preempt = [], eng.admission.preempt

    def recorded(req):
        decoding = [r for r in eng.running if r.state is RequestState.DECODE]
        chosen.append((req, decoding))
        preempt(req)
    eng.admission.preempt = recorded
    await eng.start()
    reqs = [eng.add_request(prompt_of(i), SamplingParams(max_tokens=60, ignore_eos=True, priority=(i * 5) % 3))
            for i in range(10)]
    while not all(r.state.done for r in reqs):
        await asyncio.sleep(0.002)
    eng.cache.check_integrity()
    assert chosen
    for victim, decoding in chosen:  # (the request that needs the page among them: it may be the least urgent)
        assert victim in decoding
        assert (victim.params.priority, victim.arrival_s) == max((r.params.priority, r.arrival_s) for r in decoding)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_less_urgent_request_that_outgrows_l1_preempts_itself_not_a_more_urgent_one():
    """Regression (session 54's hunt): the requester and this step's rows were never candidates, so a priority-5
    request needing a page preempted the priority-0 one decoding beside it."""
    eng = Engine(dataclasses.replace(config(0.0), num_pages=16, scheduling_policy="priority"))
    await eng.start()
    low = eng.add_request([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True, priority=5))
    while len(low.output) < 3:
        await asyncio.sleep(0.001)
    high = eng.add_request([9, 10, 11, 12, 13, 14, 15, 16], SamplingParams(max_tokens=40, ignore_eos=True, priority=0))
    while not (low.state.done and high.state.done):
        await asyncio.sleep(0.002)
    eng.cache.check_integrity()
    assert high.preemptions == 0 and low.preemptions > 0
    assert len(high.output) == len(low.output) == 40 and high.finish_s < low.finish_s
    await eng.shutdown()


@pytest.mark.asyncio
async def test_stop_loop_lets_requests_preempted_during_the_stop_finish():
    """Regression (session 54's hunt): stop_loop() lets the running requests finish, but one preempted meanwhile
    was never admitted again while stopping: 6 of 8 stayed queued mid-stream until the next start()."""
    eng = Engine(config(0.0))
    await eng.start()
    reqs = [eng.add_request([i + 1] * 8, SamplingParams(max_tokens=100, ignore_eos=True)) for i in range(8)]
    while eng.waiting or any(r.state is not RequestState.DECODE for r in eng.running):
        await asyncio.sleep(0.001)
    running = [r for r in reqs if r in eng.running]
    await eng.stop_loop()
    assert eng.stats["preempted"] > 0
    assert [(r.finish_reason, len(r.output)) for r in running] == [("length", 100)] * len(running)
    eng.cache.check_integrity()
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_stop_string_while_preempted_finishes_the_request():
    """Regression (session 54's hunt): abort(stop=True) (a stop string the server matched) of a preempted request
    ended it "abort" (stats, log) where in decode it finishes "stop"."""
    eng = Engine(config(0.0))
    await eng.start()
    reqs = [eng.add_request([i + 1] * 8, SamplingParams(max_tokens=100, ignore_eos=True)) for i in range(8)]
    target = None
    while target is None:
        target = next((r for r in reqs if r.preemptions and r.state is RequestState.WAITING), None)
        await asyncio.sleep(0.0005)
    await eng.abort(target.rid, stop=True)
    while not all(r.state.done for r in reqs):
        await asyncio.sleep(0.002)
    assert (target.state, target.finish_reason) == (RequestState.FINISHED, "stop")
    assert eng.stats["aborted"] == 0 and eng.stats["finished"] == len(reqs)
    eng.cache.check_integrity()
    await eng.shutdown()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.asyncio
async def test_the_timeline_keeps_a_preempted_requests_hits_through_a_discarded_restore(tmp_path, restore_logging,
                                                                                        seed):
    """Regression (session 54's hunt): a resumption's overlapped restore discarded (a transfer fault) zeroed the
    request's hits in the timeline, where the engine reports its first admission's; the timeline's prefill time
    spanned its decode up to its resumption's prefill."""
    log = tmp_path / "run.jsonl"
    faults = FaultInjector()
    faults.arm(Fault.TRANSFER_RAISE, times=None, probability=0.5, seed=seed)
    eng = Engine(config(0.0, "l2", log_json=str(log)), faults=faults)
    await eng.start()
    prefix = [9, 8, 7, 6] * 5
    await eng.generate_async([prefix + [1]], SamplingParams(max_tokens=1))
    rng = random.Random(seed)
    reqs = [eng.add_request(prefix + [rng.randrange(20, 300) for _ in range(3 + i)],
                            SamplingParams(max_tokens=60, ignore_eos=True)) for i in range(10)]
    while not all(r.state.done for r in reqs):
        await asyncio.sleep(0.001)
    await eng.cache.drain()
    eng.cache.check_integrity()
    await eng.shutdown()
    timeline = build_timeline(read_events(log))
    assert any(r.preemptions for r in reqs)
    for r in reqs:
        span = timeline.requests[r.rid]
        assert {t: n for t, n in span.hit_tokens.items() if n} == {t: n for t, n in r.result().cached_tokens.items()
                                                                  if n}, [s for s, _ in span.states]
        assert span.prefill_ns <= span.first_token_ns
        assert span.preemptions == r.preemptions and (span.preempted_ns(timeline.open_end_ns(0)) is None) == (
            not r.preemptions)  # (the Requests table's columns)


@pytest.fixture
def restore_logging():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.mark.asyncio
async def test_a_request_reports_its_first_admissions_hits_and_an_abort_while_preempted_loses_nothing(
        tmp_path, restore_logging):
    log = tmp_path / "run.jsonl"
    eng = Engine(config(0.0, log_json=str(log)))
    preempt, seen = eng.admission.preempt, []

    def recorded(req):  # (regression, session 54's second hunt: a stream's usage chunk rendered after a preemption
        preempt(req)    # reported no cached token: it read the hits its resumption was yet to find)
        seen.append(req.result().cached_tokens)
    eng.admission.preempt = recorded
    await eng.start()
    prefix = [9, 8, 7, 6] * 5  # 5 pages: each request's first admission hits them in L1
    [warm] = await eng.generate_async([prefix + [1]], SamplingParams(max_tokens=1))
    reqs = [eng.add_request(prefix + [i + 20] * (3 + i), SamplingParams(max_tokens=60, ignore_eos=True))
            for i in range(10)]
    aborted = None
    while not all(r.state.done for r in reqs):
        if aborted is None:
            aborted = next((r for r in reqs if r.preemptions and r.state is RequestState.WAITING), None)
            if aborted is not None:
                await eng.abort(aborted.rid)
        await asyncio.sleep(0.001)
    eng.cache.check_integrity()
    assert eng.stats["preempted"] > 0 and aborted is not None
    assert seen == [{"l1": 20, "l2": 0, "l3": 0}] * eng.stats["preempted"]
    assert aborted.finish_reason == "abort" and aborted.result().cached_tokens == {"l1": 20, "l2": 0, "l3": 0}
    for r in reqs:
        if r is not aborted:
            assert len(r.output) == 60
            assert r.result().cached_tokens == {"l1": 20, "l2": 0, "l3": 0}  # (not its resumption's own output)
    assert eng.admission.reserved_pages == 0 and not eng.running and not eng.waiting
    hits = eng.metrics()["hit_tokens"]
    assert hits == {"l1": 20 * len(reqs), "l2": 0, "l3": 0}  # (each prompt's hit once: no resumption's)
    await eng.shutdown()
    timeline = build_timeline(read_events(log))  # (the structured log says the same)
    spans = [timeline.requests[r.rid] for r in reqs]
    assert [span.hit_tokens for span in spans] == [{"l1": 20, "l2": 0, "l3": 0}] * len(reqs)
    assert timeline.requests[aborted.rid].final_state == "aborted"
    assert "queued (preempted)" in [phase for phase, _, _ in timeline.requests[aborted.rid].phase_spans(0)]
    resumed = [span for span, r in zip(spans, reqs) if r.preemptions and r is not aborted]
    assert resumed and all([s for s, _ in span.states].count("resumed") >= 1 for span in resumed)
    assert all([s for s, _ in span.states].count("first_token") == 1 for span in resumed)


def test_the_ratio_is_checked_and_has_a_flag():
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="decode_reserve_ratio"):
            EngineConfig(decode_reserve_ratio=bad)
    for bad in ("0.5", True, None):
        with pytest.raises(ValueError, match="decode_reserve_ratio must be a number"):
            EngineConfig(decode_reserve_ratio=bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).decode_reserve_ratio == "auto"  # (the default, session 56)
    assert EngineConfig().decode_reserve_ratio == "auto"
    assert config_from_args(parser.parse_args(["--decode-reserve-ratio", "0.3"])).decode_reserve_ratio == 0.3
    assert config_from_args(parser.parse_args(["--decode-reserve-ratio", "1"])).decode_reserve_ratio == 1.0


@pytest.mark.asyncio
async def test_the_replay_reports_its_preemptions():
    items = [ReplayItem(i, i + 1, 0.0, [i + 1] * 8, 100) for i in range(8)]
    run = await replay_async(config(0.0), items, concurrency=8)
    summary = summarize(run, [], config(0.0), {})
    assert summary["integrity"] == "passed" and summary["completed"] == 8
    assert summary["preempted"] > 0 and f"{summary['preempted']:,} times" in format_summary(summary)
    # (regression, session 54's second hunt: the tokens resumptions computed again, and each request's preemptions,
    # were nowhere in the report)
    assert summary["preempted_recomputed_tokens"] > 0
    assert f"({summary['preempted_recomputed_tokens']:,} tokens computed again)" in format_summary(summary)
    assert sum(r["preemptions"] for r in summary["request_records"]) == summary["preempted"]
    assert "preempted" not in format_summary(summarize(await replay_async(config(1.0), items, concurrency=8), [],
                                                       config(1.0), {}))


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_stop_loop_returns_when_a_preempted_request_resumes_through_l2(ratio):
    """stop_loop() while requests preempt one another and resume through L2: every one finishes and the loop ends.
    (Session 54's review found the loop spinning here, with nothing running and a resumption parked on its
    restore; this scenario no longer reaches that window, session 55's mutation check: the next test makes it
    certain. `_within`: a spinning loop cannot time itself out.)"""
    async def scenario() -> None:
        eng = Engine(config(ratio, "l2"))
        await eng.start()
        reqs = [eng.add_request([i + 1] * 8, SamplingParams(max_tokens=100, ignore_eos=True)) for i in range(8)]
        while eng.waiting or any(r.state is not RequestState.DECODE for r in eng.running):
            await asyncio.sleep(0.001)
        await eng.stop_loop()
        assert eng.stats["preempted"] > 0 and all(len(r.output) == 100 for r in reqs)
        eng.cache.check_integrity()
        await eng.shutdown()

    _within(120, scenario)


def test_stop_loop_returns_when_a_resumption_parks_on_its_restore_with_nothing_running():
    """The same regression, its window made certain: a loop stopping with nothing running, and the one request
    waiting a preempted request (its context in L2 alone: its resumption parks on a restore). Before session 54's
    review the loop ticked again without awaiting, the restore's task never ran, and stop_loop() never returned."""
    async def scenario() -> None:
        cfg = dataclasses.replace(config(1.0, "l2"), restore_overlap=False)  # (the restore parks the request)
        eng = Engine(cfg)
        whole = (await eng.generate_async([list(range(10, 43))], SamplingParams(max_tokens=20)))[0]
        await eng.stop_loop()
        await eng.cache.drain()
        await eng.cache.flush_async(Tier.L1)  # (prompt and answer in L2 only)
        req = eng.add_request(list(range(10, 43)), SamplingParams(max_tokens=20))
        req.output, req.resumed_tokens, req.preemptions = list(whole.output_ids[:10]), 10, 1  # (as `preempt` left it)
        req.served_hits = {"l1": 0, "l2": 0, "l3": 0}
        await eng.start()
        await eng.stop_loop()  # (stopping at its first tick: the resumption is admitted, parks, lands, finishes)
        assert req.state is RequestState.FINISHED and req.output == list(whole.output_ids)
        assert req.result().cached_tokens == req.served_hits and eng.cache.metrics.restores_done == 1
        eng.cache.check_integrity()
        await eng.shutdown()

    _within(120, scenario)


def _within(timeout_s: float, scenario) -> None:
    """Run `scenario()` on its own thread's event loop; fail when it has not ended in `timeout_s` (a loop spinning
    without awaiting cannot time itself out; the thread spins on, a daemon)."""
    errors = []
    thread = threading.Thread(target=lambda: _collect(errors, lambda: asyncio.run(scenario())), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"the scenario did not end within {timeout_s} s (a loop spins)"
    if errors:
        raise errors[0]


def _collect(errors: list, call) -> None:
    try:
        call()
    except BaseException as exc:  # (raised again on the test's thread)
        errors.append(exc)


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.asyncio
async def test_one_short_page_preempts_one_request(write_policy):
    """Regression (session 54's review): under write_through the first victim's published pages were locked by its
    backup as the requester allocated, so the requester found no room again and preempted the next, until every
    request in decode (8 in one step) was preempted."""
    cfg = config(0.0).with_hicache(enable=True, policy="always", host_ratio=4.0, transfer_backend="torch",
                                   write_policy=write_policy)
    eng = Engine(cfg)
    per_step, preempt = {}, eng.admission.preempt

    def counted(req):
        per_step[eng.stats["batches"]] = per_step.get(eng.stats["batches"], 0) + 1
        preempt(req)
    eng.admission.preempt = counted
    await eng.start()
    reqs = [eng.add_request([i + 1] * 8, SamplingParams(max_tokens=100, ignore_eos=True)) for i in range(8)]
    while not all(r.state.done for r in reqs):
        await asyncio.sleep(0.002)
    await eng.cache.drain()
    eng.cache.check_integrity()
    assert per_step and max(per_step.values()) == 1 and all(len(r.output) == 100 for r in reqs)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_resumption_that_reads_nan_kv_drops_the_prefix_it_reused():
    """Regression (session 54's review): `_fail_nan` read the hits after finish() (the first admission's, none) and
    sliced the prompt alone: a resumption failing on its own poisoned K/V dropped nothing, and the next request of
    that prompt failed too."""
    eng = Engine(dataclasses.replace(config(0.0), num_pages=16))
    preempt, poisoned = eng.admission.preempt, []

    def poison(req):
        preempt(req)
        if not poisoned:
            poisoned.append(req)
            m = eng.cache.tree.match(req.cache_prefill[:-1], include_storage=False, touch=False)
            eng.cache.l1.kv[:, :, torch.tensor(m.pages[Tier.L1][:2], dtype=torch.int64)] = float("nan")
    eng.admission.preempt = poison
    await eng.start()
    a = eng.add_request([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=30, ignore_eos=True))
    b = eng.add_request([9, 10, 11, 12, 13, 14, 15, 16], SamplingParams(max_tokens=30, ignore_eos=True))
    while not (a.state.done and b.state.done):
        await asyncio.sleep(0.002)
    [victim] = poisoned
    assert victim.finish_reason == "error" and eng.cache.metrics.failures["nan_logits"] == 1
    [again] = await eng.generate_async([victim.prompt + [17]], SamplingParams(max_tokens=3))
    assert again.finish_reason == "length" and eng.cache.metrics.failures["nan_logits"] == 1
    eng.cache.check_integrity()
    await eng.shutdown()

