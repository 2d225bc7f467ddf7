"""Guards for the scheduler loop (scheduler/engine_loop.py) and its admission (scheduler/admission.py): rules that
session 64's mutation check of both broke without a failing test."""
from __future__ import annotations

import asyncio

import pytest

from hicache.radix import Tier
from hicache_helpers import until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import Request, RequestState, SamplingParams
from scheduler.speculative import SpeculativeConfig
from test_decode_token_count import poison_the_next_decode_step
from test_mutation_loop_s63 import _record


def _hicache_engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, **kw)
                  .with_hicache(enable=True, policy="always", transfer_backend="torch", storage_ratio=0.0))


def _hold_h2d(eng: Engine) -> asyncio.Event:
    """Restores (host -> device copies) complete only once the returned gate opens."""
    gate, wait = asyncio.Event(), eng.cache.transfer.wait

    async def held(tr):
        if tr.direction == "h2d":
            await gate.wait()
        return await wait(tr)
    eng.cache.transfer.wait = held
    return gate


async def _prefix_in_l2_only(eng: Engine) -> tuple[list[int], asyncio.Event]:
    """A 16-token prefix computed, then flushed from L1 (in L2 only), with its restores held (`_hold_h2d`)."""
    prefix = [(i * 5) % 97 + 1 for i in range(16)]
    await eng.generate_async([prefix + [1]], SamplingParams(max_tokens=1))
    await eng.stop_loop()
    eng.cache.flush(Tier.L1)
    return prefix, _hold_h2d(eng)


def _steps(eng: Engine) -> list[tuple[int, int, bool, bool]]:
    """Each step after its tokens are back: (its start, its end, whether a restore was pending, is decode)."""
    steps, after = [], eng._after_batch

    def recorded(work, next_ids, start_ns, restoring):
        after(work, next_ids, start_ns, restoring)
        steps.append((start_ns, eng._step_end_ns, restoring, work.binput.is_decode))
    eng._after_batch = recorded
    return steps


# -- the loop (scheduler/engine_loop.py) ---------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_preempted_request_parked_on_its_restore_as_the_loop_stops_finishes():
    """A request preempted while it ran resumes through a restore of its K/V from L2; parked on that restore, it
    still counts as resuming (`_resuming`: waiting or parked): stop_loop() lets it land, resume and finish, rather
    than end the loop with it left parked."""
    eng = _hicache_engine(num_pages=16, decode_reserve_ratio=0.0, restore_overlap=False)
    gate = _hold_h2d(eng)
    await eng.start()
    a = eng.add_request([11, 12, 13, 14, 15, 16, 17, 18], SamplingParams(max_tokens=40, ignore_eos=True))
    await asyncio.sleep(0)
    b = eng.add_request([21, 22, 23, 24, 25, 26, 27, 28], SamplingParams(max_tokens=30, ignore_eos=True))
    await until(lambda: a.state.done and b.state is RequestState.PARKED, 60)
    assert b.resumed_tokens > 0 and not eng.running  # (the premise: only the preempted request is left, parked)
    stop = asyncio.ensure_future(eng.stop_loop())
    await asyncio.sleep(0.05)
    gate.set()
    await asyncio.wait_for(stop, 30)
    assert [(r.state, r.finish_reason, len(r.output)) for r in (a, b)] == [
        (RequestState.FINISHED, "length", 40), (RequestState.FINISHED, "length", 30)]
    assert not eng.waiting and not eng.parked and not eng.requests
    await eng.shutdown()


@pytest.mark.asyncio
async def test_decode_chains_right_after_a_forward_behind_an_overlapped_restore():
    """A request whose tail's forward ran behind its overlapped restore waits for the restore, not for a chunk
    (`_chunks_wait`): the decode step after that forward chains on as after any short prefill."""
    await chains_after_an_overlapped_restore(_hicache_engine(num_pages=128),
                                             SamplingParams(max_tokens=200, ignore_eos=True))


async def chains_after_an_overlapped_restore(eng, decoding_params: SamplingParams) -> None:
    """Asserts, with a request decoding by `decoding_params`, that the decode step after a forward behind an
    overlapped restore chains on ("PDC": prefill, decode, chained decode)."""
    prefix, gate = await _prefix_in_l2_only(eng)
    kinds = _record(eng)
    await eng.start()
    decoding = eng.add_request([3, 4, 5, 6], decoding_params)
    await until(lambda: len(decoding.output) > 4, 60)
    start = len(kinds)
    req = eng.add_request(prefix + [2], SamplingParams(max_tokens=4))
    await until(lambda: req.overlap_op is not None and "P" in kinds[start:] and len(kinds) > start + 6, 60)
    after = "".join(kinds[start:])
    after = after[after.index("P"):]
    gate.set()
    await until(lambda: req.state.done, 60)
    assert eng.stats["restore_overlaps"] == 1 and req.hit_tokens["l2"] == 16  # (the premise)
    assert after.startswith("PDC"), after
    await eng.abort(decoding.rid)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_each_chained_step_is_timed_from_its_own_launch_and_restore_overlap_counted_once():
    """A chained decode step starts when it is launched (its batch log's start_ns, the draft policy's step time),
    not when the chain's first step was; and the time decode steps ran beside a pending restore
    (restore_overlapped_s) counts each instant once, though a chained step starts before the one before ends."""
    eng = _hicache_engine(num_pages=128, restore_overlap=False)
    prefix, gate = await _prefix_in_l2_only(eng)
    steps = _steps(eng)
    await eng.start()
    decoding = eng.add_request([3, 4, 5, 6], SamplingParams(max_tokens=200, ignore_eos=True))
    await until(lambda: len(decoding.output) > 4, 60)
    req = eng.add_request(prefix + [2], SamplingParams(max_tokens=4))
    await until(lambda: req.state is RequestState.PARKED, 60)
    start = len(steps)
    await until(lambda: len(steps) > start + 8, 60)
    gate.set()
    await until(lambda: req.state.done, 60)
    await eng.abort(decoding.rid)
    overlapped = [(s, e) for s, e, restoring, decode in steps if restoring and decode]
    assert eng.stats["chained_steps"] > 0 and len(overlapped) >= 8  # (the premise: chained steps beside a restore)
    decodes = [s for s, _, _, decode in steps if decode]
    assert all(a < b for a, b in zip(decodes, decodes[1:]))  # each its own start
    union, end = 0, 0
    for s, e in sorted(overlapped):
        union += max(0, e - max(s, end))
        end = max(end, e)
    assert eng.cache.metrics.restore_overlapped_s == pytest.approx(union / 1e9, abs=1e-7)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_nan_row_of_a_verify_step_fails_as_nan_though_the_request_restricts_its_tokens():
    """A verify step's NaN mark (a token < 0) is not judged by the request's bans: with allowed_token_ids the mark
    is no allowed id, yet the request fails for its NaN logits (named so, counted under nan_logits), not as a
    request whose bans left it no token."""
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1, draft_policy="always")
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=128, speculative=spec))
    prompt = [5, 7, 5, 7, 5, 7, 5, 7]
    params = SamplingParams(max_tokens=12, ignore_eos=True, allowed_token_ids=(5, 7))
    [first] = await eng.generate_async([prompt], params)  # (its answer: the next one's drafts, from the prefix cache)
    verified = eng.speculator.stats["verify_steps"]
    poison_the_next_decode_step(eng)  # (the first decode step: its request's K/V NaN)
    [r] = await eng.generate_async([prompt], params)
    assert eng.speculator.stats["verify_steps"] == verified + 1  # (the premise: the NaN step was a verify step)
    assert r.finish_reason == "error" and "NaN" in r.error and r.output_ids == first.output_ids[:1], r
    assert eng.cache.metrics.failures.get("nan_logits") == 1
    await eng.shutdown()


# -- admission (scheduler/admission.py) ----------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_request_queued_as_the_loop_stops_is_not_admitted_when_a_running_slot_frees():
    """stop_loop() lets the running requests finish and admits nothing new: a request waiting for a running slot
    stays queued when one of the running requests ends and frees a slot while another still runs."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4, max_running_requests=2))
    await eng.start()
    short = eng.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True))
    long = eng.add_request([6, 7, 8, 9, 10], SamplingParams(max_tokens=40, ignore_eos=True))
    queued = eng.add_request([11, 12, 13, 14, 15], SamplingParams(max_tokens=4, ignore_eos=True))
    await until(lambda: short in eng.running and long in eng.running, 30)
    await asyncio.wait_for(eng.stop_loop(), 30)  # (stopping from here: before `short` ends)
    assert [r.state for r in (short, long)] == [RequestState.FINISHED] * 2
    assert queued.state is RequestState.WAITING and queued.output == [] and queued.first_token_s is None
    await eng.start()  # it goes on where it was
    await until(lambda: queued.state.done, 30)
    assert queued.finish_reason == "length" and len(queued.output) == 4
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_request_aborted_while_the_loop_waits_for_a_blocking_restore_is_not_admitted_after_it():
    """With blocking restores (prefetch off) a prefill pass waits for the restore of the request ahead; one queued
    behind it and aborted meanwhile is passed over (the next tick ends it): it never prefills nor streams a token."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=128, restore_overlap=False)
                 .with_hicache(enable=True, policy="always", transfer_backend="torch", storage_ratio=0.0,
                               prefetch=False))
    prefix, gate = await _prefix_in_l2_only(eng)
    await eng.start()
    restoring = eng.add_request(prefix + [2], SamplingParams(max_tokens=2))
    behind = eng.add_request([50, 51, 52, 53], SamplingParams(max_tokens=2))
    await until(lambda: restoring.state is RequestState.PARKED, 30)
    assert await eng.abort(behind.rid)
    gate.set()
    await until(lambda: restoring.state.done and behind.state.done, 30)
    assert restoring.finish_reason == "length" and restoring.hit_tokens["l2"] == 16  # (the premise: it restored)
    assert behind.finish_reason == "abort" and behind.output == [] and behind.first_token_s is None
    await eng.shutdown()


@pytest.mark.asyncio
async def test_the_auto_reserve_share_is_kept_while_a_request_is_parked():
    """decode_reserve_ratio "auto" starts again only when nothing runs, waits or is parked: a request parked on its
    restore will run, so a prefill pass that finds only it keeps the share decode steps raised."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64))
    eng.admission.auto_ratio.value = 0.9
    eng.parked.append(Request(prompt=[1, 2, 3, 4, 5], params=SamplingParams(max_tokens=4)))
    assert await eng.admission.prefill_batch() is None
    assert eng.admission.auto_ratio.value == 0.9
    eng.parked.clear()
    assert await eng.admission.prefill_batch() is None
    assert eng.admission.auto_ratio.value == eng.admission.auto_ratio.START  # (nothing at all: it starts again)
    await eng.shutdown()


def test_a_request_queued_outside_a_loop_starts_no_prefetch_while_the_loop_stops(tmp_path):
    """A request queued where no loop ran has its L3 prefetch deferred to a running loop's next plan; a plan made
    while the loop stops leaves it deferred (the request stays queued as it is, for the next start())."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64)
                 .with_hicache(enable=True, storage_path=str(tmp_path / "l3")))
    req = eng.add_request(list(range(1, 20)), SamplingParams(max_tokens=2))
    assert req.hint_deferred  # (the premise: queued outside a running loop)

    async def plan_while_stopping():
        eng.stopping = True
        assert await eng.admission.prefill_batch() is None
        eng.stopping = False
    asyncio.run(plan_while_stopping())
    assert req.hint_deferred and req.state is RequestState.WAITING
    [result] = eng.generate([list(range(1, 20))], SamplingParams(max_tokens=2))  # (the queue still runs)
    assert result.finish_reason == "length"


def test_a_prefix_of_exactly_the_sharing_threshold_is_waited_for():
    """Two identical prompts whose reusable part (the prompt less its last token) is PREFILL_SHARE_MIN_TOKENS long:
    the second waits for the first's pages rather than computing them beside it."""
    from scheduler.admission import PREFILL_SHARE_MIN_TOKENS
    prompt = [(i * 7) % 300 + 1 for i in range(PREFILL_SHARE_MIN_TOKENS + 1)]
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256))
    eng.generate([prompt] * 2, SamplingParams(max_tokens=2))
    assert eng.metrics()["recomputed_tokens"] == len(prompt) + 1
    eng.check_integrity()


def test_lpm_orders_by_the_cached_tokens_a_request_can_use():
    """scheduling_policy "lpm" ranks a queued request by the L1 tokens it can reuse: never its prompt's last token,
    which is computed for its first output. A prompt wholly in L1 reuses a page less than a longer prompt whose
    first two pages are there, so the longer one goes first though it arrived later."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=128, scheduling_policy="lpm"))
    whole, head = [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28]
    eng.generate([whole, head], SamplingParams(max_tokens=1))  # (both prompts' two pages now in L1)
    first = eng.add_request(whole, SamplingParams(max_tokens=1))
    later = eng.add_request(head + [29, 30, 31, 32], SamplingParams(max_tokens=1))
    assert eng.admission._admission_order() == [later, first]
    eng.generate([[40, 41]], SamplingParams(max_tokens=1))  # (runs the queue too)
    assert first.state.done and later.state.done


@pytest.mark.asyncio
async def test_a_decode_chain_launches_no_step_past_a_requests_last_token():
    """A chained step is queued only for requests that will still run then: none past the step that makes a
    request's last token by length (its row would be computed and thrown away)."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64))
    kinds = _record(eng)
    await eng.start()
    req = eng.add_request([3, 4, 5, 6], SamplingParams(max_tokens=12, ignore_eos=True))
    await until(lambda: req.state.done, 30)
    assert len(req.output) == 12 and "C" in kinds  # (the premise: its steps chained)
    assert "".join(kinds).count("P") == 1 and len(kinds) == 12, kinds  # its prefill, then 11 decode steps
    await eng.shutdown()


def _after_each_admission(eng: Engine, record) -> None:
    """`record(req, admitted)` after each admission attempt of `eng`'s loop."""
    admit = eng.admission._admit

    async def admitted(req, *args, **kw):
        out = await admit(req, *args, **kw)
        record(req, out)
        return out
    eng.admission._admit = admitted


@pytest.mark.asyncio
async def test_a_preempted_request_with_prompt_logprobs_resumes_on_its_kept_pages():
    """A39 (session 65): a request asking for prompt logprobs computes every prompt row once (it reuses no cached
    prefix), but a preempted one has them all: its resumption reuses the K/V it kept (L1's, or L2's restored),
    as any other request's does, instead of recomputing its whole context (prompt and output so far)."""
    from test_preemption import config, prompt_of

    eng = Engine(config(0.0, "l2"))  # (no decode reserve: requests that outgrow L1 are preempted)
    resumed: list[int] = []  # the tokens each resumption found cached

    def note_resumed(req, admitted) -> None:
        if admitted and req.resumed_tokens > 0:
            resumed.append(req.cached_len)
    _after_each_admission(eng, note_resumed)
    await eng.start()
    params = SamplingParams(max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    reqs = [eng.add_request(prompt_of(i), params) for i in range(6)]
    try:
        await until(lambda: all(r.state.done for r in reqs), 120)
        assert all(r.state is RequestState.FINISHED and len(r.prompt_logprobs) == len(r.prompt) for r in reqs)
        assert resumed, "nothing was preempted"
        assert any(cached > 0 for cached in resumed), resumed
        await eng.cache.drain()
        eng.cache.check_integrity()
    finally:
        await eng.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("variant", ["plain", "l2"])
async def test_a_preempted_request_keeps_its_first_prefills_start(variant):
    """A25 (session 65): a request's `scheduled_s` is its first prefill's start, and a preemption does not move
    it: the server's phases read from it (vllm:request_prefill_time_seconds, first token minus it, went negative
    for a request resumed after its first token; request_inference_time_seconds lost the time before)."""
    from test_preemption import config, prompt_of

    eng = Engine(config(0.0, variant))  # (l2: resumptions behind an overlapped restore too)
    first: dict[str, float] = {}  # rid -> scheduled_s as its first admission left it

    def note_first(req, _admitted) -> None:
        if req.scheduled_s is not None:
            first.setdefault(req.rid, req.scheduled_s)
    _after_each_admission(eng, note_first)
    await eng.start()
    reqs = [eng.add_request(prompt_of(i), SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(6)]
    try:
        await until(lambda: all(r.state.done for r in reqs), 120)
        preempted = [r for r in reqs if r.preemptions]
        assert preempted, "nothing was preempted"
        assert [r.scheduled_s for r in preempted] == [first[r.rid] for r in preempted]
    finally:
        await eng.shutdown()
