"""decode_reserve_ratio "auto" (scheduler/reservations.py AutoReserveRatio): SGLang's adaptive new_token_ratio. The
share admission reserves starts at 0.7, falls per decode step to 0.1, jumps after a preemption to what the requests
in decode have used of their max_tokens, and starts again at 0.7 when the engine is idle; every request streams what
it streams at ratio 1."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scheduler.config import EngineConfig, add_engine_args, config_from_args
from scheduler.engine import Engine
from scheduler.prom import EngineCollector
from scheduler.request import Request, RequestState, SamplingParams
from scheduler.reservations import AutoReserveRatio
from test_preemption import config, mixed_params, prompt_of, run_all, streamed


def decoding(outputs_and_max: list[tuple[int, int]]) -> list[Request]:
    reqs = []
    for i, (used, max_tokens) in enumerate(outputs_and_max):
        req = Request([1, 2, 3], SamplingParams(max_tokens=max_tokens), rid=f"r{i}")
        req.output = [7] * used
        reqs.append(req)
    return reqs


def test_the_share_falls_per_decode_step_to_its_floor_and_starts_again_when_idle():
    ratio = AutoReserveRatio()
    assert ratio.value == 0.7
    for _ in range(300):
        ratio.decode_step()
    assert ratio.value == pytest.approx(0.4)
    for _ in range(1000):
        ratio.decode_step()
    assert ratio.value == 0.1  # (the floor, not below)
    ratio.idle()
    assert ratio.value == 0.7


def test_a_preemption_sets_the_share_to_what_the_requests_in_decode_used():
    ratio = AutoReserveRatio()
    for _ in range(600):
        ratio.decode_step()
    ratio.preempted(decoding([(30, 200), (70, 200)]))  # (30 + 20 + 70 + 20) / 400
    assert ratio.value == pytest.approx(0.35)
    ratio.preempted(decoding([(190, 200)]))
    assert ratio.value == 1.0  # (capped)
    ratio.preempted([])  # (nobody left in decode: the share stays)
    assert ratio.value == 1.0


def test_a_preemption_never_lowers_the_share():
    """Regression (session 55's hunt): requests using little of a huge max_tokens (chats without one) set the share
    below its floor after a preemption, admission less cautious than before L1 ran short."""
    ratio = AutoReserveRatio()
    for _ in range(600):
        ratio.decode_step()
    ratio.preempted(decoding([(30, 4000), (50, 4000)]))  # ((30 + 20 + 50 + 20) / 8000: 0.015)
    assert ratio.value == 0.1
    ratio.value = 0.5
    ratio.preempted(decoding([(30, 200)]))  # (0.25)
    assert ratio.value == 0.5


def test_auto_is_checked_and_has_a_flag():
    assert EngineConfig(decode_reserve_ratio="auto").decode_reserve_ratio == "auto"
    for bad in ("Auto", "0.5", "x"):
        with pytest.raises(ValueError, match="decode_reserve_ratio must be a number or 'auto'"):
            EngineConfig(decode_reserve_ratio=bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--decode-reserve-ratio", "auto"])).decode_reserve_ratio == "auto"
    for bad in ("1.5", "nan", "often"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--decode-reserve-ratio", bad])


@pytest.mark.parametrize("variant", ["plain", "l2"])
@pytest.mark.asyncio
async def test_requests_stream_what_they_would_at_ratio_one(variant):
    prompts = [prompt_of(i, variant) for i in range(12)]
    params = [mixed_params(i) for i in range(12)]
    whole, whole_reqs = await run_all(config(1.0, variant), prompts, params)
    auto, auto_reqs = await run_all(config("auto", variant), prompts, params)
    try:
        assert auto.stats["preempted"] > 0  # (0.7 of 50 tokens reserved, every request writes all 50)
        for a, b in zip(whole_reqs, auto_reqs):
            assert (b.state, b.finish_reason, b.output) == (RequestState.FINISHED, a.finish_reason, a.output)
            events = streamed(b)
            assert [e[:2] for e in events[:-1]] == [(t, i) for i, t in enumerate(b.output)]  # each token once
    finally:
        await whole.shutdown()
        await auto.shutdown()


@pytest.mark.asyncio
async def test_the_share_starts_again_only_when_nothing_runs_or_waits():
    """Regression (session 55's hunt): with requests queued behind a full batch (max_running_requests), every
    prefill pass between one batch's end and the next admission found nothing running and reset the share to 0.7,
    though the engine never idled."""
    eng = Engine(dataclasses.replace(config("auto"), num_pages=512, max_running_requests=2))
    admitted_at = []
    admit = eng.admission._admit

    async def recorded(req, alone=False, budget=0):
        admitted_at.append(eng.admission.reserve_ratio())
        return await admit(req, alone, budget)
    eng.admission._admit = recorded
    await eng.start()
    reqs = [eng.add_request([i + 3] * 8, SamplingParams(max_tokens=300, ignore_eos=True)) for i in range(4)]
    while not all(r.state.done for r in reqs):
        await asyncio.sleep(0.002)
    assert admitted_at[:2] == [0.7, 0.7] and len(admitted_at) == 4
    assert all(value < 0.5 for value in admitted_at[2:]), admitted_at  # (~300 decode steps later: ~0.4)
    await asyncio.sleep(0.05)
    assert eng.admission.reserve_ratio() == 0.7  # (idle now)
    eng.cache.check_integrity()
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_request_admitted_later_reserves_the_share_decode_steps_lowered():
    """One request decodes alone for a while; one arriving then reserves less than 0.7 of its max_tokens, more than
    0.1; once both end and the engine idles the share is 0.7 again, as status and the gauge say."""
    eng = Engine(dataclasses.replace(config("auto"), num_pages=512))
    await eng.start()
    try:
        first = eng.add_request([3] * 8, SamplingParams(max_tokens=300, ignore_eos=True))
        while len(first.output) < 200:
            await asyncio.sleep(0.002)
        second = eng.add_request([4] * 8, SamplingParams(max_tokens=400, ignore_eos=True))
        while second.state is RequestState.WAITING:
            await asyncio.sleep(0)
        held = len(second.pages) + second.reserved_pages  # (pages of 4 for its prompt and its share of 399)
        assert -(-(8 + 0.1 * 399) // 4) < held < -(-(8 + 0.7 * 399) // 4)
        while not (first.state.done and second.state.done):
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)  # (a tick with nothing running)
        assert eng.status()["engine"]["decode_reserve_ratio"] == 0.7
        gauge = {f.name: f for f in text_string_to_metric_families(
            _render(EngineCollector(eng)))}["hicache_engine_decode_reserve_ratio"]
        assert gauge.samples[0].value == 0.7
        eng.cache.check_integrity()
    finally:
        await eng.shutdown()


def _render(collector) -> str:
    from prometheus_client import CollectorRegistry, generate_latest
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()
