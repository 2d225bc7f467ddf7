"""Follow-up of session 28's prefix-edge hunt (tests/test_prefix_edges_hunt.py): siblings wrote a
shared prefix to L3 twice when L2 already held it. Session 28 made a backup wait for a sibling's
backup that copies the page after L2's end (the D2H side); but when L2 already holds the shared
prefix and L3 does not, the siblings' D2Hs copy only their own tails (nothing to wait for), and each
backup's L3 write then wrote the whole prefix L3 lacked: once per sibling. The same when a backup's
L3 write is in flight (L2 got its pages when its D2H ended) and a sibling's backup reaches its own L3
write meanwhile. The referee: greedy outputs equal a no-cache engine's, every page reaches L3, the
pages written to L3 (the h2s metric) are the distinct pages, and every tier is whole afterwards."""
from __future__ import annotations

import random

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.radix import Tier
from hicache_helpers import WriteGate, finish, until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from test_prefix_edges_hunt import reference

VOCAB = 512


def make_engine(page_size: int = 4, num_pages: int = 256, faults: FaultInjector | None = None,
                **hicache) -> Engine:
    hicache.setdefault("transfer_backend", "torch")
    hicache.setdefault("policy", "always")
    config = EngineConfig(model="tiny", device="cpu", num_pages=num_pages, page_size=page_size)
    return Engine(config.with_hicache(enable=True, host_ratio=2.0, storage_ratio=4.0, **hicache),
                  faults=faults or FaultInjector())


def written_pages(eng: Engine) -> int:
    """Pages written to L3 so far (a failed write counts nothing)."""
    return eng.metrics()["directions"]["h2s"]["bytes"] // eng.cache.geometry.bytes_per_page


def l3_pages(eng: Engine) -> int:
    return eng.cache.tree.num_resident_pages[Tier.L3]


def distinct_pages(seqs: list[list[int]], page_size: int) -> int:
    """The distinct pages of these sequences (a page: the token prefix through its end)."""
    return len({tuple(s[:k]) for s in seqs for k in range(page_size, len(s) + 1, page_size)})


def published(prompts: list[list[int]], out) -> list[list[int]]:
    """What each finished request left cached: its prompt and every output token but the last."""
    return [p + r.output_ids[:-1] for p, r in zip(prompts, out)]


async def _prefix_in_l1_and_l2_only(eng: Engine, base: list[int]) -> None:
    """`base` cached in L1 and L2, L3 holding nothing (an operator flushed it, or it evicted it)."""
    await eng.generate_async([base + [1]], SamplingParams(max_tokens=1))
    await eng.cache.drain()
    eng.cache.flush(Tier.L3)
    assert eng.cache.tree.match(base, touch=False).lengths == [len(base)] * 2 + [0]


# -- L2 already holds the shared prefix ------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("page_size,siblings", [(4, 2), (4, 3), (4, 4), (1, 3), (16, 2)])
async def test_siblings_write_a_prefix_that_l2_holds_to_l3_once(page_size, siblings):
    """Regression: a 32-token prefix in L1 and L2 but not L3; sibling prompts extending it, computed
    together, each wrote the whole prefix to L3 (page 4, 3 siblings: 30 pages written for 14
    distinct; 4 siblings: 40 for 16), the duplicates then freed. A backup whose L3 write would
    write the page after L3's end that a write in flight writes waits for it, then writes only what
    L3 still lacks."""
    rng = random.Random(31 * page_size + siblings)
    base = [rng.randrange(VOCAB) for _ in range(32)]
    tail_tokens = max(7, 2 * page_size - 1)  # (with the one token computed after it: two pages more)
    prompts = [base + [rng.randrange(VOCAB) for _ in range(tail_tokens)] for _ in range(siblings)]
    eng = make_engine(page_size=page_size, num_pages=1024 // page_size)
    await eng.start()
    await _prefix_in_l1_and_l2_only(eng, base)
    written0, resident0 = written_pages(eng), l3_pages(eng)
    out = await eng.generate_async(prompts, SamplingParams(max_tokens=2))
    assert [r.output_ids for r in out] == await reference(prompts, 2, page_size)
    await eng.cache.drain()
    seqs = published(prompts, out)
    want = distinct_pages(seqs, page_size)
    for seq in seqs:
        aligned = len(seq) - len(seq) % page_size
        assert eng.cache.tree.match(seq, touch=False).lengths == [aligned] * 3
    assert eng.metrics()["failures"] == {}
    assert (written_pages(eng) - written0, l3_pages(eng) - resident0) == (want, want)
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("fail_first", [False, True])
async def test_a_sibling_waits_for_an_l3_write_in_flight_of_their_prefix(fail_first):
    """Regression: a prompt's backup published its pages in L2 and its L3 write is in flight (held
    here); sibling prompts sharing its 32-token prefix, computed meanwhile, copy only their own
    tails to L2 (L2 holds the prefix), and each then wrote the whole prefix to L3 again (no L3
    residency was published yet): 30 pages written for 14 distinct (22 with fail_first). They now wait for that write and
    write only their tails. fail_first: the write they wait for fails; every page still reaches L3
    (the first to go writes the shared prefix, the others wait for it; the failed prompt's pages
    come with its longer sequence's backup, which waited for the failed one), none written twice."""
    rng = random.Random(7)
    base = [rng.randrange(VOCAB) for _ in range(32)]
    prompts = [base + [rng.randrange(VOCAB) for _ in range(7)] for _ in range(3)]
    faults = FaultInjector()
    eng = make_engine(faults=faults)
    await eng.start()
    gate = WriteGate(eng.cache.store)
    if fail_first:
        faults.arm(Fault.EIO_WRITE)  # the first L3 write: prompt 0's
    first = await eng.generate_async(prompts[:1], SamplingParams(max_tokens=2))
    await until(lambda: eng.cache.tree.match(prompts[0], touch=False).lengths[Tier.L2] >= 36)  # its D2H ended
    rest = await eng.generate_async(prompts[1:], SamplingParams(max_tokens=2))
    out = first + rest
    await until(lambda: all(eng.cache.tree.match(p, touch=False).lengths[Tier.L2] >= 36 for p in prompts[1:]))
    assert len(eng.cache.runner._l3_writing) == 1  # the siblings' backups reached L3: they wait for prompt 0's
    assert [r.output_ids for r in out] == await reference(prompts, 2, 4)
    gate.release()
    await eng.cache.drain()
    seqs = published(prompts, out)
    want = distinct_pages(seqs, 4)
    assert sum(eng.metrics()["failures"].values()) == int(fail_first)
    for seq in seqs:
        assert eng.cache.tree.match(seq, touch=False).lengths == [40, 40, 40]
    assert (written_pages(eng), l3_pages(eng)) == (want, want)
    await finish(eng)


# -- the other write policies ---------------------------------------------------------------------
@pytest.mark.asyncio
async def test_write_through_selective_siblings_write_a_prefix_that_l2_holds_to_l3_once():
    """Regression (write_through_selective: a prefix is backed up at its second hit): sibling
    sequences sharing a prefix L2 holds and L3 lacks reach their second hit together, and each
    backup wrote the prefix to L3 (30 pages written for 14 distinct)."""
    rng = random.Random(3)
    base = [rng.randrange(VOCAB) for _ in range(32)]
    eng = make_engine(write_policy="write_through_selective")
    await eng.start()
    for _ in range(3):  # backed up at its second hit (the first run creates its node)
        await eng.generate_async([base + [1]], SamplingParams(max_tokens=1))
    await eng.cache.drain()
    eng.cache.flush(Tier.L3)
    assert eng.cache.tree.match(base, touch=False).lengths == [32, 32, 0]
    seqs = [base + [rng.randrange(VOCAB) for _ in range(8)] for _ in range(3)]
    written0, resident0 = written_pages(eng), l3_pages(eng)
    prompts = [s + [9] for s in seqs]
    for _ in range(3):  # a sibling's own node: created, then hit twice
        out = await eng.generate_async(prompts, SamplingParams(max_tokens=1))
        assert [r.output_ids for r in out] == await reference(prompts, 1, 4)
    await eng.cache.drain()
    for seq in seqs:
        assert eng.cache.tree.match(seq, touch=False).lengths == [40, 40, 40]
    want = distinct_pages(seqs, 4)
    assert (written_pages(eng) - written0, l3_pages(eng) - resident0) == (want, want)
    await finish(eng)


@pytest.mark.asyncio
async def test_write_back_siblings_evicted_together_write_a_prefix_that_l2_holds_to_l3_once():
    """Regression (write_back: a leaf is backed up when L1 evicts it): sibling leaves under a prefix
    L2 holds and L3 lacks, evicted by one long prompt, were each backed up with an L3 write of the
    whole prefix (30 pages written, 14 kept)."""
    rng = random.Random(5)
    base = [rng.randrange(VOCAB) for _ in range(32)]
    eng = make_engine(num_pages=32, write_policy="write_back")
    await eng.start()
    await eng.generate_async([base + [1]], SamplingParams(max_tokens=1))
    await eng.generate_async([[rng.randrange(VOCAB) for _ in range(100)]], SamplingParams(max_tokens=1))
    await eng.cache.drain()  # the long prompt evicted base: backed up to L2 and L3
    eng.cache.flush(Tier.L3)
    assert eng.cache.tree.match(base, touch=False).lengths == [0, 32, 0]
    prompts = [base + [rng.randrange(VOCAB) for _ in range(7)] for _ in range(3)]
    out = await eng.generate_async(prompts, SamplingParams(max_tokens=2))
    assert [r.output_ids for r in out] == await reference(prompts, 2, 4)
    await eng.cache.drain()
    written0, resident0 = written_pages(eng), l3_pages(eng)
    await eng.generate_async([[rng.randrange(VOCAB) for _ in range(100)]], SamplingParams(max_tokens=1))
    await eng.cache.drain()
    assert eng.cache.tree.match(base, touch=False).lengths == [0, 32, 32]
    assert eng.metrics()["failures"] == {}
    assert written_pages(eng) - written0 == l3_pages(eng) - resident0 > 0
    await finish(eng)
