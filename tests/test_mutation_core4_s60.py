"""Cache-core guards found untested by session 60's mutation check of hicache/allocator.py, pools.py, pinned.py,
faults.py, cost_memory.py and geometry.py (and the leftovers of session 59's check of allocator.py, radix.py and
restores.py): what a pinned L2 registration keeps alive and says when refused, what a fault injector's re-arm,
snapshot and `remaining` promise, which kept cost samples are learned again, a geometry's sizes, a simulated pool's
memory, the allocator's refusals and forgotten claims, and what counts as a restore or an L2 read."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from structlog.testing import capture_logs

from hicache import pinned
from hicache.faults import Fault, FaultInjector
from test_pinned import _Owner, _Runtime  # (CUDA's runtime, recorded)


# -- pinned ---------------------------------------------------------------------------------------
def test_the_registration_keeps_its_memory_until_it_ends_and_is_not_ended_at_exit(monkeypatch):
    """The pinned L2 buffer outlives its registration: with the caller's tensor gone while the owner lives, the
    memory is still mapped (the finalizer holds it), and is let go only once the owner goes and the registration
    ended; the finalizer does not run at interpreter exit (the runtime may be gone by then; the driver unpins)."""
    runtime = _Runtime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    made = []
    real_finalize = weakref.finalize

    def finalize(*args, **kwargs):
        made.append(real_finalize(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(pinned.weakref, "finalize", finalize)
    owner = _Owner()
    buf = pinned.pinned_zeros(owner, (4, 8), torch.float32)
    ptr, alive = buf.data_ptr(), weakref.ref(buf)
    assert len(made) == 1 and made[0].atexit is False
    del buf
    gc.collect()
    assert alive() is not None and alive().data_ptr() == ptr  # still mapped while still registered
    del owner
    gc.collect()
    assert runtime.calls[-1] == ("unregister", ptr) and alive() is None


def test_a_refused_registration_is_a_warning(monkeypatch):
    """An L2 the runtime refused to register (torch's pinned allocator takes over, rounding it up to a power of
    two) is logged as a warning naming the CUDA error, for the operator who wonders where the memory went."""
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Runtime(register_code=2))
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros",
                        lambda *a, **k: real_zeros(*a, **{x: v for x, v in k.items() if x != "pin_memory"}))
    with capture_logs() as logs:
        pinned.pinned_zeros(_Owner(), (2, 4), torch.float16)
    assert [(e["event"], e["log_level"], e["cuda_error"]) for e in logs] == [("l2_host_register_failed", "warning", 2)]


# -- faults ---------------------------------------------------------------------------------------
def test_a_rearm_replaces_the_delay_too():
    """Re-arming replaces the whole arming: a slow read re-armed with another delay sleeps the new one."""
    faults = FaultInjector()
    faults.arm(Fault.SLOW_READ, delay_s=0.5)
    faults.arm(Fault.SLOW_READ, delay_s=0.01)
    assert faults.should_fire(Fault.SLOW_READ) and faults.delay_s(Fault.SLOW_READ) == 0.01


def test_fired_is_a_snapshot_and_remaining_is_none_when_not_armed():
    """`fired` is a copy (a caller's count does not move under it, nor can it change the injector's), and
    `remaining` says None for a fault not armed, as documented (0 would read as "armed, used up")."""
    faults = FaultInjector()
    assert faults.remaining(Fault.EIO_READ) is None
    faults.arm(Fault.EIO_READ, times=2)
    before = faults.fired
    assert faults.should_fire(Fault.EIO_READ)
    assert before[Fault.EIO_READ] == 0 and faults.fired[Fault.EIO_READ] == 1
    before[Fault.EIO_READ] = 99
    assert faults.fired[Fault.EIO_READ] == 1 and faults.remaining(Fault.EIO_READ) == 1


# -- cost_memory ----------------------------------------------------------------------------------
def test_learn_again_refuses_a_negative_size_or_an_over_an_hour_sample_before_learning_anything():
    """A kept index's sample of a negative size, or of more than an hour (SAMPLE_SECONDS_MAX, the bound itself is
    taken), is refused before anything is learned (not half learned, then LinearCost's own refusal midway); a
    rows field not a list (a dict, a number) is a ValueError too, the one `learn_costs` turns into a warning."""
    from hicache_helpers import make_manager

    mgr = make_manager(storage_pages=0)
    for bad in ({"recompute": [[16, 1e-3], [-16, 1e-3]]}, {"s2h": [[4096, 3601.0]]},
                {"s2h": 5}, {"s2h": {"4096": 1e-3}}):
        with pytest.raises(ValueError):
            mgr.cost.learn_again(bad)
        assert all(c.regime == "prior" and not c.samples() for c in mgr.cost.directions.values()), bad
    assert mgr.cost.learn_again({"s2h": [[4096, 3600.0]]}) == 1  # (an hour: SAMPLE_SECONDS_MAX)


def test_learn_again_learns_nothing_where_the_cost_model_does_not_learn():
    """A simulation's cost model does not learn (`learning` off: nothing is timed there); a kept index's samples
    do not teach it either: learn_again says 0 and every direction keeps its prior."""
    from hicache_helpers import make_manager

    mgr = make_manager(storage_pages=0)
    mgr.cost.learning = False
    assert mgr.cost.learn_again({"recompute": [[16, 1e-3], [64, 4e-3]]}, {"recompute": 1e-5}) == 0
    assert all(c.regime == "prior" and not c.samples() for c in mgr.cost.directions.values())
    assert mgr.cost.directions["recompute"].reference_slope == mgr.cost.directions["recompute"].prior_slope


def test_the_kept_reference_slope_is_the_reference_not_the_current_slope():
    """`reference_slopes` (saved with a kept index) is each direction's reference slope, not its current slope: a
    window of one size faster than the prior moves the slope, never the reference."""
    from hicache_helpers import make_manager

    mgr = make_manager(storage_pages=0)
    assert mgr.cost.learn_again({"recompute": [[16, 1e-6]]}) == 1
    rc = mgr.cost.directions["recompute"]
    assert rc.slope != rc.reference_slope
    assert mgr.cost.reference_slopes()["recompute"] == rc.reference_slope == rc.prior_slope


# -- geometry -------------------------------------------------------------------------------------
def test_geometry_sizes_agree_with_its_layouts():
    """A token's bytes are K and V of every layer (the cost model prices a transfer of n tokens at
    n * bytes_per_token), a page's are page_size tokens', and both agree with the element counts of the L1 and
    page-major layouts; a slab is one (kv, layer) of a page; `describe` (/hicache/status) says the same."""
    import math

    from hicache.geometry import KVGeometry

    g = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16)
    assert g.bytes_per_token == 2 * 3 * 2 * 8 * 2
    assert g.bytes_per_page == g.page_size * g.bytes_per_token == math.prod(g.page_major_shape(1)) * g.itemsize
    assert g.l1_shape(5) == (2, 3, 5, 4, 2, 8) and g.page_major_shape(5) == (5, 2, 3, 4, 2, 8)
    assert g.slab_elements == 4 * 2 * 8 and g.page_elements == 2 * 3 * g.slab_elements
    assert g.describe() == {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8, "page_size": 4, "dtype": "bfloat16",
                            "bytes_per_token": 192, "bytes_per_page": 768}


def test_geometry_rounds_tokens_up_to_pages_and_refuses_an_empty_dimension():
    """`pages_for_tokens` is the pages that hold n tokens (a part page is a page; none for none), and a geometry
    with a dimension of 0 (no layer, no head, an empty page) is refused at once."""
    from hicache.geometry import KVGeometry

    g = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1, page_size=4, dtype=torch.float16)
    assert [g.pages_for_tokens(n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
        with pytest.raises(ValueError, match=name):
            KVGeometry(**{"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "page_size": 1, name: 0},
                       dtype=torch.float16)


# -- pools ----------------------------------------------------------------------------------------
def test_simulated_pools_hold_no_kv_memory_but_every_page():
    """A simulation (replay --simulate) keeps the books of every page but holds no K/V: a 64 GiB L2 simulated
    takes no memory, while its allocator still has every page (and names its tier in its errors)."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool

    g = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float16)
    l1 = DevicePool(g, 1000, torch.device("cpu"), simulate=True)
    l2 = HostPool(g, 2000, pin=False, simulate=True)
    assert l1.kv.numel() == 0 and l2.page_buffer.numel() == 0
    assert l1.allocator.num_free == 1000 and l2.allocator.num_free == 2000
    assert (l1.allocator.name, l2.allocator.name) == ("l1", "l2")  # (what an allocator error names)
    real = HostPool(g, 3, pin=False)
    assert real.page_buffer.shape == g.page_major_shape(3) and real.buffer.shape == g.l1_shape(3)


def test_a_pinned_host_pool_stays_registered_while_it_lives(monkeypatch):
    """An L2 pinned through hicache/pinned.py says so (`pinned`: the transfers take the host-address kernels and
    layer-wise copies only then) and stays registered as long as the pool lives, not just while it is built."""
    from hicache.geometry import KVGeometry
    from hicache.pools import HostPool

    runtime = _Runtime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    g = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.float16)
    pool = HostPool(g, 4, pin=True)
    gc.collect()
    assert pool.pinned and [c[0] for c in runtime.calls] == ["register"]
    assert runtime.calls[0][1] == pool.page_buffer.data_ptr() and runtime.calls[0][2] == 4 * g.bytes_per_page
    del pool
    gc.collect()
    assert [c[0] for c in runtime.calls] == ["register", "unregister"]


# -- allocator ------------------------------------------------------------------------------------
def test_take_refuses_a_negative_or_repeated_page_and_takes_nothing():
    """`take` (a kept L3 index's slots adopted at start) refuses a page below 0 (numpy would read it from the end)
    and a page listed twice, before taking anything."""
    from hicache.allocator import AllocatorError, PageAllocator

    alloc = PageAllocator(8, "l3")
    claim = alloc.new_claim("index")
    for bad in ([-1, 2], [3, 3]):
        with pytest.raises(AllocatorError, match="out of range or listed twice"):
            alloc.take(bad, claim)
        assert alloc.num_free == 8 and alloc.pages_of(claim) == []
    alloc.check([])


def test_a_closed_claim_is_forgotten():
    """A closed claim is gone: it can no longer be given pages (a request's claim closed by mistake while it still
    allocates is an error, not a silent leak), and the allocator keeps no entry for it (one a request, forever)."""
    from hicache.allocator import AllocatorError, PageAllocator

    alloc = PageAllocator(8, "l1")
    claims = [alloc.new_claim(f"r{i}") for i in range(3)]
    for claim in claims:
        alloc.free(alloc.alloc(2, claim), claim)
        alloc.close_claim(claim)
    with pytest.raises(AllocatorError, match="unknown claim"):
        alloc.alloc(1, claims[0])
    assert alloc.claim_labels == {} and alloc._held == {}
    alloc.check([])


def test_bad_sizes_and_pages_are_allocator_errors():
    """A page one past the end is an AllocatorError naming the range (not numpy's IndexError); no pages (or fewer
    than none) allocate nothing and leave the free runs whole; a tier of fewer than no pages names num_pages;
    num_tree counts the tree's pages, not a claim's."""
    from hicache.allocator import AllocatorError, PageAllocator

    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(-1, "l1")
    alloc = PageAllocator(8, "l1")
    claim = alloc.new_claim("r")
    assert alloc.alloc(0, claim) == [] and alloc.alloc(-1, claim) == []
    alloc.check([])
    with pytest.raises(AllocatorError, match="out of range"):
        alloc.free([8], claim)
    pages = alloc.alloc(3, claim)
    alloc.give_to_tree(pages[:1], claim)
    assert alloc.num_tree() == 1 and alloc.num_private() == 2
    alloc.check(pages[:1])


# -- restores -------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_prefetch_is_no_restore_and_an_l3_restore_reads_no_l2():
    """hicache_restores_started counts restores, not prefetches into L2; and L2's reuse record (whether L2 backups
    pay: reads against evictions) counts what an L2 restore read, not the pages an L3 restore landed in L2 on its
    way to L1 (L3's record has those)."""
    from hicache.radix import Tier
    from hicache_helpers import l3_only_chain, make_manager

    mgr = make_manager()
    tokens, m = await l3_only_chain(mgr)
    op = mgr.runner.start_restore(tokens, m, "prefetch", "p")
    assert op is not None
    await mgr.drain()
    assert mgr.metrics.restores_started == 0
    mgr.tree.evict(Tier.L2, 100)
    l2_reads, l3_reads = mgr.reuse[Tier.L2].read_pages, mgr.reuse[Tier.L3].read_pages
    m = mgr.tree.match(tokens, touch=False)
    assert m.lengths == [0, 0, 16]
    assert mgr.runner.start_restore(tokens, m, "l3", "r") is not None
    await mgr.drain()
    assert mgr.metrics.restores_started == 1
    assert mgr.reuse[Tier.L2].read_pages == l2_reads and mgr.reuse[Tier.L3].read_pages == l3_reads + 4
    mgr.check_integrity()
    await mgr.close()
