"""A NaN prefix in the shared Redis L3 fails one request, not every later one (a bug hunt).

A request that reused a cached prefix and got NaN logits drops that prefix from every tier of the
local tree (Admission._fail_nan -> hicache/suspect.py). A NaN page backed up before anyone noticed
carries a valid checksum (its own bytes'), so with a shared Redis L3 the local drop was not enough:
the next hint refresh found the pages in Redis again, the next request restored them and failed
again, forever, on every instance that shared the store (regression). Now the dropped range's keys
are deleted from the store too (best effort, off the request's path). A file L3 is this process's
own: the local drop already frees its slots. CPU, tiny preset, a throwaway redis-server."""
from __future__ import annotations

import pytest
import torch

from hicache.radix import Tier
from hicache.suspect import drop_suspect_prefix
from redis_server import REDIS_SERVER, needs_redis, private_server, redis_server, server  # noqa: F401
from scheduler.engine import Engine
from test_faults import OTHER, PAGE, PROMPT, REUSABLE, make_engine, reference, run_one
from test_nan_prefix_hunt import TOKENS, _failed_nan, _poison_l1, assert_whole


_REDIS_MARKS = (pytest.mark.redis, pytest.mark.skipif(REDIS_SERVER is None, reason="no redis-server binary"))


def _engine(backend: str, url: str | None) -> Engine:
    if backend == "redis":
        return make_engine(storage_backend="redis", storage_url=url)
    return make_engine()  # (a temporary L3 file)


def _lengths(eng) -> list[int]:
    return eng.cache.tree.match(TOKENS, touch=False).lengths


async def assert_recomputed_after_the_nan(eng, want: list[int]) -> None:
    """Two more runs of PROMPT after the one that failed on NaN logits: both recompute (the bad pages are never
    restored again) and end as a clean engine's, and that one NaN failure is the only one counted."""
    outcomes = []
    for _ in range(2):
        later = await run_one(eng)
        await eng.cache.drain()
        outcomes.append((later.finish_reason, later.output_ids, later.error))
    assert outcomes == [("length", want, None)] * 2
    assert eng.cache.metrics.failures.get("nan_logits") == 1


async def _poison_lower_tiers(eng) -> None:
    """The engine idle, PROMPT's prefix cached everywhere: its L1 copy turns NaN and is then backed
    up again (its L2 and L3 copies dropped first), so L2 and L3 hold NaN pages with valid checksums
    (in Redis under the prefix's keys); then L1 and L2 lose it: only L3 holds it."""
    cache, tree = eng.cache, eng.cache.tree
    tree.evict(Tier.L2, cache.l2.num_pages)
    tree.evict(Tier.L3, cache.store.num_slots)  # (redis: only the hints go; the pages stay)
    assert _lengths(eng) == [REUSABLE, 0, 0]
    _poison_l1(eng, TOKENS)
    cache.back_up_l1(TOKENS)
    await cache.drain()
    assert _lengths(eng) == [REUSABLE] * 3
    l1_pages = tree.match(TOKENS, include_storage=False, touch=False).pages[Tier.L1]
    tree.evict(Tier.L1, cache.l1.num_pages)
    cache.l1.kv[:, :, torch.tensor(l1_pages, dtype=torch.int64)] = 0  # (the free pool holds finite values)
    tree.evict(Tier.L2, cache.l2.num_pages)
    assert _lengths(eng) == [0, 0, REUSABLE]


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["file", pytest.param("redis", marks=_REDIS_MARKS)])
async def test_a_nan_prefix_in_l3_fails_one_request_not_every_later_one(backend, request):
    """NaN pages of a prefix in L3 (checksums valid): the request that restores them fails and the
    prefix leaves every tier; the next two requests for the prompt get the no-cache output (the
    first recomputes it and writes it back clean, the second hits it). Redis, regression: the
    pages stayed in Redis, each later request found them again through its hint refresh, restored
    them and failed too."""
    url = request.getfixturevalue("server").url() if backend == "redis" else None
    want = await reference(PROMPT)
    eng = _engine(backend, url)
    assert (await run_one(eng)).output_ids == want
    await eng.cache.drain()
    await _poison_lower_tiers(eng)
    bad = await run_one(eng)
    assert bad.cached_tokens["l3"] == REUSABLE and _failed_nan(bad), (bad.cached_tokens, bad.error)
    await eng.cache.drain()
    assert _lengths(eng) == [0, 0, 0]
    assert eng.cache.metrics.nan_dropped_pages["l3"] >= REUSABLE // PAGE
    await assert_recomputed_after_the_nan(eng, want)
    assert not torch.isnan(eng.cache.l1.kv).any()
    assert_whole(eng)
    if backend == "redis":
        store = eng.cache.store
        assert store.counters["suspect_pages_deleted"] == REUSABLE // PAGE
        # another instance sharing the store gets the prefix clean (written back by the recompute)
        other = _engine(backend, url)
        assert (await run_one(other)).output_ids == want
        assert not other.metrics()["failures"]
        await other.shutdown()
    await eng.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_only_the_dropped_range_leaves_redis(server):
    """The keys deleted are those of the pages the prefix lost in L3, to the end of the reused
    prefix: not a head an operation still holds in L3 (it stays, locally and in Redis), not the page
    below the prefix (the answer's, computed on top of it), not another prompt's pages. The hint
    refresh of the next request for the prompt finds only the kept head."""
    from prometheus_client.parser import text_string_to_metric_families

    from scheduler.prom import ServerMetrics

    eng = _engine("redis", server.url())
    metrics = ServerMetrics(eng)
    await run_one(eng)
    await run_one(eng, OTHER)
    await eng.cache.drain()
    store, tree, sync = eng.cache.store, eng.cache.tree, server.client()
    answer = (await run_one(eng)).output_ids
    await eng.cache.drain()
    full = list(PROMPT) + answer
    keys = store.page_keys(full, 0, REUSABLE + PAGE)  # the prefix's 6 pages and the answer's first
    other_keys = store.page_keys(OTHER, 0, len(OTHER) - len(OTHER) % PAGE)
    assert sync.exists(*keys) == len(keys) and sync.exists(*other_keys) == len(other_keys)
    head = tree.match(TOKENS[:2 * PAGE], touch=False).handles[Tier.L3]  # (splits the node there)
    tree.lock(head, Tier.L3)  # as an operation reading those L3 pages does
    dropped, kept_tokens = drop_suspect_prefix(eng.cache, TOKENS)
    tree.unlock(head, Tier.L3)
    assert dropped["l3"] > 0 and kept_tokens == 2 * PAGE
    await eng.cache.refresh_l3_hints(PROMPT)  # (the next request's; it waits for the deletion)
    assert [bool(sync.exists(k)) for k in keys] == [True, True, False, False, False, False, True]
    assert sync.exists(*other_keys) == len(other_keys)
    assert _lengths(eng) == [0, 0, 2 * PAGE]
    assert store.counters["suspect_pages_deleted"] == 4
    events = {s.labels["event"]: s.value for fam in text_string_to_metric_families(metrics.render().decode())
              if fam.name == "hicache_redis_events" for s in fam.samples if s.name.endswith("_total")}
    assert events["suspect_pages_deleted"] == 4
    assert (await run_one(eng)).output_ids == await reference(PROMPT)
    await eng.cache.drain()
    assert_whole(eng)
    await eng.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_a_redis_down_when_a_nan_prefix_is_dropped_fails_only_that_request(private_server):
    """The store is down when the prefix is dropped: no key is deleted, nothing but the NaN error
    reaches the failing request, and the next request recomputes with the no-cache output."""
    want = await reference(PROMPT)
    eng = _engine("redis", private_server.url())
    assert (await run_one(eng)).output_ids == want
    await eng.cache.drain()
    _poison_l1(eng, TOKENS)
    private_server.stop()
    bad = await run_one(eng)
    assert bad.cached_tokens["l1"] == REUSABLE and _failed_nan(bad), (bad.cached_tokens, bad.error)
    await eng.cache.drain()
    assert _lengths(eng) == [0, 0, 0]
    again = await run_one(eng)
    assert (again.finish_reason, again.output_ids, again.error) == ("length", want, None)
    await eng.cache.drain()
    assert eng.cache.store.counters.get("suspect_pages_deleted", 0) == 0
    assert eng.cache.metrics.failures.get("nan_logits") == 1
    assert_whole(eng)
    await eng.shutdown()
