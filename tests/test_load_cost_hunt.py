"""The cost policy's load awareness (`scheduler.load.busy_s` -> `decide`/`worth_writing` hidden_s) as a
running engine meets it: tiny preset on the CPU, fixed cost lines (learning off) so that every
decision is deterministic; what is asserted is decisions and counters, never wall time."""
from __future__ import annotations

import random

import pytest

from hicache.faults import FaultInjector
from hicache.radix import Tier
from hicache_helpers import ReadGate, capture_op_logs, finish, op_transitions, until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestState, SamplingParams

PAGE = 4
REUSABLE = 6 * PAGE  # a prompt's reusable prefix: 6 pages (its last token is always computed)
_rng = random.Random(11)


def _prompts(n: int) -> list[list[int]]:
    return [[_rng.randrange(512) for _ in range(REUSABLE + 1)] for _ in range(n)]


def _fix_lines(eng: Engine, forward_s: float, recompute_s: float, read_s: float, h2d_s: float | None = None) -> None:
    """Fixed cost lines, per REUSABLE tokens: a forward's fixed cost, a prefix's recompute, its
    storage read and its H2D (by default 1/30 of the recompute)."""
    cost = eng.cache.cost
    cost.learning = False
    per_byte = 1.0 / (REUSABLE * cost.bytes_per_token)
    dirs = cost.directions
    dirs["recompute"].fixed_s, dirs["recompute"].slope = forward_s, recompute_s / REUSABLE
    dirs["s2h"].fixed_s, dirs["s2h"].slope = 0.0, read_s * per_byte
    dirs["h2d"].fixed_s, dirs["h2d"].slope = 0.0, (recompute_s / 30 if h2d_s is None else h2d_s) * per_byte


async def _only_in_l3(prompts: list[list[int]], num_pages: int = 256, **hicache) -> Engine:
    """A cost-policy engine whose L3 alone holds each prompt's reusable prefix."""
    config = EngineConfig(model="tiny", device="cpu", num_pages=num_pages, page_size=PAGE,
                          max_prefill_tokens=hicache.pop("max_prefill_tokens", 2048),
                          restore_overlap=hicache.pop("restore_overlap", False),  # (ReadGate hides a read's landing hooks)
                          ).with_hicache(
        enable=True, policy="cost", transfer_backend="torch", storage_ratio=4.0, **hicache)
    eng = Engine(config, faults=FaultInjector())
    await eng.start()
    await eng.generate_async(prompts, SamplingParams(max_tokens=1))
    for prompt in prompts:
        eng.cache.runner.start_backup(prompt[:REUSABLE])
    await eng.cache.drain()
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    eng.cache.tree.evict(Tier.L2, eng.cache.l2.num_pages)
    for prompt in prompts:
        assert eng.cache.tree.match(prompt[:REUSABLE], touch=False).lengths == [0, 0, REUSABLE]
    return eng


@pytest.mark.asyncio
async def test_a_blocking_restore_is_not_hidden_behind_the_queue_it_blocks():
    """With prefetch off (--disable-hicache-prefetch) a restore blocks the engine's loop until its
    pages land: no forward of anyone runs beside it, so the work queued behind it hides nothing.
    The hit's read costs 3 ms to save 1 ms of recompute: it must be recomputed, loaded or not.
    Regression: the two requests queued behind it made the read look free, and the whole engine
    waited the 3 ms read to save 1 ms."""
    first, *others = _prompts(3)
    eng = await _only_in_l3([first], prefetch=False)
    _fix_lines(eng, forward_s=5e-3, recompute_s=1e-3, read_s=3e-3)
    with capture_op_logs() as logs:
        results = await eng.generate_async([first] + others, SamplingParams(max_tokens=2))
    reads = op_transitions(logs, "restore_l3")
    assert results[0].cached_tokens["l3"] == 0 and not reads, (
        f"the loop blocked on {len(reads)} L3 read(s) dearer than their recompute: {results[0].cached_tokens}")
    eng.check_integrity()
    await finish(eng)


@pytest.mark.asyncio
async def test_a_queue_does_not_all_park_on_slow_reads_while_the_gpu_idles():
    """20 requests arrive together, each with its prefix only in L3, whose read takes 30 ms against a
    forward of 6 ms (5 fixed, 1 of recompute). Each read hides behind the GPU work of the requests
    that recompute, but the reads queue behind one another on the store: so only about one request in
    six may read, the rest recompute (the reads are held until every request was decided, so what
    is asserted does not depend on when they land). Regression: each request priced the others as
    recomputing, all 20 parked on reads (600 ms of them one behind the other) and the GPU ran
    nothing meanwhile."""
    n, forward_s, recompute_s, read_s = 20, 5e-3, 1e-3, 30e-3
    prompts = _prompts(n)
    eng = await _only_in_l3(prompts, max_prefill_tokens=REUSABLE + 1)  # one prompt a forward
    _fix_lines(eng, forward_s=forward_s, recompute_s=recompute_s, read_s=read_s)
    gate = ReadGate(eng.cache.store)
    reqs = [eng.add_request(prompt, SamplingParams(max_tokens=1)) for prompt in prompts]
    await until(lambda: not eng.waiting)  # each recomputes, or is parked on its read
    reads = len(eng.parked)
    gate.release()
    await until(lambda: all(r.state.done for r in reqs))
    results = [r.result() for r in reqs]
    restored = sum(1 for r in results if r.cached_tokens["l3"])
    assert restored <= reads
    recomputed = n - reads
    assert reads * read_s <= recomputed * (forward_s + recompute_s) + read_s, (
        f"{reads} of {n} requests parked on L3 reads ({reads * read_s * 1e3:.0f} ms of them) beside "
        f"{recomputed} forwards of GPU work")
    assert reads >= 1  # (the load still hides some)
    eng.check_integrity()
    await finish(eng)


@pytest.mark.asyncio
async def test_a_request_alone_is_not_written_to_l3_by_its_own_decode_steps():
    """A request runs alone (max_tokens 32) where an L3 read costs 3 ms to save 1 ms of recompute:
    alone, a later request would recompute its prefix rather than read it, so the cost policy must
    not write it to L3 (write admission by the load, like restores, counts the GPU work besides the
    request, and there is none). Regression: its prompt's backup was admitted by the load of the
    pass after its prefill, its own 31 decode steps (155 ms), and written to L3 for nothing."""
    [prompt] = _prompts(1)
    config = EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=PAGE).with_hicache(
        enable=True, policy="cost", transfer_backend="torch")
    eng = Engine(config)
    await eng.start()
    _fix_lines(eng, forward_s=5e-3, recompute_s=1e-3, read_s=3e-3)
    await eng.generate_async([prompt], SamplingParams(max_tokens=32, ignore_eos=True))
    await eng.cache.drain()
    lengths = eng.cache.tree.match(prompt[:REUSABLE], touch=False).lengths
    assert lengths[Tier.L2] == REUSABLE and lengths[Tier.L3] == 0, f"written to L3 alone: {lengths}"
    [again] = await eng.generate_async([prompt], SamplingParams(max_tokens=1))
    assert again.cached_tokens["l3"] == 0  # (alone, an L3 hit of it would be recomputed)
    eng.check_integrity()
    await finish(eng)


@pytest.mark.asyncio
async def test_an_overlapped_l2_restore_is_not_hidden_behind_the_requests_it_holds_up():
    """A prefix only L2 holds, over a slow host link: its H2D takes 3 ms against 1 ms of recompute
    and a forward of 1 ms. Overlapped with the request's tail forward (which waits for it layer by
    layer) it costs the 2 ms beyond that forward: dearer than the recompute, alone or not, since
    nothing but that forward runs while it lands; the two requests queued behind it wait the whole
    copy. Regression: their 3 ms of queued work was taken to hide the copy, the restore was
    overlapped and the engine stalled on it."""
    first, *others = _prompts(3)
    eng = await _only_in_l3([first], restore_overlap=True)
    eng.cache.runner.start_restore(first[:REUSABLE], eng.cache.match(first[:REUSABLE]), "prefetch", None)
    await eng.cache.drain()
    assert eng.cache.tree.match(first[:REUSABLE], touch=False).lengths == [0, REUSABLE, REUSABLE]
    _fix_lines(eng, forward_s=1e-3, recompute_s=1e-3, read_s=3e-3, h2d_s=3e-3)
    results = await eng.generate_async([first] + others, SamplingParams(max_tokens=2))
    assert eng.stats["restore_overlaps"] == 0 and results[0].cached_tokens["l2"] == 0, (
        f"an overlapped H2D dearer than its recompute was priced as hidden: {results[0].cached_tokens}")
    eng.check_integrity()
    await finish(eng)


@pytest.mark.asyncio
async def test_an_aborted_request_hides_no_read_for_the_next_one():
    """A long generation (200 steps of 5 ms) is aborted, and the next request arrives before the
    loop has ended it: its prefix only L3 holds, read in 3 ms against 1 ms of recompute. The
    aborted request's steps will never run, so the read hides behind nothing and the prefix is
    recomputed, as alone. Regression: the aborted request still counted (it leaves `running` at
    the loop's next tick), its 199 steps hid the read, and the new request waited for a prefetch
    dearer than its recompute."""
    first, other = _prompts(2)
    eng = await _only_in_l3([first])
    _fix_lines(eng, forward_s=5e-3, recompute_s=1e-3, read_s=3e-3)
    long = eng.add_request(other, SamplingParams(max_tokens=200, ignore_eos=True))
    await until(lambda: long.state is RequestState.DECODE)
    assert await eng.abort(long.rid)
    req = eng.add_request(first, SamplingParams(max_tokens=1))
    assert req.prefetch_op is None, "a read was started behind the steps of an aborted request"
    await until(lambda: req.state.done)
    assert req.result().cached_tokens["l3"] == 0
    eng.check_integrity()
    await finish(eng)


@pytest.mark.asyncio
async def test_a_long_generation_hides_only_its_step_in_flight():
    """One request decodes 200 steps of 5 ms; the next arrives with a prefix only L3 holds, read in
    30 ms against 1 ms of recompute. Prefills go first, so recomputed it runs at once, after the
    one step in flight: that step (5 ms) is all a read could hide behind, and the prefix is
    recomputed. Regression (session 30's review): every remaining step counted, the 200 steps hid
    any read however slow, and the request waited 30 ms for a read to save 1 ms of GPU time. With a
    read of 3 ms (within the step in flight) it is read."""
    slow, fast, other = _prompts(3)
    eng = await _only_in_l3([slow, fast])
    _fix_lines(eng, forward_s=5e-3, recompute_s=1e-3, read_s=30e-3)
    long = eng.add_request(other, SamplingParams(max_tokens=200, ignore_eos=True))
    await until(lambda: long.state is RequestState.DECODE)
    req = eng.add_request(slow, SamplingParams(max_tokens=1))
    assert req.prefetch_op is None, "a read 30x dearer than its recompute hid behind 200 future steps"
    await until(lambda: req.state.done)
    assert req.result().cached_tokens["l3"] == 0
    _fix_lines(eng, forward_s=5e-3, recompute_s=1e-3, read_s=3e-3)
    req = eng.add_request(fast, SamplingParams(max_tokens=1))
    assert req.prefetch_op is not None  # (the step in flight hides it)
    await until(lambda: req.state.done)
    assert req.result().cached_tokens["l3"] == REUSABLE
    assert await eng.abort(long.rid)
    eng.check_integrity()
    await finish(eng)
