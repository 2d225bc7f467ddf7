"""The engine's lifecycle and its requests', mixed into the Engine: starting and stopping the loop
task (`start`, `stop_loop`, `shutdown`), a request queued (`add_request`, `submit`), aborted
(`abort`, settled at the loop's next tick by `_settle_aborts`) and ended (`finish`: its pages,
locks and last event). Uses the Engine's request queues (`waiting`, `parked`, `running`,
`requests`), `admission`, `cache`, `stats` and the loop's `_loop`, `_wake` and `wake_soon`
(scheduler/engine_loop.py)."""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence

import structlog

from scheduler.logs import restore_logging
from scheduler.loop_task import check_caller, check_loop, crash_of, end_broken, join_loop
from scheduler.request import Request, RequestError, RequestState, SamplingParams, TokenEvent, enqueue
from scheduler.sampling import seeded_generator


class EngineLifecycle:
    async def start(self) -> None:
        """Start the loop (submit() and generate_async() call this); a no-op once shutdown() began:
        a shut-down engine stays down, and add_request refuses (regression: a request submitted
        while shutdown drained, or after it, restarted the loop on closed tiers). A stop_loop() under way
        ends first, then a new loop starts (regression: one started in its last await was orphaned by it, and
        two loops ran the same requests' batches); a loop still stopping after its stop_loop()'s caller was
        cancelled runs on (regression: start() did nothing, and the requests queued were stranded). Not in a process
        forked from the one that built it (regression: its L3's I/O threads are not there, and it hung)."""
        if os.getpid() != self._pid:
            raise RuntimeError("this Engine was built in another process (this one was forked from it): its copy "
                               "threads and L3 file are that process's; build the Engine in this process, or use the "
                               "'spawn' start method")
        check_loop(self._loop_task, asyncio.get_running_loop())  # (first: a stop on another loop is not awaited here)
        await self._stop_ended()
        if self._closing:
            return
        check_loop(self._loop_task, asyncio.get_running_loop())
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self.stopping = False
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())
            # (its end read as it ends: a crash the loop logged, an interrupt that went out of the event loop; else
            # asyncio added "Task exception was never retrieved" as the task was collected: regression)
            self._loop_task.add_done_callback(crash_of)
        elif self.stopping:
            self.stopping = False
            self.wake_soon()

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None,
                    rid: str | None = None, continuing: bool = False) -> Request:
        """Queue a request (raises RequestError on bad input; nothing else is affected). continuing: the next
        request of a client counted in `continuing` (a beam search's step), taken in a shutdown's grace too
        (regression: a search under way was cut short by a grace it would have finished within)."""
        check_caller(self._loop_task)  # (only from the loop's own thread: nothing here is thread-safe)
        if not self.accepting and not (continuing and self._closing and not self.stopping):
            raise RequestError(("the engine has shut down" if self._shut_down else "the engine is shutting down")
                               if self._closing else
                               "the engine loop is stopping (stop_loop); start() resumes it")
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
        try:
            self.log_event(req, "queued", prompt_tokens=len(req.prompt), priority=params.priority)
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
        its blocking restore was admitted after it, prefilled and sent a token before it ended). Refused from
        another event loop than the loop task's (regression: taken from another thread, its wake-up, a thread-unsafe
        Event.set, was missed, and a parked request was ended there under the running loop).
        stop: the caller's own stop condition ended it (an API stop string): a decoding request FINISHES ("stop") and
        publishes what it computed, as a stop token would (regression: counted as aborted, its answer's
        KV left out of the prefix cache). A parked request whose end raises still ends, failed (`end_broken`, as
        `_settle_aborts` ends one), before the error is raised (regression: left half-ended, out of the parked list
        but PARKED, with no last event: its read's landing unparked it and crashed the loop)."""
        check_loop(self._loop_task, asyncio.get_running_loop())
        req = self.requests.get(rid)
        if req is None or req.state.done:
            return False
        if stop:
            self._stops.add(rid)
        if req.state is RequestState.PARKED:
            try:
                self._end_aborted(req)
            except Exception as exc:
                end_broken(self, req, f"ending the aborted request raised: {exc!r}")
                raise
            return True
        self.aborting.add(rid)
        self.wake_soon()
        if self._loop_task is None or self._loop_task.done():
            self._settle_aborts()
        return True

    async def stop_loop(self, cancel_ops: bool = False) -> None:
        """Stop admitting, let the running requests finish, end the loop task and drain the
        operations in flight; waiting and parked requests stay queued (`start()` resumes them). A crashed
        loop's error is raised after the drain (regression: raised before it, leaving the backups of the
        requests before the crash in flight; `generate()`'s loop then ended and cancelled them).
        cancel_ops: the drain drops the backups queued and asks the live ops to stop (`CacheManager.drain`)."""
        check_loop(self._loop_task, asyncio.get_running_loop())
        await self._stop_ended()  # (one at a time)
        self._stop_done = done = asyncio.get_running_loop().create_future()
        try:
            if self._loop_task is not None:
                self.stopping = True
                self.wake_soon()
                try:
                    await join_loop(self._loop_task, shield=True)
                except BaseException:
                    if crash_of(self._loop_task) is None:  # (this caller cancelled: the loop stops on)
                        raise
                    # crashed, not stopping: add_request names the crash (regression: it said "stopping
                    # (stop_loop)" for good, and `accepting` stayed False); also of a KeyboardInterrupt raised
                    # in it (regression: the drain was skipped, and the aborts' settling left to a closing loop
                    # stayed pending for good: every later drain raised on a closed loop's task)
                    self.stopping = False
                    await self.cache.drain(cancel=cancel_ops)
                    raise
                self._loop_task = None
                self.stopping = False
            await self.cache.drain(cancel=cancel_ops)
            self._log_occupancy()
        finally:
            done.set_result(None)

    async def _stop_ended(self) -> None:
        """Wait for a stop_loop() under way on this event loop; one on another is the caller's error, said so."""
        while self._stop_done is not None and not self._stop_done.done():
            if self._stop_done.get_loop() is not asyncio.get_running_loop():
                raise RuntimeError("a stop_loop() on another event loop is under way: the engine serves one loop "
                                   "(one thread) at a time")
            await asyncio.shield(self._stop_done)

    @property
    def loop_stopped(self) -> bool:
        """Whether a stop_loop() ended the loop and no start() began it again (queued requests wait for one)."""
        return self._loop_task is None and self._stop_done is not None

    @property
    def accepting(self) -> bool:
        """Whether add_request takes new requests: False from shutdown() on, and while stop_loop() runs (once it
        returned, requests are queued again, for start() to run)."""
        return not (self._closing or self.stopping)

    async def shutdown(self, grace_s: float = 0.0, release_log: bool = True) -> None:
        """Take no new requests; let the ones already queued or running finish within `grace_s`, abort
        the rest, drain every transfer and close the tiers (a temporary L3 file is removed); a shared L3's
        backups first finish within what is left of `grace_s` (`Backups.save_for_others`). The grace also
        runs a loop that stop_loop() ended, that never started or that an asyncio.run() ending cancelled, for the
        requests left (regression: after that cancel, aborted at once, the running ones too). (Regressions:
        queued requests were not admitted in the grace, then aborted after it; or aborted at once; a
        shutdown cancelled in the grace left the loop running and the tiers open.) Clients under way with
        several requests in turn (`continuing`: a beam search) get the grace too: their next requests are
        taken until it ends. release_log False: the caller lets the --log-json go (`release_logging`) once it
        logged what this raised (the server: its line went to stdout, not the JSON log)."""
        check_loop(self._loop_task, asyncio.get_running_loop())  # (else: closed tiers under a loop that runs on)
        task = self._loop_task
        if (grace_s > 0 and (task is None or task.done() and crash_of(task) is None)
                and (self.running or self.waiting or self.parked)):
            await self.start()  # (not after a crash: that loop failed them all; a no-op once closing)
        self._closing = True
        deadline = time.monotonic() + grace_s

        def grace_left_s() -> float:
            return 0.0 if self._grace_cut else deadline - time.monotonic()
        try:
            while ((self.running or self.waiting or self.parked or self.continuing) and grace_left_s() > 0
                   and self._loop_task is not None and not self._loop_task.done()):
                await asyncio.sleep(0.01)
            self._abort_all()
            if self._loop_task is not None:
                await join_loop(self._loop_task, shield=False)  # re-raises a loop crash; we still clean up
            self._settle_aborts()
            await self.cache.runner.save_for_others(grace_left_s())  # (a shared L3's pages)
        finally:
            if self._loop_task is not None and not self._loop_task.done():  # (cancelled in the grace)
                self._abort_all()
                await asyncio.wait([self._loop_task])
                crash_of(self._loop_task)  # (a crash now was logged: taken, not raised; the cancel goes on)
            self._loop_task = None
            try:
                self._settle_aborts()
                await self.cache.drain(cancel=True)
                self._log_occupancy()
            finally:  # (the tiers close whatever that raised, e.g. the occupancy's line on a full disk)
                try:
                    await self.cache.close()
                finally:  # (and the model's runner whatever the tiers' closing raised: a device error)
                    self.runner.close()
                    self._shut_down = True
                    if release_log:
                        self.release_logging()

    def release_logging(self) -> None:
        """structlog's configuration put back as this engine found it, and the log it opened let go, where the logging
        is still this engine's (regression: its --log-json stayed open and locked for the process's life, one file a
        restart with another log, another process refused it, and a later engine without a log wrote into it)."""
        logging, self._logging = getattr(self, "_logging", None), None
        if logging is None:
            return
        before, factory, processors = logging
        now = structlog.get_config()
        # (not where another's came since: a later engine's log, a test's capture_logs, which swaps the processors)
        if now["logger_factory"] is factory and now["processors"] == processors:
            restore_logging(before)

    def end_grace(self) -> None:
        """End the grace of a shutdown under way, or to come, now: its requests are aborted at once and the backups of
        a kept or shared L3 not waited for; the tiers still close (hicache-serve's forced exit, a second Ctrl-C or
        SIGTERM). Safe from a signal handler (a flag the shutdown's wait reads)."""
        self._grace_cut = True

    def _abort_all(self) -> None:
        """Stop: the loop admits nothing more and ends once every live request was aborted."""
        self.stopping = True
        self.aborting.update(rid for rid, req in self.requests.items() if not req.state.done)
        self.wake_soon()

    # -- finishing -----------------------------------------------------------------------------
    def _settle_aborts(self) -> None:
        """End the requests aborted since the last tick; each stays in `aborting` until all have
        ended, so that none keeps another's restore going for its sake (`Restoring.drop_ops`). One whose end
        raises still gets its last event (failed: `end_broken`), and the others end, before its error is raised
        (regression: it and those after it never ended; with no loop running, their clients waited forever)."""
        errors = []
        # (in arrival order, not the set's, which follows the hash seed: so did the order they published their K/V in,
        # and so which the prefix cache evicted first, from one run of the same requests to the next)
        for rid in [rid for rid in self.requests if rid in self.aborting] if self.aborting else ():
            req = self.requests.get(rid)
            if req is not None and not req.state.done:
                try:
                    self._end_aborted(req)
                except Exception as exc:
                    end_broken(self, req, f"ending the aborted request raised: {exc!r}")
                    errors.append(exc)
        self.aborting.clear()
        self._stops.clear()
        if errors:
            raise errors[0]

    def _end_aborted(self, req: Request) -> None:
        stop = req.rid in self._stops
        self._stops.discard(req.rid)
        if stop and req.output:  # (in decode, or preempted: its tokens so far end at the stop string)
            self.finish(req, RequestState.FINISHED, "stop")
        else:
            self.finish(req, RequestState.ABORTED, "abort")

    def finish(self, req: Request, state: RequestState, reason: str, error: str | None = None) -> None:
        """End the request: cancel its restore or prefetch, publish what it computed (only when
        FINISHED), free its private pages, release its locks and send its last event. Pages freed
        here may still be written by a chained decode step in flight: safe because every later
        user of an L1 page is enqueued after it on the compute stream (or on a transfer stream
        that waits for it)."""
        # its restore's hits were never served where it ends parked, queued or before it took its overlapped
        # restore over: the metrics count them only then (regression: an abort's result reported them)
        unserved = req in self.waiting or req in self.parked or req.overlap_op is not None
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
        if unserved:
            req.hit_tokens.update(l1=0, l2=0, l3=0)
        self.stats[state.value] += 1  # (finished / aborted / failed)
        try:
            if req.overlap_op is not None:
                # it ends before taking over the restore its forward ran behind: that admission's hits
                # never count (Restoring.adopt_restored), so its log says it was discarded (regression:
                # the timeline kept the hits of its prefill_start, which the metrics never counted)
                self.log_event(req, "restore_overlap_discarded", restore_failed=False)
            self.log_event(req, state.value, output_tokens=len(req.output), reason=reason, error=error)
        finally:
            # ended, it gets its last event even when logging that raised (regression: the loop crashed, and
            # fail_live_requests, which skips ended requests, left its client waiting forever)
            req.emit(TokenEvent(req.rid, None, len(req.output), finished=True, finish_reason=reason, error=error))
            self.requests.pop(req.rid, None)
        if self.waiting or self.running:  # its pages may let one of them on: a loop about to sleep plans again
            self.wake_idle()
