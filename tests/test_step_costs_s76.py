"""Per-step host costs a previous hunt noticed (session 76), each pinned by counting operations (never by timing):
the queue's head that waits for L1 room, checked at every chained decode step; the queue's order under
scheduling_policy "lpm", walked at every prefill pass; the timeline PNG's occupancy levels of a
log of many runs."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.radix import RadixTree, Tier
from hicache_helpers import finish, until
from scheduler.admission import Admission
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import Request, SamplingParams
from scheduler.timeline import OccupancySample, Timeline
from scheduler.timeline_views import render_png


@pytest.mark.asyncio
async def test_a_head_waiting_for_l1_room_is_not_walked_again_at_each_chained_decode_step(monkeypatch):
    """Regression: while the queue's head waited for L1 room, every chained decode step copied its whole prompt
    and walked it down the radix tree again (`_head_still_blocked`) to find its L1 prefix, though nothing in the
    tree had changed: 0.6 ms of host time a decode step for a 32k-token prompt whose prefix L1 holds (0.17 ms for
    one it does not), on top of each step of every running request. The walk is done again only once the tree
    changed; the decisions are the same (tests/test_memory_wait_s39_hunt.py checks them differentially)."""
    walked = {"tokens": 0, "in_chain": False}
    kept_match, kept_chain = RadixTree.match, Admission.chain_decode_batch

    def counting_match(self, tokens, **kw):
        if walked["in_chain"]:
            walked["tokens"] += len(tokens)
        return kept_match(self, tokens, **kw)

    def flagged_chain(self, reqs):
        walked["in_chain"] = True
        try:
            return kept_chain(self, reqs)
        finally:
            walked["in_chain"] = False
    monkeypatch.setattr(RadixTree, "match", counting_match)
    monkeypatch.setattr(Admission, "chain_decode_batch", flagged_chain)
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4, decode_reserve_ratio=1.0))
    await eng.start()
    long = eng.add_request([1] * 20, SamplingParams(max_tokens=200, ignore_eos=True))  # (55 of 64 pages)
    await until(lambda: len(long.output) >= 2)
    head_prompt = [2] * 40
    head = eng.add_request(head_prompt, SamplingParams(max_tokens=4, ignore_eos=True))  # (11 pages: no room)
    await until(lambda: eng.admission.memory_blocked is not None)
    assert eng.admission.memory_blocked[0] == head.rid
    chained_before = eng.stats["chained_steps"]
    await until(lambda: head.state.done)
    chained_while_waiting = eng.stats["chained_steps"] - chained_before
    assert len(long.output) == 200 and len(head.output) == 4
    assert chained_while_waiting > 150  # (the head waited that long without ending the chain)
    assert walked["tokens"] <= 4 * len(head_prompt), (walked["tokens"], chained_while_waiting)  # (was ~7,500)
    await finish(eng)



# -- the queue's order under "lpm" -------------------------------------------------------------------------------------
class _CountingList(list):
    """A prompt that counts the tokens its slices copy (each one, compared, a comparison)."""
    sliced_tokens = 0

    def __getitem__(self, key):
        got = super().__getitem__(key)
        if isinstance(key, slice):
            _CountingList.sliced_tokens += len(got)
        return got


def _fresh_lpm_order(eng: Engine) -> list[Request]:
    """The queue's order under "lpm" from walks made now (admission.py `_admission_order`, less its kept walks)."""
    return sorted(eng.waiting, key=lambda r: -eng.cache.tree.resident_tokens(list(r.prompt), Tier.L1,
                                                                             end=len(r.prompt) - 1))


def _lpm_engine(prompt_tokens: int, num_waiting: int) -> Engine:
    """L1 holds a shared prefix; queued: requests of it whole (their last page in the tree's node, past what they
    reuse) and requests of its first 8 pages."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=512, scheduling_policy="lpm"))
    rng = random.Random(0)
    shared = [rng.randrange(1, 400) for _ in range(prompt_tokens)]
    eng.generate([shared], SamplingParams(max_tokens=1))
    for i in range(num_waiting):
        prompt = shared if i % 2 else shared[:32] + [500 + i] * (prompt_tokens - 32)
        eng.waiting.append(Request(_CountingList(prompt), SamplingParams(max_tokens=1)))
    return eng


def test_lpm_does_not_walk_the_queue_again_at_each_pass_while_l1_is_unchanged():
    """Regression: each prefill pass under "lpm" walked every queued request's prompt down the tree, copying and
    comparing all that L1 holds of it (and a node it ends in): 9.5 ms of the event loop a pass for 128 queued
    requests of one 8k-token prefix L1 holds (39 ms at 32k), again at every pass while they wait (each arrival
    ends a decode chain: a pass). A request's walk is kept until L1 changes; the order is the same."""
    prompt_tokens, num_waiting, passes = 512, 8, 10
    eng = _lpm_engine(prompt_tokens, num_waiting)
    want = _fresh_lpm_order(eng)
    _CountingList.sliced_tokens = 0
    for _ in range(passes):
        assert eng.admission._admission_order() == want
    per_pass = _CountingList.sliced_tokens / passes
    assert per_pass <= num_waiting * prompt_tokens / 4, per_pass  # (was ~4,100: each pass walked them all again)
    eng.check_integrity()


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_lpm_order_after_l1_changed_is_what_walks_made_now_find(data):
    """The kept walks go stale when L1 changes: prompts published (new branches, splits), L1 evicted, a prefix
    dropped from L1. After each change the queue's order is the one walks made now give."""
    eng = _lpm_engine(64, 6)
    tree = eng.cache.tree
    assert eng.admission._admission_order() == _fresh_lpm_order(eng)
    for _ in range(data.draw(st.integers(1, 4))):
        change = data.draw(st.sampled_from(["insert", "evict", "drop"]))
        queued = eng.waiting[data.draw(st.integers(0, len(eng.waiting) - 1))]
        if change == "insert":  # (one queued request's prompt, or a part of it, published)
            tokens = list(queued.prompt)[:4 * data.draw(st.integers(1, 16))]
            start = tree.match(tokens, include_storage=False, touch=False).lengths[Tier.L1]
            claim = eng.cache.new_claim("test")
            eng.cache.insert_l1(tokens, eng.cache.l1.allocator.alloc((len(tokens) - start) // 4, claim), claim,
                                start_tokens=start, backup=False)
            eng.cache.release_claim(claim)
        elif change == "evict":
            tree.evict(Tier.L1, data.draw(st.integers(1, 12)))
        else:
            m = tree.match(list(queued.prompt), include_storage=False, touch=False)
            if m.handles[Tier.L1] is not None:
                tree.drop(m.handles[Tier.L1], Tier.L1, from_pages=data.draw(st.integers(0, 3)))
        assert eng.admission._admission_order() == _fresh_lpm_order(eng)
        eng.check_integrity()

# -- the timeline PNG's occupancy levels -------------------------------------------------------------------------------
class _CountingRun(int):
    """A sample's run index that counts the comparisons made with it (one object per sample: a dict lookup by it
    compares too, once)."""
    compared = 0

    def __eq__(self, other):
        _CountingRun.compared += 1
        return int(self) == int(other)

    __hash__ = int.__hash__


def test_the_png_groups_occupancy_samples_by_run_once(tmp_path):
    """Regression: each run's occupancy levels were picked out of the tier's samples by a scan of all of them, runs x
    samples comparisons per tier: 0.3 s a tier for 100 runs of 1,000 samples, 2.8 s for 1,000 runs of 100 (a log that
    every engine run of a sweep appended to). The samples are grouped by run once; the PNG draws the same levels."""
    runs, per_run = 60, 20
    samples = [OccupancySample(run * 1000 + i, i, per_run, run=_CountingRun(run))
               for run in range(runs) for i in range(per_run)]
    tl = Timeline(occupancy={"l1": samples}, run_first_ns=[run * 1000 for run in range(runs)],
                  run_last_ns=[run * 1000 + per_run for run in range(runs)], num_runs=runs)
    _CountingRun.compared = 0
    render_png(tl, tmp_path / "runs.png")
    assert (tmp_path / "runs.png").stat().st_size > 1000
    assert _CountingRun.compared <= 4 * len(samples), _CountingRun.compared  # (was ~24,000: each run's scan)
