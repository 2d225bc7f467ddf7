"""Session 75's hunt for swallowed and misfiled errors: what the broad handlers do with what they catch.

- The cost model learning a copy's or an L3 read's / write's time (`CostModel.observe_transfer`, from the op runner's
  waits) raised out of the op that timed it: a backup's D2H or a restore's H2D that had landed was failed as a
  `transfer` failure (the operator pointed at the copy engine; the backup's L2 pages freed, the restore's request
  recomputing), an L3 write or read that had landed as a `driver` bug. Learning a prefill's or a first token's time
  already drops the sample (`failures.cost_model`, docs/reliability.md): so now does learning a transfer's, and the
  op ends as its copy did.
- The server's shutdown that raised as it closed the tiers, its engine loop never having crashed, was logged as
  `engine_shutdown_after_loop_crash`: now `engine_shutdown_failed` (scheduler/server.py `_shutdown`).
"""
from __future__ import annotations

import pytest

from hicache.radix import Tier
from hicache_helpers import assert_whole
from scheduler.request import SamplingParams
from test_faults import PROMPT, make_engine, only_in_l3, reference
from test_raise_cache_s70 import RaiseOnce

BAD_SAMPLE = ValueError("cost sample must be finite and >= 0, got size=4096 seconds=nan")


async def _served(eng, prompt: list[int]):
    out = await eng.generate_async([prompt], SamplingParams(max_tokens=4))
    return out[0]


@pytest.mark.asyncio
@pytest.mark.parametrize("direction", ["d2h", "h2s"])
async def test_a_backup_whose_time_the_cost_model_cannot_learn_still_lands(direction):
    """The backup's copy (D2H into L2, or its write to L3) lands, and the cost model raises as it learns that
    copy's time: the sample is dropped (`failures.cost_model`), the backup publishes what it copied and a later
    request restores from it (regression: failed as a `transfer` failure / a driver bug, its pages thrown away)."""
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    fault = RaiseOnce(eng.cache.cost.directions[direction], "observe", BAD_SAMPLE)
    assert (await _served(eng, PROMPT)).output_ids == want
    await eng.cache.drain()
    assert fault.calls >= 1, "the fault was never reached"
    failures = eng.cache.metrics.failures
    assert failures.get("cost_model") == 1, failures
    assert not failures.get("transfer") and not failures.get("driver"), failures
    tier = Tier.L2 if direction == "d2h" else Tier.L3
    assert eng.cache.tree.match(PROMPT, include_storage=True, touch=False).lengths[tier] == len(PROMPT) - 1
    assert_whole(eng.cache)
    await eng.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("direction", ["h2d", "s2h"])
async def test_a_restore_whose_time_the_cost_model_cannot_learn_is_still_a_hit(direction):
    """The prompt's prefix is in L2 (or L3) only; its restore's copy lands and the cost model raises as it learns
    the copy's time: the sample is dropped (`failures.cost_model`) and the request is served from the restored
    pages (regression: the restore failed as a `transfer` failure / a driver bug and the request recomputed)."""
    eng = make_engine(prefetch=False)
    await eng.start()
    want = await reference(PROMPT)
    assert (await _served(eng, PROMPT)).output_ids == want
    await eng.cache.drain()
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    if direction == "s2h":
        only_in_l3(eng, PROMPT[:-1])
    fault = RaiseOnce(eng.cache.cost.directions[direction], "observe", BAD_SAMPLE)
    result = await _served(eng, PROMPT)
    assert fault.calls >= 1, "the fault was never reached"
    assert result.output_ids == want
    failures = eng.cache.metrics.failures
    assert failures.get("cost_model") == 1, failures
    assert not failures.get("transfer") and not failures.get("driver"), failures
    assert result.cached_tokens["l2" if direction == "h2d" else "l3"] == len(PROMPT) - 1, result.cached_tokens
    await eng.cache.drain()
    assert_whole(eng.cache)
    await eng.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("crash", [False, True])
async def test_a_servers_failed_shutdown_is_logged_as_what_failed(monkeypatch, crash):
    """The server's shutdown raised as it closed the tiers (a device error re-raised by the copy streams), its engine
    loop never having crashed: the log said `engine_shutdown_after_loop_crash`, sending the operator after a crash
    that never was (no `engine_loop_crashed` line anywhere). Now `engine_shutdown_failed`; after a real crash, the
    line it had."""
    from structlog.testing import capture_logs

    from scheduler.server import ServerLimits, create_app
    from scheduler.tokenizer import ByteTokenizer
    from test_server_crash_hunt import make_engine as make_plain_engine

    eng = make_plain_engine()
    app = create_app(eng, ServerLimits(shutdown_grace_s=0.0), tokenizer=ByteTokenizer(eng.vocab_size))

    async def broken_close() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with capture_logs() as logs:
        async with app.router.lifespan_context(app):
            if crash:
                def broken():
                    raise RuntimeError("injected scheduler bug")
                monkeypatch.setattr(eng.admission, "decode_batch", broken)
                out = await eng.generate_async([[1, 2, 3]], SamplingParams(max_tokens=4))
                assert out[0].finish_reason == "error"
            monkeypatch.setattr(eng.cache, "close", broken_close)
    events = [e["event"] for e in logs if e.get("log_level") in ("error", "critical")]
    want = "engine_shutdown_after_loop_crash" if crash else "engine_shutdown_failed"
    assert want in events, events
    assert ("engine_loop_crashed" in events) == crash, events
    assert ({"engine_shutdown_after_loop_crash", "engine_shutdown_failed"} - {want}).isdisjoint(events), events
