"""Preemption and speculation guards found untested by session 58's mutation check of scheduler/reservations.py,
admission.py (release, decode_batch, _decode_step, resumptions), draft_policy.py and memory_plan.py: what admission
reserves, whom a preemption takes and what it leaves, resumptions, the draft policy's averages."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hicache.config import HiCacheConfig
from hicache_helpers import until
from scheduler import draft_policy, memory_plan
from scheduler.draft_policy import DraftPolicy
from scheduler.engine import Engine
from scheduler.memory_plan import disk_free_bytes, host_config_within_memory
from scheduler.request import Request, RequestState, SamplingParams
from test_preemption import config

PROMPT = list(range(30, 38))  # 2 pages of 4


# -- reservations ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio, max_tokens, output, want", [
    (1.0, 9, 0, 8 + 8),          # every token but the last writes K/V: 16 tokens, 4 whole pages (not 17: 5)
    (0.5, 10, 0, 8 + 5),         # 0.5 x 9 rounds up
    (0.5, 10, 3, 8 + 3 + 3),     # a resumption: its output folded into its prefill, 6 tokens still to write
    (0.0, 10, 0, 8),
])
def test_admission_reserves_the_prefill_and_the_share_rounded_up_of_every_token_but_the_last(
        ratio, max_tokens, output, want):
    eng = Engine(config(ratio))
    req = Request(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid="r")
    req.output, req.resumed_tokens = [7] * output, output
    assert eng.admission._reserve_tokens(req) == want
    assert eng.admission._pages_after(req, 4) == -(-want // 4) - 1  # (one page of it in L1 already)


def decoding_request(rid: str, output: int, max_tokens: int = 100, state=RequestState.DECODE) -> Request:
    req = Request(list(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid=rid)
    req.output, req.state = [7] * output, state
    return req


def test_the_victim_is_the_newest_request_in_decode_never_one_still_in_prefill():
    """A request in prefill (a newer one, between its chunks or behind its restore) is no victim: it has no output
    to fold into a resumption (`resumed_tokens` 0 would read as a new request's, its hits counted twice)."""
    eng = Engine(config(0.0))
    adm, victims = eng.admission, []
    old, new = decoding_request("old", 5), decoding_request("new", 0, state=RequestState.PREFILL)
    eng.running.extend([old, new])  # (`new` arrived last)

    def preempt(req):  # (recorded and taken off, no pages involved)
        victims.append(req.rid)
        eng.running.remove(req)
        req.state = RequestState.WAITING
    adm.preempt = preempt
    adm.reserved_pages = eng.cache.available_l1_pages()  # (no room: `old` outgrew it)
    assert not adm._grow_or_preempt(old, 4) and victims == ["old"]
    adm.reserved_pages = 0


def test_a_preemption_resets_its_requests_admission_and_raises_the_share_by_decode_alone():
    """What `preempt` leaves: the request queued with no hit, restore or plan of its first admission (its result
    keeps that admission's hits), and the "auto" share raised to what the requests still in decode used (one in
    prefill has used nothing and is not counted)."""
    eng = Engine(config("auto"))
    adm = eng.admission
    adm.auto_ratio.value = 0.1
    req, other = decoding_request("r", 6), decoding_request("d", 30)
    prefilling = decoding_request("p", 0, state=RequestState.PREFILL)
    req.hit_tokens = {"l1": 4, "l2": 8, "l3": 0}
    req.restore_tier, req.restore_l1_start, req.restore_declined, req.span_plan = "l2", 4, True, object()
    req.promoted_tokens = 8  # (its prefetch brought 8 tokens from L3 to L2)
    eng.running.extend([other, prefilling, req])
    adm.preempt(req)
    assert list(eng.waiting) == [req] and req.state is RequestState.WAITING and req.resumed_tokens == 6
    assert req.served_hits == {"l1": 4, "l2": 8, "l3": 0} and req.hit_tokens == {"l1": 0, "l2": 0, "l3": 0}
    assert (req.restore_tier, req.restore_l1_start, req.restore_declined, req.span_plan) == ("none", 0, False, None)
    # (regression: promoted_tokens stayed, so a resumption's L2 restore of its own K/V logged that much as L3 hits)
    assert req.promoted_tokens == 0
    assert req.preemptions == 1 and eng.stats["preempted"] == 1
    assert adm.auto_ratio.value == pytest.approx((30 + 20) / 100)  # (not (30 + 20 + 0 + 20) / 200 with `p`)


@pytest.mark.asyncio
async def test_the_share_starts_again_only_when_nothing_is_parked_either():
    eng = Engine(config("auto"))
    adm = eng.admission
    adm.auto_ratio.value = 0.3
    eng.parked.append(decoding_request("parked", 0, state=RequestState.WAITING))  # (on a prefetch from L3)
    assert await adm.prefill_batch() is None and adm.reserve_ratio() == 0.3
    eng.parked.clear()
    assert await adm.prefill_batch() is None and adm.reserve_ratio() == 0.7  # (idle now)


# -- resumptions ----------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_resumption_asking_prompt_logprobs_reuses_its_own_kv():
    """A request asking prompt logprobs reuses no cached prefix (every prompt row's logits are computed), but its
    resumption after a preemption has them all: it reuses the K/V its first admission left (`_reuses`)."""
    eng = Engine(config(1.0))
    [first] = await eng.generate_async([PROMPT], SamplingParams(max_tokens=14, ignore_eos=True))
    out = list(first.output_ids)  # (L1 holds PROMPT + out[:12]: 5 pages)
    await eng.stop_loop()
    req = eng.add_request(PROMPT, SamplingParams(max_tokens=14, ignore_eos=True, prompt_logprobs=2))
    req.output, req.resumed_tokens, req.preemptions = out[:12], 12, 1  # (as `preempt` leaves it)
    req.served_hits = {"l1": 0, "l2": 0, "l3": 0}
    await eng.start()
    await until(lambda: req.state.done, 60)
    assert req.output == out and eng.stats["preempted_recomputed_tokens"] == 4  # (16 of its 20 tokens in L1)
    eng.cache.check_integrity()
    await eng.shutdown()


# -- draft policy ---------------------------------------------------------------------------------
def test_a_new_observation_averages_with_the_drifted_average():
    """Between its verify steps a request's average drifts back to the prior; the next observation averages with
    where it drifted to, not with what was last observed."""
    pol, req = DraftPolicy(), SimpleNamespace(output=[0] * 10, spec_accepted=None)
    pol.observe_request(req, 0)  # (0.0 at 11 tokens)
    req.output += [0] * 111  # (110 tokens since without a verify step)
    drifted = 1.0 - draft_policy.RECOVERY ** 110
    pol.observe_request(req, 2)
    assert req.spec_accepted == (pytest.approx(draft_policy.KEEP * drifted + (1 - draft_policy.KEEP) * 2), 124)


def test_a_verify_step_is_never_priced_below_its_own_time():
    """The unchained decode step after a verify step adds what it took beyond a decode step's cost; one that took
    less (a faster step) takes nothing off the verify step's own time."""
    pol = DraftPolicy()
    pol.observe_step("decode", 4, 0.005, 0.005, chained=True)
    pol.observe_step("verify", 4, 0.006, 0.0055, chained=False)
    pol.observe_step("decode", 4, 0.004, 0.004, chained=False)
    assert pol.step_s[("verify", 4)] == pytest.approx(0.006) and pol.rho(4) == pytest.approx(1.2)


@pytest.mark.asyncio
async def test_a_resumption_ending_early_gives_back_its_reservation_and_its_first_admissions_hits():
    """A resumption ending before its max_tokens (a stop token) gives its reservation's rest back (`release`: else
    admission's reserved count only grows, and L1 room it counts on shrinks for good); once its prefill ended, its
    hit_tokens are its first admission's again (what a beam search's per-step cached tokens and a NaN's dropped
    prefix read), not those of its resumption, which hit its own K/V."""
    eng = Engine(config(1.0))
    [first] = await eng.generate_async([PROMPT], SamplingParams(max_tokens=14, ignore_eos=True))
    out = list(first.output_ids)
    await eng.stop_loop()
    assert eng.admission.reserved_pages == 0
    req = eng.add_request(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True, stop_token_ids=[out[13]]))
    req.output, req.resumed_tokens, req.preemptions = out[:12], 12, 1  # (as `preempt` leaves it)
    req.served_hits = {"l1": 4, "l2": 0, "l3": 0}
    await eng.start()
    await until(lambda: req.state.done, 60)
    assert req.finish_reason == "stop" and len(req.output) < 60
    assert req.hit_tokens == {"l1": 4, "l2": 0, "l3": 0} and req.served_hit_tokens == req.hit_tokens
    assert eng.admission.reserved_pages == 0  # (it reserved 60 - 12 - 1 tokens' pages at its readmission)
    eng.cache.check_integrity()
    await eng.shutdown()


def test_a_request_whose_reserved_page_cannot_come_fails_alone():
    """Where a request in decode cannot have the page it reserved and nothing pending will free one (L1 promised
    twice: a bookkeeping bug), it fails with an error and is counted, rather than wait for a page forever."""
    eng = Engine(config(1.0))
    req = decoding_request("r", 3)
    req.reserved_pages = 1
    eng.admission.reserved_pages = 1
    eng.running.append(req)
    eng.cache.alloc_l1 = lambda num_pages, claim: None  # (the page it reserved is not there)
    assert eng.admission.decode_batch() is None
    assert (req.state, req.finish_reason) == (RequestState.FAILED, "error") and "no KV page" in req.error
    assert eng.cache.metrics.failures["l1_overcommit"] == 1 and eng.admission.reserved_pages == 0


# -- memory plan ----------------------------------------------------------------------------------
def test_an_l2_asking_exactly_half_the_host_is_left_as_asked():
    hc, bpp = HiCacheConfig(enable=True, host_ratio=2.0), 1000
    assert host_config_within_memory(hc, 100, bpp, 400_000) is hc  # (200,000 bytes asked: exactly the half)
    held = host_config_within_memory(hc, 100, bpp, 399_999)
    assert held.host_pages(100, bpp) == 199


def test_the_free_disk_counts_the_blocks_of_the_last_runs_l3_file(tmp_path, monkeypatch):
    """(The new file is truncated into the old one's blocks: else each restart held L3 to half of what the last
    one left free.) A directory at the path is no such file."""
    path = tmp_path / "l3.bin"
    path.write_bytes(b"\1" * (1 << 20))
    monkeypatch.setattr(memory_plan.os, "statvfs", lambda d: SimpleNamespace(f_bavail=1000, f_frsize=4096))
    blocks = path.stat().st_blocks * 512
    assert blocks > 0
    assert disk_free_bytes(HiCacheConfig(enable=True, storage_path=str(path))) == 4096 * 1000 + blocks
    assert disk_free_bytes(HiCacheConfig(enable=True, storage_path=str(tmp_path))) == 4096 * 1000
