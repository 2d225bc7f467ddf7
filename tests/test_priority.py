"""vLLM's priority scheduling (EngineConfig.scheduling_policy "priority", SamplingParams.priority): the queue
admits lower priorities first, in arrival order among equals (`request.enqueue`); nothing running is preempted;
under "fcfs" (the default) a priority other than 0 is refused, as vLLM refuses it."""
from __future__ import annotations

import asyncio
from collections import deque

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import Request, RequestError, SamplingParams, enqueue


def _engine(policy: str = "priority") -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512, max_running_requests=1,
                               scheduling_policy=policy))


async def _ended(reqs: list[Request]) -> None:
    while not all(r.state.done for r in reqs):
        await asyncio.sleep(0.005)


def _admission_order(reqs: list[Request]) -> list[int]:
    return [reqs.index(r) for r in sorted(reqs, key=lambda r: r.first_token_s)]


@pytest.mark.asyncio
async def test_the_queue_admits_by_priority_then_arrival():
    eng = _engine()
    priorities = [0, 5, -1, 5, 0, -1]
    reqs = [eng.add_request([10 + i, 11, 12], SamplingParams(max_tokens=2, priority=p))
            for i, p in enumerate(priorities)]
    assert [r.params.priority for r in eng.waiting] == sorted(priorities)
    await eng.start()
    await _ended(reqs)
    assert _admission_order(reqs) == [2, 5, 0, 4, 1, 3]  # (one running at a time: admission order is finish order)
    assert all(r.finish_reason == "length" for r in reqs)
    eng.check_integrity()
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_later_urgent_request_goes_first_but_preempts_nothing():
    eng = _engine()
    await eng.start()
    running = eng.add_request([1, 2, 3], SamplingParams(max_tokens=40))
    while running.first_token_s is None:
        await asyncio.sleep(0.001)
    early, later = (eng.add_request([4 + i, 5], SamplingParams(max_tokens=2)) for i in range(2))
    urgent = eng.add_request([9, 9], SamplingParams(max_tokens=2, priority=-3))
    reqs = [running, early, later, urgent]
    await _ended(reqs)
    assert _admission_order(reqs) == [0, 3, 1, 2]
    assert len(running.output) == 40 and running.finish_reason == "length"  # (ran to its end)
    eng.check_integrity()
    await eng.shutdown()


def test_fcfs_refuses_a_priority_and_every_policy_checks_it():
    eng = _engine("fcfs")
    with pytest.raises(RequestError, match="--scheduling-policy priority") as err:
        eng.add_request([1, 2], SamplingParams(priority=1))
    assert err.value.param == "priority" and not eng.waiting and not eng.requests
    eng.add_request([1, 2], SamplingParams(priority=0))
    for bad in (1.5, True, 1 << 63):
        with pytest.raises(RequestError, match="priority must be an integer"):
            _engine().add_request([1, 2], SamplingParams(priority=bad))
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(model="tiny", device="cpu", scheduling_policy="lifo")


def test_enqueue_keeps_priority_then_arrival_order():
    """The one rule for a new request and one back from parking (Restoring._requeue)."""
    queue: deque[Request] = deque()
    made = []
    for i, (priority, arrival_s) in enumerate([(0, 1.0), (1, 2.0), (0, 3.0), (-1, 4.0), (1, 0.5), (0, 2.5)]):
        req = Request(prompt=[i], params=SamplingParams(priority=priority), arrival_s=arrival_s)
        made.append(req)
        enqueue(queue, req)
    assert [made.index(r) for r in queue] == [3, 0, 5, 2, 4, 1]


def test_the_api_field_reaches_the_queue_and_fcfs_refuses_it():
    """`priority` is a field of completions and chat alike (api_models._SamplingFields)."""
    import httpx

    from scheduler.server import ServerLimits, create_app
    from test_server import ServerThread

    for policy, status in (("fcfs", 400), ("priority", 200)):
        engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512, scheduling_policy=policy))
        with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
            r = httpx.post(s.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "priority": -2},
                           timeout=60)
            assert r.status_code == status, r.text
            if status == 400:
                assert r.json()["error"]["param"] == "priority" and "--scheduling-policy" in r.text
            r = httpx.post(s.url + "/v1/completions", json={"prompt": [5], "max_tokens": 1, "priority": "high"},
                           timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
