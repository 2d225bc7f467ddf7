"""Bug hunt: chunked prefill (prompts longer than max_prefill_tokens, prefilled over several
batches) meeting the prefix cache: hits in L1 / L2 / L3 ending mid-chunk, mid-page or on a chunk
boundary, requests sharing a prefix that another is still chunk-prefilling, aborts between chunks,
a tiny L1, the model's last position, chunks shorter than a page. The referee: every greedy output
equals a no-cache engine's, hits + recomputed tokens are the prompt, and once every request ended
each tier is whole (integrity, nothing private, no lock left)."""
from __future__ import annotations

import random

import pytest

from hicache.radix import Tier
from hicache_helpers import assert_whole, finish, served_then_below_l1, until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams
from test_prefix_edges_hunt import VOCAB, reference

PAGE = 4


def make_engine(hicache: bool = True, num_pages: int = 64, max_prefill_tokens: int = 16, page_size: int = PAGE,
                **changes) -> Engine:
    config = EngineConfig(model="tiny", device="cpu", num_pages=num_pages, page_size=page_size,
                          max_prefill_tokens=max_prefill_tokens,
                          restore_overlap=changes.pop("restore_overlap", True))
    if hicache:
        changes.setdefault("transfer_backend", "torch")
        changes.setdefault("policy", "always")
        config = config.with_hicache(enable=True, host_ratio=2.0, storage_ratio=changes.pop("storage_ratio", 0.0),
                                     **changes)
    return Engine(config)


def random_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


# -- a request sharing a prefix another is still chunk-prefilling -------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("hicache,write_policy", [(False, None), (True, "write_through"), (True, "write_back"),
                                                  (True, "write_through_selective")])
async def test_a_request_reuses_the_chunks_of_a_shared_prefix_already_computed(hicache, write_policy):
    """Regression: a request's pages were published only once its whole prompt was prefilled, so a
    request sharing a long prefix, admitted while the first was still chunk-prefilling it, computed
    every shared token again, those the first had already computed too (here all 64 of them: it was
    admitted in the batch of the first's last chunk), and the first's then came back as
    duplicates. Each chunk's full pages are published as it is kept: the second hits them."""
    base = random_tokens(1, 64)
    prompts = [base + [1], base + [2, 3]]
    eng = make_engine(hicache, **({"write_policy": write_policy} if hicache else {}))
    await eng.start()
    first = eng.add_request(prompts[0], SamplingParams(max_tokens=3))  # chunks of 16, 16, 16, 16, 1
    await until(lambda: first.cached_len >= 16)
    second = eng.add_request(prompts[1], SamplingParams(max_tokens=3))
    await until(lambda: first.state.done and second.state.done)
    assert [first.output, second.output] == await reference(prompts, 3)
    assert second.hit_tokens["l1"] == 64, second.hit_tokens  # the first's chunks, published as computed
    assert second.recomputed_tokens == 2
    assert eng.stats["prefill_tokens"] == eng.metrics()["recomputed_tokens"] == 65 + 2
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("prompt_tokens", [65, 66, 72])
async def test_write_through_backs_up_a_prompt_whose_chunks_published_every_page(prompt_tokens):
    """A chunked prompt's pages are published chunk by chunk without a backup each; the prompt's
    write-through backup comes once its prefill ends, also where its last chunk added no full page
    (65 tokens: chunks 16 x 4 then 1; a test of the fix above: that prompt was never backed up)."""
    prompt = random_tokens(2, prompt_tokens)
    eng = make_engine(write_policy="write_through")
    await eng.start()
    await eng.generate_async([prompt], SamplingParams(max_tokens=2))
    await eng.cache.drain()
    aligned = prompt_tokens - prompt_tokens % PAGE
    assert eng.cache.tree.match(prompt, touch=False).lengths[:2] == [aligned, aligned]
    assert eng.metrics()["backups_started"] == 1  # the prompt's, not one a chunk
    eng.cache.flush(Tier.L1)
    [r] = await eng.generate_async([prompt], SamplingParams(max_tokens=2))
    assert r.output_ids == (await reference([prompt], 2))[0]
    assert r.cached_tokens["l2"] == (prompt_tokens - 1) - (prompt_tokens - 1) % PAGE
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.parametrize("again_from", ["l1", "l2"])
async def test_a_request_aborted_between_chunks_leaves_only_what_it_computed(write_policy, again_from):
    """Aborted between its prefill chunks, a request leaves in the tree the full pages of the chunks
    it computed (nothing beyond), no lock and no private page; under write_through they are backed
    up as it ends (under write_back as L1 is flushed). The same prompt sent again reuses them, from
    L1 or L2, and its output equals a no-cache engine's; recomputed_tokens counts each prompt token
    once."""
    prompt = random_tokens(3, 70)
    eng = make_engine(write_policy=write_policy)
    await eng.start()
    req = eng.add_request(prompt, SamplingParams(max_tokens=3))
    await until(lambda: req.cached_len >= 32)
    assert await eng.abort(req.rid)
    await until(lambda: req.state.done)
    await eng.cache.drain()
    computed = req.cached_len
    assert 32 <= computed < 70 and req.finish_reason == "abort"
    m = eng.cache.tree.match(prompt, touch=False)
    assert m.lengths[Tier.L1] == computed - computed % PAGE
    assert m.lengths[Tier.L2] == (m.lengths[Tier.L1] if write_policy == "write_through" else 0)
    assert_whole(eng.cache)
    if again_from == "l2":
        await eng.cache.flush_async(Tier.L1)
        assert eng.cache.tree.match(prompt, touch=False).lengths[:2] == [0, m.lengths[Tier.L1]]
    [r] = await eng.generate_async([prompt], SamplingParams(max_tokens=3))
    assert r.output_ids == (await reference([prompt], 3))[0]
    assert r.cached_tokens[again_from] == m.lengths[Tier.L1]
    assert eng.metrics()["recomputed_tokens"] == computed + 70 - m.lengths[Tier.L1]
    await finish(eng)


# -- a cached prefix ending anywhere against the chunk boundaries --------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("page_size,max_prefill_tokens", [(4, 16), (4, 5), (4, 4), (4, 3), (1, 7), (2, 1)])
@pytest.mark.parametrize("tier", ["l1", "l2", "l3"])
async def test_a_prefix_hit_ending_anywhere_chunks_the_rest_like_recompute(page_size, max_prefill_tokens, tier):
    """Prefixes of a 48-token sequence cached in one tier (lengths on and off a chunk boundary, one
    page and more), then prompts reusing them with tails longer than a chunk: outputs equal a
    no-cache engine's, each prompt counts its hit in that tier and recomputes the rest."""
    seq = random_tokens(4, 48)
    cuts = [page_size, 16, 20, 24, 33]
    eng = make_engine(page_size=page_size, num_pages=256 // page_size, max_prefill_tokens=max_prefill_tokens,
                      storage_ratio=4.0 if tier == "l3" else 0.0, prefetch=tier == "l3")
    await eng.start()
    prompts = [seq[:cut] + random_tokens(cut, 2 * max_prefill_tokens + 3) for cut in cuts]
    got = []
    for cut, prompt in zip(cuts, prompts):
        [warm] = await eng.generate_async([seq[:cut] + [1]], SamplingParams(max_tokens=1))  # caches seq[:cut]
        await eng.cache.drain()
        if tier != "l1":
            eng.cache.flush(Tier.L1)
        if tier == "l3":
            eng.cache.flush(Tier.L2)
        hit = cut - cut % page_size
        assert eng.cache.tree.match(prompt, touch=False).lengths[int(tier[1]) - 1] >= hit
        before = eng.metrics()["recomputed_tokens"]
        [r] = await eng.generate_async([prompt], SamplingParams(max_tokens=3))
        got.append(r.output_ids)
        assert r.cached_tokens[tier] >= hit and sum(r.cached_tokens.values()) + (
            eng.metrics()["recomputed_tokens"] - before) == len(prompt), (cut, r.cached_tokens)
    assert got == await reference(prompts, 3, page_size)
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("tier,prefetch,overlap", [("l2", True, True), ("l2", False, True), ("l3", True, True),
                                                   ("l3", True, False), ("l3", False, False)])
async def test_requests_sharing_a_lower_tier_prefix_with_chunked_tails_copy_it_once(tier, prefetch, overlap):
    """Three requests arriving together share a 32-token prefix only L2 (or L3) holds, each with a
    tail longer than a chunk (no overlapped restore: parked, blocking or prefetched, then chunks):
    the prefix is copied up once, counted once as the lower tier's hit and twice as L1 hits; the
    outputs equal a no-cache engine's."""
    base = random_tokens(5, 32)
    prompts = [base + random_tokens(50 + i, 20 + 7 * i) for i in range(3)]
    eng = make_engine(storage_ratio=4.0 if tier == "l3" else 0.0, prefetch=prefetch, restore_overlap=overlap)
    await served_then_below_l1(eng, base, tier)
    before = eng.metrics()
    out = await eng.generate_async(prompts, SamplingParams(max_tokens=3))
    assert [r.output_ids for r in out] == await reference(prompts, 3)
    after = eng.metrics()
    hits = {t: after["hit_tokens"][t] - before["hit_tokens"][t] for t in ("l1", "l2", "l3")}
    assert hits == {"l1": 64, "l2": 32 if tier == "l2" else 0, "l3": 32 if tier == "l3" else 0}, hits
    assert after["directions"]["h2d"]["count"] - before["directions"]["h2d"]["count"] == 1
    assert after["recomputed_tokens"] - before["recomputed_tokens"] == sum(len(p) for p in prompts) - 96
    await finish(eng)


@pytest.mark.asyncio
async def test_a_chunked_prompt_up_to_the_models_last_position_from_each_tier():
    """Prompt + max_tokens - 1 = the model's 4,096 positions, prefilled in chunks of 1,000 (the last
    one ending mid-page): cold, then with its prefix from L1, from L2 and from L3, each output equals
    a no-cache engine's; one token more is refused naming max_tokens."""
    positions = 4096
    prompt = random_tokens(6, positions - 6)
    params = SamplingParams(max_tokens=7)
    eng = make_engine(num_pages=positions // PAGE + 8, max_prefill_tokens=1000, storage_ratio=2.0)
    assert eng.model_config.max_position_embeddings == positions
    with pytest.raises(RequestError, match="max_position_embeddings") as refused:
        eng.validate(prompt, SamplingParams(max_tokens=8))
    assert refused.value.param == "max_tokens"
    await eng.start()
    [want] = await reference([prompt], 7)
    for tier in ("cold", "l1", "l2", "l3"):
        if tier in ("l2", "l3"):
            await eng.cache.drain()
            eng.cache.flush(Tier.L1)
        if tier == "l3":
            eng.cache.flush(Tier.L2)
        [r] = await eng.generate_async([prompt], params)
        assert r.output_ids == want, tier
        assert r.cached_tokens.get(tier, 0) == (0 if tier == "cold" else positions - 8), (tier, r.cached_tokens)
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.parametrize("max_prefill_tokens", [3, 16])
async def test_a_chunked_prompt_that_fills_l1_evicts_the_cached_prefix_chunk_by_chunk(write_policy,
                                                                                     max_prefill_tokens):
    """L1 of 20 pages holds a 60-token sequence (unsaved under write_back) when a 70-token prompt
    with max_tokens 11 arrives: it needs all 20 pages, taken chunk by chunk, each evicting what it
    must (under write_back only once saved in L2). Its output equals a no-cache engine's, and the
    evicted sequence then comes back from L2."""
    warm, prompt = random_tokens(7, 60), random_tokens(8, 70)
    eng = make_engine(num_pages=20, max_prefill_tokens=max_prefill_tokens, write_policy=write_policy)
    await eng.start()
    await eng.generate_async([warm], SamplingParams(max_tokens=1))
    await eng.cache.drain()
    assert eng.cache.tree.match(warm, touch=False).lengths[:2] == [60, 60 if write_policy == "write_through" else 0]
    [r] = await eng.generate_async([prompt], SamplingParams(max_tokens=11))
    assert r.output_ids == (await reference([prompt], 11))[0] and r.finish_reason == "length"
    await eng.cache.drain()
    assert eng.cache.tree.match(warm, touch=False).lengths[Tier.L2] == 60
    [again] = await eng.generate_async([warm + [5]], SamplingParams(max_tokens=2))
    assert again.output_ids == (await reference([warm + [5]], 2))[0]
    assert again.cached_tokens["l2"] + again.cached_tokens["l1"] == 60, again.cached_tokens
    assert not eng.metrics()["failures"]
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("tier", ["l2", "l3"])
@pytest.mark.parametrize("tail_tokens", [15, 16, 17, 33])
async def test_a_restore_overlaps_its_tail_only_where_the_tail_is_one_chunk(tier, tail_tokens):
    """A 32-token prefix only L2 (L3, prefetched) holds, a tail of one chunk or more (chunks of 16):
    a tail of at most one chunk runs its forward behind the restore (an overlapped L2 restore, a
    prefetch taken on to L1), a longer one waits for the restore and is then prefilled in chunks.
    Either way the output equals a no-cache engine's and the prefix is one hit of its tier."""
    base = random_tokens(9, 32)
    prompt = base + random_tokens(10, tail_tokens)
    eng = make_engine(storage_ratio=4.0 if tier == "l3" else 0.0, prefetch=True)
    await served_then_below_l1(eng, base, tier)
    [r] = await eng.generate_async([prompt], SamplingParams(max_tokens=3))
    assert r.output_ids == (await reference([prompt], 3))[0]
    assert r.cached_tokens == {"l1": 0, "l2": 32 if tier == "l2" else 0, "l3": 32 if tier == "l3" else 0}
    assert eng.stats["restore_overlaps"] == (1 if tail_tokens <= 16 else 0)
    assert eng.metrics()["recomputed_tokens"] == 33 + tail_tokens  # (the warm-up's 33, then the tail)
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
async def test_shutdown_between_chunks_aborts_the_prefill_and_leaves_l1_whole(write_policy):
    """Shut down (no grace) while a prompt is between its chunks: the request ends aborted, its
    stream gets its last event, and L1 is whole: nothing private, no lock, the chunks it computed
    in the tree (their write-through backup, asked for as it ended, dropped by the shutdown)."""
    prompt = random_tokens(11, 90)
    eng = make_engine(write_policy=write_policy)
    await eng.start()
    req = eng.add_request(prompt, SamplingParams(max_tokens=3))
    await until(lambda: req.cached_len >= 32)
    await eng.shutdown()
    assert req.finish_reason == "abort" and req.state.done and not eng.requests
    events = []
    while not req.queue.empty():
        events.append(req.queue.get_nowait())
    assert events and events[-1].finished and events[-1].finish_reason == "abort"
    eng.cache.tree.check_integrity()
    alloc = eng.cache.l1.allocator
    assert alloc.num_private() == 0 and alloc.num_free + alloc.num_tree() == alloc.num_pages
    assert eng.cache.tree.match(prompt, touch=False).lengths[Tier.L1] == req.cached_len - req.cached_len % PAGE
    assert all(n.locks == [0, 0, 0] for n in eng.cache.tree.iter_nodes() if n is not eng.cache.tree.root)
