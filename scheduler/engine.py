"""The serving engine: one asyncio loop that admits requests, restores or recomputes their prefixes,
and runs prefill and decode batches over the paged L1 pool.

    tick:  settle aborts and parked restores  ->  form a batch (prefill first, else decode)
           ->  launch it on the device  ->  await its tokens (restores and I/O progress meanwhile)
           ->  post-process: stream tokens, publish prefixes, finish requests

In-process API: `await engine.start()`, `async for ev in engine.submit(prompt, params)`, `await engine.abort(rid)`,
`engine.status()`, `await engine.shutdown()`; and the synchronous `Engine(...).generate(prompts, params)` for
batches (scheduler/batch_api.py). Only from the thread whose loop ran `start()`: nothing here is thread-safe.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

import structlog
import torch

from hicache.faults import FaultInjector
from hicache.manager import CacheManager
from scheduler import step_extras
from scheduler.admission import Admission
from scheduler.batch_api import BatchAPI
from scheduler.config import EngineConfig, resolve_device
from scheduler.cuda_graphs import capture_graphs
from scheduler.logs import OccupancyLog, configure_logging, info_enabled
from scheduler.memory_plan import plan_pools
from scheduler.loop_task import check_loop, crash_of, fail_live_requests, join_loop
from scheduler.model import load_model
from scheduler.guided import Guides
from scheduler.presets import model_config_of
from scheduler.request import (Request, RequestError, RequestState, SamplingParams,
                               TokenEvent, enqueue, kv_tokens)
from scheduler.runner import Batch, ModelRunner, PendingSample, SimRunner
from scheduler.sampling import seeded_generator

log = structlog.get_logger("scheduler.engine")

class Engine(BatchAPI):
    def __init__(self, config: EngineConfig | None = None, faults: FaultInjector | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.log_json or not structlog.is_configured():
            configure_logging(config.log_json)
        self.device, self.dtype = resolve_device(config)
        if self.device.type == "cpu" and config.cpu_threads > 0:
            torch.set_num_threads(config.cpu_threads)
        if config.simulate:
            self.model, self.model_config = None, model_config_of(config.model)
            self.model_id = f"{config.model}:simulated"
        else:
            self.model, self.model_config, self.model_id = load_model(config.model, self.device, self.dtype,
                                                                      config.seed)
            self.model.skinny = self.model.fused and config.small_gemm == "triton"
        page_size = config.page_size_on(self.device.type)
        geometry = self.model_config.kv_geometry(page_size, self.dtype)
        num_pages, hc = plan_pools(config, self.device, self.model_config, geometry, self.model_id)
        self.cache = CacheManager(geometry, num_pages, self.device, hc, faults=faults, simulate=config.simulate)
        self.cache.wakeup = self.wake_soon
        self.cache.defer_backups = True  # a step's tokens reach their clients before its backups start
        self.cache.wakeup_idle = self._wake_idle
        self.page_size = page_size
        self.held_l1_pages = 0  # L1 pages taken for good at start (usable_l1_pages)
        self.runner = (SimRunner(self.model_config.vocab_size) if config.simulate
                       else ModelRunner(self.model, self.cache.l1.kv, page_size, self.device,
                                        spin_wait=config.gpu_wait == "spin"))
        transfer = self.cache.transfer
        if config.restore_overlap and not config.simulate and transfer is not None and transfer.layerwise:
            self.runner.layer_flags = transfer.layer_flags  # None on the CPU: copies are synchronous
        if self.device.type == "cuda" and config.cuda_graphs and not config.simulate:
            capture_graphs(self)
        self.admission = Admission(self)
        self.guides = Guides(config.model, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.parked: list[Request] = []
        self.running: list[Request] = []      # admitted: PREFILL (chunked) or DECODE
        self.requests: dict[str, Request] = {}
        self.aborting: set[str] = set()  # rids aborted, ended at the next tick (admission and pricing skip them)
        self._stops: set[str] = set()  # of those, the ones a caller's stop condition ended (`abort`)
        self._wake: asyncio.Event | None = None
        self._end_chain = False  # set by wake_soon, not by _wake_idle: a decode chain stops for it
        self._loop_task: asyncio.Task | None = None
        self.stopping = False  # the loop is asked to stop: nothing more is admitted (a restart clears it)
        self._closing = False  # shutdown() began: no new requests ever; queued ones run within its grace
        self._batch_id = 0
        self._overlap_counted_ns = 0  # restore_overlapped_s counts decode time up to here (chained spans overlap)
        self.last_batch_seqs = 0  # sequences in the last batch that ended (Restoring.score_outcome)
        self._log_occupancy = OccupancyLog(self.cache.tree.allocators)  # after batches, at stops
        self.stats = {"batches": 0, "prefill_tokens": 0, "decode_tokens": 0, "finished": 0, "aborted": 0,
                      "failed": 0, "chained_steps": 0, "restore_overlaps": 0, "restore_waits_timed_out": 0}

    def hold_l1_page(self, label: str) -> int:
        """Take one L1 page for good (before any request): requests are sized without it. Refuses the last one
        (regression: a one-page L1 with CUDA graphs started, then refused every request for want of a page)."""
        if self.usable_l1_pages <= 1:
            raise ValueError(f"an L1 pool of {self.cache.l1.num_pages} page(s) leaves none for requests once "
                             f"{label!r} holds one: give --num-pages >= {self.held_l1_pages + 2}"
                             + (" or --disable-cuda-graphs" if label == "cuda-graph-scratch" else ""))
        alloc = self.cache.l1.allocator
        page = alloc.alloc(1, alloc.new_claim(label))[0]
        self.held_l1_pages += 1
        return page

    # -- public API ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def usable_l1_pages(self) -> int:
        """L1 pages requests can have: the pool less pages held for good (the CUDA graphs' scratch)."""
        return self.cache.l1.num_pages - self.held_l1_pages

    @property
    def max_kv_tokens(self) -> int:
        """Tokens of K/V one request may hold (`validate`): its L1 pages, within the model's positions."""
        return min(self.usable_l1_pages * self.page_size, self.model_config.max_position_embeddings)

    @property
    def max_prompt_tokens(self) -> int:
        """--max-prompt-tokens within `max_kv_tokens` (regression: the L1 pool alone; a prompt past the
        model's positions but within the pool was refused by a second check with another message)."""
        return min(self.config.max_prompt_tokens or self.max_kv_tokens, self.max_kv_tokens)

    def validate(self, prompt: Sequence[int], params: SamplingParams) -> None:
        if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
            kind = "" if isinstance(prompt, (list, tuple)) else f", got a {type(prompt).__name__}"
            hint = " (convert it with .tolist())" if hasattr(prompt, "tolist") else ""
            raise RequestError(f"prompt must be a non-empty list of token ids{kind}{hint}")
        vocab = self.vocab_size
        if set(map(type, prompt)) != {int} or min(prompt) < 0 or max(prompt) >= vocab:  # C-speed scans
            bad = next(t for t in prompt if type(t) is not int or not 0 <= t < vocab)
            if type(bad) is not int:  # (regression: np.int64(1) was said to be outside the vocabulary)
                raise RequestError(f"token id {bad!r} is a {type(bad).__name__}, not an int: a prompt is a list "
                                   "of Python ints (convert an array with .tolist())")
            raise RequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        params.validate(self.config.max_new_tokens_limit, vocab)
        if params.priority and self.config.scheduling_policy != "priority":  # (vLLM's refusal)
            raise RequestError(f"priority {params.priority} needs --scheduling-policy priority", "priority")
        if self.config.simulate:
            step_extras.refuse_without_logits(params)
        if params.guided is not None:
            self.guides.check(params.guided)  # (its grammar compiles, once per spec)
        if len(prompt) > self.max_prompt_tokens:
            raise RequestError(f"prompt of {len(prompt)} tokens exceeds the limit of {self.max_prompt_tokens}")
        kv = kv_tokens(len(prompt), params.max_tokens)
        positions = self.model_config.max_position_embeddings
        # the field to lower: max_tokens where the prompt alone (one new token) would fit
        fits_alone = -(-len(prompt) // self.page_size) <= self.usable_l1_pages and len(prompt) <= positions
        param = "max_tokens" if fits_alone else None
        if kv > positions:  # past the positions it was trained for
            raise RequestError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) - 1 exceeds the model's "
                               f"{positions} positions (max_position_embeddings)", param)
        need_pages = -(-kv // self.page_size)
        if need_pages > self.usable_l1_pages:
            raise RequestError(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) - 1 needs {need_pages} pages; the L1 "
                f"pool has {self.usable_l1_pages} pages of {self.page_size} tokens for requests", param)

    async def start(self) -> None:
        """Start the loop (submit() and generate_async() call this); a no-op once shutdown() began:
        a shut-down engine stays down, and add_request refuses (regression: a request submitted
        while shutdown drained, or after it, restarted the loop on closed tiers)."""
        if self._closing:
            return
        check_loop(self._loop_task, asyncio.get_running_loop())
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self.stopping = False
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None,
                    rid: str | None = None) -> Request:
        """Queue a request (raises RequestError on bad input; nothing else is affected)."""
        if not self.accepting:
            raise RequestError("the engine is shutting down")
        if (crash := crash_of(self._loop_task)) is not None:  # (regression: queued where nothing ran it)
            raise RequestError(f"the engine loop crashed ({crash!r}); start() runs a new one")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):  # (regression: a dict raised AttributeError out of generate())
            raise RequestError(f"params must be a SamplingParams, got a {type(params).__name__}")
        self.validate(prompt, params)
        req = Request(prompt=list(prompt), params=params, **({"rid": rid} if rid else {}))
        if req.rid in self.requests:
            raise RequestError(f"duplicate request id {req.rid!r}")
        if params.seed is not None:
            req.generator = seeded_generator(params.seed, self.device)
        req.queue, req.guide = asyncio.Queue(), self.guides.start(params.guided)
        req.arrival_batch = self.stats["batches"]
        self.requests[req.rid] = req
        enqueue(self.waiting, req)
        self.log_event(req, "queued", prompt_tokens=len(req.prompt), priority=params.priority)
        try:
            self.admission.maybe_prefetch(req)
        except BaseException as exc:
            # the caller is told it failed: it must not stay queued, to run later or hold up an
            # idle check, nor keep a read it started (regression: a shared L3's hint task, which
            # needs a running loop, raised outside one and left the request queued)
            self.waiting.remove(req)
            self.requests.pop(req.rid, None)
            self.admission.drop_ops(req, aborting=set())
            self.admission.release(req, publish=False)
            # nor stay queued in the log (regression: the timeline showed it running to the run's end)
            self.log_event(req, "failed", output_tokens=0, reason="error", error=f"not queued: {exc!r}")
            raise
        self.wake_soon()
        return req

    async def submit(self, prompt: Sequence[int], params: SamplingParams | None = None,
                     rid: str | None = None) -> AsyncIterator[TokenEvent]:
        """Stream a request's tokens; the last event has finished=True. Closing the iterator early
        (a client went away) aborts the request and frees its pages."""
        await self.start()
        req = self.add_request(prompt, params, rid)
        try:
            while True:
                ev = await req.queue.get()
                yield ev
                if ev.finished:
                    return
        finally:
            if not req.state.done:
                await self.abort(req.rid)

    async def abort(self, rid: str, stop: bool = False) -> bool:
        """End a live request (False for an unknown or ended one). A parked request, in no batch, ends
        now; others at the loop's next tick (regression: a request aborted while the loop waited for
        its blocking restore was admitted after it, prefilled and sent a token before it ended).
        stop: the caller's own stop condition ended it (an API stop string): a decoding request FINISHES ("stop") and
        publishes what it computed, as a stop token would (regression: counted as aborted, its answer's
        KV left out of the prefix cache)."""
        req = self.requests.get(rid)
        if req is None or req.state.done:
            return False
        if stop:
            self._stops.add(rid)
        if req.state is RequestState.PARKED:
            self._end_aborted(req)
            return True
        self.aborting.add(rid)
        self.wake_soon()
        if self._loop_task is None or self._loop_task.done():
            self._settle_aborts()
        return True

    async def stop_loop(self) -> None:
        """Stop admitting, let the running requests finish, end the loop task and drain the
        operations in flight; waiting and parked requests stay queued (`start()` resumes them)."""
        check_loop(self._loop_task, asyncio.get_running_loop())
        if self._loop_task is not None:
            self.stopping = True
            self.wake_soon()
            await join_loop(self._loop_task, shield=True)
            self._loop_task = None
            self.stopping = False
        await self.cache.drain()
        self._log_occupancy()

    @property
    def accepting(self) -> bool:
        """Whether add_request takes new requests (False once shutdown() or stop_loop() began)."""
        return not (self._closing or self.stopping)

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Take no new requests; let the ones already queued or running finish within `grace_s`, abort
        the rest, drain every transfer and close the tiers (a temporary L3 file is removed); a shared L3's
        backups first finish within what is left of `grace_s` (`Backups.save_for_others`). The grace also
        runs a loop that stop_loop() ended or that never started, for the requests queued. (Regressions:
        queued requests were not admitted in the grace, then aborted after it; or aborted at once; a
        shutdown cancelled in the grace left the loop running and the tiers open.)"""
        check_loop(self._loop_task, asyncio.get_running_loop())  # (else: closed tiers under a loop that runs on)
        if grace_s > 0 and self._loop_task is None and (self.waiting or self.parked):
            await self.start()  # (not after a crash: that loop failed them all; a no-op once closing)
        self._closing = True
        deadline = time.monotonic() + grace_s
        try:
            while ((self.running or self.waiting or self.parked) and time.monotonic() < deadline
                   and self._loop_task is not None and not self._loop_task.done()):
                await asyncio.sleep(0.01)
            self._abort_all()
            if self._loop_task is not None:
                await join_loop(self._loop_task, shield=False)  # re-raises a loop crash; we still clean up
            self._settle_aborts()
            await self.cache.runner.save_for_others(deadline - time.monotonic())  # (a shared L3's pages)
        finally:
            if self._loop_task is not None and not self._loop_task.done():  # (cancelled in the grace)
                self._abort_all()
                await asyncio.wait([self._loop_task])
                crash_of(self._loop_task)  # (a crash now was logged: taken, not raised; the cancel goes on)
            self._loop_task = None
            self._settle_aborts()
            await self.cache.drain(cancel=True)
            self._log_occupancy()
            await self.cache.close()
            self.runner.close()

    def _abort_all(self) -> None:
        """Stop: the loop admits nothing more and ends once every live request was aborted."""
        self.stopping = True
        self.aborting.update(rid for rid, req in self.requests.items() if not req.state.done)
        self.wake_soon()

    def status(self) -> dict:
        s = self.cache.status()
        s["engine"] = {"model": self.config.model, "model_id": self.model_id, "device": str(self.device),
                       "dtype": str(self.dtype).removeprefix("torch."), "page_size": self.page_size,
                       "waiting": len(self.waiting), "parked": len(self.parked), "running": len(self.running),
                       **self.stats}
        return s

    def metrics(self) -> dict:
        return self.cache.metrics.as_dict()

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    # -- loop ----------------------------------------------------------------------------------
    def wake_soon(self) -> None:
        """Something may be runnable (a request, an abort, a finished restore): the next tick
        re-plans, and a decode chain in progress stops to let it."""
        self._end_chain = True
        if self._wake is not None:
            self._wake.set()

    def _wake_idle(self) -> None:
        """Wake a loop that is waiting with nothing to run; a decode chain goes on."""
        if self._wake is not None:
            self._wake.set()

    def log_event(self, req: Request, state: str, **fields) -> None:
        """One line of a request's timeline (scheduler/timeline.py reads them back)."""
        if info_enabled():
            log.info("request", rid=req.rid, state=state, **fields)

    async def _loop(self) -> None:
        try:
            await self._ticks()
        except Exception as exc:
            # a bug must not leave clients waiting forever: fail every live request, then re-raise
            log.exception("engine_loop_crashed")
            fail_live_requests(self, exc)
            raise

    async def _ticks(self) -> None:
        while True:
            self._wake.clear()
            self._end_chain = False
            self._settle_aborts()
            if self.stopping and not self.running:
                return  # (nothing is admitted while stopping: waiting and parked requests stay as they are)
            self.admission.settle_parked()
            self.admission.settle_overlaps()
            batch = await self.admission.prefill_batch()
            if batch is None:
                batch = self.admission.decode_batch()
            if batch is None:
                # (stopping: this tick may have ended the last running request, e.g. an overlapped
                # restore's adopted by settle_overlaps; regression: it then waited for a wake-up that
                # never came, and stop_loop() hung)
                if not (self.aborting or self._wake.is_set() or (self.stopping and not self.running)):
                    await self._wake.wait()
                continue
            await self._run(batch)

    async def _run(self, work: Batch) -> None:
        if work.binput.is_decode and self.config.overlap_schedule:
            await self._run_decode_chain(work)
            return
        start_ns, restoring = time.monotonic_ns(), self.cache.pending_restores() > 0
        handle = self._launch(work)
        if work.binput.wait_restore:
            self.admission.restore_launched(work)
        next_ids = await self.runner.collect(handle)
        step_extras.keep_logprobs(self.runner, work.reqs, work.binput, handle, next_ids)
        await asyncio.sleep(0)  # on the CPU nothing above yields: let streams and aborts run
        if work.binput.wait_restore:
            work, next_ids = self.admission.after_overlapped_forward(work, next_ids)
        self._after_batch(work, next_ids, start_ns, restoring)

    async def _run_decode_chain(self, work: Batch) -> None:
        """Decode with overlap scheduling: while step N runs on the device, step N+1 of the requests
        that will surely continue is enqueued with its input ids taken from step N's sampled ids on
        the device; only then are N's tokens awaited and processed. A request that ends at step N (a
        stop token, an abort) has its step N+1 result discarded (after_step ignores finished
        requests). The chain ends when anything else wants the loop: a new or returning request, an
        abort, a finished restore (`wake_soon`; a finished write-through backup makes nothing
        runnable and does not end it), or a request that needs a page it cannot get."""
        start_ns, restoring = time.monotonic_ns(), self.cache.pending_restores() > 0
        handle = self._launch(work)
        while True:
            nxt = None if self._end_chain or self.stopping else self.admission.chain_decode_batch(work.reqs)
            next_handle = None
            if nxt is not None:
                rows = [work.reqs.index(r) for r in nxt.reqs]
                next_start_ns, next_restoring = time.monotonic_ns(), self.cache.pending_restores() > 0
                next_handle = self._launch(nxt, chain=(handle, rows))
                self.stats["chained_steps"] += 1
            next_ids = await self.runner.collect(handle)
            step_extras.keep_logprobs(self.runner, work.reqs, work.binput, handle, next_ids)
            await asyncio.sleep(0)
            self._after_batch(work, next_ids, start_ns, restoring)
            self._settle_aborts()
            if nxt is None:
                return
            if isinstance(next_handle, PendingSample):  # its guided rows' masks: from the tokens just processed
                next_handle = self._sample(nxt, next_handle)
            work, handle, start_ns, restoring = nxt, next_handle, next_start_ns, next_restoring

    def _launch(self, work: Batch, chain=None):
        if chain is not None and any(r.guide is not None for r in work.reqs):  # (scheduler/guided.py)
            # its guided rows' masks need the step before it processed: its forward now, its sampling at `_sample`
            return self.runner.launch(work.binput, chain=chain, defer_sample=True)
        step_extras.ask(work.reqs, work.binput, self.model_config.eos_token_ids)  # logprobs, penalties: where asked
        return self.runner.launch(work.binput, chain=chain)

    def _sample(self, work: Batch, pending: PendingSample):
        """A deferred step's sampling (`_launch`), its extras asked now that the host has every token."""
        step_extras.ask(work.reqs, work.binput, self.model_config.eos_token_ids)
        return self.runner.sample(pending, work.binput)

    def _after_batch(self, work: Batch, next_ids: list[int], start_ns: int, restoring: bool) -> None:
        reqs, chunks, binput = work
        self._batch_id += 1
        self.last_batch_seqs = len(binput.new_lens)
        end_ns = time.monotonic_ns()
        self.stats["batches"] += 1
        if info_enabled():
            kind = "decode" if binput.is_decode else "prefill"
            # (new_lens: reqs is empty for a forward whose output waits for its restore; regression:
            # logged as a batch of no sequence)
            log.info("batch", batch_id=self._batch_id, kind=kind, num_seqs=len(binput.new_lens),
                     num_tokens=len(binput.input_ids), start_ns=start_ns, end_ns=end_ns)
            self._log_occupancy()
        if binput.is_decode:
            self.stats["decode_tokens"] += len(reqs)
            if restoring:  # (a chained step starts before the one before ends: count each instant once)
                since_ns = max(start_ns, self._overlap_counted_ns)
                self.cache.metrics.restore_overlapped_s += max(0, end_ns - since_ns) / 1e9
                self._overlap_counted_ns = max(self._overlap_counted_ns, end_ns)
        else:
            self.stats["prefill_tokens"] += len(binput.input_ids)
            # one forward over an uncached tail, also behind an overlapped restore (then it is what
            # a restore's tail really costs, copy included): these samples give the recompute model
            # its intercept, without which a full prefill's fixed cost would count as a restore's saving
            # (binput: reqs is empty while such a restore is unsettled); not one that also made its prompt
            # rows' logits (prompt logprobs: eager, and slower)
            if len(binput.new_lens) == 1 and binput.prompt_logprobs is None:
                self.cache.observe_prefill(len(binput.input_ids), (end_ns - start_ns) / 1e9)
        step_extras.fail_broken_bans(self, work, next_ids)  # (before its tokens are taken: a row with none left)
        for req, chunk, token in zip(reqs, chunks, next_ids):
            self.admission.after_step(req, chunk, token)

    # -- finishing -----------------------------------------------------------------------------
    def _settle_aborts(self) -> None:
        """End the requests aborted since the last tick; each stays in `aborting` until all have
        ended, so that none keeps another's restore going for its sake (`Restoring.drop_ops`)."""
        for rid in list(self.aborting):
            req = self.requests.get(rid)
            if req is not None and not req.state.done:
                self._end_aborted(req)
        self.aborting.clear()
        self._stops.clear()

    def _end_aborted(self, req: Request) -> None:
        stop = req.rid in self._stops
        self._stops.discard(req.rid)
        if stop and req.state is RequestState.DECODE:
            self.finish(req, RequestState.FINISHED, "stop")
        else:
            self.finish(req, RequestState.ABORTED, "abort")

    def finish(self, req: Request, state: RequestState, reason: str, error: str | None = None) -> None:
        """End the request: cancel its restore or prefetch, publish what it computed (only when
        FINISHED), free its private pages, release its locks and send its last event. Pages freed
        here may still be written by a chained decode step in flight: safe because every later
        user of an L1 page is enqueued after it on the compute stream (or on a transfer stream
        that waits for it)."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.parked:
            self.parked.remove(req)
        self.admission.drop_ops(req, aborting=self.aborting)
        self.admission.release(req, publish=state is RequestState.FINISHED)
        req.state, req.finish_reason, req.error = state, reason, error
        req.finish_s, req.penalty_state = time.perf_counter(), None  # (its device tensors go now, not with the Request)
        self.stats[state.value] += 1  # (finished / aborted / failed)
        if req.overlap_op is not None:
            # it ends before taking over the restore its forward ran behind: that admission's hits
            # never count (Restoring.adopt_restored), so its log says it was discarded (regression:
            # the timeline kept the hits of its prefill_start, which the metrics never counted)
            self.log_event(req, "restore_overlap_discarded", restore_failed=False)
        self.log_event(req, state.value, output_tokens=len(req.output), reason=reason, error=error)
        req.emit(TokenEvent(req.rid, None, len(req.output), finished=True, finish_reason=reason, error=error))
        self.requests.pop(req.rid, None)
        if self.waiting or self.running:  # its pages may let one of them on: a loop about to sleep plans again
            self._wake_idle()
