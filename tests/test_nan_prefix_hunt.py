"""A corrupt cached prefix (NaN K/V in its pages) fails one request, not every later one (a bug hunt).

A request whose logits are NaN fails with `nan_logits` (Admission._fail_nan). When its prompt reused
cached pages, those pages are the likely cause: they leave every tier they can (what other running
requests lock stays, under them), so the next request for that prompt recomputes it and gets the
output of an engine without any cache. Regression: the prefix stayed in the tree and every later
request that hit it failed too, forever. CPU, tiny preset."""
from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from hicache.radix import Tier
from scheduler.request import SamplingParams
from test_faults import OTHER, PAGE, PROMPT, REUSABLE, make_engine, reference, run_one

TOKENS = tuple(PROMPT[:REUSABLE])  # 6 pages


def assert_whole(eng) -> None:
    eng.check_integrity()
    alloc = eng.cache.l1.allocator
    assert alloc.num_private() == 0 and alloc.num_free + alloc.num_tree() == alloc.num_pages


async def _cached(eng) -> list[int]:
    """Serve PROMPT once (its prefix now in L1 and, backed up, in L2 and L3): the no-cache output."""
    want = await reference(PROMPT)
    assert (await run_one(eng)).output_ids == want
    await eng.cache.drain()
    assert eng.cache.tree.match(TOKENS, touch=False).lengths == [REUSABLE] * 3
    return want


def _poison_l1(eng, tokens, from_page: int = 0) -> None:
    m = eng.cache.tree.match(tokens, include_storage=False, touch=False)
    pages = m.pages[Tier.L1][from_page:]
    assert pages
    eng.cache.l1.kv[:, :, torch.tensor(pages, dtype=torch.int64)] = float("nan")


def _poison_l2(eng, tokens) -> None:
    m = eng.cache.tree.match(tokens, include_storage=False, touch=False)
    assert m.lengths[Tier.L2] == len(tokens)
    eng.cache.l2.page_buffer[torch.tensor(m.pages[Tier.L2], dtype=torch.int64)] = float("nan")


def _failed_nan(out) -> bool:
    return out.finish_reason == "error" and "NaN" in (out.error or "")


@pytest.mark.asyncio
async def test_a_corrupt_l1_prefix_fails_one_request_then_is_recomputed():
    """NaN K/V in a cached prefix's L1 pages: the request that reuses it fails; the next one (it
    failed too, and every one after) recomputes the prefix and gets the no-cache output."""
    eng = make_engine()
    want = await _cached(eng)
    _poison_l1(eng, TOKENS)
    with capture_logs() as logs:
        bad = await run_one(eng)
    assert bad.cached_tokens["l1"] == REUSABLE and _failed_nan(bad), (bad.finish_reason, bad.error)
    await eng.cache.drain()
    assert eng.cache.tree.match(TOKENS, touch=False).lengths == [0, 0, 0]  # every tier's copy left
    dropped = [e for e in logs if e["event"] == "nan_prefix_dropped"]
    assert len(dropped) == 1 and dropped[0]["rid"] == bad.rid and dropped[0]["dropped_tokens"] == REUSABLE
    # the prefix's 6 pages and the page below it (the first answer's, computed on top of it)
    assert eng.cache.metrics.nan_dropped_pages == {"l1": 7, "l2": 7, "l3": 7}
    assert not torch.isnan(eng.cache.l1.kv).any()  # the dropped pages went back to the pool finite
    assert_whole(eng)
    again = await run_one(eng)
    assert (again.finish_reason, again.output_ids) == ("length", want), (again.finish_reason, again.error)
    assert sum(again.cached_tokens.values()) == 0
    await eng.cache.drain()
    assert eng.cache.metrics.failures.get("nan_logits") == 1
    assert (await run_one(eng)).output_ids == want  # and it is cached again, clean
    assert_whole(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_corrupt_l2_prefix_restored_to_l1_fails_one_request_then_is_recomputed():
    """The prefix only in L2 (and L3), its L2 copy NaN (no checksum guards L2): the request restores
    it from L2 and fails; the next one recomputes instead of restoring the same bad copy again."""
    eng = make_engine()
    want = await _cached(eng)
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    _poison_l2(eng, TOKENS)
    bad = await run_one(eng)
    assert bad.cached_tokens["l2"] == REUSABLE and _failed_nan(bad), (bad.cached_tokens, bad.error)
    await eng.cache.drain()
    assert eng.cache.tree.match(TOKENS, touch=False).lengths == [0, 0, 0]
    assert_whole(eng)
    again = await run_one(eng)
    assert (again.finish_reason, again.output_ids) == ("length", want), (again.finish_reason, again.error)
    assert not torch.isnan(eng.cache.l1.kv).any()
    await eng.cache.drain()
    assert_whole(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_prefix_another_running_request_locks_stays_under_it():
    """The corrupt pages lie past a shared prefix that a running request reads: the failing request
    drops only what nobody else locks (the shared pages stay, the running request finishes with the
    no-cache output), and the next request for the prompt reuses the shared part and recomputes
    the rest."""
    shared = 4 * PAGE
    other_prompt = list(PROMPT[:shared]) + list(OTHER)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    other_want = await reference(other_prompt, max_tokens=16)
    eng = make_engine()
    want = await _cached(eng)
    bystander = eng.add_request(other_prompt, params)
    first = await bystander.queue.get()
    assert first.token_id == other_want[0] and bystander.locked_len >= shared
    _poison_l1(eng, TOKENS, from_page=shared // PAGE)
    bad = await run_one(eng)
    assert bad.cached_tokens["l1"] == REUSABLE and _failed_nan(bad), bad.error
    assert not bystander.state.done
    lengths = eng.cache.tree.match(TOKENS, touch=False).lengths
    assert lengths[Tier.L1] == shared  # locked by the bystander: kept
    tokens = [first.token_id]
    while not bystander.state.done:
        ev = await bystander.queue.get()
        if ev.token_id is not None:
            tokens.append(ev.token_id)
    assert (bystander.finish_reason, tokens) == ("length", other_want)
    again = await run_one(eng)
    assert (again.finish_reason, again.output_ids) == ("length", want), again.error
    assert again.cached_tokens["l1"] == shared
    await eng.cache.drain()
    assert_whole(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_nan_without_a_cache_hit_drops_no_prefix():
    """A request that reused nothing (its K/V turned NaN after its first token, in its own private
    pages) fails alone; the cached prefixes stay where they were."""
    eng = make_engine()
    await _cached(eng)
    before = list(eng.cache.tree.num_resident_pages)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    victim = eng.add_request(OTHER, params)
    first = await victim.queue.get()
    assert sum(victim.hit_tokens.values()) == 0
    private = victim.pages[victim.locked_len // PAGE:]
    eng.cache.l1.kv[:, :, torch.tensor(private, dtype=torch.int64)] = float("nan")
    while not (await victim.queue.get()).finished:
        pass
    assert victim.finish_reason == "error" and "NaN" in victim.error and first.token_id is not None
    await eng.cache.drain()
    assert eng.cache.tree.match(TOKENS, touch=False).lengths == [REUSABLE] * 3
    assert eng.cache.metrics.nan_dropped_pages == {"l1": 0, "l2": 0, "l3": 0}
    assert all(now >= was for now, was in zip(eng.cache.tree.num_resident_pages, before))
    assert_whole(eng)
    await eng.shutdown()
