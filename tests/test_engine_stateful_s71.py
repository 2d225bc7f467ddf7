"""The real Engine (tiny preset, CPU, float32) under random interleavings of requests, aborts, loop steps, operator
flushes and restarts, and cache faults (a hypothesis stateful test). No bug found by it yet (session 71: ~6,800
random examples): it pins the request lifecycle's invariants around the cache's ops, which no test watched
interleaved.

The engine is small on purpose: 2-token pages, an L1 of 24 pages with a low decode reserve (requests are preempted),
an L2 of 12 pages and a file L3 of 48 (tmp path) so that eviction, backups, write-back saves, L3 restores and
prefetches all happen; device <-> host copies and L3 writes can be held in flight (`hold`: on the CPU they complete
as enqueued). tests/test_stateful_manager.py does this for the CacheManager alone; this one adds the scheduler:
admission, parking, preemption, aborts and the request lifecycle around those ops.

After every rule: `Engine.check_integrity()` (the cache's checks and every tree lock held by a live request or op),
the loop has not crashed, no op driver raised, no ended request is still listed (requests, waiting, running, parked)
and every ended request got exactly one last event, as its last. At every quiet point (every request ended, the
cache drained): no private page or lock in any tier, nothing queued, every FINISHED request's tokens (and logprobs)
those of an engine without any cache for the same prompt and params, every aborted one's a prefix of them, none
FAILED, and the engine still serves a fresh request. HICACHE_ENGINE_STATEFUL_EXAMPLES / _STEPS raise the budget and
HICACHE_ENGINE_STATEFUL_HUNT=1 draws random examples (a hunt by hand).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import os
import shutil
import sys
import tempfile
import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from hicache.faults import Fault, FaultInjector
from hicache.radix import Tier
from hicache_helpers import assert_whole, flip_l3_byte
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.guided import GuidedSpec
from scheduler.loop_task import crash_of
from scheduler.request import RequestState, SamplingParams
from test_lifecycle_hunt import assert_nothing_queued

PAGE = 2
# every await of a rule ends well within it, and every request of a quiet point ends within it: a hang fails, and
# fast (shrinking replays a failing example again and again)
HANG_GUARD_S = 5.0
BASES = ((11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22), (11, 12, 13, 14, 40, 41, 42, 43, 44, 45, 46, 47),
         (70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81))
TAILS = ((), (5,), (300, 301, 302))
STOP_IDS = tuple(range(3, 512, 7))  # a stop id comes up in about one greedy token of seven
KINDS = ("plain", "logprobs", "stop", "guided", "penalty", "seeded", "salted", "prompt_logprobs")
FAULTS = (Fault.EIO_READ, Fault.SHORT_READ, Fault.SLOW_READ, Fault.SLOW_VERIFY, Fault.EIO_WRITE, Fault.SHORT_WRITE,
          Fault.ENOSPC_WRITE, Fault.TRANSFER_RAISE)


def prompt_of(base: int, cut: int, tail: int) -> tuple[int, ...]:
    return BASES[base][: cut * PAGE] + TAILS[tail] or (1,)


def params_of(kind: str, max_tokens: int) -> SamplingParams:
    extra = {"logprobs": {"logprobs": 2}, "stop": {"stop_token_ids": STOP_IDS},
             "guided": {"guided": GuidedSpec("regex", "[a-c]{1,12}")},
             "penalty": {"repetition_penalty": 1.3, "presence_penalty": 0.5},
             "seeded": {"temperature": 0.8, "seed": 7}, "salted": {"cache_salt": "tenant"},
             "prompt_logprobs": {"prompt_logprobs": 1}}.get(kind, {})
    return SamplingParams(max_tokens=max_tokens, **extra)


_REFERENCE: dict = {}
_REFERENCE_ENGINE: list[Engine] = []


def reference(prompt: tuple[int, ...], kind: str, max_tokens: int) -> tuple[list[int], list[float] | None]:
    """(tokens, logprobs) of an engine without any cache, alone: computed once per (prompt, params)."""
    key = (prompt, kind, max_tokens)
    if key not in _REFERENCE:
        if not _REFERENCE_ENGINE:
            _REFERENCE_ENGINE.append(Engine(EngineConfig(model="tiny", device="cpu", dtype="float32", num_pages=64,
                                                         page_size=PAGE, enable_prefix_cache=False)))
        [out] = _REFERENCE_ENGINE[0].generate([list(prompt)], params_of(kind, max_tokens))
        assert out.error is None, out.error
        _REFERENCE[key] = (out.output_ids, [lp.logprob for lp in out.logprobs] if out.logprobs else None)
    return _REFERENCE[key]


def make_engine(tmp: str, faults: FaultInjector, write_policy: str = "write_through", prefetch: bool = True) -> Engine:
    config = EngineConfig(model="tiny", device="cpu", dtype="float32", num_pages=24, page_size=PAGE,
                          decode_reserve_ratio=0.2, max_new_tokens_limit=64)
    return Engine(config.with_hicache(enable=True, transfer_backend="torch", policy="always", host_ratio=0.5,
                                      storage_ratio=4.0, storage_path=os.path.join(tmp, "l3.bin"),
                                      write_policy=write_policy, prefetch=prefetch, io_timeout_s=0.1),
                  faults=faults)


class Tracked:
    """A request the machine submitted, with every event read from its queue."""

    def __init__(self, req, prompt, kind, max_tokens) -> None:
        self.req, self.prompt, self.kind, self.max_tokens = req, prompt, kind, max_tokens
        self.events: list = []
        self.checked = False
        self.stopped = False  # aborted by a caller's stop condition (Engine.abort(stop=True))


prompts = st.builds(prompt_of, st.integers(0, len(BASES) - 1), st.integers(0, 6), st.integers(0, len(TAILS) - 1))


class EngineMachine(RuleBasedStateMachine):
    """Rules drive an Engine's async API from a loop of the machine's own, run between rules."""

    @initialize(write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
                prefetch=st.booleans())
    def setup(self, write_policy, prefetch):
        self.tmp = tempfile.mkdtemp(prefix="hicache-s71-")
        self.loop = asyncio.new_event_loop()
        self.faults = FaultInjector()
        self.eng = make_engine(self.tmp, self.faults, write_policy, prefetch)
        self.tracked: list[Tracked] = []
        self._hold_gates()
        self._run(self.eng.start())

    def _hold_gates(self) -> None:
        """Device <-> host copies and L3 writes complete only while their gate is open (`hold`): on the CPU
        they complete as enqueued, so without a gate no op would be pending while requests come and go."""
        self.copy_gate, self.write_gate = None, None
        transfer, store = self.eng.cache.transfer, self.eng.cache.store
        wait, write_pages = transfer.wait, store.write_pages

        async def held_wait(tr):
            gate = self.copy_gate
            if gate is not None:
                await gate.wait()
            return await wait(tr)

        def held_write_pages(*args, **kwargs):
            inner, gate = write_pages(*args, **kwargs), self.write_gate
            if gate is None:
                return inner
            outer = cf.Future()

            def relay():
                gate.wait(HANG_GUARD_S)
                try:
                    outer.set_result(inner.result())
                except BaseException as exc:  # noqa: BLE001  (relayed as the store raised it)
                    outer.set_exception(exc)
            threading.Thread(target=relay, daemon=True).start()
            return outer
        transfer.wait, store.write_pages = held_wait, held_write_pages

    def _release_gates(self) -> None:
        if self.copy_gate is not None:
            self.copy_gate.set()
        if self.write_gate is not None:
            self.write_gate.set()
        self.copy_gate = self.write_gate = None

    def _run(self, coro):
        return self.loop.run_until_complete(asyncio.wait_for(coro, HANG_GUARD_S))

    def _read_events(self) -> None:
        for t in self.tracked:
            while not t.req.queue.empty():
                t.events.append(t.req.queue.get_nowait())

    async def _until(self, predicate) -> None:
        while not predicate():
            await asyncio.sleep(0.001)

    # -- rules ---------------------------------------------------------------------------------
    @rule(burst=st.lists(st.tuples(prompts, st.sampled_from(KINDS), st.sampled_from([24, 12, 4, 1])),
                         min_size=1, max_size=3), abort_after=st.one_of(st.none(), st.integers(0, 12)))
    def submit(self, burst, abort_after):
        """One to three requests queued at once (prompt, kind of params, max_tokens); abort_after: the last of them
        is aborted after that many loop iterations."""
        async def add(prompt, kind, max_tokens):
            return self.eng.add_request(list(prompt), params_of(kind, max_tokens))
        for prompt, kind, max_tokens in burst:
            self.tracked.append(Tracked(self._run(add(prompt, kind, max_tokens)), prompt, kind, max_tokens))
        if abort_after is not None:
            self.run_a_bit(abort_after)
            self._run(self.eng.abort(self.tracked[-1].req.rid))

    @rule(index=st.integers(-3, 100), stop=st.booleans())
    def abort(self, index, stop):
        """A live request aborted (index < 0: among the newest), or ended by its caller's stop condition."""
        live = [t for t in self.tracked if not t.req.state.done]
        if live:
            t = live[index % len(live)]
            t.stopped |= stop
            self._run(self.eng.abort(t.req.rid, stop=stop))

    @rule(index=st.integers(0, 100))
    def abort_restoring(self, index):
        """A request aborted while it waits for its restore or prefetch, or runs beside its overlapped restore."""
        live = [t for t in self.tracked if not t.req.state.done and (
            t.req.state is RequestState.PARKED or t.req.restore_op or t.req.prefetch_op or t.req.overlap_op)]
        if live:
            self._run(self.eng.abort(live[index % len(live)].req.rid))

    @rule(steps=st.integers(1, 12))
    def run_a_bit(self, steps):
        """Each pending task advances by (at most) one await per step."""
        for _ in range(steps):
            self.loop.run_until_complete(asyncio.sleep(0))

    @rule(batches=st.integers(1, 4))
    def run_batches(self, batches):
        """Let a few batches run (or every request end, or 0.2 s pass: a gate may hold them), I/O threads
        landing meanwhile."""
        stats, eng = self.eng.stats, self.eng
        goal = stats["batches"] + batches
        with contextlib.suppress(asyncio.TimeoutError):
            self.loop.run_until_complete(asyncio.wait_for(
                self._until(lambda: stats["batches"] >= goal or not eng.requests), 0.2))

    @rule(fault=st.sampled_from(FAULTS), times=st.sampled_from([1, 1, 2, 3]), slow=st.booleans())
    def inject(self, fault, times, slow):
        """The next cache operation(s) of that kind fail; a slow read or checksum takes 0.02 s or (slow) more
        than io_timeout_s."""
        delay = (0.2 if slow else 0.02) if fault in (Fault.SLOW_READ, Fault.SLOW_VERIFY) else 0.0
        self.faults.arm(fault, times=times, delay_s=delay)

    @rule(copies=st.booleans(), writes=st.booleans())
    def hold(self, copies, writes):
        """Hold the completions of the device <-> host copies and/or L3 writes from now on."""
        if copies and self.copy_gate is None:
            self.copy_gate = asyncio.Event()
        if writes and self.write_gate is None:
            self.write_gate = threading.Event()

    @rule()
    def release(self):
        self._release_gates()

    @rule(index=st.integers(0, 100))
    def corrupt_l3_page(self, index):
        """A published L3 page's bytes flip: its next read fails its checksum."""
        slots = [p for node in self.eng.cache.tree.iter_nodes() for p in (node.pages[Tier.L3] or ())]
        if slots:
            flip_l3_byte(self.eng.cache, slots[index % len(slots)])

    @rule(tier=st.sampled_from([Tier.L1, Tier.L2, Tier.L3]))
    def flush(self, tier):
        """An operator's flush of one tier (what no request holds goes; write_back saves L1 pages first)."""
        async def flush():
            return self.eng.cache.flush(tier)
        self._run(flush())

    @rule(when=st.integers(0, 3))
    def restart_loop(self, when):
        """(One time in four: it empties the engine) stop_loop() (the running requests finish, the queued stay)
        then start() again, as each generate() call does; the gates open first (stop_loop waits for them)."""
        if when:
            return
        self._release_gates()
        self._run(self.eng.stop_loop())
        self._run(self.eng.start())

    @rule(when=st.integers(0, 3))
    def quiet(self, when):
        """(One time in four: it empties the engine) wait until every request ended and the cache drained."""
        if not when:
            self._quiet()

    def _quiet(self) -> None:
        eng = self.eng
        self._release_gates()
        self._run(self._until(lambda: not eng.requests))
        self._run(eng.cache.drain())
        self._read_events()
        assert_nothing_queued(eng)
        assert_whole(eng.cache)
        for t in self.tracked:
            if not t.checked:
                self._check_output(t)
        fresh = (99, 98, 97, 96, 95)

        async def serve():
            return await eng.generate_async([list(fresh)], params_of("plain", 3))
        [out] = self._run(serve())
        assert out.error is None and out.output_ids == reference(fresh, "plain", 3)[0]
        self._run(eng.cache.drain())
        assert_whole(eng.cache)

    def _check_output(self, t: Tracked) -> None:
        t.checked = True
        req = t.req
        assert req.state is not RequestState.FAILED, (req.finish_reason, req.error)
        tokens = [ev.token_id for ev in t.events if not ev.finished]
        want, want_lps = reference(t.prompt, t.kind, t.max_tokens)
        assert tokens == req.output
        if req.state is RequestState.FINISHED and not (t.stopped and req.finish_reason == "stop"):
            assert tokens == want, (t.prompt, t.kind, t.max_tokens)
        else:
            assert tokens == want[: len(tokens)], (t.prompt, t.kind, t.max_tokens)
        if want_lps is not None:
            got = [ev.logprobs.logprob for ev in t.events if not ev.finished]
            assert got == pytest.approx(want_lps[: len(got)], abs=1e-3)

    # -- checks --------------------------------------------------------------------------------
    @invariant()
    def integrity(self):
        if not hasattr(self, "eng"):
            return
        eng = self.eng
        assert crash_of(eng._loop_task) is None, crash_of(eng._loop_task)
        eng.check_integrity()
        assert "driver" not in eng.cache.metrics.failures
        for req in list(eng.waiting) + eng.running + eng.parked:
            assert eng.requests.get(req.rid) is req, f"{req.rid} queued but not listed"
        for rid, req in eng.requests.items():
            assert not req.state.done, f"{rid} ended ({req.state}) but still listed"
        self._read_events()
        for t in self.tracked:
            last = [i for i, ev in enumerate(t.events) if ev.finished]
            if t.req.state.done:
                assert last == [len(t.events) - 1], f"{t.req.rid} ended with last events at {last}"
                assert t.req.rid not in eng.requests
            else:
                assert not last, f"{t.req.rid} live ({t.req.state}) after its last event"

    def teardown(self):
        if not hasattr(self, "eng"):
            return
        try:
            self.faults.disarm()
            if sys.exc_info()[0] is None:  # (after a failed step the engine may hang: shrinking would wait on it)
                self._quiet()
            else:
                self._release_gates()
        finally:
            try:
                self._run(self.eng.shutdown())
            finally:
                self.loop.close()
                shutil.rmtree(self.tmp, ignore_errors=True)


def test_engine_state_machine():
    hunt = bool(os.environ.get("HICACHE_ENGINE_STATEFUL_HUNT"))  # (random seeds: a hunt by hand)
    run_state_machine_as_test(EngineMachine, settings=settings(
        max_examples=int(os.environ.get("HICACHE_ENGINE_STATEFUL_EXAMPLES", "100")),
        stateful_step_count=int(os.environ.get("HICACHE_ENGINE_STATEFUL_STEPS", "50")),
        deadline=None, derandomize=not hunt, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
