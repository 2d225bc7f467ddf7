"""The fault matrix, through the real Engine (tiny preset, CPU, all three tiers).

Each cell (fault, state) injects one fault while an operation is in (or has just passed) one state of
the backup or restore machine, and checks: the request still completes with the output of a plain
recompute (an engine without any cache); the failure is counted (metrics "failures" / "fallbacks" /
"cancellations") and logged (an op event into FAILED or CANCELLED, whose from_state is the targeted
state); integrity holds; after every request ended and the cache drained no tier holds a private page.
docs/reliability.md has the table of cells with their observed behaviour. The cancellation cells
(aborts and shutdown while an op is pending) are in tests/test_faults_cancellation.py; this file also
holds bad input that fails only its request, two backup regressions (session 26), and the harness
(engines, references, TransferGate) that other test files import.

Holding an op in a state: an L3 read is held with SLOW_READ (a worker sleeps before reading); a
device/host copy or an L3 write is held by a gate that keeps its completion back until the test
releases it (on the GPU such copies really are in flight for a while; on the CPU they complete
when enqueued, so without the gate nothing could ever land "while pending").
"""
from __future__ import annotations

import asyncio
import random

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import WriteGate, capture_op_logs, finish, flip_l3_byte, until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams

VOCAB = 512
PAGE = 4
MAX_TOKENS = 4
_rng = random.Random(7)
PROMPT = [_rng.randrange(VOCAB) for _ in range(6 * PAGE + 1)]  # 24 reusable tokens: 6 pages
OTHER = [_rng.randrange(VOCAB) for _ in range(3 * PAGE + 2)]
REUSABLE = len(PROMPT) - 1
PARAMS = SamplingParams(max_tokens=MAX_TOKENS)


# -- references and engines ----------------------------------------------------------------------
_REFERENCE: dict = {}


async def reference(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy output of an engine without any cache (no prefix reuse, no hierarchy)."""
    key = (tuple(prompt), max_tokens)
    if key not in _REFERENCE:
        eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=256, page_size=PAGE,
                                  enable_prefix_cache=False))
        out = await eng.generate_async([prompt], SamplingParams(max_tokens=max_tokens))
        await eng.shutdown()
        _REFERENCE[key] = out[0].output_ids
    return _REFERENCE[key]


def make_engine(faults: FaultInjector | None = None, num_pages: int = 48, **hicache) -> Engine:
    hicache.setdefault("transfer_backend", "torch")
    hicache.setdefault("policy", "always")
    config = EngineConfig(model="tiny", device="cpu", num_pages=num_pages, page_size=PAGE).with_hicache(
        enable=True, **hicache)
    return Engine(config, faults=faults or FaultInjector())


async def run_one(eng: Engine, prompt: list[int] = PROMPT, max_tokens: int = MAX_TOKENS):
    out = await eng.generate_async([prompt], SamplingParams(max_tokens=max_tokens))
    return out[0]


def only_in_l3(eng: Engine, tokens) -> None:
    """Evict the prefix from L1 and L2 (engine idle): only L3 holds it."""
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    eng.cache.tree.evict(Tier.L2, eng.cache.l2.num_pages)
    assert eng.cache.tree.match(tokens, touch=False).lengths == [0, 0, len(tokens)]


def op_paths(logs: list[dict]) -> list[tuple[str, list[str]]]:
    """(kind, states entered) per op, in the order the ops first logged."""
    paths: dict[int, tuple[str, list[str]]] = {}
    for e in logs:
        if e.get("event") == "op":
            paths.setdefault(e["op_id"], (e["kind"], [e["from_state"]]))[1].append(e["to_state"])
    return list(paths.values())


def ended(logs: list[dict], end: str) -> list[dict]:
    """Op events into FAILED / CANCELLED."""
    return [e for e in logs if e.get("event") == "op" and e["to_state"] == end]


def live_in(eng: Engine, state: OpState):
    return [op for op in eng.cache.runner.live.values() if op.state is state]


class TransferGate:
    """Holds back the completion of device<->host copies of one direction until released."""

    def __init__(self, eng: Engine, direction: str) -> None:
        self.direction, self.release = direction, asyncio.Event()
        transfer = eng.cache.transfer
        self._wait = transfer.wait
        transfer.wait = self.wait

    async def wait(self, tr):
        if tr.direction == self.direction:
            await self.release.wait()
        return await self._wait(tr)


# -- the matrix ----------------------------------------------------------------------------------
FAULT_KIND = {"eio_write": "eio", "short_write": "short", "enospc_write": "enospc", "eio_read": "eio",
              "short_read": "short", "slow_read": "timeout", "bit_flip": "checksum",
              "transfer_raise": "transfer"}
ARM = {"eio_write": Fault.EIO_WRITE, "short_write": Fault.SHORT_WRITE, "enospc_write": Fault.ENOSPC_WRITE,
       "eio_read": Fault.EIO_READ, "short_read": Fault.SHORT_READ, "slow_read": Fault.SLOW_READ,
       "transfer_raise": Fault.TRANSFER_RAISE}

BACKUP_CELLS = [
    ("transfer_raise", "D2H_PENDING"),
    ("eio_write", "H2S_PENDING"), ("short_write", "H2S_PENDING"), ("enospc_write", "H2S_PENDING"),
    # the published state between: L2 pages published after D2H survive the H2S failure and serve
    ("eio_write", "L1_L2"), ("short_write", "L1_L2"), ("enospc_write", "L1_L2"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("fault,state", BACKUP_CELLS, ids=[f"{f}@{s}" for f, s in BACKUP_CELLS])
async def test_backup_fault(fault, state):
    faults = FaultInjector()
    eng = make_engine(faults)
    await eng.start()
    want = await reference(PROMPT, 1)
    # the first copy / write is the backup of this request's prompt; with one output token the
    # request publishes nothing more when it finishes, so that backup is the only op
    faults.arm(ARM[fault])
    with capture_op_logs() as logs:
        first = await run_one(eng, max_tokens=1)
        await eng.cache.drain()
    assert first.output_ids == want and first.error is None
    failed = ended(logs, "FAILED")
    assert len(failed) == 1 and failed[0]["kind"] == "backup"
    pending = "D2H_PENDING" if state == "D2H_PENDING" else "H2S_PENDING"
    assert failed[0]["from_state"] == pending  # the op really was in that state when the fault struck
    [(_, path)] = op_paths(logs)
    metrics = eng.metrics()
    assert metrics["failures"] == {FAULT_KIND[fault]: 1} and metrics["fallbacks"] == 0  # no request fell back
    tokens = PROMPT[:REUSABLE]
    m = eng.cache.tree.match(tokens, touch=False)
    if state == "D2H_PENDING":
        assert path == ["L1_PRIVATE", "D2H_PENDING", "FAILED"]
        assert m.lengths == [REUSABLE, 0, 0]  # nothing was published below L1
    else:
        assert path == ["L1_PRIVATE", "D2H_PENDING", "L1_L2", "H2S_PENDING", "FAILED"]
        assert m.lengths == [REUSABLE, REUSABLE, 0]  # L2 was published before the write failed
    eng.check_integrity()

    if state == "L1_L2":  # the published L2 pages are whole: an L2 restore serves the prompt
        eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
        with capture_op_logs() as logs:
            again = await run_one(eng, max_tokens=1)
        assert again.output_ids == want and again.cached_tokens["l2"] == REUSABLE
        assert ("restore_l2", ["L2", "H2D_PENDING", "L1_L2"]) in op_paths(logs)
    else:
        again = await run_one(eng, max_tokens=1)
        assert again.output_ids == want and again.cached_tokens["l1"] == REUSABLE
    await finish(eng)


RESTORE_CELLS = [
    (fault, "S2H_PENDING", mode) for fault in ("eio_read", "short_read", "slow_read", "bit_flip")
    for mode in ("prefetch", "blocking")
] + [
    ("transfer_raise", "H2D_PENDING", "prefetch"), ("transfer_raise", "H2D_PENDING", "blocking"),
    # the published state between: promoted L2 pages survive the H2D failure and serve a retry
    ("transfer_raise", "L2_L3", "prefetch"), ("transfer_raise", "L2_L3", "blocking"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("fault,state,mode", RESTORE_CELLS, ids=[f"{f}@{s}-{m}" for f, s, m in RESTORE_CELLS])
async def test_restore_fault(fault, state, mode):
    """mode "prefetch": the default engine path (an L3 hit is promoted by a PREFETCH_L3 op when the
    request is queued, then restored from L2 by RESTORE_L2); "blocking" (--disable-hicache-prefetch):
    one RESTORE_L3 op runs L3 -> S2H_PENDING -> L2_L3 -> H2D_PENDING -> L1_L2_L3."""
    faults = FaultInjector()
    # bit flip: with selective write-through the request's recompute does not write the prefix
    # back, so the test can see the corrupt page's residency gone afterwards
    eng = make_engine(faults, prefetch=(mode == "prefetch"), io_timeout_s=0.1,
                      write_policy="write_through_selective" if fault == "bit_flip" else "write_through")
    await eng.start()
    want = await reference(PROMPT)
    tokens = PROMPT[:REUSABLE]
    assert (await run_one(eng)).output_ids == want
    eng.cache.runner.start_backup(tokens)  # (a no-op under write_through: already backed up)
    await eng.cache.drain()
    only_in_l3(eng, tokens)
    flipped_page = None
    if fault == "bit_flip":
        flipped_page = 3
        flip_l3_byte(eng.cache, eng.cache.tree.match(tokens, touch=False).pages[Tier.L3][flipped_page])
    else:
        faults.arm(ARM[fault], delay_s=0.4 if fault == "slow_read" else 0.0)

    with capture_op_logs() as logs:
        result = await run_one(eng)
        await eng.cache.drain()
    assert result.output_ids == want and result.error is None
    failed = ended(logs, "FAILED")
    assert len(failed) == 1, op_paths(logs)
    pending = "H2D_PENDING" if state in ("H2D_PENDING", "L2_L3") else "S2H_PENDING"
    if (fault, mode) == ("bit_flip", "prefetch"):  # the bytes landed before their checksum failed; the
        # request may have taken the prefetch on to L1 meanwhile (Admission._take_landed)
        assert failed[0]["from_state"] in ("S2H_LANDED", "H2D_VERIFYING")
    else:
        assert failed[0]["from_state"] == pending
    # prefetch mode: the L2 -> L1 copy is a RESTORE_L2 after the promotion, or the promotion's own
    # H2D when the request took the prefetch on to L1 while its checksums ran (_take_landed)
    kinds = {("prefetch", "S2H_PENDING"): ["prefetch_l3"],
             ("prefetch", "H2D_PENDING"): ["restore_l2", "prefetch_l3"]}.get((mode, pending), ["restore_l3"])
    assert failed[0]["kind"] in kinds
    metrics = eng.metrics()
    # a fallback is the request recomputing what its restore was to bring (slow_read with a prefetch:
    # the timed-out prefetch's request read L3 itself; tests/test_restore_bookkeeping_hunt.py)
    restored = result.cached_tokens["l2"] + result.cached_tokens["l3"]
    assert metrics["failures"] == {FAULT_KIND[fault]: 1} and metrics["fallbacks"] == (0 if restored else 1)
    paths = op_paths(logs)
    if state in ("H2D_PENDING", "L2_L3"):  # the promotion happened, then the copy to L1 failed
        if mode == "prefetch":
            landed = ["L3", "S2H_PENDING", "S2H_LANDED"]
            assert (("prefetch_l3", landed + ["L2_L3"]) in paths
                    or ("prefetch_l3", landed + ["H2D_VERIFYING", "H2D_PENDING", "FAILED"]) in paths), paths
        else:
            assert ("restore_l3", ["L3", "S2H_PENDING", "L2_L3", "H2D_PENDING", "FAILED"]) in paths
        assert result.cached_tokens["l1"] == 0  # the request recomputed its prefix
    eng.check_integrity()
    m = eng.cache.tree.match(tokens, touch=False)
    if fault == "bit_flip":  # the corrupt page lost its L3 residency and the request recomputed
        assert m.lengths[Tier.L3] <= flipped_page * PAGE
        assert result.cached_tokens == {"l1": 0, "l2": 0, "l3": 0}
        assert metrics["recomputed_tokens"] >= 2 * len(PROMPT)
    if state == "L2_L3":  # promoted pages stayed published: after L1 loses it, L2 serves it whole
        assert m.lengths[Tier.L2] == REUSABLE
        eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
        with capture_op_logs() as logs:
            again = await run_one(eng)
        assert again.output_ids == want and again.cached_tokens["l2"] == REUSABLE
        assert ("restore_l2", ["L2", "H2D_PENDING", "L1_L2"]) in op_paths(logs)
    await finish(eng)


# -- bad input -----------------------------------------------------------------------------------
BAD_INPUTS = {
    "empty_prompt": ([], PARAMS, "non-empty"),
    "out_of_vocab": ([1, 2, VOCAB], PARAMS, "vocabulary"),
    "negative_id": ([1, -1, 2], PARAMS, "vocabulary"),
    "not_int": ([1, 2.0, 3], PARAMS, "not an int"),
    "max_tokens_zero": ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens"),
    "max_tokens_negative": ([1, 2, 3], SamplingParams(max_tokens=-3), "max_tokens"),
    "longer_than_pool": (list(range(48 * PAGE + 1)), PARAMS, "exceeds"),
    "prompt_plus_output_exceed_pool": (list(range(40 * PAGE)), SamplingParams(max_tokens=9 * PAGE), "pool"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(BAD_INPUTS))
async def test_bad_input_fails_only_its_request(case):
    prompt, params, message = BAD_INPUTS[case]
    eng = make_engine()
    await eng.start()
    good = asyncio.create_task(run_one(eng, PROMPT, max_tokens=16))
    await asyncio.sleep(0)
    with pytest.raises(RequestError, match=message):
        eng.add_request(prompt, params)
    with pytest.raises(RequestError, match=message):
        async for _ in eng.submit(prompt, params):
            pass
    [bad] = await eng.generate_async([prompt], params)
    assert bad.finish_reason == "error" and message in bad.error and bad.output_ids == []
    assert (await good).output_ids == await reference(PROMPT, 16)
    await finish(eng)


# -- found by a bug hunt (session 26) ---------------------------------------------------------------
_hunt = random.Random(5)
HUNT_FIRST = [_hunt.randrange(VOCAB) for _ in range(41)]   # 10 full pages published in L1
HUNT_SECOND = [_hunt.randrange(VOCAB) for _ in range(30)]  # needs 13 of 16 pages: must evict FIRST's


@pytest.mark.asyncio
async def test_write_back_evicts_a_leaf_unsaved_once_its_backup_failed():
    """Regression: under write_back an L1 leaf not in L2 is backed up before it may go; while every
    copy failed, each retry of the allocation vetoed the eviction again and started a new backup, so
    the request that needed the pages never got them (thousands of failed backups in 5 s). Now a
    leaf whose backup failed is evicted unsaved, as a failed write-through backup only costs time."""
    faults = FaultInjector()
    eng = make_engine(faults, num_pages=16, write_policy="write_back", storage_ratio=0.0)
    await eng.start()
    [first] = await eng.generate_async([HUNT_FIRST], SamplingParams(max_tokens=1, ignore_eos=True))
    assert first.finish_reason == "length"
    faults.arm(Fault.TRANSFER_RAISE, times=None)  # every L1 <-> L2 copy fails from now on
    task = asyncio.ensure_future(eng.generate_async([HUNT_SECOND], SamplingParams(max_tokens=20, ignore_eos=True)))
    done, _ = await asyncio.wait({task}, timeout=10)
    failed_backups = eng.metrics()["failures"].get("transfer", 0)
    faults.disarm()
    [second] = await asyncio.wait_for(task, 30)
    assert done, f"no progress in 10 s while {failed_backups} backups failed"
    assert second.finish_reason == "length" and failed_backups <= 2
    eng.check_integrity()
    await eng.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
async def test_a_request_waiting_for_pages_a_backup_freed_is_not_held_by_its_l3_write(write_policy):
    """Regression: a backup unlocks its L1 source once its D2H published the pages in L2, then
    writes L3; the loop was woken only when the whole op ended, so a request waiting for those
    (now evictable) pages slept through the L3 write."""
    eng = make_engine(num_pages=16, write_policy=write_policy)
    await eng.start()
    l3_write = WriteGate(eng.cache.store)  # L3 writes complete only when released
    d2h = TransferGate(eng, "d2h") if write_policy == "write_through" else None
    try:
        first = eng.add_request(HUNT_FIRST, SamplingParams(max_tokens=1, ignore_eos=True))
        await until(lambda: first.state.done)
        if d2h is not None:  # the write-through backup holds FIRST's 10 L1 pages while its D2H runs
            await until(lambda: live_in(eng, OpState.D2H_PENDING))
        second = eng.add_request(HUNT_SECOND, SamplingParams(max_tokens=20, ignore_eos=True))
        if d2h is not None:
            await asyncio.sleep(0.05)
            assert not second.output  # its pages are locked by the D2H
            d2h.release.set()
        await until(lambda: live_in(eng, OpState.H2S_PENDING))  # in L2, unlocked; the L3 write held
        await until(lambda: eng.cache.tree.evictable_pages(Tier.L1) >= 10)
        await until(lambda: bool(second.output), timeout_s=5.0)
        assert live_in(eng, OpState.H2S_PENDING)  # served while the L3 write is still held
    finally:
        l3_write.release()
        if d2h is not None:
            d2h.release.set()
    await until(lambda: second.state.done, timeout_s=30.0)
    assert second.finish_reason == "length"
    await eng.shutdown()
