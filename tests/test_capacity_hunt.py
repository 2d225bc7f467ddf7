"""Bug hunt at capacity edges under load (session 29): page sizes 1 to 64 with prompts off page
boundaries, tiers smaller than one request's prefix (L2 of one page, L3 smaller than L2, L2 the size
of L1), an L1 that holds one request at a time with many arriving, chunked prefill below a page with
restores (overlapped, parked, blocking), every write and restore policy, and sequences that run up
to the model's last position. The referee: every greedy output equals a no-cache engine's, no
request hangs (each batch under asyncio.wait_for), hits per tier + recomputed tokens are the
prompts, and afterwards every tier is whole."""
from __future__ import annotations

import asyncio
import random

import pytest

from hicache.radix import Tier
from hicache_helpers import assert_whole
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from test_prefix_edges_hunt import VOCAB, reference

TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # tiny preset, float32: K/V x layers x kv heads x head_dim x 4 bytes
WAIT_S = 60  # a batch of requests that takes longer hangs


def make_engine(page_size: int, l1_pages: int, l2_pages: int, l3_pages: int, max_prefill_tokens: int = 2048,
                max_running_requests: int = 64, restore_overlap: bool = True, **hicache) -> Engine:
    """An engine whose tiers hold exactly these many pages (l3_pages=0: no L3)."""
    page_gib = TOKEN_BYTES * page_size / (1 << 30)
    hicache.setdefault("transfer_backend", "torch")
    config = EngineConfig(model="tiny", device="cpu", page_size=page_size, num_pages=l1_pages,
                          max_prefill_tokens=max_prefill_tokens, max_running_requests=max_running_requests,
                          restore_overlap=restore_overlap)
    eng = Engine(config.with_hicache(enable=True, host_size_gb=l2_pages * page_gib,
                                     storage_size_gb=l3_pages * page_gib if l3_pages else None,
                                     storage_ratio=2.0 if l3_pages else 0.0, **hicache))
    assert eng.cache.l2.num_pages == l2_pages
    return eng


async def run_batch(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    return await asyncio.wait_for(eng.generate_async(prompts, params), WAIT_S)


async def check_end(eng: Engine, done: list) -> None:
    """`done`: (prompt, params, result) of every request. Each one that fits L1 finished with the
    no-cache output, each that cannot was refused naming max_tokens; the metrics add up; every tier
    is whole."""
    await eng.stop_loop()
    await eng.cache.drain()
    assert_whole(eng.cache)
    fitting = []
    for prompt, params, r in done:
        if len(prompt) + params.max_tokens - 1 > eng.usable_l1_pages * eng.page_size:
            assert r.finish_reason == "error" and "max_tokens" in r.error, (len(prompt), r.finish_reason, r.error)
            continue
        assert r.finish_reason == "length", (len(prompt), r.finish_reason, r.error)
        assert sum(r.cached_tokens.values()) < len(prompt), (len(prompt), r.cached_tokens)
        fitting.append((prompt, params, r))
    for max_tokens in {p.max_tokens for _, p, _ in fitting}:
        group = [(prompt, r) for prompt, p, r in fitting if p.max_tokens == max_tokens]
        want = await reference([prompt for prompt, _ in group], max_tokens)
        for (prompt, r), expected in zip(group, want):
            assert r.output_ids == expected, (len(prompt), r.cached_tokens)
    m = eng.metrics()
    assert sum(m["hit_tokens"].values()) + m["recomputed_tokens"] == sum(len(p) for p, _, _ in fitting), m
    per_request = {t: sum(r.cached_tokens[t] for _, _, r in fitting) for t in ("l1", "l2", "l3")}
    assert per_request == m["hit_tokens"], (per_request, m["hit_tokens"])
    await eng.shutdown()


# -- a blocking restore must not admit on an overlapped restore's unadopted pages ---------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("max_prefill_tokens", [1, 2048])
async def test_blocking_restore_beside_an_overlapped_one_does_not_overcommit_l1(max_prefill_tokens):
    """Regression: with --disable-hicache-prefetch (blocking restores) and restore overlap on, A's
    L2 restore ran layer by layer under its tail's forward; B's blocking restore then made the loop
    wait, and meanwhile A's restore published its pages to the tree, unlocked until A's request
    adopts them at the next tick. B was admitted on room that counted those pages as evictable;
    then A locked them, and one of the two could not get a page it had reserved: it failed with
    "no KV page available (accounting)" (an l1_overcommit) although both fit L1 together."""
    eng = make_engine(page_size=4, l1_pages=6, l2_pages=16, l3_pages=0, max_prefill_tokens=max_prefill_tokens,
                      prefetch=False, policy="always")
    await eng.start()
    rng = random.Random(0)
    x, y = [rng.randrange(VOCAB) for _ in range(8)], [rng.randrange(VOCAB) for _ in range(4)]
    warm = ([x + [1], y + [1]], [SamplingParams(max_tokens=1)] * 2)
    done = list(zip(*warm, await run_batch(eng, *warm)))
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)  # x (2 pages) and y (1 page) only in L2
    prompts, params = [x + [2], y + [3]], [SamplingParams(max_tokens=8), SamplingParams(max_tokens=9)]
    out = await run_batch(eng, prompts, params)  # 4 + 4 pages of L1's 6 at most: B waits for room
    assert [r.error for r in out] == [None, None]
    assert eng.stats["restore_overlaps"] >= 1 and "l1_overcommit" not in eng.metrics()["failures"]
    assert [r.cached_tokens for r in out] == [{"l1": 0, "l2": 8, "l3": 0}, {"l1": 0, "l2": 4, "l3": 0}]
    await check_end(eng, done + list(zip(prompts, params, out)))


# -- property-style sweep: tight tiers under every policy --------------------------------------------
async def _tight_workload(seed: int, page_size: int, l1_pages: int, l2_pages: int, l3_pages: int, **config) -> None:
    """Bursts of 3-12 requests from three prompt families (prefixes of one another, a changed last
    token, some that can never fit L1), with operator flushes of L1 / L2 between bursts."""
    rng = random.Random(seed)
    eng = make_engine(page_size, l1_pages, l2_pages, l3_pages, **config)
    await eng.start()
    capacity = l1_pages * page_size
    families = [[rng.randrange(VOCAB) for _ in range(capacity)] for _ in range(3)]
    done = []
    for _ in range(3):
        prompts, params = [], []
        for _ in range(rng.randrange(3, 13)):
            max_tokens = rng.randrange(1, 5)
            prompt = rng.choice(families)[: rng.randrange(1, max(2, capacity - max_tokens + 3))]  # (+1: no fit)
            if rng.random() < 0.5:
                prompt = prompt[:-1] + [rng.randrange(VOCAB)]
            prompts.append(prompt), params.append(SamplingParams(max_tokens=max_tokens))
        done += list(zip(prompts, params, await run_batch(eng, prompts, params)))
        if rng.random() < 0.4:
            await eng.cache.drain()
            eng.cache.flush(Tier.L1)
            if rng.random() < 0.3:
                eng.cache.flush(Tier.L2)
    await check_end(eng, done)


@pytest.mark.parametrize("page_size,l1_pages,l2_pages,l3_pages,config", [
    (1, 12, 24, 0, dict(max_prefill_tokens=1, max_running_requests=2, prefetch=False, policy="always")),
    (1, 8, 1, 1, dict(max_prefill_tokens=3, write_policy="write_back", policy="cost")),  # one-page L2 and L3
    (2, 6, 6, 5, dict(max_prefill_tokens=1, max_running_requests=1, write_policy="write_through_selective",
                      policy="always")),  # L2 the size of L1, L3 smaller than L2
    (2, 8, 3, 2, dict(prefetch=False, restore_overlap=False, policy="always", write_policy="write_back")),
    (16, 2, 2, 1, dict(max_prefill_tokens=15, policy="always", whole_first=False)),  # chunks under a page
    (16, 3, 1, 6, dict(max_prefill_tokens=17, max_running_requests=1, policy="never")),
    (64, 1, 2, 1, dict(max_prefill_tokens=63, policy="always")),  # L1 of one page, prompts under it
    (64, 2, 1, 2, dict(prefetch=False, policy="always", write_policy="write_back", max_running_requests=1)),
])
def test_tight_tiers_equal_recompute_and_add_up(page_size, l1_pages, l2_pages, l3_pages, config):
    """Guard over the combinations this hunt tried (none failed but the one above): outputs equal a
    no-cache engine's, requests that can never fit are refused naming max_tokens while the others
    go on, hits + recomputed tokens are the prompts, per request as in the metrics, tiers whole."""
    asyncio.run(_tight_workload(page_size * 31 + l1_pages, page_size, l1_pages, l2_pages, l3_pages, **config))


# -- a sequence up to the model's last position ---------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("page_size", [1, 64])
async def test_sequences_up_to_the_last_position_restore_from_every_tier(page_size):
    """A 4,001-token prompt generating up to position 4,095 (the tiny preset's 4,096 positions),
    then its prefix restored from L2 and, as a 4,096-token prompt, from L3: outputs equal a no-cache
    engine's; one token more is refused naming max_tokens."""
    positions = 4096
    eng = make_engine(page_size, positions // page_size, positions // page_size, positions // page_size,
                      policy="always")
    await eng.start()
    rng = random.Random(page_size)
    base = [rng.randrange(VOCAB) for _ in range(4000)]
    first, max_tokens = base + [1], positions - len(base)
    with pytest.raises(ValueError, match="max_tokens.*positions"):
        eng.validate(first, SamplingParams(max_tokens=max_tokens + 1))
    params = SamplingParams(max_tokens=max_tokens)
    [a] = await run_batch(eng, [first], [params])
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    [b] = await run_batch(eng, [base + [2]], [params])
    assert b.cached_tokens["l2"] == len(base) - len(base) % page_size
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    eng.cache.flush(Tier.L2)
    last = (first + a.output_ids)[:positions]
    [c] = await run_batch(eng, [last], [SamplingParams(max_tokens=1)])
    assert c.cached_tokens["l3"] > 0 and c.output_ids == a.output_ids[-1:]
    await check_end(eng, [(first, params, a), (base + [2], params, b), (last, SamplingParams(max_tokens=1), c)])
