"""Chunked prefill in the cost model: a prompt longer than max_prefill_tokens is prefilled in several
forwards, and recomputing a prefix of it runs more of them than the tail a restore leaves (a
3,500-token hit of a 3,513-token prompt: 2,048 + 1,465 recomputed, 13 restored). Each forward costs
the recompute line's fixed cost (~4.5 ms on the H200 with the 8B shape), which the marginal price
`recompute_cost_s` leaves out: priced without them, a restore from a storage a little slower than
the marginal recompute lost exactly where it would have paid (`CostModel.decide`'s prompt_tokens,
chunk_tokens)."""
from __future__ import annotations

import pytest

from hicache.config import HiCacheConfig
from hicache.cost_model import CostModel
from test_faults import PAGE, PROMPT, REUSABLE, finish, reference, run_one
from test_prefetch_take_on import served_then_only_in_l3

BYTES_PER_TOKEN = 1024
CHUNK = 2048
FIXED_S, SLOPE = 5e-3, 10e-6  # a forward 5 ms, a token 10 us


def _model(read_s_per_token: float = 10.5e-6) -> CostModel:
    """Recompute at FIXED_S + SLOPE a token; an L2 or L3 restore at `read_s_per_token` (by default
    5 % slower than the marginal recompute; for L3 the read, its H2D free)."""
    cost = CostModel(HiCacheConfig(enable=True), BYTES_PER_TOKEN)
    cost.learning = False
    dirs = cost.directions
    dirs["recompute"].fixed_s, dirs["recompute"].slope = FIXED_S, SLOPE
    for name in ("h2d", "s2h", "d2h", "h2s"):
        dirs[name].fixed_s, dirs[name].slope = 0.0, 0.0
    dirs["h2d"].slope = read_s_per_token / BYTES_PER_TOKEN
    return cost


@pytest.mark.parametrize("tier", ["l2", "l3"])
def test_a_restore_that_saves_forwards_wins_over_a_slightly_cheaper_marginal_recompute(tier):
    cost = _model()
    if tier == "l3":  # the read is the slow part: 10.5 us a token, the H2D free
        cost.directions["s2h"].slope, cost.directions["h2d"].slope = cost.directions["h2d"].slope, 0.0
    hit = (0, 4000, 0) if tier == "l2" else (0, 0, 4000)
    # marginal only: 40 ms of recompute against a 42 ms restore
    assert cost.decide(*hit).tier == "l1"
    # a 4,001-token prompt: recomputed, two forwards (2,048 + 1,953); restored, one (its last token)
    chunked = cost.decide(*hit, prompt_tokens=4001, chunk_tokens=CHUNK)
    assert chunked.tier == tier
    assert chunked.costs[f"{tier}_recompute_forwards_s"] == pytest.approx(FIXED_S)
    assert chunked.costs[f"{tier}_recompute_s"] == pytest.approx(4000 * SLOPE + FIXED_S)
    assert chunked.benefit_s == pytest.approx(4000 * SLOPE + FIXED_S - 4000 * 10.5e-6)


@pytest.mark.parametrize("l1,l2,l3,prompt,forwards_saved", [
    (0, 1, 0, 2049, 1),        # restored, exactly 2,048 left: one forward; recomputed, 2,049: two
    (0, 1, 0, 2050, 0),        # restored, 2,049 left: still two forwards
    (0, 2048, 0, 4096, 1),     # recomputed, exactly two chunks; restored, 2,048 left: one
    (0, 4096, 0, 4097, 2),     # the tail alone: 3 forwards against 1
    (0, 4096, 0, 4096, 1),     # nothing left (a caller's whole prompt hit): still one forward
    (2048, 4096, 0, 4097, 1),  # L1 holds 2,048: recomputed, 2,049 left (two forwards)
    (0, 1000, 5000, 5001, 1),  # L2's part: 5,001 -> 4,001 left, 3 forwards -> 2
])
def test_the_forwards_saved_at_chunk_boundaries(l1, l2, l3, prompt, forwards_saved):
    cost = _model()
    costs = cost.decide(l1, l2, l3, prompt_tokens=prompt, chunk_tokens=CHUNK).costs
    assert costs["l2_recompute_forwards_s"] == pytest.approx(forwards_saved * FIXED_S)
    assert costs["l2_recompute_s"] == pytest.approx((l2 - l1) * SLOPE + forwards_saved * FIXED_S)
    if l3:  # L3's whole hit: 5,001 -> 1 left, 3 forwards -> 1
        assert costs["l3_recompute_forwards_s"] == pytest.approx(2 * FIXED_S)


@pytest.mark.parametrize("read_s_per_token", [2e-6, 10.5e-6, 30e-6])
@pytest.mark.parametrize("l1,l2,l3,prompt", [(0, 1000, 0, 1001), (0, 0, 2047, 2048), (0, 1000, 2000, 2048),
                                             (500, 1500, 0, 1600), (0, 2048, 0, 2048)])
def test_a_prompt_of_one_chunk_is_decided_as_before(l1, l2, l3, prompt, read_s_per_token):
    """One forward either way: nothing changes but the forwards' cost, recorded as 0."""
    before, after = _model(read_s_per_token), _model(read_s_per_token)
    old = before.decide(l1, l2, l3)
    new = after.decide(l1, l2, l3, prompt_tokens=prompt, chunk_tokens=CHUNK)
    assert (new.tier, new.restore_tokens, new.benefit_s) == (old.tier, old.restore_tokens, old.benefit_s)
    extra = {key: new.costs.pop(key) for key in list(new.costs) if key.endswith("_recompute_forwards_s")}
    assert extra and set(extra.values()) == {0.0}
    assert new.costs == old.costs and "l2_recompute_forwards_s" not in old.costs


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.asyncio
async def test_an_engine_prices_the_forwards_its_chunked_prompt_would_recompute(prefetch):
    """PROMPT's 24-token prefix only in L3, read at 3 ms against 1 ms of marginal recompute, and
    chunks of 8 tokens: recomputed, the prompt takes 4 forwards of 5 ms; restored, its last token
    one. The request's decisions (the prefetch's at queue time and the admission's) record 3
    forwards more on the recompute side, and the hit is read from L3."""
    eng = await served_then_only_in_l3(False, "cost", max_prefill_tokens=2 * PAGE, prefetch=prefetch)
    cost = eng.cache.cost
    cost.learning = False  # the costs below, fixed: no exploration, no new samples
    per_byte = 1.0 / (REUSABLE * cost.bytes_per_token)
    dirs = cost.directions
    dirs["recompute"].fixed_s, dirs["recompute"].slope = 5e-3, 1e-3 / REUSABLE  # recompute: 1 ms
    dirs["s2h"].fixed_s, dirs["s2h"].slope = 0.0, 3e-3 * per_byte              # read: 3 ms
    dirs["h2d"].fixed_s, dirs["h2d"].slope = 0.0, 0.1e-3 * per_byte
    decisions, decide = [], eng.cache.decide

    def recorded(*args, **kwargs):  # (the manager's own decide, its decisions kept)
        decisions.append(decide(*args, **kwargs))
        return decisions[-1]
    eng.cache.decide = recorded
    result = await run_one(eng)
    assert result.output_ids == await reference(PROMPT)
    assert result.cached_tokens == {"l1": 0, "l2": 0, "l3": REUSABLE}
    # (with prefetches the read lands in L2, and the admission then restores it from there)
    assert [d.tier for d in decisions] == (["l3", "l2"] if prefetch else ["l3"])
    for d in decisions:
        assert d.costs[f"{d.tier}_recompute_forwards_s"] == pytest.approx(3 * 5e-3)
        assert d.costs[f"{d.tier}_recompute_s"] == pytest.approx(1e-3 + 3 * 5e-3)
    await finish(eng)
