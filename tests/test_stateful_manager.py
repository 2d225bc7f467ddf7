"""The CacheManager under random sequences of operations (hypothesis stateful test, no model), and the
regression tests of the op-driver bugs that such sequences exposed.

Every step ends with `check_integrity()`; at teardown everything drains and, with nothing locked by a
caller, no tier holds a private page. The machine is synchronous, so it drives its own event loop:
a "complete" step runs the loop a few iterations (ops are asyncio tasks, file I/O runs on threads).
"""
from __future__ import annotations

import asyncio
import gc
import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import (TIER_LIST, assert_whole, capture_op_logs, flip_l3_byte, l1_bytes, l3_only_chain,
                             make_manager, toks, write_prefix)


# -- regression tests (each failed before its fix) -------------------------------------------------
@pytest.mark.asyncio
async def test_backup_locks_its_l2_prefix_before_allocating():
    """Bug: start_backup allocated L2 pages (evicting L2 LRU leaves) before locking its own L2
    prefix, so it could evict the very prefix it extends; publishing then broke contiguity and the
    lock raised out of insert_l1 with an L1 lock and private L2 pages leaked."""
    mgr = make_manager(l1_pages=16, host_pages=4, storage_pages=0)
    a, c = toks((0, 8)), toks((500, 504))
    b = a + toks((100, 108))
    write_prefix(mgr, a)
    await mgr.drain()
    write_prefix(mgr, c)  # L2: a (2 pages, older), c (1 page), 1 free
    await mgr.drain()
    write_prefix(mgr, b, start=8)  # needs 2 L2 pages: must evict c, never a
    await mgr.drain()
    m = mgr.tree.match(b, touch=False)
    assert m.lengths[Tier.L2] == 16 and mgr.metrics.failures == {}
    assert mgr.tree.match(c, touch=False).lengths[Tier.L2] == 0
    assert torch.equal(mgr.l2.buffer[:, :, m.pages[Tier.L2]], mgr.l1.kv[:, :, m.pages[Tier.L1]])
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_backup_locks_its_l3_prefix_before_allocating():
    """Bug: the H2S step allocated L3 slots before locking the L3 prefix it extends; the eviction
    took that prefix and the lock then raised (the backup failed as a driver error)."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=4)
    a, c = toks((0, 8)), toks((500, 504))
    b = a + toks((100, 108))
    for t, start in ((a, 0), (c, 0), (b, 8)):
        write_prefix(mgr, t, start)
        await mgr.drain()
    assert mgr.tree.match(b, touch=False).lengths[Tier.L3] == 16
    assert mgr.tree.match(c, touch=False).lengths[Tier.L3] == 0
    assert mgr.metrics.failures == {}
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_l3_restore_locks_its_l2_prefix_before_allocating():
    """Bug: _start_s2h allocated L2 pages before locking the L2 prefix; promoting [8, 16) evicted
    [0, 8) from L2 and publication failed."""
    mgr = make_manager(l1_pages=16, host_pages=4, storage_pages=32)
    a, c = toks((0, 8)), toks((500, 504))
    b = a + toks((100, 108))
    write_prefix(mgr, a)
    await mgr.drain()
    write_prefix(mgr, b, 8)
    await mgr.drain()
    original = l1_bytes(mgr, b)
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 2)  # b's tail leaves L2; a stays (L2: 2 of 4 pages)
    write_prefix(mgr, c)  # L2: a (older), c; 1 free
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 100)
    m = mgr.tree.match(b, touch=False)
    assert m.lengths == [0, 8, 16]
    op = mgr.runner.start_restore(b, m, "l3", "r")
    await mgr.drain()
    assert op.state is OpState.L1_L2_L3, op.error
    assert torch.equal(l1_bytes(mgr, b), original)
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_l3_restore_locks_the_l1_prefix_it_lands_after():
    """Bug: after S2H the restore re-matched L1 (another request may have computed part of the
    prefix meanwhile) and allocated L1 pages without locking that L1 prefix, so the allocation could
    evict it and publishing the restored pages after it raised (an op_driver_error). Now the prefix
    is locked: the allocation fails cleanly and the request recomputes."""
    mgr = make_manager(l1_pages=4, host_pages=32, storage_pages=32, write_policy="write_through_selective")
    a, d = toks((0, 8)), toks((500, 508))
    b = a + toks((100, 108))
    write_prefix(mgr, b)
    mgr.runner.start_backup(b)
    await mgr.drain()
    kv_of_a = mgr.l1.kv[:, :, mgr.tree.match(a, touch=False).pages[Tier.L1]].clone()
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 100)
    m = mgr.tree.match(b, touch=False)
    assert m.lengths == [0, 0, 16]
    with capture_op_logs() as logs:
        op = mgr.runner.start_restore(b, m, "l3", "r")
        # before the read lands: a request computes a (same KV), another holds d locked; L1 is full
        claim = mgr.new_claim("w")
        pages = mgr.alloc_l1(2, claim)
        mgr.l1.kv[:, :, pages] = kv_of_a
        mgr.insert_l1(a, pages, claim, 0)
        mgr.release_claim(claim)
        write_prefix(mgr, d)
        reader = mgr.tree.match(d).handles[Tier.L1]
        mgr.lock(reader)
        await mgr.drain()
    assert op.state is OpState.FAILED and op.error == "no L1 pages for the H2D step"
    assert not [e for e in logs if e["event"] == "op_driver_error"]
    assert mgr.metrics.failures == {"no_pages": 1}
    assert mgr.tree.match(a, touch=False).lengths[Tier.L1] == 8  # the unlocked prefix survived
    assert mgr.tree.match(b, touch=False).lengths[Tier.L2] == 16  # the promotion stays published
    mgr.unlock(reader)
    assert_whole(mgr)



@pytest.mark.asyncio
async def test_guard_releases_an_op_whose_publication_raised():
    """Bug: _guard released an op only when the driver raised before a terminal state; an exception
    from publishing (after H2D_DONE) left its private L1 pages and its locks held forever."""
    mgr = make_manager()
    b = toks((0, 16))
    write_prefix(mgr, b)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 100)
    insert = mgr.tree.insert

    def broken_insert(tokens, tier, *args, **kwargs):
        if tier is Tier.L1:
            raise RuntimeError("injected publication bug")
        return insert(tokens, tier, *args, **kwargs)
    mgr.tree.insert = broken_insert
    with capture_op_logs() as logs:
        op = mgr.runner.start_restore(b, mgr.match(b), "l2", "r")
        await mgr.drain()
    mgr.tree.insert = insert
    assert op.state is OpState.L1_L2  # the transition happened; its publication did not
    assert [e["event"] for e in logs if e["event"] == "op_driver_error"] == ["op_driver_error"]
    assert mgr.metrics.failures == {"driver": 1}
    assert_whole(mgr, driver_errors=1)


@pytest.mark.asyncio
async def test_l3_restore_whose_read_lands_after_l1_was_filled():
    """Bug: a restore whose S2H landed after another restore of the same prefix had published it
    in L1 found nothing left to copy and enqueued an H2D of zero pages, which raised (a spurious
    'driver error' failure and fallback). Two requests with one prefix do this. The interleaving is
    made deterministic by starting the second restore from the match taken before the first ran."""
    mgr = make_manager()
    b = toks((0, 16))
    write_prefix(mgr, b)
    await mgr.drain()
    original = l1_bytes(mgr, b)
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 100)
    m = mgr.tree.match(b, touch=False)
    first = mgr.runner.start_restore(b, m, "l3", "r0")
    await mgr.drain()
    second = mgr.runner.start_restore(b, m, "l3", "r1")
    await mgr.drain()
    assert [first.state, second.state] == [OpState.L1_L2_L3] * 2, second.error
    assert mgr.metrics.failures == {} and mgr.metrics.fallbacks == 0
    assert torch.equal(l1_bytes(mgr, b), original)
    assert_whole(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize("tier", ["l2", "l3", "prefetch"])
async def test_restore_with_nothing_to_copy_is_refused_cleanly(tier):
    """Bug: start_restore with a stale match (the tier holds no more than L1) enqueued a zero-page
    transfer that raised out of start_restore with the op's L1 lock still held."""
    mgr = make_manager()
    b = toks((0, 16))
    write_prefix(mgr, b)
    await mgr.drain()
    m = mgr.tree.match(b, touch=False)
    assert m.lengths == [16, 16, 16]
    assert mgr.runner.start_restore(b, m, tier, "r") is None
    await mgr.drain()
    assert_whole(mgr)


def test_drop_of_a_multi_node_chain():
    """Bug: RadixTree.drop removed nodes leaves-first, but removing a leaf also removed its emptied
    parent, and the loop then tried to remove that parent again (AssertionError, half-dropped tree)."""
    mgr = make_manager()
    a = toks((0, 8))
    b = a + toks((100, 108))

    async def build():
        write_prefix(mgr, a)
        await mgr.drain()
        write_prefix(mgr, b, 8)
        await mgr.drain()
    asyncio.run(build())
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 100)
    m = mgr.tree.match(b, touch=False)
    assert m.lengths == [0, 0, 16] and len(m.path) == 2
    freed = mgr.tree.drop(m.path[0], Tier.L3)
    assert sorted(freed) == sorted(m.pages[Tier.L3])
    assert mgr.tree.match(b).path == [] and not mgr.tree.root.children
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_checksum_mismatch_drops_a_multi_node_l3_chain():
    """The same drop bug through the driver: a bit flip in the first node's slot of a two-node
    L3-only chain made the restore's failure handling crash and leave an empty node behind."""
    mgr = make_manager()
    b, m = await l3_only_chain(mgr)
    flip_l3_byte(mgr, m.pages[Tier.L3][0])
    with capture_op_logs() as logs:
        op = mgr.runner.start_restore(b, m, "l3", "r")
        await mgr.drain()
    assert op.state is OpState.FAILED and "checksum" in op.error
    assert [e["to_state"] for e in logs if e["event"] == "op"] == ["S2H_PENDING", "FAILED"]
    assert not [e for e in logs if e["event"] == "op_driver_error"]
    # (no request: a fallback is a request recomputing, counted by the engine's admission)
    assert mgr.metrics.failures == {"checksum": 1} and mgr.metrics.fallbacks == 0
    assert mgr.tree.match(b, touch=False).lengths == [0, 0, 0]  # the corrupt page's residency is gone
    assert_whole(mgr)



@pytest.mark.asyncio
async def test_late_failure_of_a_timed_out_read_is_retrieved():
    """Bug (found by the state machine): an L3 read past its deadline fails the restore at once and
    a settle task waits for the I/O; when that I/O then failed, the driver's own wrapper future was
    never awaited again and asyncio reported 'Future exception was never retrieved'."""
    faults = FaultInjector()
    mgr = make_manager(faults=faults, io_timeout_s=0.01)
    b = toks((0, 16))
    write_prefix(mgr, b)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 100)
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    old_handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        faults.arm(Fault.SLOW_READ, delay_s=0.2)
        faults.arm(Fault.EIO_READ)
        op = mgr.runner.start_restore(b, mgr.match(b), "l3", "r")
        await mgr.drain()
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(old_handler)
    assert op.state is OpState.FAILED and "deadline" in op.error
    assert faults.fired[Fault.EIO_READ] == 1
    assert mgr.metrics.failures == {"timeout": 1}
    assert not [c for c in reported if "never retrieved" in c.get("message", "")], reported
    assert_whole(mgr)


# -- the randomized state machine ----------------------------------------------------------------
PAGE = 2  # tokens per page in the machine (small pages: many nodes, many splits)
ALPHABET = 3  # token values: tiny, so random sequences share prefixes often
FAULTS = [Fault.TRANSFER_RAISE, Fault.EIO_READ, Fault.EIO_WRITE, Fault.SHORT_READ, Fault.SHORT_WRITE,
          Fault.ENOSPC_WRITE, Fault.SLOW_READ]
BASES = ((0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2), (0, 1, 2, 2, 1, 0, 0, 0, 1, 1, 2, 2),
         (1, 1, 0, 0, 2, 2, 1, 0, 2, 1, 0, 2))
# a few shared bases cut at a random page, plus a random tail: prefixes are shared, nodes split
sequences = st.builds(
    lambda base, cut, tail: BASES[base][: cut * PAGE] + tuple(tail[: len(tail) - len(tail) % PAGE]),
    st.integers(0, len(BASES) - 1), st.integers(0, 6), st.lists(st.integers(0, ALPHABET - 1), max_size=2 * PAGE),
).filter(len)


def page_value(prefix: tuple[int, ...], shape: torch.Size) -> torch.Tensor:
    """The KV a page holds is a function of the whole prefix through that page (exact in fp32)."""
    base = float((hash(prefix) % 4093) * 4096)
    return base + torch.arange(shape.numel(), dtype=torch.float32).view(shape)


class ManagerMachine(RuleBasedStateMachine):
    """Rules drive a CacheManager the way requests, the admission loop and the I/O layer would."""

    @initialize()
    def setup(self):
        self.loop = asyncio.new_event_loop()
        self.faults = FaultInjector()
        self.mgr = make_manager(l1_pages=10, host_pages=12, storage_pages=16, page_size=PAGE,
                                faults=self.faults, io_timeout_s=0.002)
        self.caller_locks: list[tuple] = []
        self.known: list[tuple[int, ...]] = []  # sequences computed so far
        self.ops: list = []  # every op the manager started (backups from inserts included)
        register = self.mgr.runner._register

        def record(op, coro):
            self.ops.append(op)
            return register(op, coro)
        self.mgr.runner._register = record

    def _call(self, fn, *args):
        async def go():
            return fn(*args)
        return self.loop.run_until_complete(go())

    # -- request-like rules --------------------------------------------------------------------
    @rule(seq=sequences)
    def insert_prefix(self, seq):
        """A request computes seq's uncached tail in private pages and publishes it."""
        mgr = self.mgr

        def compute():
            m = mgr.match(seq)
            handle, start = m.handles[Tier.L1], m.lengths[Tier.L1]
            mgr.lock(handle)
            claim = mgr.new_claim("request")
            try:
                pages = mgr.alloc_l1((len(seq) - start) // PAGE, claim)
                if pages is None:
                    return
                for i, p in enumerate(pages):
                    end = start + (i + 1) * PAGE
                    mgr.l1.kv[:, :, p] = page_value(seq[:end], mgr.l1.kv[:, :, p].shape)
                mgr.insert_l1(seq, pages, claim, start)
                self.known.append(seq)
            finally:
                mgr.release_claim(claim)
                mgr.unlock(handle)
        self._call(compute)

    @rule(seq=sequences)
    def match(self, seq):
        m = self.mgr.match(seq)
        for length in m.lengths:
            assert length % PAGE == 0 and length <= m.path_tokens <= len(seq)

    @rule(seq=sequences, tier=st.sampled_from(TIER_LIST))
    def lock(self, seq, tier):
        handle = self.mgr.match(seq).handles[tier]
        if handle is not None:
            self.mgr.lock(handle, tier)
            self.caller_locks.append((handle, tier))

    @rule(index=st.integers(0, 100))
    def unlock(self, index):
        # no preconditions on state anywhere: I/O timing shapes the state, and hypothesis needs
        # the same draws on a replay
        if self.caller_locks:
            handle, tier = self.caller_locks.pop(index % len(self.caller_locks))
            self.mgr.unlock(handle, tier)

    @rule(tier=st.sampled_from(TIER_LIST), num_pages=st.integers(1, 12))
    def evict(self, tier, num_pages):
        self.mgr.tree.evict(tier, num_pages)

    # -- operations ----------------------------------------------------------------------------
    @rule(seq=sequences)
    def start_backup(self, seq):
        self._call(self.mgr.runner.start_backup, seq)

    @rule(index=st.integers(0, 100), tier=st.sampled_from(["l2", "l3", "prefetch"]),
          evict_first=st.sampled_from([(), (Tier.L1,), (Tier.L1, Tier.L2)]),
          fault=st.sampled_from([None, None, None, Fault.TRANSFER_RAISE, Fault.EIO_READ, Fault.SLOW_READ]))
    def start_restore(self, index, tier, evict_first, fault):
        """A request arrives for a prefix computed earlier (after its upper tiers were evicted,
        when evict_first says so: restores are rare otherwise), maybe with a fault armed for it."""
        if not self.known:
            return
        seq = self.known[index % len(self.known)]
        for t in evict_first:
            self.mgr.tree.evict(t, self.mgr.allocator(t).num_pages)
        if fault is not None:
            self.fail(fault)
        runner = self.mgr.runner
        self._call(lambda: runner.start_restore(seq, self.mgr.match(seq), tier, "req"))

    @rule(steps=st.integers(1, 4))
    def complete(self, steps):
        """Let the loop run: each pending task advances by (at most) one await."""
        for _ in range(steps):
            self.loop.run_until_complete(asyncio.sleep(0))

    @rule()
    def wait_for_io(self):
        self.loop.run_until_complete(asyncio.sleep(0.003))

    @rule()
    def drain(self):
        """Every pending op runs to its end."""
        self.loop.run_until_complete(self.mgr.drain())

    @rule(fault=st.sampled_from(FAULTS))
    def fail(self, fault):
        self.faults.arm(fault, times=1, delay_s=0.01 if fault is Fault.SLOW_READ else 0.0)

    @rule(seq=sequences)
    def flip_l3_bit(self, seq):
        m = self.mgr.match(seq)
        if m.pages[Tier.L3]:
            flip_l3_byte(self.mgr, m.pages[Tier.L3][-1])

    @rule(index=st.integers(0, 100))
    def cancel(self, index):
        live = list(self.mgr.runner.live.values())
        if live:
            self.mgr.runner.cancel(live[index % len(live)])

    # -- checks --------------------------------------------------------------------------------
    @invariant()
    def integrity(self):
        if hasattr(self, "mgr"):
            self.mgr.check_integrity()
            assert "driver" not in self.mgr.metrics.failures  # _guard caught a driver exception

    @invariant()
    def published_pages_hold_their_prefix(self):
        """Every L1 / L2 page the tree publishes holds exactly the KV of its prefix."""
        if not hasattr(self, "mgr"):
            return
        mgr = self.mgr
        stack = [(mgr.tree.root, ())]
        while stack:
            node, prefix = stack.pop()
            full = prefix + node.key
            for tier, pages in ((Tier.L1, node.pages[Tier.L1]), (Tier.L2, node.pages[Tier.L2])):
                for i, p in enumerate(pages or ()):
                    got = mgr.l1.kv[:, :, p] if tier is Tier.L1 else mgr.l2.page_buffer[p]
                    want = page_value(full[: len(prefix) + (i + 1) * PAGE], got.shape)
                    assert torch.equal(got, want), f"{tier.name} page {p} of {node} holds other KV"
            stack.extend((c, full) for c in node.children.values())

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        mgr = self.mgr
        try:
            self.faults.disarm()
            for handle, tier in self.caller_locks:
                mgr.unlock(handle, tier)
            self.loop.run_until_complete(mgr.drain())
            assert not mgr.runner.live and all(op.done for op in self.ops)
            self.published_pages_hold_their_prefix()
            assert_whole(mgr)
        finally:
            self.loop.run_until_complete(mgr.close())
            self.loop.close()


def test_manager_state_machine():
    run_state_machine_as_test(ManagerMachine, settings=settings(
        max_examples=int(os.environ.get("HICACHE_STATEFUL_EXAMPLES", "150")), stateful_step_count=50,
        deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
