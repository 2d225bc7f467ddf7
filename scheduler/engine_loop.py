"""The engine's scheduler loop, mixed into the Engine: one asyncio task whose tick settles aborts and
parked restores, forms a batch, launches it on the device, awaits its tokens and post-processes them
(`_after_batch`); with overlap scheduling, decode steps chain on the device (`_run_decode_chain`). Also
what wakes it (`wake_soon`, `wake_idle`). Forming batches and taking their tokens is the Engine's
`admission` (scheduler/admission.py); ending requests is `finish` / `_settle_aborts`
(scheduler/engine_lifecycle.py).

Which batch: prefill first, else decode; but while requests decode, prefill and decode take turns: after a
prefill batch the next tick decodes first (one step, where prefill work waits), so a decoding request waits at
most one prefill forward (a chunk of --max-prefill-tokens) for its next token. (Regression: decode ran only once
no prefill was left: every chunk of a long prompt stalled it, and a steady stream of short requests starved it.
vLLM V1 puts the decodes' rows in every step's token budget, with no forward of their own; here each turn is one.)"""
from __future__ import annotations

import asyncio
import time

import structlog

from scheduler import step_extras
from scheduler.logs import info_enabled, log_anyway
from scheduler.loop_task import fail_live_requests
from scheduler.request import RequestState
from scheduler.runner import Batch, PendingSample
from scheduler.speculative import rows_of

log = structlog.get_logger("scheduler.engine")


class EngineLoop:
    def wake_soon(self) -> None:
        """Something may be runnable (a request, an abort, a finished restore): the next tick
        re-plans, and a decode chain in progress stops to let it."""
        self._end_chain = True
        if self._wake is not None:
            self._wake.set()

    def wake_idle(self) -> None:
        """Wake a loop that is waiting with nothing to run; a decode chain goes on."""
        if self._wake is not None:
            self._wake.set()

    async def _loop(self) -> None:
        try:
            await self._ticks()
        except asyncio.CancelledError:
            # cancelled from outside (the engine never cancels it): its event loop ends, an asyncio.run() that
            # forgot stop_loop(); its copies in flight settle first, as asyncio.run waits for this task
            # (regression: an L3 write's settling was destroyed with the loop and kept for good: its pages never
            # came back, and every later drain raised ValueError, shutdown's before it closed the L3 file)
            await self.cache.drain(cancel=True)
            # aborts that landed meanwhile (asyncio.run cancels its other tasks too: a stream's closing aborts its
            # request) end now, as a tick would end them; one landing after this task ended is settled by abort()
            # itself (regression: left running, in status() and holding its L1 pages, until some later loop ran)
            if self.aborting:
                try:
                    self._settle_aborts()
                except Exception:  # (each one ended, `end_broken`: the cancellation goes on, not what one raised)
                    log_anyway(log.exception, "aborting_requests_after_loop_cancel_failed")
                await self.cache.drain(cancel=True)  # (what ending them began: a backup of the chunks one published)
            raise
        except Exception as exc:
            # a bug must not leave clients waiting forever: fail every live request, then re-raise (the crash
            # may be the log's own, a full disk: logging it must not stop that)
            log_anyway(log.exception, "engine_loop_crashed")
            fail_live_requests(self, exc)
            raise
        except BaseException:
            # an interrupt landed in the loop's code (a Ctrl-C's KeyboardInterrupt, a SystemExit): the event loop ends
            # with it, and nobody reads the live requests' streams any more: they end aborted, as their callers'
            # cancellation would end them (regression: left listed as running or queued, the next loop ran them to
            # their end for no one, and a caller that caught the interrupt and read on waited forever)
            self.aborting.update(rid for rid, req in self.requests.items() if not req.state.done)
            try:
                self._settle_aborts()
            except Exception:  # (each one ended, `end_broken`: the interrupt goes on, not what ending one raised)
                log_anyway(log.exception, "aborting_requests_after_loop_interrupt_failed")
            raise

    async def _ticks(self) -> None:
        while True:
            self._wake.clear()
            self._end_chain = False
            self._settle_aborts()
            if self.stopping and not self.running and not self._resuming():
                return  # (nothing is admitted while stopping: waiting and parked requests stay as they are)
            self.admission.settle_parked()
            self.admission.settle_overlaps()
            batch = None
            if self._prefill_turn:
                batch = await self.admission.prefill_batch()
            else:
                self.admission.note_load()  # (as a prefill pass does: what this step's backups are admitted by)
            if batch is None:
                batch = self.admission.decode_batch()
                if batch is not None and not self._prefill_turn and self._chunks_wait():
                    self._end_chain = True  # (its turn is one step: a chain would hold the prompt's next chunk off;
                    # a queued request that could be admitted ends a chain itself: Admission.chain_decode_batch)
            if batch is None and not self._prefill_turn:
                batch = await self.admission.prefill_batch()
            # (a prefill's turn is followed by decode's, where a request decodes; decode's by prefill's)
            self._prefill_turn = batch is None or batch.binput.is_decode or batch.binput.verify_drafts is not None
            if batch is None:
                # (stopping: this tick may have ended the last running request, e.g. an overlapped
                # restore's adopted by settle_overlaps; regression: it then waited for a wake-up that
                # never came, and stop_loop() hung)
                if not (self.aborting or self._wake.is_set() or (self.stopping and not self.running
                                                                 and not self._resuming())):
                    await self._wake.wait()
                continue
            await self._run(batch)

    def _resuming(self) -> bool:
        """Whether a request preempted while it ran waits to resume (a stop lets it finish as the running do)."""
        return any(r.resumed_tokens for r in (*self.waiting, *self.parked))

    def _chunks_wait(self) -> bool:
        """Whether a prompt is part-way through its chunked prefill (not waiting for its restore to land)."""
        return any(r.state is RequestState.PREFILL and r.overlap_op is None for r in self.running)

    async def _run(self, work: Batch) -> None:
        if work.binput.is_decode and self.config.overlap_schedule:
            await self._run_decode_chain(work)
            return
        start_ns, restoring = time.monotonic_ns(), self.cache.pending_restores() > 0
        handle = self._launch(work)
        if work.binput.wait_restore:
            self.admission.restore_launched(work)
        next_ids = await self.runner.collect(handle)
        if work.binput.verify_drafts is not None:  # every row's greedy token: per sequence
            next_ids = rows_of(next_ids, work.binput.new_lens, handle.row_stride)
        step_extras.keep_logprobs(self, work.reqs, work.binput, handle, next_ids)
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
                # (by identity, in one pass: a search of the step's list per row was B * B / 2 comparisons a step)
                row_of = {id(r): i for i, r in enumerate(work.reqs)}
                rows = [row_of[id(r)] for r in nxt.reqs]
                next_start_ns, next_restoring = time.monotonic_ns(), self.cache.pending_restores() > 0
                next_handle = self._launch(nxt, chain=(handle, rows))
                self.stats["chained_steps"] += 1
            next_ids = await self.runner.collect(handle)
            step_extras.keep_logprobs(self, work.reqs, work.binput, handle, next_ids)
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
        step_extras.ask_or_fail(self, work)  # logprobs, penalties: where asked
        return self.runner.launch(work.binput, chain=chain)

    def _sample(self, work: Batch, pending: PendingSample):
        """A deferred step's sampling (`_launch`), its extras asked now that the host has every token."""
        step_extras.ask_or_fail(self, work)
        return self.runner.sample(pending, work.binput)

    def fail_own_work(self, req, what: str, exc: Exception) -> None:
        """Fail `req` alone for a raise in work that is its own, not its batch's (its grammar's mask or matcher, its
        penalties', logit_bias', min_tokens' or bans' inputs, its logprobs, its drafts: scheduler/step_extras.py,
        Admission.after_step, the Speculator), its error naming what raised; the others in its step go on, and so
        does the loop (regression: the loop crashed, every live request failed with it, and a server refused every
        later request, 503 "the engine loop failed", until restarted). vLLM fails the one request where it can."""
        log_anyway(log.error, "request_work_failed", rid=req.rid, what=what, exc_info=exc)
        self.cache.metrics.count_failure("request_work")
        self.finish(req, RequestState.FAILED, "error", f"{what} raised {type(exc).__name__}: {exc}")

    def _after_batch(self, work: Batch, next_ids: list[int], start_ns: int, restoring: bool) -> None:
        reqs, chunks, binput = work
        self._batch_id += 1
        self.last_batch_seqs = len(binput.new_lens)
        end_ns = time.monotonic_ns()
        self.stats["batches"] += 1
        if info_enabled():
            kind = "decode" if binput.is_decode else "prefill" if binput.verify_drafts is None else "verify"
            # (new_lens: reqs is empty for a forward whose output waits for its restore; regression:
            # logged as a batch of no sequence)
            log.info("batch", batch_id=self._batch_id, kind=kind, num_seqs=len(binput.new_lens),
                     num_tokens=len(binput.input_ids), start_ns=start_ns, end_ns=end_ns)
            self._log_occupancy()
        policy = self.speculator.policy if self.speculator is not None else None
        if policy is not None and (binput.is_decode or binput.verify_drafts is not None):  # step costs, from the
            # end of the step before (scheduler/draft_policy.py)
            policy.observe_step("decode" if binput.is_decode else "verify", len(binput.new_lens),
                                (end_ns - self._step_end_ns) / 1e9, (end_ns - start_ns) / 1e9,
                                chained=start_ns < self._step_end_ns or not self.config.overlap_schedule)
        self._step_end_ns = end_ns
        if binput.is_decode:
            if restoring:  # (a chained step starts before the one before ends: count each instant once)
                since_ns = max(start_ns, self._overlap_counted_ns)
                self.cache.metrics.restore_overlapped_s += max(0, end_ns - since_ns) / 1e9
                self._overlap_counted_ns = max(self._overlap_counted_ns, end_ns)
        elif binput.verify_drafts is not None:  # its tokens, counted as they are taken (each judged by its bans)
            bans = dict(zip(map(id, reqs), binput.bans)) if binput.bans is not None else {}

            def take(req, chunk: int, token: int, same_step: bool = False) -> None:
                row = bans.get(id(req))  # (a NaN mark, < 0, fails as NaN in after_step)
                if row is None or token < 0 or not step_extras.fail_if_banned(self, req, row, token):
                    self.admission.after_step(req, chunk, token, same_step=same_step)
            taken = self.speculator.after_verify(reqs, binput.verify_drafts, next_ids, take)
            self.stats["decode_tokens"] += taken
            return
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
            kept = len(req.output)
            self.admission.after_step(req, chunk, token)
            if binput.is_decode:  # the tokens kept, as a verify step's (regression: a chained step's rows of
                # requests its step before had ended were counted; so was a token that broke its grammar)
                self.stats["decode_tokens"] += len(req.output) - kept
