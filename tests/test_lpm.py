"""SGLang's longest-prefix-match scheduling (EngineConfig.scheduling_policy "lpm", scheduler/admission.py
`_admission_order`): a prefill pass tries the queued requests whose prompts L1 holds most of first, arrival among
equals, so a prefix is used by the requests that share it before the others evict it; a queue longer than
LPM_MAX_WAITING goes in arrival order. The walks that order the queue change nothing in the tree."""
from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.radix import Tier
from scheduler import admission
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import Request, SamplingParams

PREFIX_TOKENS = 64  # 16 pages of 4 tokens: L1 (30 pages) holds one such prefix beside a request in prefill


def _engine(policy: str, **kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=120, max_running_requests=1,
                               scheduling_policy=policy, **kw))


def _alternating(rng: random.Random, rounds: int = 3) -> list[list[int]]:
    """Prompts of two prefixes, alternating: P1 + a, P2 + b, P1 + c, ..."""
    prefixes = [[rng.randrange(5, 480) for _ in range(PREFIX_TOKENS)] for _ in range(2)]
    return [prefixes[i % 2] + [490 + i] for i in range(2 * rounds)]


async def _serve_queued(eng: Engine, prompts: list[list[int]]) -> list[Request]:
    """Every prompt queued before the loop starts (one prefill pass sees them all), then served to the end."""
    reqs = [eng.add_request(p, SamplingParams(max_tokens=2)) for p in prompts]
    await eng.start()
    while not all(r.state.done for r in reqs):
        await asyncio.sleep(0.005)
    eng.check_integrity()
    await eng.shutdown()
    return reqs


def _admitted_order(reqs: list[Request]) -> list[int]:
    return [reqs.index(r) for r in sorted(reqs, key=lambda r: r.first_token_s)]


@pytest.mark.asyncio
async def test_lpm_serves_a_prefix_s_requests_together_where_fcfs_evicts_it_between_them():
    """Two 64-token prefixes alternate in the queue and L1 holds one beside the request in prefill: in arrival
    order each request evicts the prefix the next one needs (no hit); by longest prefix match the requests of the
    prefix in L1 go first, every one after the first of each prefix a hit, and every output equals fcfs's."""
    prompts = _alternating(random.Random(0))
    fcfs = await _serve_queued(_engine("fcfs"), prompts)
    lpm = await _serve_queued(_engine("lpm"), prompts)
    assert _admitted_order(fcfs) == [0, 1, 2, 3, 4, 5]
    assert _admitted_order(lpm) == [0, 2, 4, 1, 3, 5]
    assert sum(r.hit_tokens["l1"] for r in fcfs) == 0
    assert sum(r.hit_tokens["l1"] for r in lpm) == 4 * PREFIX_TOKENS
    assert [r.output for r in lpm] == [r.output for r in fcfs]


@pytest.mark.asyncio
async def test_a_queue_longer_than_the_threshold_goes_in_arrival_order(monkeypatch):
    monkeypatch.setattr(admission, "LPM_MAX_WAITING", 4)
    reqs = await _serve_queued(_engine("lpm"), _alternating(random.Random(1)))
    # 6, then 5 queued: as queued; then 4: the prefix the last one left in L1 (P2) first
    assert _admitted_order(reqs) == [0, 1, 3, 5, 2, 4]


def test_ordering_the_queue_walks_the_tree_read_only():
    """A queued prompt that leaves a cached node in its middle: ordering the queue neither splits that node nor
    stamps, locks or counts a hit on anything."""
    eng = _engine("lpm")
    rng = random.Random(2)
    cached = [rng.randrange(5, 480) for _ in range(PREFIX_TOKENS)]
    eng.generate([cached + [7]], SamplingParams(max_tokens=1))
    tree = eng.cache.tree

    def state():
        nodes, frontier = [], [tree.root]
        while frontier:
            nodes += frontier
            frontier = [c for n in frontier for c in n.children.values()]
        return [(n.node_id, len(n.key), list(n.stamp), list(n.locks), n.hits) for n in nodes]

    before = state()
    for prompt in (cached[:30] + [1] * 40, cached + [9], [3] * 20):  # (30: mid-node, not page aligned)
        eng.add_request(prompt, SamplingParams(max_tokens=1))
    order = eng.admission._admission_order()
    assert [len(r.prompt) for r in order] == [65, 70, 20]  # the whole prefix, then 28 tokens (7 pages), then none
    held = [tree.resident_tokens(r.cache_prompt, Tier.L1, end=len(r.prompt) - 1) for r in order]
    assert held == [PREFIX_TOKENS, 28, 0]
    assert state() == before
    assert tree.match(cached, touch=False, split=False).lengths[Tier.L1] == PREFIX_TOKENS


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_resident_tokens_equals_what_a_match_finds(data):
    """RadixTree.resident_tokens against the tree's own match (which may split, so it runs second) on trees of
    random sequences sharing prefixes, for random queries and ends, L1 only partly resident."""
    eng = _tree_engine()
    tree = eng.cache.tree
    base = data.draw(st.lists(st.integers(1, 3), min_size=8, max_size=40))
    for _ in range(data.draw(st.integers(1, 4))):
        cut = data.draw(st.integers(0, len(base)))
        seq = base[:cut] + data.draw(st.lists(st.integers(1, 3), min_size=4, max_size=24))
        eng.generate([seq], SamplingParams(max_tokens=1))
    if data.draw(st.booleans()):
        eng.cache.tree.evict(Tier.L1, data.draw(st.integers(1, 6)))
    cut = data.draw(st.integers(0, len(base)))
    query = base[:cut] + data.draw(st.lists(st.integers(1, 3), max_size=20))
    end = data.draw(st.one_of(st.none(), st.integers(0, len(query) + 2)))
    got = tree.resident_tokens(query, Tier.L1, end=end)
    want = tree.match(query[:end], include_storage=False, touch=False).lengths[Tier.L1]
    assert got == want


def _tree_engine() -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=2, num_pages=128))


def test_the_lpm_policy_is_a_choice_of_the_flag():
    from scheduler import serve
    from scheduler.config import config_from_args

    args = serve.build_parser().parse_args(["--model", "tiny", "--scheduling-policy", "lpm"])
    assert config_from_args(args).scheduling_policy == "lpm"
    assert _engine("lpm").config.scheduling_policy == "lpm"
