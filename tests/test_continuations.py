"""Drafts from the prefix cache (hicache/continuations.py): what the radix tree holds after a context, against a
naive reference over the inserted sequences; a walk changes nothing in the tree; an anchor's walk equals the walk
from the root, across splits and evictions. Then the engine (`cache_lookup` of scheduler/speculative.py): prompts
served again are drafted from their first answers (their pages in L1, L2 or L3 only, their last tokens kept as
tails) and give the same tokens, only within one cache_salt."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.continuations import Joined, Tails, attached, continuation
from hicache.radix import Tier
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from scheduler.speculative import SpeculativeConfig
from tests.test_radix import make_tree, put
from tests.test_speculative import make_engine

PS = 4


def snapshot(tree) -> list:
    """Everything a walk must leave as it was: each node's key, parent, pages, locks, stamps and hits."""
    return sorted((n.node_id, n.key, n.parent.node_id if n.parent else None, repr(n.pages), tuple(n.locks),
                   tuple(n.stamp), n.hits) for n in tree.iter_nodes())


def test_cases_on_one_tree():
    tree, allocs = make_tree(PS)
    a = list(range(100, 124))               # 6 pages
    b = a[:8] + list(range(200, 208))       # shares 2 pages with a, then its own 2
    put(tree, allocs, a)
    put(tree, allocs, b)                    # (b is the most recent: its branch wins where both fit)
    before = snapshot(tree)
    assert continuation(tree, a[:12], 5)[0] == a[12:17]            # at a page boundary inside a's node
    assert continuation(tree, a[:14], 3)[0] == a[14:17]            # inside a page
    assert continuation(tree, a[:8], 3)[0] == b[8:11]              # at the fork: the most recent branch
    assert continuation(tree, a[:6], 6)[0] == a[6:8] + b[8:12]     # on through the fork, the most recent branch
    assert continuation(tree, a[:10], 100)[0] == a[10:]            # up to the end of what the tree holds
    assert continuation(tree, a, 4)[0] == []                       # nothing after it
    assert continuation(tree, a[:5] + [999], 4)[0] == []           # strays inside a page
    assert continuation(tree, a[:9] + [999, 1, 2, 3], 4)[0] == []  # strays past a whole page
    assert continuation(tree, [], 3)[0] == b[:3]                   # (the empty context: the latest first page)
    assert continuation(tree, a[:2], 2)[0] == a[2:4]               # shorter than a page, at the root
    assert snapshot(tree) == before
    tree.check_integrity()


def test_the_anchor_is_the_deepest_node_covered_whole():
    tree, allocs = make_tree(PS)
    a = list(range(100, 124))
    b = a[:8] + list(range(200, 208))
    put(tree, allocs, a)
    put(tree, allocs, b)
    drafts, node, covered = continuation(tree, a[:14], 2)
    assert node.key == tuple(a[:8]) and covered == 8 and drafts == a[14:16]
    drafts2, node2, covered2 = continuation(tree, a[covered:15], 2, node)  # on from the anchor
    assert drafts2 == a[15:17] and node2 is node and covered2 == 0
    _, root_anchor, zero = continuation(tree, [999, 1, 2, 3, 4], 2)
    assert root_anchor is tree.root and zero == 0


def test_tails_go_on_where_the_pages_end():
    tree, allocs = make_tree(PS)
    a = list(range(100, 116))  # 4 pages, then a tail of 3
    put(tree, allocs, a)
    tails = Tails()
    [leaf] = tree.root.children.values()
    tails.put(leaf, [7, 8, 9])
    assert continuation(tree, a[:14], 5, tails=tails)[0] == a[14:] + [7, 8, 9]  # through the pages into it
    assert continuation(tree, a, 5, tails=tails)[0] == [7, 8, 9]               # from the pages' end
    assert continuation(tree, a + [7], 5, tails=tails)[0] == [8, 9]            # inside it
    assert continuation(tree, a + [7, 0], 5, tails=tails)[0] == []             # strays inside it
    assert continuation(tree, a + [7, 8, 9], 5, tails=tails)[0] == []          # past it
    assert continuation(tree, a, 5)[0] == []                                   # (without the table)
    b = a + [1, 2, 3, 4]
    put(tree, allocs, b)  # a child below the leaf: the pages win
    assert continuation(tree, a, 5, tails=tails)[0] == [1, 2, 3, 4]
    assert continuation(tree, a + [7], 5, tails=tails)[0] == [8, 9]            # (the tail still, where it fits)
    tree.evict(Tier.L1, 64)  # the node leaves the tree: its tail is never read
    assert leaf.parent is None and tails.get(tree, leaf) == ()


def test_tails_keep_the_latest_capacity_nodes():
    tree, allocs = make_tree(PS)
    tails = Tails(capacity=2)
    nodes = []
    for i in range(3):
        put(tree, allocs, [i] * PS)
        nodes.append(tree.root.children[(i,) * PS])
        tails.put(nodes[-1], [i + 50])
    assert len(tails) == 2 and tails.get(tree, nodes[0]) == () and tails.get(tree, nodes[2]) == (52,)
    tails.put(nodes[1], [9])  # (the latest sequence's tail)
    assert tails.get(tree, nodes[1]) == (9,)


@pytest.mark.parametrize("head, rest", [([1, 2, 3], [4, 5]), ([], [4, 5]), ([1, 2], [])])
def test_joined_slices_as_the_concatenation(head, rest):
    whole, joined = head + rest, Joined(head, rest)
    assert len(joined) == len(whole)
    for a in range(len(whole) + 2):
        for b in range(len(whole) + 2):
            assert joined[a:b] == whole[a:b]
    assert joined[1:] == whole[1:]


# -- against a naive reference ----------------------------------------------------------------------------
def held(seqs: list[list[int]]) -> list[list[int]]:
    """What the tree holds of each inserted sequence: its whole pages."""
    return [s[:len(s) - len(s) % PS] for s in seqs]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_continuation_is_what_followed_the_context_in_some_sequence(data):
    alphabet = st.integers(0, 3)  # (few token values: many shared prefixes and forks)
    seqs = data.draw(st.lists(st.lists(alphabet, min_size=PS, max_size=6 * PS), min_size=1, max_size=6))
    tree, allocs = make_tree(PS, pages=256)
    for s in seqs:
        put(tree, allocs, s[:len(s) - len(s) % PS])
    whole = held(seqs)
    src = data.draw(st.sampled_from(whole))
    cut = data.draw(st.integers(0, len(src)))
    context = src[:cut] if data.draw(st.booleans()) else src[:cut] + data.draw(st.lists(alphabet, max_size=3))
    k = data.draw(st.integers(1, 8))
    before = snapshot(tree)
    drafts, node, covered = continuation(tree, context, k)
    assert snapshot(tree) == before
    went_on = [s for s in whole if s[:len(context)] == context and len(s) > len(context)]
    if drafts:  # sound: the context and its drafts are the start of a sequence the tree holds
        assert any(s[:len(context) + len(drafts)] == context + drafts for s in whole)
        assert len(drafts) == k or any(len(s) == len(context) + len(drafts) and s[:len(s)] == context + drafts
                                       for s in whole)  # (k of them, or up to the end of one)
    else:  # complete: no sequence goes on after the context
        assert not went_on
    # the anchor: a node on the context's path, and a walk on from it gives the same drafts, the context sliced
    # or read in place (split anywhere into a prompt and an output: Joined), its end where the first walk's was
    assert attached(tree, node) and covered <= len(context)
    assert continuation(tree, context[covered:], k, node)[0] == drafts
    cut = data.draw(st.integers(0, len(context)))
    assert continuation(tree, Joined(context[:cut], context[cut:]), k, node, start=covered) == (drafts, node, covered)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_walk_on_from_an_old_anchor_equals_one_from_the_root_after_splits_and_evictions(data):
    alphabet = st.integers(0, 3)
    tree, allocs = make_tree(PS, pages=256)
    first = data.draw(st.lists(alphabet, min_size=2 * PS, max_size=6 * PS))
    put(tree, allocs, first[:len(first) - len(first) % PS])
    context = first[:data.draw(st.integers(0, len(first)))]
    _, node, covered = continuation(tree, context, 4)
    for _ in range(data.draw(st.integers(1, 4))):  # the tree changes under the anchor
        if data.draw(st.booleans()):
            s = data.draw(st.lists(alphabet, min_size=PS, max_size=6 * PS))
            put(tree, allocs, s[:len(s) - len(s) % PS])  # may split the anchor's node
        else:
            tree.evict(Tier.L1, data.draw(st.integers(1, 8)))  # may remove it
    tree.check_integrity()
    grown = context + data.draw(st.lists(alphabet, max_size=PS))
    k = data.draw(st.integers(1, 6))
    want = continuation(tree, grown, k)[0]
    if attached(tree, node):
        assert continuation(tree, grown[covered:], k, node)[0] == want
    else:
        assert node is not tree.root and node.parent is None


# -- the engine -------------------------------------------------------------------------------------------
def spec_config(**kw) -> SpeculativeConfig:
    return SpeculativeConfig(**{"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 4,
                                "draft_policy": "always", **kw})


def fresh_prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 400) for _ in range(length)] for _ in range(n)]


def cache_stats(eng) -> tuple[int, int]:
    s = eng.speculator.stats
    return s["cache_drafts"], s["cache_accepted_tokens"]


def test_prompts_served_again_are_drafted_from_their_first_answers():
    eng = make_engine(spec_config(), dtype="float32", page_size=16)
    prompts = fresh_prompts(1, 3, 37)  # (not page aligned: the answer starts inside a page)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    first = [r.output_ids for r in eng.generate(prompts, params)]
    assert cache_stats(eng) == (0, 0)  # (nothing held after these contexts yet)
    again = eng.generate(prompts, params)
    assert [r.output_ids for r in again] == first
    drafts, accepted = cache_stats(eng)
    # every token after each one's first (its prefill's) came from a verify step of drafts from the cache: the
    # first answers' whole pages, then their last 13 tokens, kept as tails (regression: 81 of the 117 without)
    assert accepted + drafts == 3 * 39
    eng.check_integrity()


def test_cache_lookup_off_drafts_by_prompt_lookup_only():
    eng = make_engine(spec_config(cache_lookup=False), dtype="float32")
    prompts = fresh_prompts(1, 3, 37)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    first = [r.output_ids for r in eng.generate(prompts, params)]
    assert [r.output_ids for r in eng.generate(prompts, params)] == first
    assert cache_stats(eng) == (0, 0)
    eng.check_integrity()


def test_a_salted_request_is_drafted_only_from_answers_of_its_own_salt():
    eng = make_engine(spec_config(), dtype="float32")
    [prompt] = fresh_prompts(2, 1, 30)
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    [want] = [r.output_ids for r in eng.generate([prompt], plain)]
    salted = SamplingParams(max_tokens=24, ignore_eos=True, cache_salt="tenant-a")
    [got] = eng.generate([prompt], salted)
    assert got.output_ids == want and cache_stats(eng) == (0, 0)  # the unsalted answer is not its to see
    [again] = eng.generate([prompt], salted)
    assert again.output_ids == want and cache_stats(eng)[0] > 0  # its own salt's is
    eng.check_integrity()


def test_the_prefix_cache_off_means_no_cache_drafts():
    eng = make_engine(spec_config(), enable_prefix_cache=False)
    [prompt] = fresh_prompts(3, 1, 30)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    first = eng.generate([prompt], params)[0].output_ids
    assert eng.generate([prompt], params)[0].output_ids == first and cache_stats(eng) == (0, 0)


@pytest.mark.parametrize("value, ok", [(False, True), (True, True), ("yes", False), (1, False)])
def test_the_config_takes_cache_lookup_as_a_bool(value, ok):
    fields = {"method": "ngram", "num_speculative_tokens": 3, "cache_lookup": value}
    if ok:
        assert SpeculativeConfig.parse(fields).cache_lookup is value
    else:
        with pytest.raises(ValueError, match="cache_lookup"):
            SpeculativeConfig.parse(fields)


@pytest.mark.parametrize("tier", ["l2", "l3"])
@pytest.mark.asyncio
async def test_an_answer_below_l1_still_drafts(tier):
    """The tree keeps a node's tokens while any tier holds its pages: an answer whose pages L1 (and L2) gave up is
    still drafted, while its prompt comes back from that tier."""
    config = EngineConfig(model="tiny", device="cpu", page_size=16, num_pages=512, dtype="float32",
                          speculative=spec_config()).with_hicache(
        enable=True, policy="always", host_ratio=4.0, storage_ratio=0.0 if tier == "l2" else 8.0)
    eng = Engine(config)
    await eng.start()
    try:
        [prompt] = fresh_prompts(4, 1, 37)
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        [first] = await eng.generate_async([prompt], params)
        await eng.cache.drain()
        eng.cache.flush(Tier.L1)
        if tier == "l3":
            eng.cache.flush(Tier.L2)
        held = eng.cache.tree.match(prompt + first.output_ids, touch=False).lengths
        assert held[Tier.L1] == 0 and held[Tier.L2 if tier == "l2" else Tier.L3] >= 64
        [again] = await eng.generate_async([prompt], params)
        assert again.output_ids == first.output_ids and again.cached_tokens[tier] > 0
        drafts, accepted = cache_stats(eng)
        assert accepted + drafts == 39  # (every token after its first: the pages, then the tail)
        await eng.cache.drain()
        eng.check_integrity()
    finally:
        await eng.shutdown()


@pytest.mark.asyncio
async def test_tails_keep_no_node_the_tree_dropped():
    """Regression (session 58's leak hunt): each Tails entry held its node, so a node evicted from every tier, out
    of the tree and never read again, stayed alive with its whole key (the request's tokens past the shared prefix,
    as long as its prompt): up to 4,096 dead prompts in host memory. 40 unique 101-token prompts through an L1 and
    an L2 of 64 pages each: most leave the tree, and none may stay alive."""
    import gc

    from hicache.radix import Node
    rng = random.Random(58)
    first_id = next(Node._ids)  # (this engine's nodes are those made from now on; other tests' may be alive)
    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1, draft_policy="always")
    cfg = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, max_running_requests=4, speculative=spec)
    eng = Engine(cfg.with_hicache(enable=True, policy="always", host_ratio=1.0, storage_ratio=0,
                                  transfer_backend="torch"))
    await eng.start()
    try:
        for _ in range(40):
            await eng.generate_async([[rng.randrange(1, 500) for _ in range(101)]], SamplingParams(max_tokens=3))
        await eng.cache.drain()
        tree = eng.cache.tree
        kept = {id(n) for n in tree.iter_nodes()}
        kept |= {id(entry[2]) for heap in tree._candidates for entry in heap}  # (eviction heaps: bounded by pages)
        assert len(eng.speculator.tails) == 40
        gc.collect()
        dead = [o for o in gc.get_objects() if type(o) is Node and o.node_id > first_id and id(o) not in kept]
        assert not dead, f"{len(dead)} nodes that left the tree are alive, with {sum(len(n.key) for n in dead)} tokens"
    finally:
        await eng.shutdown()
