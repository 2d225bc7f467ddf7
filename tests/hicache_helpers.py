"""Helpers shared by the cache-hierarchy reliability tests (test_stateful_manager, test_hierarchy,
test_faults, test_soak, test_transfer_hunt, test_shutdown_hunt): small CPU managers with exact tier
sizes, a request-like writer, whole-pool checks, an L3 bit flip, log capture that lets info-level op
events through, a gate holding L3 writes' completions, and an abandoned L3 read's setup and check."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import logging
import threading

import structlog
import torch
from structlog.testing import capture_logs

from hicache.config import HiCacheConfig
from hicache.faults import FaultInjector
from hicache.geometry import KVGeometry
from hicache.manager import CacheManager
from hicache.radix import Tier

TIER_LIST = (Tier.L1, Tier.L2, Tier.L3)


class CompletionGate:
    """Holds back the completion of a store's `method` (a future per call) until `release()`: the
    bytes move at once; each call's future resolves when the gate opens, or after 30 s so a failed
    test ends."""

    def __init__(self, store, method: str) -> None:
        self.gate = threading.Event()
        self._call = getattr(store, method)
        setattr(store, method, self._held)

    def _held(self, *args, **kwargs):
        inner, outer, gate = self._call(*args, **kwargs), cf.Future(), self._gate_of_call()

        def relay():
            gate.wait(30)
            self.released(inner)
            try:
                outer.set_result(inner.result())
            except BaseException as exc:
                outer.set_exception(exc)
        threading.Thread(target=relay, daemon=True).start()
        return outer

    def _gate_of_call(self) -> threading.Event:
        """The event a call waits for: the one gate (EachWriteGate: each call's own)."""
        return self.gate

    def released(self, inner) -> None:
        """Called with a held call's own future once the gate opened, before its result is relayed."""

    def release(self) -> None:
        self.gate.set()


class WriteGate(CompletionGate):
    """The store's L3 writes held back (CompletionGate)."""

    def __init__(self, store) -> None:
        super().__init__(store, "write_pages")


class EachWriteGate(CompletionGate):
    """Each L3 write held by an event of its own (`events`, one per call, in call order)."""

    def __init__(self, store) -> None:
        self.events: list[threading.Event] = []
        super().__init__(store, "write_pages")

    def _gate_of_call(self) -> threading.Event:
        self.events.append(threading.Event())
        return self.events[-1]


class ReadGate(CompletionGate):
    """The store's L3 reads held back (CompletionGate)."""

    def __init__(self, store) -> None:
        super().__init__(store, "read_pages")


def make_manager(l1_pages: int = 16, host_pages: int = 32, storage_pages: int = 64, page_size: int = 4,
                 dtype: torch.dtype = torch.float32, faults: FaultInjector | None = None,
                 **config) -> CacheManager:
    """A CPU manager with exact page counts per tier (storage_pages=0: no L3)."""
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=page_size, dtype=dtype)
    gib = 1 << 30
    config.setdefault("policy", "always")
    config.setdefault("transfer_backend", "torch")
    cfg = HiCacheConfig(enable=True, host_size_gb=host_pages * geometry.bytes_per_page / gib,
                        storage_size_gb=(storage_pages * geometry.bytes_per_page / gib) if storage_pages else None,
                        storage_ratio=2.0 if storage_pages else 0.0, **config)
    mgr = CacheManager(geometry, l1_pages, "cpu", cfg, faults=faults)
    assert mgr.l2.num_pages == host_pages
    assert (mgr.allocator(Tier.L3).num_pages if mgr.has_l3 else 0) == storage_pages
    return mgr


def write_prefix(mgr: CacheManager, tokens, start: int = 0, seed: int = 0) -> list[int] | None:
    """Compute (random KV) tokens[start:] into fresh L1 pages and publish them, as a request would.
    Returns the L1 pages, or None when L1 has no room."""
    num_pages = (len(tokens) - start) // mgr.page_size
    claim = mgr.new_claim("writer")
    pages = mgr.alloc_l1(num_pages, claim)
    if pages is None:
        mgr.release_claim(claim)
        return None
    gen = torch.Generator().manual_seed(seed)
    for p in pages:
        mgr.l1.kv[:, :, p] = torch.randn(mgr.l1.kv[:, :, p].shape, generator=gen).to(mgr.l1.kv.dtype)
    mgr.insert_l1(tuple(tokens), pages, claim, start)
    mgr.release_claim(claim)  # duplicates of what L1 already held go back to the free list
    return pages


def l1_bytes(mgr: CacheManager, tokens) -> torch.Tensor:
    """The KV of `tokens` (fully L1 resident) in page order, as raw bytes."""
    m = mgr.tree.match(tokens, include_storage=False, touch=False)
    assert m.lengths[Tier.L1] == len(tokens), m.lengths
    return mgr.l1.kv[:, :, m.pages[Tier.L1]].contiguous().view(torch.uint8).clone()


def assert_whole(mgr: CacheManager, driver_errors: int = 0, held_l1_pages: int = 0) -> None:
    """Integrity, no op driver crashed (but the `driver_errors` a test caused), and no tier holds a private page but
    the `held_l1_pages` an engine took for good (`Engine.held_l1_pages`: the CUDA graphs' scratch page) (call after
    drain with nothing locked)."""
    mgr.check_integrity()
    assert mgr.metrics.failures.get("driver", 0) == driver_errors, "an op driver raised (the op_driver_error log)"
    for tier in TIER_LIST:
        if tier in mgr.tree.allocators:
            alloc, held = mgr.allocator(tier), held_l1_pages if tier is Tier.L1 else 0
            assert alloc.num_private() == held, f"{tier.name}: {alloc.num_private() - held} private pages leaked"
            assert alloc.num_free + alloc.num_tree() + held == alloc.num_pages
    for node in mgr.tree.iter_nodes():
        if node is not mgr.tree.root:
            assert node.locks == [0, 0, 0], f"{node} still locked: {node.locks}"


async def served_then_below_l1(eng, prefix: list[int], tier: str) -> None:
    """Start `eng`, serve `prefix` + one token (one output token) and leave its pages in `tier` only
    ("l2", or "l3": L2 flushed too)."""
    from scheduler.request import SamplingParams

    await eng.start()
    await eng.generate_async([prefix + [1]], SamplingParams(max_tokens=1))
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    if tier == "l3":
        eng.cache.flush(Tier.L2)


async def read_stream(req) -> tuple[list[int], str]:
    """A queued request's token events up to its end: (its tokens, its finish reason)."""
    tokens, reason = [], None
    while reason is None:
        ev = await req.queue.get()
        if ev.finished:
            reason = ev.finish_reason
        else:
            tokens.append(ev.token_id)
    return tokens, reason


async def finish(eng) -> None:
    """End of an engine test: every request ended, the cache drained -> every tier whole, then close."""
    await eng.stop_loop()
    await eng.cache.drain()
    assert not eng.requests
    assert_whole(eng.cache)
    await eng.shutdown()


def flip_l3_byte(mgr: CacheManager, slot: int, at: int = 5) -> None:
    offset = slot * mgr.store.bytes_per_page + at
    with open(mgr.store.path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@contextlib.contextmanager
def capture_op_logs():
    """capture_logs() with info-level events let through (tests/conftest.py filters below WARNING)."""
    old = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(wrapper_class=old)


def toks(*runs: tuple[int, int]) -> tuple[int, ...]:
    out: list[int] = []
    for lo, hi in runs:
        out.extend(range(lo, hi))
    return tuple(out)


def op_transitions(logs: list[dict], kind: str | None = None) -> dict[int, list[str]]:
    """From captured logs: op id -> [initial state, every state it entered], in order."""
    out: dict[int, list[str]] = {}
    for e in logs:
        if e.get("event") == "op" and (kind is None or e["kind"] == kind):
            out.setdefault(e["op_id"], [e["from_state"]]).append(e["to_state"])
    return out


async def l3_only_chain(mgr):
    """Publish a two-node chain (8 tokens, then 8 more) and evict it from L1 and L2: it lives in L3
    only. Returns (the 16 tokens, their match)."""
    from hicache.radix import Tier

    a = toks((0, 8))
    b = a + toks((100, 108))
    write_prefix(mgr, a)
    await mgr.drain()
    write_prefix(mgr, b, 8)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 100)
    return b, mgr.tree.match(b, touch=False)


async def assert_abandoned_read_missed_reused_pages(mgr: CacheManager, op, tokens: list[int]) -> None:
    """`op` abandoned an L3 read into L2 pages; `tokens` (a 4-page prefix) needs every L2 page for
    its backup: write it, let the read land, and check that its L2 pages hold its own KV (had the
    op's pages been freed while the read ran, the read would have landed in them)."""
    write_prefix(mgr, tokens, seed=2)  # its backup needs every L2 page (skipped while they are held)
    await mgr.drain()
    with contextlib.suppress(Exception):  # the abandoned read has landed
        await asyncio.wrap_future(op.payload["read"])
    await mgr.drain()
    mgr.runner.start_backup(tokens)  # (a no-op when it was backed up above)
    await mgr.drain()
    m = mgr.tree.match(tokens, touch=False)
    assert m.lengths == [16, 16, 16]
    assert torch.equal(mgr.l2.page_buffer[m.pages[Tier.L2]].view(torch.uint8),
                       mgr.l1.kv[:, :, m.pages[Tier.L1]].permute(2, 0, 1, 3, 4, 5).contiguous().view(torch.uint8)), \
        "the prefix's L2 pages hold other KV: the abandoned read landed in them"


async def until(predicate, timeout_s: float = 10.0) -> None:
    """Yield to the loop until `predicate()` holds (AssertionError after timeout_s)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


async def l3_only_prefix_with_slow_reads() -> tuple[CacheManager, tuple[int, ...], tuple[int, ...], object]:
    """A manager whose L2 holds 4 pages, a 4-page prefix `a` in L3 only (its match returned), reads
    slowed (0.3 s), and another 4-page prefix `b` not yet written -> (mgr, a, b, match of a)."""
    from hicache.faults import Fault

    faults = FaultInjector()
    mgr = make_manager(l1_pages=16, host_pages=4, storage_pages=64, faults=faults)
    a, b = toks((1, 17)), toks((500, 516))
    write_prefix(mgr, a, seed=1)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 10 ** 9)
    mgr.tree.evict(Tier.L2, 10 ** 9)
    m = mgr.match(a)
    assert m.lengths == [0, 0, 16]
    faults.arm(Fault.SLOW_READ, delay_s=0.3)
    return mgr, a, b, m


def hold_copies(mgr, each: bool = False):
    """Hold every L1 <-> L2 copy's completion: until the returned event is set, or (each) its own
    event, appended to the returned list as the copy is awaited."""
    gates, real, one = [], mgr.transfer.wait, asyncio.Event()

    async def held(tr):
        gates.append(asyncio.Event() if each else one)
        await gates[-1].wait()
        return await real(tr)
    mgr.transfer.wait = held
    return gates if each else one
