"""Speculative drafts against L1 reservations (session 58's hunt, closes "speculative drafts may take unreserved L1"):
a verify step's drafts grow their request's pages only from its own reservation and the room nobody reserved
(Reservations._grow/_outgrew), never past what it may still write (Speculator.split's room), so: at
decode_reserve_ratio 1 nothing is preempted, no draft ever leaves L1 reserved twice, the engine drains whole, and
greedy outputs equal those without speculation."""
from __future__ import annotations

import asyncio

import pytest

from hicache_helpers import assert_whole, until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestState, SamplingParams
from scheduler.speculative import SpeculativeConfig

PROMPTS = [[7, 8, 9] * 4, [11, 12] * 5, [3, 4, 5, 6] * 3, [21, 22, 23] * 4]


async def run(cfg: EngineConfig, max_tokens: int, room_seen: list | None = None) -> tuple[Engine, list]:
    eng = Engine(cfg)
    if room_seen is not None:
        adm, grow = eng.admission, eng.admission._grow

        def watched(req, num_tokens):  # (every growth, drafts' included: L1 never promised twice)
            ok = grow(req, num_tokens)
            room_seen.append(adm._l1_room_pages())
            return ok
        adm._grow = watched
    await eng.start()
    reqs = []
    for p in PROMPTS:
        reqs.append(eng.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        await asyncio.sleep(0)
    await until(lambda: all(r.state.done for r in reqs), 60)
    return eng, reqs


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0, "auto"])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.asyncio
async def test_drafts_take_no_reserved_l1_and_change_no_token(ratio, k):
    max_tokens = 24
    need = -(-(12 + max_tokens - 1) // 4)
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1, draft_policy="always")
    tight = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=need + 2, decode_reserve_ratio=ratio,
                         speculative=spec)
    room_seen: list[int] = []
    eng, reqs = await run(tight, max_tokens, room_seen)
    ref_eng, ref = await run(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=512), max_tokens)
    try:
        assert eng.speculator.stats["draft_tokens"] > 0  # (the premise: it speculated)
        assert min(room_seen) >= 0  # (no growth, a draft's included, took a page another request reserved)
        if ratio == 1.0:
            assert eng.stats["preempted"] == 0
        assert [r.output for r in reqs] == [r.output for r in ref]
        assert all(r.state is RequestState.FINISHED for r in reqs)
        await eng.stop_loop()
        await eng.cache.drain()
        assert eng.admission.reserved_pages == 0 and not eng.requests
        assert_whole(eng.cache)
    finally:
        await eng.shutdown()
        await ref_eng.shutdown()
