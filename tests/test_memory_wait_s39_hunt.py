"""Session 39's rule, hunted differentially (scheduler/reservations.py `_head_still_blocked`): the
queue's head that the last prefill pass found no L1 room for does not end a decode chain until the L1
room grows above what it was then. Engines whose L1 holds two or three of a workload's requests at a
time (page_size 4), with and without L2 (write_through, write_back), staggered submits, closed streams,
stop ids, seeded sampling, logprobs, chunked prefill, few or many running slots: each request gets what
it gets alone, every request finishes, the tiers are whole after, and the chain never goes on while the
head would fit (`watch_chain`). Then each way room comes back (a request ending by length, on a stop id,
by an abort, a closed stream or a caller's stop; a backup that unlocks what it copied or saves what must
be evicted) must bring the waiting head in within a step or two, not at the chain's end, while the rule
before (`old_rule`) chained less. (Session 39's hunt found no bug in the rule.)"""
from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from hicache.config import HiCacheConfig
from hicache.radix import Tier
from hicache_helpers import assert_whole, capture_op_logs
from scheduler.admission import Admission
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams, kv_tokens
from test_decode_chain_s38_hunt import (VOCAB, assert_as_alone, random_params, run_alone, run_staggered,
                                        same_logprobs)

PAGE_TOKENS = 4
TIMEOUT_S = 60  # a hang fails the test instead of the CI job


def tight_workload(seed: int):
    """(prompt, params, submit delay in loop turns, tokens after which its stream closes or None): prompts
    of at most 18 tokens, often sharing a prefix, and s38's random params (max_tokens 1-13)."""
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 14))]
    out = []
    for _ in range(rng.randrange(5, 9)):
        shared = base[:rng.randrange(0, len(base))] if rng.random() < 0.5 else []
        prompt = (shared + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))])[:18]
        delay = rng.choice([0, 0, rng.randrange(1, 200)])
        close_after = rng.randrange(1, 8) if rng.random() < 0.15 else None
        out.append((prompt, random_params(rng), delay, close_after))
    return out


def request_pages(prompt, params) -> int:
    """L1 pages admission reserves for a request (prompt + max_tokens - 1 tokens)."""
    return -(-kv_tokens(len(prompt), params.max_tokens) // PAGE_TOKENS)


def tight_l1_pages(workload) -> int:
    """An L1 that holds about two and a half of the workload's requests, and each one alone."""
    pages = [request_pages(prompt, params) for prompt, params, _, _ in workload]
    return max(max(pages), round(2.5 * sum(pages) / len(pages)))


def head_fits(adm: Admission) -> bool:
    """Whether the queue's head would get its L1 room now (`Admission._admit`'s count, side-effect free)."""
    cache, req = adm.cache, adm.engine.waiting[0]
    m = cache.tree.match(adm._reusable(req), include_storage=False, touch=False)
    cache.lock(m.handles[Tier.L1])
    need_pages = request_pages(req.prompt, req.params) - m.lengths[Tier.L1] // PAGE_TOKENS
    fits = need_pages <= cache.available_l1_pages() - adm.reserved_pages
    cache.unlock(m.handles[Tier.L1])
    return fits


@contextlib.contextmanager
def watch_chain(monkeypatch):
    """Every chained step is checked: none is built while a free running slot could take the queue's head.
    Yields the number of steps built while the head waited for room (the rule at work)."""
    kept = Admission.chain_decode_batch
    waited = [0]

    def checked(self, reqs):
        nxt = kept(self, reqs)
        eng = self.engine
        if nxt is not None and eng.waiting and len(eng.running) < eng.config.max_running_requests:
            assert not head_fits(self), ("chained past a head that fits", self.memory_blocked, eng.stats)
            waited[0] += 1
        return nxt
    monkeypatch.setattr(Admission, "chain_decode_batch", checked)
    yield waited
    monkeypatch.setattr(Admission, "chain_decode_batch", kept)


def old_rule(monkeypatch) -> None:
    """The rule before session 39: a head waiting for L1 room ends the chain every step."""
    monkeypatch.setattr(Admission, "_head_still_blocked", lambda self: False)


WT_SMALL_L2 = HiCacheConfig(enable=True, policy="always", write_policy="write_through", host_ratio=1.0)  # (L3 reads)
WB = HiCacheConfig(enable=True, policy="always", write_policy="write_back")


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [1, 6])  # (of 0-7, those whose heads wait for room longest in every row)
@pytest.mark.parametrize("engine_kw", [{}, {"max_running_requests": 3}, {"max_prefill_tokens": 5},
                                       {"hicache": WT_SMALL_L2}, {"hicache": WB, "max_prefill_tokens": 5}],
                         ids=["plain", "three-running", "chunked", "write-through-l3", "write-back-chunked"])
async def test_requests_waiting_for_l1_room_each_get_what_they_get_alone(seed, engine_kw, monkeypatch):
    """A random workload on an L1 of two or three of its requests: each request as alone, all finish, the
    tiers whole after, and some steps chained while the head waited for room, none while it would fit."""
    workload = tight_workload(seed)
    if "hicache" in engine_kw:  # each prompt twice: the second may come back from L2
        workload = workload + workload
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE_TOKENS, num_pages=tight_l1_pages(workload),
                              **engine_kw))
    with watch_chain(monkeypatch) as waited:
        got = await asyncio.wait_for(run_staggered(eng, workload), TIMEOUT_S)
    assert_as_alone(got, await run_alone(workload), workload)
    assert eng.stats["chained_steps"] > 0 and waited[0] > 0  # (the rule was at work)
    assert_whole(eng.cache)
    await eng.shutdown()


def batches_before(logs: list[dict], rid: str, states: tuple[str, ...]) -> int:
    """Batches that ended before request `rid` first entered one of `states` (its log events)."""
    done = 0
    for e in logs:
        if e.get("event") == "batch":
            done += 1
        elif e.get("event") == "request" and e.get("rid") == rid and e.get("state") in states:
            return done
    raise AssertionError(f"{rid} never entered {states}")


async def serve(eng: Engine, requests: dict, act_after: int = 0, act=None) -> dict:
    """Serve {rid: (prompt, params)} submitted at once, in that order; after `act_after` tokens of the
    request "A", `act(eng, stream)` (an abort, a closed stream, ...; True: stop reading). Each rid's
    (tokens, finish reason or None where its stream was closed)."""
    await eng.start()

    async def one(rid, prompt, params):
        tokens = []
        async with contextlib.aclosing(eng.submit(prompt, params, rid=rid)) as stream:
            async for ev in stream:
                if ev.finished:
                    return tokens, ev.finish_reason
                tokens.append(ev.token_id)
                if rid == "A" and act is not None and len(tokens) == act_after and await act(eng, stream):
                    return tokens, None
    out = await asyncio.wait_for(asyncio.gather(*(one(rid, *r) for rid, r in requests.items())), TIMEOUT_S)
    await eng.stop_loop()
    return dict(zip(requests, out))


async def close_stream(eng, stream) -> bool:
    return True  # (aclosing closes it: Engine.submit aborts the request)


async def abort(eng, stream) -> bool:
    await eng.abort("A")
    return False


async def caller_stop(eng, stream) -> bool:  # (an API stop string: it finishes, publishing what it computed)
    await eng.abort("A", stop=True)
    return False


async def stop_at_third_new_token(prompt, params) -> SamplingParams:
    """`params` with a stop id: the first token the request alone makes at index >= 2 that it did not make
    before (it then stops there, mid-chain)."""
    out = (await run_alone([(prompt, params, 0, None)]))[0].output_ids
    k = next(i for i in range(2, len(out)) if out[i] not in out[:i])
    return SamplingParams(max_tokens=params.max_tokens, ignore_eos=True, stop_token_ids=(out[k],))


ENDINGS = {"length": (None, 0), "stop-id": (None, 0), "abort": (abort, 3), "closed-stream": (close_stream, 3),
           "caller-stop": (caller_stop, 3)}


@pytest.mark.asyncio
@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_a_head_waiting_for_room_is_admitted_within_a_step_of_its_coming_back(ending, monkeypatch):
    """R (11 pages, 40 tokens) and A (4 pages) run; H (4 pages) waits: 2 pages are left. A ends (by length,
    on a stop id, aborted, its stream closed, stopped by its caller): its pages come back and H must be
    admitted within two batches, though R's chain could go on for 30 more steps (only the room rule ends
    it). Each request gets what it gets alone; the rule before today chained fewer steps meanwhile."""
    params_a = SamplingParams(max_tokens=8 if ending == "length" else 12, ignore_eos=True)
    if ending == "stop-id":
        params_a = await stop_at_third_new_token([21, 22, 23, 24], params_a)
    requests = {"R": ([11, 12, 13, 14], SamplingParams(max_tokens=40, ignore_eos=True)),
                "A": ([21, 22, 23, 24], params_a),
                "H": ([31, 32, 33, 34], SamplingParams(max_tokens=12, ignore_eos=True))}
    assert [request_pages(*r) for r in requests.values()] == [11, 3 if ending == "length" else 4, 4]
    act, act_after = ENDINGS[ending]
    chained = {}
    for rule in ("new", "old"):
        if rule == "old":
            old_rule(monkeypatch)
        eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE_TOKENS, num_pages=17,
                                  decode_reserve_ratio=1.0))  # (each reserving all its max_tokens)
        with capture_op_logs() as logs, watch_chain(monkeypatch):
            got = await serve(eng, requests, act_after, act)
        assert_whole(eng.cache)
        chained[rule] = eng.stats["chained_steps"]
        ended_a = batches_before(logs, "A", ("finished", "aborted"))
        admitted_h = batches_before(logs, "H", ("prefill_start",))
        assert ended_a <= admitted_h <= ended_a + 2, (rule, ended_a, admitted_h)
        alone = await run_alone([(p, params, 0, None) for p, params in requests.values()])
        for (rid, (tokens, reason)), ref in zip(got.items(), alone):
            if rid == "A" and act is not None:
                assert tokens == ref.output_ids[:len(tokens)] and reason in (None, "abort", "stop"), (rid, reason)
            else:
                assert (tokens, reason) == (ref.output_ids, ref.finish_reason), rid
        await eng.shutdown()
    assert chained["new"] > chained["old"] > 0, chained


@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
async def test_room_a_backup_holds_reaches_the_waiting_head_when_it_ends(write_policy, monkeypatch):
    """R (6 pages, 21 tokens) and A (8 pages, one token) fill L1; H (6 pages) waits. A ends at once and its
    8 published pages are H's room, but a backup holds them: write_through's copies them to L2 (locked, H
    waits in the queue, and the copy's end wakes no chain: only the room rule ends it); write_back's saves
    the leaves H's pages evict (H is admitted and waits for them: the backup's end ends the chain). Either
    way H must run well before R's 20 decode steps end, and get what it gets alone."""
    requests = {"R": ([1, 2, 3, 4], SamplingParams(max_tokens=21, ignore_eos=True)),
                "A": (list(range(100, 132)), SamplingParams(max_tokens=1, ignore_eos=True)),
                "H": (list(range(200, 224)), SamplingParams(max_tokens=1, ignore_eos=True))}
    assert [request_pages(*r) for r in requests.values()] == [6, 8, 6]
    hicache = HiCacheConfig(enable=True, policy="always", write_policy=write_policy,
                            storage_ratio=0.0)  # (no L3: its I/O threads would make the steps' timing vary)
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE_TOKENS, num_pages=14, hicache=hicache))
    with capture_op_logs() as logs, watch_chain(monkeypatch):
        got = await serve(eng, requests)
    assert_whole(eng.cache)
    assert batches_before(logs, "A", ("finished",)) < batches_before(logs, "H", ("first_token",))
    assert batches_before(logs, "H", ("first_token",)) < batches_before(logs, "R", ("finished",)) - 10
    assert eng.stats["chained_steps"] > 0
    alone = await run_alone([(p, params, 0, None) for p, params in requests.values()])
    assert [got[rid] for rid in requests] == [(ref.output_ids, ref.finish_reason) for ref in alone]
    await eng.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [1, 6])
async def test_the_rule_chains_more_than_the_one_before_with_the_same_tokens(seed, monkeypatch):
    """A workload submitted at once (deterministic: no L2) chains more decode steps with today's rule than
    with the one before (every step went back to the loop while the head waited for room), token for token
    the same (logprobs within float noise: the batches differ)."""
    workload = tight_workload(seed)
    runs = {}
    for rule in ("new", "old"):
        if rule == "old":
            old_rule(monkeypatch)
        eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE_TOKENS,
                                  num_pages=tight_l1_pages(workload)))
        results = await asyncio.wait_for(eng.generate_async([w[0] for w in workload], [w[1] for w in workload]),
                                         TIMEOUT_S)
        assert_whole(eng.cache)
        runs[rule] = eng.stats["chained_steps"], results
        await eng.shutdown()
    assert runs["new"][0] > runs["old"][0] > 0, (runs["new"][0], runs["old"][0])
    for new, old in zip(runs["new"][1], runs["old"][1]):
        assert (new.output_ids, new.finish_reason) == (old.output_ids, old.finish_reason)
        assert all(same_logprobs(a, b) for a, b in zip(new.logprobs or [], old.logprobs or []))


@pytest.mark.asyncio
async def test_the_head_is_no_longer_blocked_once_its_room_beside_its_prefix_fits():
    """Regression (session 54; one CI run in ~12 failed the workload test above): the rule compared L1's room
    overall, which counts the head's own prefix as evictable while nobody holds it. Another request locking that
    prefix then lowered the room overall while the head's room (beside its prefix) grew as pages came back: the
    chain went on past a head that fit."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE_TOKENS, num_pages=12))
    prefix = [5, 6, 7, 8]
    await eng.generate_async([prefix + [9]], SamplingParams(max_tokens=1))  # (its page is published, unlocked)
    await eng.stop_loop()
    adm, cache = eng.admission, eng.cache
    head = eng.add_request(prefix + [10, 11, 12, 13], SamplingParams(max_tokens=9, ignore_eos=True))
    m = cache.tree.match(adm._reusable(head), include_storage=False, touch=False)
    assert m.lengths[Tier.L1] == PAGE_TOKENS
    need = adm._pages_after(head, PAGE_TOKENS)
    adm.reserved_pages += adm._room_beside(m.handles[Tier.L1]) - need + 1  # (others' reservations: one page short)
    assert await adm._admit(head) is False and adm.memory_blocked[0] == head.rid
    assert adm._head_still_blocked()
    cache.lock(m.handles[Tier.L1])  # another request takes the prefix: the room overall falls by its page
    adm.reserved_pages -= 1  # and a page comes back: the head's room is now what it needs
    assert adm._l1_room_pages() <= adm.memory_blocked[1]  # (the room overall did not grow)
    assert not adm._head_still_blocked()
    cache.unlock(m.handles[Tier.L1])
    adm.reserved_pages -= adm.reserved_pages
    await eng.shutdown()
