"""Follow-ups of session 28's prefix-edge hunt (tests/test_prefix_edges_hunt.py): backups waiting for
a backup that then failed, and L3 restores whose H2D lost its L1 room (or whose restored pages were
evicted) before their request was admitted. The referee as there: greedy outputs equal a no-cache
engine's, every tier whole after the engine drained."""
from __future__ import annotations

import asyncio
import random

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpKind
from hicache.radix import Tier
from hicache_helpers import ReadGate, WriteGate, assert_whole, finish, until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

VOCAB = 512
PAGE = 4
_REFERENCE: dict = {}


async def reference(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of an engine without any cache (no prefix reuse, no hierarchy)."""
    missing = sorted({tuple(p) for p in prompts if (tuple(p), max_tokens) not in _REFERENCE})
    if missing:
        eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=1024, page_size=PAGE,
                                  enable_prefix_cache=False, max_running_requests=64))
        out = await eng.generate_async([list(p) for p in missing], SamplingParams(max_tokens=max_tokens))
        await eng.shutdown()
        _REFERENCE.update({(p, max_tokens): r.output_ids for p, r in zip(missing, out)})
    return [_REFERENCE[(tuple(p), max_tokens)] for p in prompts]


def make_engine(faults: FaultInjector | None = None, num_pages: int = 64, **hicache) -> Engine:
    hicache.setdefault("transfer_backend", "torch")
    hicache.setdefault("policy", "always")
    hicache.setdefault("host_ratio", 2.0)
    hicache.setdefault("storage_ratio", 4.0)
    config = EngineConfig(model="tiny", device="cpu", num_pages=num_pages, page_size=PAGE)
    return Engine(config.with_hicache(enable=True, **hicache), faults=faults or FaultInjector())


class D2HGate:
    """Holds back the completion of L1 -> L2 copies until `release` is set."""

    def __init__(self, eng: Engine) -> None:
        self.release = asyncio.Event()
        transfer = eng.cache.transfer
        self._wait = transfer.wait
        transfer.wait = self.wait

    async def wait(self, tr):
        if tr.direction == "d2h":
            await self.release.wait()
        return await self._wait(tr)


# -- 1. backups waiting for a backup that fails ----------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("step", ["d2h", "h2s"])
async def test_backups_waiting_for_a_failed_backup_start_when_it_ends(step):
    """Regression: backups waiting for one in flight (a longer sequence of the same prompt, and a
    sibling prompt sharing the prefix L2 lacked) were dropped when that backup failed: under
    write_through their pages never reached L2 (d2h: none of the shared prefix, h2s: not the pages
    beyond the failed backup's). Each now gets its own backup when the one it waits for ends,
    failed or not, copying what L2 still lacks: every page reaches L2 and L3, none is copied twice.

    Two prompts share a 16-token prefix S that no tier holds; each publishes S + 4 tokens at its
    first token (prompt 23 tokens) and one page more when it finishes (24 tokens cached). The
    first prompt's backup is the first copy: it is held in flight (its D2H, or its L3 write) while
    the others wait for it, then fails."""
    rng = random.Random(11)
    shared = [rng.randrange(VOCAB) for _ in range(16)]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(7)] for _ in range(2)]
    expected = await reference(prompts, 2)  # (first: computed after the run, it let the waiting backups move on)
    faults = FaultInjector()
    eng = make_engine(faults)
    await eng.start()
    if step == "d2h":
        gate = D2HGate(eng)
        faults.arm(Fault.TRANSFER_RAISE)  # the first copy: prompt 0's backup's D2H
        release = gate.release.set
    else:
        gate = WriteGate(eng.cache.store)
        faults.arm(Fault.EIO_WRITE)  # the first L3 write: prompt 0's backup's H2S
        release = gate.release
    out = await eng.generate_async(prompts, SamplingParams(max_tokens=2))
    assert [r.output_ids for r in out] == expected
    seqs = [tuple(p + r.output_ids)[:24] for p, r in zip(prompts, out)]  # what each request published
    waiting = [w for ws in eng.cache.runner._deferred.values() for w in ws]
    assert seqs[0] in waiting  # (the test's premise: the longer sequence waits for prompt 0's backup)
    release()
    await eng.cache.drain()
    assert sum(eng.metrics()["failures"].values()) == 1
    for seq in seqs:
        lengths = eng.cache.tree.match(seq, touch=False).lengths
        assert lengths == [24, 24, 24], (seq is seqs[0], lengths)
    distinct = (16 + 2 * 8) // PAGE
    m, page_bytes = eng.metrics(), eng.cache.geometry.bytes_per_page
    copied = {d: m["directions"][d]["bytes"] // page_bytes for d in ("d2h", "h2s")}
    assert copied == {"d2h": distinct, "h2s": distinct}, copied  # (a failed copy counts nothing)
    assert eng.cache.tree.num_resident_pages[Tier.L2] == distinct
    # served from L2 afterwards, with the same output
    eng.cache.flush(Tier.L1)
    again = [list(seq) + [1] for seq in seqs]
    out = await eng.generate_async(again, SamplingParams(max_tokens=2))
    assert [r.output_ids for r in out] == await reference(again, 2)
    assert sum(r.cached_tokens["l2"] + r.cached_tokens["l1"] for r in out) == 2 * 24
    await finish(eng)


@pytest.mark.asyncio
async def test_backups_waiting_for_a_cancelled_backup_are_dropped_by_a_cancelling_drain():
    """Guard for the fix above: a drain that cancels (shutdown's) drops the waiting backups, as it
    drops due ones, instead of starting new copies while it drains; nothing leaks."""
    rng = random.Random(12)
    shared = [rng.randrange(VOCAB) for _ in range(16)]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(7)] for _ in range(2)]
    eng = make_engine()
    await eng.start()
    gate = D2HGate(eng)
    await eng.generate_async(prompts, SamplingParams(max_tokens=2))
    assert any(eng.cache.runner._deferred.values())
    started = eng.metrics()["backups_started"]
    drain = asyncio.ensure_future(eng.cache.drain(cancel=True))
    await asyncio.sleep(0)
    gate.release.set()
    await drain
    assert eng.metrics()["backups_started"] == started
    assert not eng.cache.runner._deferred
    assert_whole(eng.cache)
    await eng.shutdown()


# -- 2. L3 restores that lost their L1 room ------------------------------------------------------
async def _prefix_in_l3(eng: Engine, prefix: list[int]) -> None:
    await eng.generate_async([prefix + [1]], SamplingParams(max_tokens=1))
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    eng.cache.flush(Tier.L2)
    assert eng.cache.tree.match(prefix, touch=False).lengths == [0, 0, len(prefix)]


@pytest.mark.asyncio
async def test_an_l3_restore_whose_h2d_lost_its_l1_room_decides_again():
    """Regression: an L3 restore started at admission (no prefetch: the request was queued while L2
    held its prefix, and L2 evicted it before the request was admitted) parks its request; the L1
    room the restore was started with is taken while it reads (here by a claim of the test's: since
    session 29 the parked read keeps its room from requests admitted meanwhile, which took it then;
    tests/test_restore_bookkeeping_hunt.py). Its read lands and is published in L2, its H2D finds
    no L1 pages and fails, and its request was marked restore_failed: it recomputed its whole
    32-token prefix although L2 held it. It now decides again, as a request whose L2 restore lacks
    room does: it waits for room and restores from L2 (no second read)."""
    rng = random.Random(21)
    prefix = [rng.randrange(VOCAB) for _ in range(32)]
    eng = make_engine(num_pages=32)
    await eng.start()
    await _prefix_in_l3(eng, prefix)
    [warm] = await eng.generate_async([prefix + [2]], SamplingParams(max_tokens=1))  # L3 -> L2 -> L1
    assert warm.cached_tokens["l3"] == 32
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    assert eng.cache.tree.match(prefix, touch=False).lengths == [0, 32, 32]
    gate = ReadGate(eng.cache.store)
    prompts, params = [prefix + [3]], [SamplingParams(max_tokens=4)]
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    assert reqs[0].prefetch_op is None  # (queued while L2 held it: nothing to promote)
    eng.cache.flush(Tier.L2)  # L2 loses it before the request is admitted
    assert eng.cache.tree.match(prefix, touch=False).lengths == [0, 0, 32]
    await until(lambda: reqs[0].restore_op is not None)
    assert reqs[0].restore_op.kind is OpKind.RESTORE_L3
    squatter = eng.cache.new_claim("squatter")  # the restore's room goes while it reads
    assert eng.cache.alloc_l1(eng.cache.l1.allocator.num_free, squatter)
    gate.release()
    await until(lambda: eng.metrics()["failures"])
    eng.cache.release_claim(squatter)  # room again: the request's L2 restore may start
    eng.wake_soon()
    results = []
    for req in reqs:
        while True:
            ev = await req.queue.get()
            if ev.finished:
                break
        results.append(req.result())
    want = [(await reference([p], sp.max_tokens))[0] for p, sp in zip(prompts, params)]
    assert [r.output_ids for r in results] == want
    metrics = eng.metrics()
    assert metrics["failures"] == {"no_pages": 1}, metrics["failures"]  # (the premise: its H2D lost its room)
    # (restored from L2, scored as the L3 hit its read was, as for a prefetch's promotion)
    assert results[0].cached_tokens == {"l1": 0, "l2": 0, "l3": 32}, results[0].cached_tokens
    assert metrics["directions"]["s2h"]["count"] == 2  # the warm-up's read and the lost restore's: no third
    assert metrics["directions"]["h2d"]["count"] == 2  # the warm-up's and the retry's, from L2
    await finish(eng)


@pytest.mark.asyncio
async def test_a_blocking_l3_restore_admits_its_request_before_others_evict_what_it_restored():
    """Regression (--disable-hicache-prefetch): the loop waits for an L3 restore started at admission,
    so no other request can take its room while it reads; but it then parked its request until the
    next tick and went on admitting the requests queued behind it, which evicted the pages it had
    just restored (unlocked once published): the request, first in the queue, recomputed its whole
    32-token prefix. It is now admitted as soon as its restore ended."""
    rng = random.Random(22)
    prefix = [rng.randrange(VOCAB) for _ in range(32)]
    others = [[rng.randrange(VOCAB) for _ in range(20)] for _ in range(4)]
    eng = make_engine(num_pages=24, prefetch=False)
    await eng.start()
    await _prefix_in_l3(eng, prefix)
    prompts = [prefix + [3]] + others
    out = await eng.generate_async(prompts, SamplingParams(max_tokens=4))
    assert [r.output_ids for r in out] == await reference(prompts, 4)
    assert out[0].cached_tokens == {"l1": 0, "l2": 0, "l3": 32}, out[0].cached_tokens
    assert eng.metrics()["failures"] == {}
    await finish(eng)
