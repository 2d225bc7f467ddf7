"""Bug hunt at the prefix cache's edges (session 28): prompts at page boundaries, prompts that are
(prefixes of) cached sequences, generated tokens reused as a prefix, requests sharing a prefix that
only a lower tier holds, tiny tiers under every write and restore policy. The referee: every greedy
output equals a no-cache engine's, and after the engine drained every tier is whole (integrity,
nothing private, no lock left)."""
from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hicache.radix import Tier
from hicache_helpers import (WriteGate, assert_whole, finish, make_manager, served_then_below_l1, toks, until,
                             write_prefix)
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

VOCAB = 512
_REFERENCE: dict = {}


async def reference(prompts: list[list[int]], max_tokens: int, page_size: int = 4) -> list[list[int]]:
    """Greedy outputs of an engine without any cache (no prefix reuse, no hierarchy)."""
    missing = sorted({tuple(p) for p in prompts if (tuple(p), max_tokens) not in _REFERENCE})
    if missing:
        eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=4096 // page_size, page_size=page_size,
                                  enable_prefix_cache=False, max_running_requests=64))
        out = await eng.generate_async([list(p) for p in missing], SamplingParams(max_tokens=max_tokens))
        await eng.shutdown()
        _REFERENCE.update({(p, max_tokens): r.output_ids for p, r in zip(missing, out)})
    return [_REFERENCE[(tuple(p), max_tokens)] for p in prompts]


def make_engine(page_size: int = 4, num_pages: int = 64, storage: bool = True, restore_overlap: bool = True,
                max_prefill_tokens: int = 2048, **hicache) -> Engine:
    hicache.setdefault("transfer_backend", "torch")
    hicache.setdefault("policy", "always")
    config = EngineConfig(model="tiny", device="cpu", num_pages=num_pages, page_size=page_size,
                          restore_overlap=restore_overlap, max_prefill_tokens=max_prefill_tokens)
    return Engine(config.with_hicache(enable=True, host_ratio=2.0, storage_ratio=2.0 if storage else 0.0, **hicache))


# -- requests sharing a prefix that only a lower tier holds ------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("tier,prefetch,overlap", [("l2", True, True), ("l2", True, False),
                                                   ("l3", True, True), ("l3", True, False),
                                                   ("l3", False, True)])
async def test_requests_sharing_a_lower_tier_prefix_copy_it_once(tier, prefetch, overlap):
    """Regression: three requests sharing a 32-token prefix that only L2 (or only L3) held, arriving
    together, each restored it (three H2Ds into three sets of L1 pages, two of them freed as
    duplicates; with prefetch, three storage reads of the same pages at queue time), and each
    counted the prefix as its own L2/L3 hit. One restore serves them all: the others wait for it
    and hit L1."""
    rng = random.Random(0)
    base = [rng.randrange(VOCAB) for _ in range(32)]
    prompts = [base + [2, 3], base + [4, 5, 6], base + [7]]
    eng = make_engine(storage=tier == "l3", restore_overlap=overlap, prefetch=prefetch)
    await served_then_below_l1(eng, base, tier)
    assert eng.cache.tree.match(base, touch=False).lengths == ([0, 32, 0] if tier == "l2" else [0, 0, 32])
    before = eng.metrics()
    out = await eng.generate_async(prompts, SamplingParams(max_tokens=3))
    assert [r.output_ids for r in out] == await reference(prompts, 3)
    after = eng.metrics()
    delta = {d: after["directions"][d]["count"] - before["directions"][d]["count"] for d in ("h2d", "s2h")}
    assert delta == {"h2d": 1, "s2h": 1 if tier == "l3" else 0}, delta
    assert after["restores_started"] - before["restores_started"] == 1
    hits = {t: after["hit_tokens"][t] - before["hit_tokens"][t] for t in ("l1", "l2", "l3")}
    # the prefix is one request's hit of the tier it was read from (an L3 prefix promoted by a
    # prefetch and restored from L2 counts as L3, also for a follower: session 29), the others' L1 hits
    assert hits == {"l1": 64, "l2": 32 if tier == "l2" else 0, "l3": 32 if tier == "l3" else 0}, hits
    await finish(eng)


# -- backups of prompts sharing a prefix ---------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("page_size", [1, 4, 16])
async def test_prompts_sharing_a_new_prefix_back_it_up_once(page_size):
    """Regression: prompts sharing a prefix that no tier held, computed together, each backed up
    their whole prompt: a backup only waited for one in flight whose tokens were a prefix of its
    own, not for a sibling's, so the shared prefix was copied to L2 (and written to L3) once per
    prompt (here 4x: 2.5x the D2H and H2S traffic, and L2 pages taken, then freed as duplicates,
    evicting what L2 held). A backup that would copy a page a backup in flight copies waits for it
    and then copies only what L2 still lacks."""
    rng = random.Random(page_size)
    shared = [rng.randrange(VOCAB) for _ in range(2 * 16)]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(16)] + [1] for _ in range(4)]
    eng = make_engine(page_size=page_size, num_pages=1024 // page_size)
    await eng.start()
    out = await eng.generate_async(prompts, SamplingParams(max_tokens=1))
    assert [r.output_ids for r in out] == await reference(prompts, 1, page_size)
    await eng.cache.drain()
    m, bytes_per_page = eng.metrics(), eng.cache.geometry.bytes_per_page
    aligned = len(prompts[0]) - len(prompts[0]) % page_size  # what each prompt publishes
    distinct_pages = (len(shared) + 4 * (aligned - len(shared))) // page_size
    assert eng.cache.tree.num_resident_pages[Tier.L2] == eng.cache.tree.num_resident_pages[Tier.L3] == distinct_pages
    copied = {d: m["directions"][d]["bytes"] // bytes_per_page for d in ("d2h", "h2s")}
    assert copied == {"d2h": distinct_pages, "h2s": distinct_pages}, (copied, distinct_pages)
    await finish(eng)



@pytest.mark.asyncio
async def test_write_back_eviction_of_a_leaf_waiting_for_a_siblings_backup_ends():
    """Guard for the fix above (a first version spun for ever): under write_back, a leaf whose
    backup waits for a sibling's (their shared prefix S was not in L2) is vetoed while that backup
    runs. Once the sibling's D2H published S and its L3 write is still in flight, the leaf's backup
    no longer overlaps it; started again by the veto, it found L2 full of locked pages, gave its
    lock back (re-offering the leaf to the eviction in progress) and the leaf was vetoed again: the
    eviction never ended. A backup already waiting for another is left to start when that ends."""
    mgr = make_manager(l1_pages=16, host_pages=3, storage_pages=16, write_policy="write_back")
    shared, a, b = toks((0, 8)), toks((100, 104)), toks((200, 204))
    write_prefix(mgr, shared + a)
    write_prefix(mgr, shared + b, start=len(shared))
    gate = WriteGate(mgr.store)  # the sibling's L3 write stays in flight
    assert mgr.runner.start_backup(shared + a) is not None
    assert mgr.runner.start_backup(shared + b) is None  # waits: the sibling copies S
    await until(lambda: mgr.tree.match(shared + a, touch=False).lengths[Tier.L2] == 12)  # D2H published
    calls = 0
    keep = mgr.runner.write_back_keep

    def counted_keep(node):
        nonlocal calls
        calls += 1
        assert calls < 100, "write_back eviction vetoes the same leaf for ever"
        return keep(node)
    mgr.runner.write_back_keep = counted_keep
    claim = mgr.new_claim("test")
    assert mgr.alloc_l1(16, claim) is None  # b's leaf is kept (its backup waits); a's is evicted
    mgr.release_claim(claim)
    gate.release()
    await mgr.drain()
    assert mgr.tree.match(shared + b, touch=False).lengths[Tier.L2] == 12  # started once the sibling's ended
    assert_whole(mgr)
    await mgr.close()


# -- a copy larger than its tier can hold ----------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("tier", ["l2", "l3"])
async def test_a_backup_its_tier_cannot_hold_evicts_nothing(tier):
    """Regression: a backup of more pages than L2 (or L3) could ever free (a prompt longer than the
    tier) evicted every unlocked page of that tier, then found no room and was skipped: one long
    prompt wiped the tier. Here a 2-page prefix survives a 12-page prompt's backup (L2 holds 8
    pages, L3 8 beside an L2 of 16) and is served from it afterwards."""
    rng = random.Random(1)
    short, long_ = [rng.randrange(VOCAB) for _ in range(8)], [rng.randrange(VOCAB) for _ in range(48)]
    page_bytes = 2 * 2 * 4 * 2 * 16 * 4  # tiny preset, float32, 4-token pages
    sizes = {"l2": (8, None), "l3": (16, 8)}[tier]
    eng = make_engine(num_pages=64, storage=tier == "l3", host_size_gb=sizes[0] * page_bytes / (1 << 30),
                      storage_size_gb=sizes[1] and sizes[1] * page_bytes / (1 << 30))
    await eng.start()
    index = {"l2": Tier.L2, "l3": Tier.L3}[tier]
    await eng.generate_async([short + [1]], SamplingParams(max_tokens=1))
    await eng.cache.drain()
    assert eng.cache.tree.match(short, touch=False).lengths[index] == 8
    await eng.generate_async([long_ + [1]], SamplingParams(max_tokens=1))
    await eng.cache.drain()
    assert eng.cache.tree.match(short, touch=False).lengths[index] == 8, "the long prompt's backup evicted it"
    assert eng.metrics()["evictions_pages"][tier] == 0
    eng.cache.flush(Tier.L1)
    if tier == "l3":
        eng.cache.flush(Tier.L2)
    prompts = [short + [2]]
    [r] = await eng.generate_async(prompts, SamplingParams(max_tokens=2))
    assert r.output_ids == (await reference(prompts, 2))[0]
    assert r.cached_tokens[tier] == 8
    await finish(eng)

# -- property: random edge workloads through tiny tiers ------------------------------------------
def _edge_prompt(rng: random.Random, bases: list[list[int]], history: list, page_size: int) -> list[int]:
    """A prompt at a prefix edge: a shared base cut at a page boundary (k pages, +-1 token, the
    whole base), an earlier prompt + its output (+ a token or two), a strict prefix of one, or a
    single token."""
    kind = rng.random()
    if history and kind < 0.3:
        prompt, output = rng.choice(history)
        return prompt + output + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 3))]
    if history and kind < 0.4:
        prompt, output = rng.choice(history)
        return (prompt + output)[: rng.randrange(1, len(prompt) + len(output) + 1)]
    if kind < 0.45:
        return [rng.randrange(VOCAB)]
    base = rng.choice(bases)
    k = rng.randrange(1, len(base) // page_size + 1)
    cut = min(len(base), max(1, rng.choice([k * page_size - 1, k * page_size, k * page_size + 1, len(base)])))
    return base[:cut] + [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 1, page_size]))]


async def _edge_workload(seed: int, page_size: int, l1_pages: int, hicache: dict, engine: dict) -> None:
    rng = random.Random(seed)
    eng = make_engine(page_size=page_size, num_pages=l1_pages, **engine, **hicache)
    await eng.start()
    limit = l1_pages * page_size
    bases = [[rng.randrange(VOCAB) for _ in range(rng.randrange(page_size, max(page_size + 1, limit // 3)))]
             for _ in range(3)]
    history: list = []
    results: list = []

    async def one(prompt: list[int], max_tokens: int) -> None:
        [r] = await eng.generate_async([prompt], SamplingParams(max_tokens=max_tokens))
        assert r.finish_reason == "length", (r.finish_reason, r.error)
        history.append((prompt, r.output_ids))
        results.append((prompt, r))

    for _ in range(6):  # bursts of requests arriving together, then maybe an operator's flush
        burst = []
        for _ in range(rng.randrange(1, 6)):
            max_tokens = rng.randrange(1, 5)
            prompt = _edge_prompt(rng, bases, history, page_size)[: limit - max_tokens - page_size]
            burst.append(one(prompt, max_tokens))
        await asyncio.gather(*burst)
        if rng.random() < 0.5:
            await eng.cache.drain()
            for tier in (Tier.L1, Tier.L2):
                if rng.random() < 0.5:
                    eng.cache.flush(tier)
    await eng.stop_loop()
    await eng.cache.drain()
    assert_whole(eng.cache)
    m = eng.metrics()
    assert sum(m["hit_tokens"].values()) + m["recomputed_tokens"] == sum(len(p) for p, _ in results), m
    want = await reference([p for p, _ in results], 4, page_size)
    for (prompt, r), expected in zip(results, want):
        assert r.output_ids == expected[: len(r.output_ids)], (len(prompt), r.cached_tokens)
    await eng.shutdown()


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2 ** 16), page_size=st.sampled_from([1, 2, 4, 16]), l1_tokens=st.sampled_from([48, 96]),
       host_pages=st.sampled_from([2, 8, 32]), storage_pages=st.sampled_from([0, 4, 32]),
       policy=st.sampled_from(["always", "cost", "never"]),
       write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
       prefetch=st.booleans(), restore_overlap=st.booleans(), max_prefill_tokens=st.sampled_from([5, 16, 2048]))
def test_edge_workloads_equal_recompute_and_leave_every_tier_whole(seed, page_size, l1_tokens, host_pages,
                                                                  storage_pages, policy, write_policy, prefetch,
                                                                  restore_overlap, max_prefill_tokens):
    """Bursts of prompts at prefix edges (page boundaries, whole and partial cached sequences,
    prompt + output, 1-token prompts) through tiny tiers under every write and restore policy, with
    operator flushes between bursts: outputs equal a no-cache engine's, hits + recomputed tokens are
    the prompts, every tier whole. (Regression, during this hunt: a write_back eviction spun for ever
    on a leaf waiting for a sibling's backup.)"""
    l1_pages = max(l1_tokens // page_size, 6)
    geometry_page_bytes = 2 * 2 * page_size * 2 * 16 * 4  # tiny preset, float32
    hicache = dict(policy=policy, write_policy=write_policy, prefetch=prefetch,
                   host_size_gb=host_pages * max(1, 4 // page_size) * geometry_page_bytes / (1 << 30),
                   storage_size_gb=(storage_pages * max(1, 4 // page_size) * geometry_page_bytes / (1 << 30)
                                    if storage_pages else None))
    engine = dict(storage=bool(storage_pages), restore_overlap=restore_overlap,
                  max_prefill_tokens=max_prefill_tokens)
    asyncio.run(_edge_workload(seed, page_size, l1_pages, hicache, engine))
