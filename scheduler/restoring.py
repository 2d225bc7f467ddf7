"""Where a queued request's prefix comes from besides L1, for `Admission` (scheduler/admission.py,
which mixes this in): L3 prefetches started at queue time, restores that park a request until
their pages land, and restores overlapped with the request's tail forward (an L2 restore landing
layer by layer under it, or an L3 prefetch taken on to L1 while its checksums run) whose output
counts only once the restore has published its pages."""
from __future__ import annotations

import asyncio
import time

import structlog

from hicache.ops import OpKind, OpState
from hicache.radix import Tier
from hicache.restores import L3_READS, RESTORE_KINDS
from scheduler import load
from scheduler.request import Request, RequestState, enqueue

log = structlog.get_logger("scheduler.engine")


class Restoring:
    """Mixin of `Admission`: prefetches, parked restores and overlapped restores. Uses the host's engine, cache,
    page_size, reserved_pages, fallback_end_tokens, `_reusable`, `_pages_after`, `release` and `after_step`."""

    _hints_deferred = False  # some queued request's hint refresh or prefetch waits for a running loop

    def maybe_prefetch(self, req: Request) -> None:
        """Start an L3 -> L2 promotion as soon as a request is queued (for a shared L3, after
        refreshing the tree's hints of what the store holds; the request waits for that refresh)."""
        if self.cache.store is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            # queued outside a running loop, as add_request allows with every backend (the loop that
            # runs it admits it: generate()'s own, or start()'s): the refresh or prefetch starts on that
            # loop's next plan (`start_deferred_hints`), before admission (regressions: a bare
            # RuntimeError, with Redis; with a file L3 too, its read held L2 pages no driver freed)
            req.hint_deferred = self._hints_deferred = True
            return
        if getattr(self.cache.store, "content_addressed", False):
            req.hint_task = loop.create_task(self._refresh_then_prefetch(req))
            return
        self._prefetch(req)

    def start_deferred_hints(self) -> None:
        """On the running loop: start the hint refreshes and prefetches of requests queued outside one."""
        if not self._hints_deferred:
            return
        self._hints_deferred = False
        for req in self.engine.waiting:
            if req.hint_deferred:
                req.hint_deferred = False
                self.maybe_prefetch(req)

    async def _refresh_then_prefetch(self, req: Request) -> None:
        try:
            await self.cache.refresh_l3_hints(self._reusable(req))
        except Exception as exc:  # a store that cannot answer only costs the hint
            log.warning("l3_hint_refresh_failed", rid=req.rid, error=repr(exc))
            self.cache.metrics.count_failure("hint_refresh")
        else:
            try:  # (a raise here is the prefetch's, a bug, not the store's: it costs no hint_refresh failure)
                self._prefetch(req)
            except Exception:
                log.exception("l3_prefetch_failed", rid=req.rid)
        finally:
            self.engine.wake_soon()

    def _prefetch(self, req: Request) -> None:
        cache = self.cache
        if req.state.done or not (cache.has_l3 and cache.config.prefetch and cache.config.policy != "never"):
            return  # (done: it ended while its hints were fetched)
        tokens = self._reusable(req)
        m = cache.tree.match(tokens, include_storage=True, touch=False)
        l1, l2, l3 = m.lengths
        # a prefetch whose request would run alone takes its H2D on under the tail's forward
        # (_take_landed): the same credit on the H2D as an overlapped L2 restore's, and its
        # checksums wait for the landing rather than slow it
        overlap = self._may_overlap(req, l3, alone=not self.engine.running,
                                    budget=self.engine.config.max_prefill_tokens)
        if l3 <= max(l1, l2) or cache.runner.restore_in_flight(tokens, m, req.rid, L3_READS, through=l3):
            return  # (another request's read brings all of it: admission waits for that)
        decision = cache.decide(m, overlap_h2d=overlap, l3_taken_on=overlap, lookahead=True,
                                **load.pricing(self.engine, req, m))
        if decision.tier != "l3":
            return
        req.prefetch_op = cache.runner.start_restore(tokens, m, "prefetch", req.rid, take_soon=overlap)
        if req.prefetch_op is not None:
            req.promote(l2, l3)  # served from L3 when this request later restores from L2
            self._plan(req, "l3", decision, req.prefill_len - l3)

    def drop_ops(self, req: Request, aborting: set[str]) -> None:
        """A request ends: cancel its restore and prefetch, and a restore it followed whose own request
        ended before, unless another live request waits for it (regression: an aborted request's read
        was cancelled under the requests parked on it, which then read the same pages again); cancel
        its L3 hint query (regression: it outlived the request, and shutdown, and its timeout counted
        as a store failure). `aborting`: ids of requests ending with it (none waits)."""
        if req.hint_task is not None and not req.hint_task.done():
            req.hint_task.cancel()
        for op in (req.restore_op, req.prefetch_op, req.follow_op):
            if op is None or op.done or op.payload.get("cancel"):
                continue
            if self._op_wanted(op, req, aborting):
                self.cache.runner.start_checks(op)  # (held for a take-on by `req`: none will come)
            else:
                self.cache.runner.cancel(op)

    def _op_wanted(self, op, req: Request, aborting: set[str]) -> bool:
        """Whether a live request other than `req`, and not being aborted with it, waits for `op`:
        its own request, one parked on it, or one queued that will (admission follows a read in
        flight rather than start its own: the first page `op` brings is that request's next)."""
        def other(r) -> bool:
            return r is not None and r is not req and not r.state.done and r.rid not in aborting

        if other(self.engine.requests.get(op.request_id) if op.request_id is not None else None):
            return True
        if any(other(r) and r.follow_op is op for r in self.engine.parked):
            return True
        theirs = op.payload.get("tokens")
        if theirs is None or not self.engine.waiting:
            return False
        start = min(op.payload.get("l1_start", len(theirs)), op.payload.get("l2_start", len(theirs)))
        upto = min(start + self.page_size, len(theirs))  # (starts are page aligned)
        return any(other(r) and r.prefill_len > upto and tuple(r.cache_prefill[:upto]) == theirs[:upto]
                   for r in self.engine.waiting)

    def _plan(self, req: Request, source: str, decision, uncached_tokens: int) -> None:
        """Note the path the request's prefix takes if it comes from `source`: what its restore was
        priced from and the tokens left to compute (priced at the first token, `score_outcome`). The
        first plan per source stands: a prefetch's read started at queue time."""
        if req.span_plan is not None and source not in req.span_plan:
            req.span_plan[source] = (decision.priced if decision is not None else (), uncached_tokens)

    def score_outcome(self, req: Request) -> None:
        """At the first token: a request that ran alone since it arrived (one batch ended since, its
        own, of one sequence) teaches the cost model what its prefix source cost end to end."""
        eng, plan = self.engine, req.span_plan
        if not plan or eng.stats["batches"] != req.arrival_batch + 1 or eng.last_batch_seqs != 1:
            return
        source = "l3" if req.hit_tokens["l3"] else "l2" if req.hit_tokens["l2"] else "l1"
        if set(plan) == {source}:  # (else its path changed on the way: a prefetch it did not use)
            self.cache.observe_outcome(source, plan[source], time.perf_counter() - req.arrival_s)

    def settle_parked(self) -> None:
        """Parked requests whose restore (or prefetch, or the op they follow) ended go back to the
        queue (`_requeue`); so does, once, a request whose prefetch's read landed (it may take it on
        to L1, `_take_landed`)."""
        for req in list(self.engine.parked):
            op = req.restore_op or req.prefetch_op or req.follow_op
            if op is not None and not op.done:
                if op is req.prefetch_op and op.state is OpState.S2H_LANDED and not req.landed_offered:
                    req.landed_offered = True
                    self.engine.parked.remove(req)
                    self._give_back_room(req)  # (its take-on counts the room anew)
                    req.state = RequestState.WAITING
                    self._requeue(req)
                continue
            self._unpark(req, op)

    def _requeue(self, req: Request) -> None:
        """Put `req` back in the queue in admission order (`request.enqueue`: by priority, then arrival;
        regression: put at the head, a request parked again after a later one, its prefetch's read seen
        landed and not taken on, went back behind it when both ops ended, and the later one was admitted
        first and restored what its read had brought)."""
        enqueue(self.engine.waiting, req)

    def _unpark(self, req: Request, op) -> None:
        """The op `req` was parked on ended: back to the queue (`_requeue`). After a failed restore
        it recomputes, except after an L3 restore whose read landed in L2 but whose H2D found no L1
        room (`l1_room_lost`): it decides again (an L2 restore now, once there is room, as for any
        request whose L2 restore lacks room; regression: the read's pages sat in L2 while it
        recomputed the whole prefix)."""
        self.engine.parked.remove(req)
        self._give_back_room(req)
        if op is not None and not op.succeeded:  # (regression: a follower's wait for a failed read was scored)
            req.span_plan = None  # a failed restore, prefetch or followed read: not what its source costs
        if op is req.restore_op and op is not None and not op.succeeded:
            req.restore_failed = not op.payload.get("l1_room_lost", False)
            if req.restore_failed:
                self._fell_back(req, len(op.payload["tokens"]))
            else:  # (what its read brought is scored as L3, as a prefetch's is)
                req.promote(op.payload["l2_start"], op.payload["l3_end"])
            req.hit_tokens.update(l2=0, l3=0)
            req.restore_tier = "none"
        if op is req.prefetch_op and op is not None:
            self.prefetch_ended(req)
        if op is req.follow_op and op is not None:
            self._followed(req, op)
        req.restore_op = req.prefetch_op = req.follow_op = None  # (a follower decides afresh)
        req.state = RequestState.WAITING
        self._requeue(req)

    def _followed(self, req: Request, op) -> None:
        """The op `req` followed ended. If it was another request's L3 read whose pages are now in
        L2 (it succeeded, or only its H2D lacked L1 room), the part of `req`'s prefix it promoted is
        scored as L3 when `req` restores it from L2, as for a prefetch of its own (regression: a
        follower first in the queue restored them and counted an L2 hit, the leader an L1 hit, and
        no one the L3 read). Its wait for that read is priced in no plan of its own."""
        if op.kind not in L3_READS or not (op.succeeded or op.payload.get("l1_room_lost", False)):
            return
        theirs, mine = op.payload["tokens"], self._reusable(req)
        shared = 0
        for a, b in zip(theirs, mine):
            if a != b:
                break
            shared += 1
        shared -= shared % self.page_size
        end = min(op.payload["l3_end"], shared)
        if end > op.payload["l2_start"]:
            req.promote(op.payload["l2_start"], end, keep_longer=True)
            req.span_plan = None

    def prefetch_ended(self, req: Request) -> None:
        """The request's prefetch ended. A failed one promoted nothing for it, and its path (and
        so the plan it was priced by) is not the one the request takes now."""
        op = req.prefetch_op
        if not op.succeeded:
            req.promoted_tokens = 0
            req.span_plan = None
            self._fell_back(req, op.payload["l3_end"])
        req.prefetch_op = None

    def _fell_back(self, req: Request, end_tokens: int) -> None:
        """A restore or prefetch of `req`'s, to bring its prefix up to `end_tokens`, failed or could
        not start: a fallback if `req` is admitted computing part of that (`Admission._admit`), not
        if it restores it after all (regression: counted at once, also when the request waited and
        was restored; or, counted by the failed op, when it then read the prefix from L3 itself)."""
        self.fallback_end_tokens[req.rid] = max(end_tokens, self.fallback_end_tokens.get(req.rid, 0))

    def _park(self, req: Request, room_pages: int = 0) -> None:
        """room_pages: L1 pages the H2D after its L3 read will take, kept out of what later requests
        are admitted on (`reserved_pages`) until the request is back in the queue (regression: a
        parked read reserved nothing, requests admitted meanwhile took the room, and the read's H2D
        found none, `l1_room_lost`, or its request waited for all of them to finish)."""
        req.state = RequestState.PARKED
        self.engine.waiting.remove(req)
        self.engine.parked.append(req)
        req.reserved_pages += room_pages
        self.reserved_pages += room_pages
        self.fallback_end_tokens.pop(req.rid, None)  # (a restore, its own or one it follows, brings it)
        self.engine.log_event(req, "parked", restore_tier=req.restore_tier, room_pages=room_pages)

    def _give_back_room(self, req: Request) -> None:
        """The room a parked request kept for its read's H2D (`_park`) goes back."""
        self.reserved_pages -= req.reserved_pages
        req.reserved_pages = 0

    def _l1_room_pages(self) -> int:
        """L1 pages a request could still reserve: free or evictable, less what others reserved."""
        return self.cache.available_l1_pages() - self.reserved_pages

    def _room_beside(self, handle) -> int:
        """`_l1_room_pages` with the L1 prefix at `handle` kept (it is no room: its user holds it)."""
        self.cache.lock(handle)
        try:
            return self._l1_room_pages()
        finally:  # (a raise crashes the loop: the lock must not outlive it)
            self.cache.unlock(handle)

    def _read_room_pages(self, req: Request, end_tokens: int) -> int:
        """L1 pages a request parked on its prefetch keeps for the H2D of its prefix up to
        `end_tokens` (that H2D starts at its L1 hit): as many as no running request or other parked
        read has reserved, up to what it needs."""
        cache = self.cache
        m = cache.tree.match(self._reusable(req)[:end_tokens], include_storage=False, touch=False)
        room = self._room_beside(m.handles[Tier.L1])  # (the H2D keeps that prefix)
        return max(0, min((end_tokens - m.lengths[Tier.L1]) // self.page_size, room))

    async def _try_restore(self, req: Request, m, alone: bool, budget: int) -> str | None:
        """Start a restore if the cost model says so. Returns "parked" (the request waits for it),
        "overlapped" (admitted now: its tail forward runs behind the layer-ordered copy), "ended"
        (a blocking restore ended: the request is back in the queue, to be admitted now), "wait"
        (its L1 room is on its way: the request waits, as for memory) or None."""
        cache, ps = self.cache, self.page_size
        if not cache.has_l2 or req.restore_failed:
            return None
        # overlap: an L2 restore of a request that runs alone in this batch and whose tail is one
        # forward (and, below, whose every page can be reserved now: its forward starts before the
        # copy ends) lands layer by layer under that forward
        may_overlap = self._may_overlap(req, m.lengths[Tier.L2], alone, budget)
        # the restore takes L1 pages only out of what no running request reserved (regression: a
        # decode later found no page), and the overlap's credit is priced only where the restore and
        # its tail's pages fit now (regression: one priced as overlapped was parked, its H2D whole)
        room = self._room_beside(m.handles[Tier.L1])
        l2_end = m.lengths[Tier.L2]
        may_overlap = may_overlap and (l2_end - m.lengths[Tier.L1]) // ps + self._pages_after(req, l2_end) <= room
        decision = cache.decide(m, overlap_h2d=may_overlap, count_skip=False, **load.pricing(self.engine, req, m))
        # a policy skip counts once, as the request is admitted (Admission._admit): waiting for
        # memory it is decided again on every loop turn (regression: each turn counted a skip)
        req.restore_declined = cache.declines_restore(m, decision)
        if decision.tier not in ("l2", "l3"):
            return None
        # another request's restore or prefetch brings (part of) the same pages: wait for it, then
        # decide again, rather than copy them a second time (`OpRunner.restore_in_flight`); for an
        # L2 restore only another L2 restore (a storage read is what deciding for L2 declined)
        kinds = (OpKind.RESTORE_L2,) if decision.tier == "l2" else RESTORE_KINDS
        leader = cache.runner.restore_in_flight(self._reusable(req), m, req.rid, kinds)
        if leader is not None:
            req.follow_op = leader
            self._park(req)
            return "parked"
        # (an L2 restore of a longer L3 hit ends at L2: its forward computes the rest; regression:
        # planned with the L3 end, the gap was learned as the L2 source's overhead)
        end = l2_end if decision.tier == "l2" else max(m.lengths[Tier.L2], m.lengths[Tier.L3])
        restore_l1_pages = (end - m.lengths[Tier.L1]) // ps
        if restore_l1_pages > room:
            return None
        overlap = may_overlap and decision.tier == "l2" and restore_l1_pages + self._pages_after(req, end) <= room
        op = cache.runner.start_restore(self._reusable(req), m, decision.tier, req.rid, layerwise=overlap,
                                        tail_tokens=req.prefill_len - end)
        if op is None:
            if cache.l1_room_coming():  # backups copy the leaves it would evict: restore once copied
                return "wait"  # (regression: it recomputed a prefix L2 held)
            self._fell_back(req, end)  # (a fallback only if it is admitted without it now)
            return None
        req.restore_op, req.restore_tier = op, decision.tier
        req.restore_l1_start = m.lengths[Tier.L1]
        l1, l2, l3 = m.lengths
        # an L3 restore reads [max(l1, l2), l3); what L2 already held comes from there
        from_l3 = l3 - max(l1, l2) if decision.tier == "l3" else min(req.promoted_in(l1, end), decision.restore_tokens)
        # (an L2 restore of what this request's prefetch promoted is scored as that prefetch's L3 hit)
        self._plan(req, "l3" if from_l3 else decision.tier, decision, req.prefill_len - end)
        req.hit_tokens.update(l3=from_l3, l2=decision.restore_tokens - from_l3)
        if op.payload.get("layerwise"):
            self._admit_overlapped(req, m, op)
            return "overlapped"
        # an L3 restore's H2D allocates once its read landed: its room is kept until then (an L2
        # restore's pages are its own from the start)
        self._park(req, restore_l1_pages if op.kind is OpKind.RESTORE_L3 else 0)
        if not cache.config.prefetch:  # blocking restore: the whole loop waits for it
            await cache.runner.wait_op(op)
            # an overlapped restore that ended meanwhile published its pages unlocked: its request
            # locks them now, before this one is admitted on room that counted them as evictable
            # (regression: both were admitted on those pages, and one failed, "no KV page available")
            self.settle_overlaps()
            # ... and its request goes on now, ahead of those queued behind it, which evicted its
            # unlocked restored pages (regression: it recomputed its prefix); unless aborted or
            # stopping: parked till then (regression: prefilled, sent a token, then aborted)
            eng = self.engine
            if req.state is RequestState.PARKED and req.rid not in eng.aborting and not eng.stopping:
                self._unpark(req, op)
                return "ended"
        return "parked"

    def _may_overlap(self, req: Request, cached_tokens: int, alone: bool, budget: int) -> bool:
        """Whether a restore up to `cached_tokens` could land layer by layer under the request's
        tail forward: overlap on, layer-ordered copies here, the request alone in its batch and
        its tail one forward (the caller still checks that every page can be reserved)."""
        return (alone and self.engine.config.restore_overlap and getattr(self.cache.transfer, "layerwise", False)
                and req.prefill_len - cached_tokens <= budget)

    def _take_landed(self, req: Request, alone: bool, budget: int) -> bool:
        """`_take_on`; a landed prefetch this request does not take on starts its checksums now
        (they wait for the forward's launch when it does: `restore_launched`)."""
        op = req.prefetch_op
        if self._take_on(req, alone, budget):
            return True
        if op.state is OpState.S2H_LANDED:
            self.cache.runner.start_checks(op)
        return False

    def restore_launched(self, work) -> None:
        """The forward of a request admitted behind its restore was launched: a taken-on prefetch's
        checksums may start (their threads would have slowed the take-on and the launch)."""
        for req in work.reqs:
            self.cache.runner.start_checks(req.overlap_op)

    def _take_on(self, req: Request, alone: bool, budget: int) -> bool:
        """Admit a request whose prefetch's read has landed but is still being verified, with the
        prefetch taken on to L1 (OpRunner.take_to_l1) and its tail forward overlapped with that
        H2D; like `_try_restore`'s overlap, only for a request alone in its batch whose tail is one
        forward and whose every page can be reserved now. The forward's output counts only if the
        checksums pass (`adopt_restored`). False: the request stays parked on the prefetch."""
        cache, ps, op = self.cache, self.page_size, req.prefetch_op
        if op.state is not OpState.S2H_LANDED or not self._may_overlap(req, op.payload["l3_end"], alone, budget):
            return False
        m = cache.match(self._reusable(req))
        end = op.payload["l3_end"]
        room = self._room_beside(m.handles[Tier.L1])
        if (end - m.lengths[Tier.L1]) // ps + self._pages_after(req, end) > room:
            return False
        if not cache.runner.take_to_l1(op, m, tail_tokens=req.prefill_len - end):
            return False
        req.prefetch_op, req.restore_op, req.restore_tier = None, op, "l3"
        from_l3 = end - op.payload["l2_start"]
        req.hit_tokens.update(l3=from_l3, l2=end - m.lengths[Tier.L1] - from_l3)
        self._admit_overlapped(req, m, op)
        return True

    # -- restores overlapped with the tail forward ---------------------------------------------
    def _admit_overlapped(self, req: Request, m, op) -> None:
        """Admit a request whose prefix is still landing: its page table takes the restore's pages
        (private to the op until it publishes them) and its forward waits layer by layer on the
        device. Until `adopt_restored` its lock stays on the L1 hit it had before the restore."""
        eng, cache = self.engine, self.cache
        end = op.payload["l1_end"]
        self.fallback_end_tokens.pop(req.rid, None)  # (its restore brings it)
        cache.note_hit(self._reusable(req), m)
        eng.waiting.remove(req)
        req.claim = cache.new_claim(req.rid)
        cache.lock(m.handles[Tier.L1])  # (with its claim, as `Admission._admit` locks)
        req.pages = list(m.pages[Tier.L1]) + list(op.payload["l1_pages"])
        req.locked_len, req.locked_node = m.lengths[Tier.L1], m.handles[Tier.L1]
        req.cached_len = end
        req.hit_tokens["l1"] = m.lengths[Tier.L1]
        req.reserved_pages = self._pages_after(req, end)
        self.reserved_pages += req.reserved_pages
        req.overlap_op = op
        cache.runner.hold_published(op)  # (its pages stay locked from their publication to `adopt_restored`)
        req.rng_state = req.generator.get_state() if req.generator is not None else None
        eng.stats["restore_overlaps"] += 1
        req.state = RequestState.PREFILL
        eng.running.append(req)
        req.scheduled_s = req.scheduled_s or time.perf_counter()
        eng.log_event(req, "prefill_start", prompt_tokens=req.prefill_len, hit_l1=req.hit_tokens["l1"],
                   hit_l2=req.hit_tokens["l2"], hit_l3=req.hit_tokens["l3"], restore_tier=req.restore_tier,
                   restore_tokens=req.hit_tokens["l2"] + req.hit_tokens["l3"], restore_overlap=True)

    def after_overlapped_forward(self, work, next_ids: list[int]):
        """The forward that ran behind a layer-ordered restore is done (so are its copies, on the
        device). Its output counts only once the op has published the pages: now if it has, else
        held in the request and applied by `settle_overlaps` (the loop never waits for an op).
        Returns the (work, next_ids) to post-process now."""
        [req], [chunk], binput = work
        # a layer wait that gave up (kernels/layer_flags.py) means this forward may have read KV
        # that had not landed: its output is dropped and the tail runs again once the op is done
        result = (chunk, next_ids[0])
        if self.engine.runner.restore_wait_timed_out():
            self.engine.stats["restore_waits_timed_out"] += 1
            result = None
            self._undo_draw(req)
        if req.overlap_op is not None and not req.overlap_op.done:
            req.overlap_result = result
            return work._replace(reqs=[], chunk_tokens=[]), []
        if not self.adopt_restored(req) or result is None:
            return work._replace(reqs=[], chunk_tokens=[]), []
        return work, next_ids

    def settle_overlaps(self) -> None:
        """Requests whose overlapped restore ended since their forward: keep or discard its output."""
        for req in [r for r in self.engine.running if r.overlap_op is not None and r.overlap_op.done]:
            result, req.overlap_result = req.overlap_result, None
            if self.adopt_restored(req) and result is not None:
                self.after_step(req, *result)

    def adopt_restored(self, req: Request) -> bool:
        """The restore ended: move the request's lock onto the published prefix (its pages must be
        the ones the forward read) and count the hit; else put the request back in the queue."""
        op, req.overlap_op = req.overlap_op, None
        if op is None:
            return True
        # the op held its published pages for this request since it ended (Restores.hold_published):
        # they are this request's lock's from here, or no one's
        cache = self.cache
        if req.state.done:  # aborted meanwhile: finish() already released everything
            cache.runner.release_held(op)
            cache.runner.drop_suspect_again(op)
            return False
        req.restore_op = None
        ps, end = self.page_size, op.payload["l1_end"]
        if op.succeeded:
            m = cache.tree.match(self._reusable(req)[:end], include_storage=False)
            # another request may have published the same prefix first: the op's pages were then
            # duplicates (freed), and this forward read pages the tree does not hold
            if m.lengths[Tier.L1] == end and list(m.pages[Tier.L1]) == req.pages[: end // ps]:
                cache.lock(m.handles[Tier.L1])
                cache.runner.release_held(op)
                cache.unlock(req.locked_node)
                req.locked_node, req.locked_len = m.handles[Tier.L1], end
                for tier in ("l1", "l2", "l3") if not req.resumed_tokens else ():  # (as `_admit`)
                    cache.metrics.hit_tokens[tier] += req.hit_tokens[tier]
                return True  # (the tail's forward counts its recomputed tokens once kept: `after_step`)
        cache.runner.release_held(op)
        self._rewind(req, failed=not op.succeeded, end_tokens=end)
        cache.runner.drop_suspect_again(op)  # (a restore stopped as suspect: the head it locked goes now)
        return False

    @staticmethod
    def _undo_draw(req: Request) -> None:
        """An overlapped forward's token is dropped: so is what it drew from the request's generator."""
        if req.generator is not None and req.rng_state is not None:
            req.generator.set_state(req.rng_state)

    def _rewind(self, req: Request, failed: bool, end_tokens: int = 0) -> None:
        self._undo_draw(req)
        eng = self.engine
        eng.running.remove(req)
        self.release(req, publish=False, zero=failed)  # (failed: its K/V came of what the copy landed: NaN)
        if failed:
            self._fell_back(req, end_tokens)
        req.pages, req.cached_len, req.locked_len, req.overlap_result = [], 0, 0, None
        req.restore_failed = req.restore_failed or failed
        req.span_plan = None  # its forward ran and was dropped: not what its source costs
        req.hit_tokens.update(l1=0, l2=0, l3=0)
        req.restore_tier = "none"
        req.state = RequestState.WAITING
        self._requeue(req)
        eng.log_event(req, "restore_overlap_discarded", restore_failed=failed)
