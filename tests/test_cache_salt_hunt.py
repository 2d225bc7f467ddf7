"""cache_salt, a bug hunt: a salted request's tokens reach every tier only salted (`Request.cache_prompt`), the
model computes only the real prompt, and a salt shares nothing outside itself; across short prompts, prompt
logprobs, choices computed together, chunked prefill, every write policy, L3 prefetches and the requests that
follow them, blocking restores, overlapped restores, a NaN prefix drop and --simulate. Referees: an engine
without a cache, `check_integrity`, and the tree's keys (each first page is one a request asked for, salted).
CPU, tiny preset."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from hicache.radix import Tier
from hicache_helpers import capture_op_logs, op_transitions
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import Request, RequestError, SamplingParams, salted_prompt
from test_faults import PAGE, make_engine, reference

VOCAB = 512
_rng = random.Random(11)
BASE = [_rng.randrange(VOCAB) for _ in range(6 * PAGE + 1)]  # 24 reusable tokens: 6 pages


def keys_of(prompt: list[int], salt: str | None) -> list[int]:
    return prompt if salt is None else salted_prompt(prompt, salt)


def params(salt: str | None, max_tokens: int = 3, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, cache_salt=salt, **kw)


def assert_tree_keys(eng: Engine, jobs, outs) -> None:
    """Every first page the tree holds (any tier) is the first page of some request's cache keys: a
    salted request's pages never appear unsalted (nor under another salt)."""
    allowed = set()
    for (prompt, salt), out in zip(jobs, outs):
        allowed.add(tuple((keys_of(prompt, salt) + out.output_ids)[:PAGE]))
    tree = eng.cache.tree
    for child in tree.root.children.values():
        assert tuple(child.key[:PAGE]) in allowed, child.key[:PAGE]
    eng.check_integrity()


async def expected(jobs, max_tokens: int = 3) -> list[list[int]]:
    return [await reference(p, max_tokens) for p, _ in jobs]


async def serve_together(eng: Engine, jobs, max_tokens: int = 3):
    """All of `jobs` queued at once (each its own request, as the n choices of one API call are)."""
    outs = await asyncio.gather(*(eng.generate_async([p], params(s, max_tokens)) for p, s in jobs))
    await eng.cache.drain()
    return [o[0] for o in outs]


async def serve_one(eng: Engine, prompt, salt, max_tokens: int = 3, **kw):
    [out] = await eng.generate_async([prompt], params(salt, max_tokens, **kw))
    await eng.cache.drain()
    return out


# -- prompts of a page or less ------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("length", [1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE + 1])
async def test_short_prompts_are_keyed_salted(length):
    eng = make_engine(num_pages=48)
    prompt = BASE[:length]
    want = await reference(prompt, 6)
    jobs = [(prompt, "a"), (prompt, "a"), (prompt, "b"), (prompt, None), (prompt, "a")]
    outs = [await serve_one(eng, p, s, 6) for p, s in jobs]
    assert [o.output_ids for o in outs] == [want] * len(jobs)
    reusable = (length - 1) - (length - 1) % PAGE
    assert [sum(o.cached_tokens.values()) for o in outs] == [0, reusable, 0, 0, reusable]
    assert_tree_keys(eng, jobs, outs)
    await eng.shutdown()


# -- prompt logprobs (echo) --------------------------------------------------------------------
@pytest.mark.asyncio
async def test_prompt_logprobs_with_a_salt_publish_salted_pages():
    eng = make_engine(num_pages=48)
    plain = await serve_one(eng, BASE, None, prompt_logprobs=1)
    salted = await serve_one(eng, BASE, "a", prompt_logprobs=1)
    assert salted.output_ids == plain.output_ids == await reference(BASE, 3)
    assert [None if e is None else e.logprob for e in salted.prompt_logprobs] == \
        [None if e is None else e.logprob for e in plain.prompt_logprobs]
    again = await serve_one(eng, BASE, "a")  # its prefill published its pages under its salt
    other = await serve_one(eng, BASE, "b")
    assert again.cached_tokens["l1"] == len(BASE) - 1 and sum(other.cached_tokens.values()) == 0
    assert_tree_keys(eng, [(BASE, None), (BASE, "a"), (BASE, "a"), (BASE, "b")], [plain, salted, again, other])
    await eng.shutdown()


# -- requests computed together, chunked prefill, write policies, L3 prefetch ------------------
def mixed_jobs(seed: int):
    """Two bases (one never asked unsalted), each asked under several salts, twice each (the n choices of
    one call); a third prompt differing from the first only in its first token, under the same salt."""
    rng = random.Random(seed)
    a = [rng.randrange(VOCAB) for _ in range(5 * PAGE + 2)]
    b = [rng.randrange(VOCAB) for _ in range(3 * PAGE + 1)]
    a2 = [(a[0] + 1) % VOCAB] + a[1:]
    jobs = [(a, None), (a, None), (a, "x"), (a, "x"), (a, "y"), (b, "x"), (b, "x"), (b, "y"), (a2, "x")]
    rng.shuffle(jobs)
    return jobs


CONFIGS = {
    "l1_chunked": dict(hicache=None, max_prefill_tokens=6),
    "write_through": dict(hicache=dict(write_policy="write_through")),
    "write_through_selective": dict(hicache=dict(write_policy="write_through_selective")),
    "write_back": dict(hicache=dict(write_policy="write_back")),
    "prefetch_chunked": dict(hicache=dict(prefetch=True), max_prefill_tokens=6),
    "blocking": dict(hicache=dict(prefetch=False)),
    "no_overlap": dict(hicache=dict(), restore_overlap=False),
}


def config_engine(name: str, num_pages: int = 24) -> Engine:
    spec = dict(CONFIGS[name])
    hc = spec.pop("hicache")
    config = EngineConfig(model="tiny", device="cpu", num_pages=num_pages, page_size=PAGE, **spec)
    if hc is not None:
        config = config.with_hicache(enable=True, policy="always", transfer_backend="torch", host_ratio=2.0,
                                     storage_ratio=8.0, **hc)
    return Engine(config)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", list(CONFIGS))
async def test_salted_requests_together_equal_recompute_and_stay_apart(name):
    """Rounds of the jobs queued at once, L1 too small for all (later rounds come back from L2/L3)."""
    eng = config_engine(name)
    jobs = mixed_jobs(1)
    want = await expected(jobs)
    all_jobs, all_outs = [], []
    for _ in range(3):
        outs = await serve_together(eng, jobs)
        assert [o.output_ids for o in outs] == want
        for (p, s), o in zip(jobs, outs):
            # a salt no earlier request of this prompt had: nothing cached serves it
            if not any(q == p and t == s for q, t in all_jobs):
                first_of_kind = [i for i, (q, t) in enumerate(jobs) if q == p and t == s][0]
                if outs[first_of_kind] is o:
                    assert sum(o.cached_tokens.values()) == 0, (s, o.cached_tokens)
        all_jobs += jobs
        all_outs += outs
        assert_tree_keys(eng, all_jobs, all_outs)
    hits = eng.metrics()["hit_tokens"]
    assert sum(hits.values()) > 0
    for alloc in eng.cache.tree.allocators.values():
        assert alloc.num_private() == 0
    await eng.shutdown()


# -- an L3 prefetch and the requests that follow it --------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("prefetch", [True, False])
async def test_an_l3_read_is_followed_only_within_its_salt(prefetch):
    """The prefix in L3 only, under salt "a" and unsalted: "a", None, "a", "b" queued together. Each reads
    only its own keys' pages; "b" finds nothing; the outputs are recompute's."""
    eng = make_engine(num_pages=48, prefetch=prefetch, storage_ratio=8.0)
    await eng.start()
    want = await reference(BASE, 3)
    for salt in ("a", None):
        assert (await serve_one(eng, BASE, salt)).output_ids == want
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    eng.cache.tree.evict(Tier.L2, eng.cache.l2.num_pages)
    for salt in ("a", None):
        assert eng.cache.tree.match(keys_of(BASE, salt)[:-1], touch=False).lengths == [0, 0, len(BASE) - 1]
    jobs = [(BASE, "a"), (BASE, None), (BASE, "a"), (BASE, "b")]
    outs = await serve_together(eng, jobs)
    assert [o.output_ids for o in outs] == [want] * 4
    assert sum(outs[3].cached_tokens.values()) == 0
    assert outs[0].cached_tokens["l3"] == sum(outs[2].cached_tokens.values()) == len(BASE) - 1
    assert outs[1].cached_tokens["l3"] == len(BASE) - 1
    assert_tree_keys(eng, [(BASE, "a"), (BASE, None)] + jobs, outs[:2] + outs)
    await eng.stop_loop()
    await eng.shutdown()


def test_restore_in_flight_of_unsalted_tokens_is_no_salted_requests_leader():
    """Restoring's follow check compares cache keys: an unsalted read of the same prompt is not a salted
    request's leader, nor the reverse, while one of the same salt is."""
    eng = make_engine(num_pages=48, prefetch=True, storage_ratio=8.0)
    runner = eng.cache.runner
    plain = Request(prompt=list(BASE), params=params(None))
    salted = Request(prompt=list(BASE), params=params("a"))
    same = Request(prompt=list(BASE), params=params("a"))

    class FakeOp:  # (only what restore_in_flight reads)
        def __init__(self, tokens, rid):
            from hicache.ops import OpKind
            self.kind, self.request_id, self.done = OpKind.RESTORE_L2, rid, False
            self.payload = {"tokens": tuple(tokens), "cancel": False}

    adm = eng.admission
    for leader, follower, follows in ((plain, salted, False), (salted, plain, False), (salted, same, True)):
        runner.live = {1: FakeOp(adm._reusable(leader), leader.rid)}
        m = eng.cache.tree.match(adm._reusable(follower), touch=False)
        assert (runner.restore_in_flight(adm._reusable(follower), m, follower.rid) is not None) == follows
        # an op whose own request ends is kept only for a queued request that would follow it (drop_ops)
        op = FakeOp(adm._reusable(leader), None)
        op.payload.update(l1_start=0, l2_start=0)
        eng.waiting.clear(), eng.waiting.append(follower)
        assert adm._op_wanted(op, leader, set()) == follows
    runner.live = {}
    eng.waiting.clear()
    # a follower scores as L3 only what the read it followed promoted of its own keys (Restoring._followed)
    from hicache.ops import OpKind
    for leader, follower, promoted in ((plain, salted, 0), (salted, plain, 0), (salted, same, len(BASE) - 1)):
        op = FakeOp(adm._reusable(leader), leader.rid)
        op.kind, op.succeeded = OpKind.RESTORE_L3, True
        op.payload.update(l2_start=0, l3_end=len(BASE) - 1)
        follower.promoted_tokens = 0
        adm._followed(follower, op)
        assert follower.promoted_tokens == promoted


# -- overlapped restores -----------------------------------------------------------------------
@pytest.mark.asyncio
async def test_overlapped_restore_of_a_salted_prefix():
    eng = make_engine(num_pages=48)
    await eng.start()
    want = await reference(BASE, 3)
    for salt in ("a", None):
        await serve_one(eng, BASE, salt)
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    first = await serve_one(eng, BASE, "a")
    assert first.output_ids == want and first.cached_tokens["l2"] == len(BASE) - 1
    assert eng.stats["restore_overlaps"] == 1
    other = await serve_one(eng, BASE, "b")
    assert other.output_ids == want and sum(other.cached_tokens.values()) == 0
    assert eng.cache.tree.match(keys_of(BASE, None)[:-1], touch=False).lengths[Tier.L1] == 0  # not restored
    assert_tree_keys(eng, [(BASE, "a"), (BASE, None), (BASE, "a"), (BASE, "b")], [first, first, first, other])
    await eng.stop_loop()
    await eng.shutdown()


# -- a NaN prefix drop ---------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_salted_nan_prefix_drops_the_salted_pages_only():
    eng = make_engine(num_pages=48)
    want = await reference(BASE, 3)
    for salt in ("a", None):
        assert (await serve_one(eng, BASE, salt)).output_ids == want
    salted = keys_of(BASE, "a")[:-1]
    m = eng.cache.tree.match(salted, include_storage=False, touch=False)
    eng.cache.l1.kv[:, :, torch.tensor(m.pages[Tier.L1], dtype=torch.int64)] = float("nan")
    failed = await serve_one(eng, BASE, "a")
    assert failed.finish_reason == "error" and "NaN" in failed.error
    assert eng.cache.tree.match(salted, touch=False).lengths == [0, 0, 0]  # its salted pages left every tier
    plain = await serve_one(eng, BASE, None)  # the unsalted prefix was never suspect
    assert plain.output_ids == want and plain.cached_tokens["l1"] == len(BASE) - 1
    again = await serve_one(eng, BASE, "a")
    assert again.output_ids == want and sum(again.cached_tokens.values()) == 0
    eng.check_integrity()
    await eng.shutdown()


# -- --simulate --------------------------------------------------------------------------------
def test_simulate_computes_the_real_prompt_and_keys_it_salted():
    eng = Engine(EngineConfig(model="tiny", simulate=True, num_pages=64, page_size=PAGE))
    jobs = [(BASE, None), (BASE, "a"), (BASE, "a"), (BASE, "b")]
    outs = [eng.generate([p], params(s))[0] for p, s in jobs]
    assert len({tuple(o.output_ids) for o in outs}) == 1  # the model saw no salted id
    assert [sum(o.cached_tokens.values()) for o in outs] == [0, 0, len(BASE) - 1, 0]
    assert_tree_keys(eng, jobs, outs)


@pytest.mark.asyncio
async def test_a_parked_restore_is_followed_only_within_its_salt():
    """The prefix in L2 only, under salt "a" and unsalted; None, "a", None, "a" queued together, restores
    parked (no overlap): each request that waits for another's restore (Restoring._try_restore's follow)
    waits for one of its own salt, and at least one does."""
    config = EngineConfig(model="tiny", device="cpu", num_pages=48, page_size=PAGE, restore_overlap=False
                          ).with_hicache(enable=True, policy="always", transfer_backend="torch")
    eng = Engine(config)
    await eng.start()
    want = await reference(BASE, 3)
    for salt in ("a", None):
        await serve_one(eng, BASE, salt)
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    follows, park = [], eng.admission._park

    def recording_park(req, room_pages=0):
        if req.follow_op is not None:  # (parked on another's restore: its leader)
            follows.append((req.params.cache_salt, eng.requests[req.follow_op.request_id].params.cache_salt))
        park(req, room_pages)
    eng.admission._park = recording_park
    jobs = [(BASE, None), (BASE, "a"), (BASE, None), (BASE, "a")]
    outs = await serve_together(eng, jobs)
    assert [o.output_ids for o in outs] == [want] * 4
    assert follows and all(mine == theirs for mine, theirs in follows), follows
    assert all(sum(o.cached_tokens.values()) == len(BASE) - 1 for o in outs)
    eng.check_integrity()
    await eng.stop_loop()
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_salted_prefetch_taken_on_to_l1_beside_the_unsalted_prefix():
    """The salted prefix in L3 only, the unsalted one back in L1: the salted request takes its landed
    prefetch on to L1 (Restoring._take_on, checksums slowed) and counts all of it from L3, none from the
    unsalted L1 pages of the same tokens."""
    from hicache.faults import Fault, FaultInjector
    faults = FaultInjector()
    eng = make_engine(faults, num_pages=48, storage_ratio=8.0)
    await eng.start()
    want = await reference(BASE, 3)
    reusable = len(BASE) - 1
    for salt in ("a", None):
        await serve_one(eng, BASE, salt)
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    eng.cache.tree.evict(Tier.L2, eng.cache.l2.num_pages)
    assert (await serve_one(eng, BASE, None)).cached_tokens["l3"] == reusable  # unsalted: back in L1
    assert eng.cache.tree.match(keys_of(BASE, "a")[:-1], touch=False).lengths == [0, 0, reusable]
    faults.arm(Fault.SLOW_VERIFY, times=None, delay_s=0.3)
    overlaps = eng.stats["restore_overlaps"]
    with capture_op_logs() as logs:
        out = await serve_one(eng, BASE, "a")
    assert out.output_ids == want and out.cached_tokens == {"l1": 0, "l2": 0, "l3": reusable}
    assert eng.stats["restore_overlaps"] == overlaps + 1
    assert list(op_transitions(logs, "prefetch_l3").values()) == [  # taken on while its checksums ran
        ["L3", "S2H_PENDING", "S2H_LANDED", "H2D_VERIFYING", "H2D_PENDING", "L1_L2_L3"]]
    assert eng.cache.tree.match(keys_of(BASE, "a")[:-1], touch=False).lengths == [reusable] * 3
    eng.check_integrity()
    await eng.stop_loop()
    await eng.shutdown()


@pytest.mark.parametrize("simulate", [False, True])
def test_a_salted_key_cannot_be_sent_as_a_prompt(simulate):
    """A salt's keys differ from every prompt only because no token id is negative: a client sending a
    salted key as its prompt is refused, not served another tenant's pages."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", simulate=simulate, num_pages=64, page_size=PAGE))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.add_request(salted_prompt(BASE, "a"), params(None))
