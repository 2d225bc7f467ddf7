"""Session 80's second mutation pass over its own fixes: survivors pinned (each test's docstring names its mutant)."""
from __future__ import annotations

import asyncio
import random

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams


@pytest.mark.asyncio
async def test_write_through_selective_without_an_l2_backs_nothing_up():
    """Mutant: hicache/manager.py note_hit without `self.has_l2 and` (write_through_selective asked of an engine
    with the hierarchical cache off). A prompt hit twice then started a backup with no L2 to copy to: the op
    failed with KeyError(Tier.L2), a driver failure counted on every later hit."""
    cfg = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64)
    eng = Engine(cfg.with_hicache(enable=False, write_policy="write_through_selective"))
    prompt = [random.Random(1).randrange(500) for _ in range(16)]
    try:
        for _ in range(3):  # (the second and third hit the prompt's prefix)
            [res] = await eng.generate_async([prompt], SamplingParams(max_tokens=4))
            assert res.finish_reason == "length"
        await eng.cache.drain()
        assert eng.metrics()["failures"] == {}
        assert eng.metrics()["backups_started"] == 0
        eng.check_integrity()
    finally:
        await eng.shutdown()


async def _ended(req) -> None:
    while not (await req.queue.get()).finished:
        pass


@pytest.mark.asyncio
async def test_a_request_that_waited_for_l1_room_once_does_not_hold_the_queue_after():
    """Mutant: scheduler/admission.py decode_batch keeps `room_waiters` (no `, []`). A request in decode that once
    waited for L1 room past its reservation stayed a waiter after its room came: no queued request was admitted
    until it ended. (Its one wait is made here by one refused page while an operation is pending, as write_back's
    backups make it.)"""
    from scheduler.request import RequestState

    cfg = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, decode_reserve_ratio=0.0,
                       overlap_schedule=False)
    eng = Engine(cfg)
    await eng.start()
    rng = random.Random(0)
    long = eng.add_request([rng.randrange(1, 200) for _ in range(8)], SamplingParams(max_tokens=60, ignore_eos=True))
    cache, refused = eng.cache, []
    real_alloc, real_pending = cache.alloc_l1, cache.pending_ops

    def alloc_l1(num_pages, claim):
        if not refused and claim == long.claim and long.state is RequestState.DECODE and len(long.output) >= 8:
            refused.append(len(long.output))
            return None  # (its page past the reservation: it waits a step, a waiter)
        return real_alloc(num_pages, claim)

    def pending_ops():  # (the refused page's "pending operation", once: else the request fails, accounting)
        return real_pending() + (len(refused) == 1 and refused.append(-1) is None)

    cache.alloc_l1, cache.pending_ops = alloc_l1, pending_ops
    try:
        while not refused:
            await asyncio.sleep(0.001)
        short = eng.add_request([rng.randrange(1, 200) for _ in range(8)], SamplingParams(max_tokens=1))
        await _ended(short)
        assert not long.state.done, "the queued request waited for the request that once waited for room"
        await _ended(long)
        assert long.finish_reason == "length" and len(long.output) == 60
        eng.check_integrity()
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("field", ["chat_template_content_format", "tool_call_parser", "reasoning_parser"])
def test_server_limits_take_none_only_for_the_parsers(field):
    """Mutant M26: scheduler/server.py ServerLimits without the content format's None check (None, no format of
    vLLM's flag, was taken). The parsers take None: off."""
    from scheduler.server import ServerLimits
    if field == "chat_template_content_format":
        with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai, got"):
            ServerLimits(**{field: None})
    else:
        assert getattr(ServerLimits(**{field: None}), field) is None
