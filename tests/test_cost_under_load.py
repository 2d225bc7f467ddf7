"""The cost policy under load: a restore's reads and copies take no GPU time, so the GPU work queued
besides a request (`scheduler.load.busy_s`) hides that much of its restore, while a recompute takes GPU
time from every request queued (`CostModel.decide`'s and `worth_writing`'s hidden_s). Regression
(session 30, H200, 8 requests in flight on the L3 stress tier): every L3 read was priced as if its
request ran alone, L3 reads slower than recompute were declined and L3 writes refused, and the cost
policy ran at 74-79 req/s against 100-131 for "always"."""
from __future__ import annotations

import pytest

from hicache.cost_model import CostModel
from hicache.config import HiCacheConfig
from hicache_helpers import capture_op_logs, finish, op_transitions
from scheduler import load
from scheduler.engine import Engine
from test_faults import OTHER, PARAMS, PROMPT, REUSABLE, reference
from test_prefetch_take_on import served_then_only_in_l3

BYTES_PER_TOKEN = 1024


def _model() -> CostModel:
    cost = CostModel(HiCacheConfig(enable=True), BYTES_PER_TOKEN)
    cost.learning = False
    per_token = 1.0 / BYTES_PER_TOKEN
    dirs = cost.directions
    dirs["recompute"].fixed_s, dirs["recompute"].slope = 5e-3, 1e-6   # 1 ms a 1,000 tokens
    dirs["s2h"].fixed_s, dirs["s2h"].slope = 0.0, 3e-6 * per_token      # a read: 3 ms a 1,000 tokens
    dirs["h2d"].fixed_s, dirs["h2d"].slope = 0.0, 0.1e-6 * per_token
    return cost


def test_a_read_slower_than_recompute_is_taken_when_queued_work_hides_it():
    cost = _model()
    assert cost.decide(0, 0, 1000).tier == "l1"  # alone: 3.1 ms of restore to save 1 ms
    assert cost.decide(0, 0, 1000, hidden_s=2e-3).tier == "l1"  # 1.1 ms left in view: still dearer
    hidden = cost.decide(0, 0, 1000, hidden_s=cost.busy_s(500, 1))  # one forward of another's 500 tokens
    assert hidden.tier == "l3" and hidden.costs["hidden_s"] == pytest.approx(5.5e-3)
    assert hidden.benefit_s == pytest.approx(1e-3)  # the whole recompute saved, nothing delayed


def test_writes_are_admitted_by_the_load_they_would_be_read_under():
    cost = _model()
    assert not cost.worth_writing("l3", 1000, probe=False)
    assert cost.worth_writing("l3", 1000, probe=False, hidden_s=cost.busy_s(0, 1))


def test_busy_s_is_the_recompute_line_over_the_queued_forwards():
    cost = _model()
    assert cost.busy_s(0, 0) == 0.0
    assert cost.busy_s(2000, 2) == pytest.approx(2 * 5e-3 + 2e-3)


async def _only_in_l3_with_slow_reads() -> Engine:
    """An engine (cost policy, fixed cost lines) whose PROMPT prefix only L3 holds, where reading it
    costs 3 ms against the 1 ms of recomputing it, and a forward 5 ms."""
    eng = await served_then_only_in_l3(True, "cost")
    cost = eng.cache.cost
    cost.learning = False
    per_byte = 1.0 / (REUSABLE * cost.bytes_per_token)
    dirs = cost.directions
    dirs["recompute"].fixed_s, dirs["recompute"].slope = 5e-3, 1e-3 / REUSABLE
    dirs["s2h"].fixed_s, dirs["s2h"].slope = 0.0, 3e-3 * per_byte
    dirs["h2d"].fixed_s, dirs["h2d"].slope = 0.0, 0.1e-3 * per_byte
    return eng


@pytest.mark.parametrize("queued", [0, 2])
@pytest.mark.asyncio
async def test_an_l3_hit_is_restored_under_load_and_recomputed_alone(queued):
    """Alone, the hit is recomputed (its read would take 3 ms to save 1); with two other requests
    queued behind it, their forwards hide the read and it is restored from L3."""
    want = await reference(PROMPT)
    eng = await _only_in_l3_with_slow_reads()
    others = [OTHER[:-1] + [i] for i in range(queued)]
    with capture_op_logs() as logs:
        results = await eng.generate_async([PROMPT] + others, PARAMS)
    assert results[0].output_ids == want
    reads = op_transitions(logs, "restore_l3") | op_transitions(logs, "prefetch_l3")
    if queued:
        assert results[0].cached_tokens == {"l1": 0, "l2": 0, "l3": REUSABLE} and len(reads) == 1
    else:
        assert results[0].cached_tokens == {"l1": 0, "l2": 0, "l3": 0} and not reads
    assert load.busy_s(eng) == 0.0  # (idle again)
    await finish(eng)
