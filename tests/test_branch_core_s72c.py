"""Session 72 branch-coverage hunt, core (the cost policy and the L3 keys): the sides of branches no test took.

- The cost model's own argument checks (CostModel, LinearCost, PageKeyer, the key range), for a Python caller that
  builds them without HiCacheConfig's validation (which refuses the same values naming the CLI flag first): each is
  a ValueError naming the argument, not a model that prices a restore at 0 s or a division by zero later.
- A PageKeyer told to cache no chain (cache_entries=0) keeps none (its cache would otherwise grow without bound:
  `del cache[:-0]` deletes nothing) and gives the same keys as a caching one.
- A shared store's hints for a prefix beyond the local L3 match, with no local L3 slot free or evictable (every
  slot holds a prefix a read has locked), publish nothing, leave the tree as it was and leak no slot."""
from __future__ import annotations

import math
import re

import pytest

from hicache.config import HiCacheConfig
from hicache.cost_model import CostModel
from hicache.linear_cost import LinearCost
from hicache.page_keys import PageKeyer, publish_l3_hints
from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager
from redis_server import refused_url


def _config(**kw) -> HiCacheConfig:
    """A valid config with `kw` forced in past its validation (frozen dataclass: object.__setattr__)."""
    cfg = HiCacheConfig(enable=True)
    for name, value in kw.items():
        object.__setattr__(cfg, name, value)
    return cfg


@pytest.mark.parametrize("build,says", [
    (lambda: CostModel(_config(), 0), "bytes_per_token must be >= 1, got 0"),
    (lambda: CostModel(_config(recompute_us_per_token=0.0), 64), "recompute_us_per_token must be > 0"),
    (lambda: CostModel(_config(host_bandwidth_gib_s=math.nan), 64), "host_bandwidth_gib_s must be > 0, got nan"),
    (lambda: CostModel(_config(storage_bandwidth_gib_s=0.0), 64), "storage_bandwidth_gib_s must be > 0, got 0.0"),
    (lambda: CostModel(_config(), 64).restore_cost_s("l1", 16), "restore tier must be 'l2' or 'l3', got 'l1'"),
    (lambda: CostModel(_config(), 64).worth_writing("l1", 16), "write tier must be 'l2' or 'l3', got 'l1'"),
    (lambda: CostModel(_config(), 64).decide(16, 16, -1), "matched lengths, prompt_tokens and chunk_tokens must"),
    (lambda: CostModel(_config(), 64).decide(16, 16, 16, chunk_tokens=-1), "matched lengths, prompt_tokens"),
    (lambda: LinearCost(math.inf), "prior slope must be finite and >= 0, got inf"),
    (lambda: LinearCost(-1.0), "prior slope must be finite and >= 0, got -1.0"),
    (lambda: LinearCost(1.0, window_samples=0), "window_samples must be >= 1 and 0 < ewma_alpha <= 1"),
    (lambda: LinearCost(1.0, ewma_alpha=0.0), "window_samples must be >= 1 and 0 < ewma_alpha <= 1"),
    (lambda: LinearCost(1.0, ewma_alpha=1.5), "window_samples must be >= 1 and 0 < ewma_alpha <= 1"),
    (lambda: PageKeyer(b"salt", 0), "page_size must be >= 1, got 0"),
    (lambda: _keyer_of(0).keys(list(range(8)), 0, 8), "page_size must be >= 1, got 0"),
], ids=["bytes-per-token", "recompute", "host-bw", "storage-bw", "restore-tier", "write-tier", "negative-l3",
        "negative-chunk", "inf-slope", "negative-slope", "window", "alpha-0", "alpha-above-1", "keyer-page",
        "key-range-page"])
def test_the_cost_models_and_keys_own_argument_checks(build, says):
    with pytest.raises(ValueError, match=f"^{re.escape(says)}"):
        build()


def _keyer_of(page_size: int) -> PageKeyer:
    """A keyer whose page size went bad after it was built (the range check of `keys` itself)."""
    keyer = PageKeyer(b"salt", 4)
    keyer.page_size = page_size
    return keyer


def test_the_valid_edges_are_accepted():
    """The bounds themselves are valid: a free slope (0), a window of one sample, alpha 1."""
    assert LinearCost(0.0, window_samples=1, ewma_alpha=1.0).prior_slope == 0.0
    model = CostModel(_config(), 1)
    assert model.restore_cost_s("l2", 16) > 0 and model.restore_cost_s("l3", 16) > model.restore_cost_s("l2", 16)


def test_a_keyer_caching_no_chain_keeps_none_and_gives_the_same_keys():
    tokens = list(range(40))
    uncached, cached = PageKeyer(b"salt", 4, cache_entries=0), PageKeyer(b"salt", 4)
    for end in (8, 24, 40, 16):
        assert uncached.keys(tokens, 0, end) == cached.keys(tokens, 0, end)
        assert uncached.keys(tokens, 4, end) == cached.keys(tokens, 4, end)
    assert uncached._cache == [] and uncached.hits == 0 and uncached.misses == 8
    assert cached.hits > 0


@pytest.mark.asyncio
async def test_hints_with_no_local_l3_slot_to_take_publish_nothing_and_leak_nothing():
    mgr = make_manager(storage_backend="redis", storage_url=refused_url(), model_id="m", storage_pages=8)
    slots = mgr.allocator(Tier.L3).num_pages
    first = tuple(range(100, 100 + slots * mgr.page_size))
    assert publish_l3_hints(mgr, first, len(first)) == (slots, 0)
    handle = mgr.tree.match(first, touch=False).handles[Tier.L3]
    mgr.lock(handle, Tier.L3)  # a read holds every slot: none free, none evictable
    other = tuple(range(500, 516))
    assert publish_l3_hints(mgr, other, 16) == (0, 0)
    assert mgr.tree.match(other, touch=False).lengths == [0, 0, 0]
    assert mgr.tree.match(first, touch=False).lengths[Tier.L3] == len(first)
    assert mgr.allocator(Tier.L3).num_private() == 0
    mgr.unlock(handle, Tier.L3)
    assert publish_l3_hints(mgr, other, 16) == (4, 0)  # (room once the read lets go: the old hints evicted)
    assert_whole(mgr)
    await mgr.close()
