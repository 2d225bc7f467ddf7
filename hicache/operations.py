"""Drivers of backup, restore and prefetch operations: `OpRunner` and the machinery they share.

The state machines themselves are data (hicache/ops.py); the drivers (hicache/backups.py,
hicache/restores.py, mixed into `OpRunner` here) do what each Action says and await the copy each
pending state waits for:
  START_x   lock the step's source in its tier, reserve private destination pages, enqueue the copy;
  PUBLISH_x only after the copy completed: hand the destination pages to the tree, unlock the source;
  RELEASE   after FAIL / CANCEL: free only still-private pages, unlock what the op holds.
A copy that was enqueued cannot be recalled, so awaiting it is shielded from cancellation, and an
operation that gives up early (a read past its deadline) keeps its private pages until the copy has
settled. All bookkeeping runs on the loop thread; only copies and file I/O run elsewhere.
Write-through backups that the engine's step processing asks for start once that step's tokens
reached their clients (`backup_soon`), never in the middle of the step.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import structlog

from hicache.backups import Backups
from hicache.cost_policy import observe_transfer
from hicache.log_gate import log_anyway
from hicache.ops import Op, OpEvent, OpKind, apply, new_op
from hicache.radix import Node, Tier
from hicache.restores import Restores
from hicache.storage import StorageError
from hicache.suspect import zero_l1_pages

if TYPE_CHECKING:
    from hicache.manager import CacheManager

log = structlog.get_logger("hicache.ops")

# An enqueue of a few kernels and DMAs takes well under a millisecond; one this slow included a Triton
# JIT compile (a new specialisation of the gather/scatter kernels), which the cost model must not learn
# as a recurring cost (a single stall would make every later restore look too slow to be tried again).
JIT_ENQUEUE_NS = 20_000_000


def learnable(tr) -> bool:
    """Whether a completed transfer is a cost sample: not when its enqueue took JIT_ENQUEUE_NS or
    more, which compiled a kernel (a one-time cost), unless it was copied inside its enqueue (the
    CPU), where a long enqueue is the copy itself (regression: every CPU copy of 20 ms or more was
    dropped, so a slow host link stayed "untimed" and was restored from for good)."""
    return tr.synchronous or tr.enqueue_ns < JIT_ENQUEUE_NS


def _l1_untrusted(op) -> bool:
    """Whether `op`'s private L1 pages may hold NaN and go back zeroed: stopped as suspect (`stop_restores_of`: its H2D
    may have copied NaN into them), or a taken prefetch whose read failed (its H2D copied the unverified bytes)."""
    return op.payload.get("suspect", False) or op.payload.get("unverified_l1", False)


class OpRunner(Backups, Restores):
    def __init__(self, mgr: "CacheManager") -> None:
        self.mgr = mgr
        self.live: dict[int, Op] = {}
        self._tasks: dict[int, asyncio.Task] = {}
        self._settling: set[asyncio.Task] = set()
        # settling ops whose locks wait for their I/O too (`_settle_then_release`): op id -> op
        self._settling_locked: dict[int, Op] = {}
        self._ids = itertools.count(1)
        # keys of the backups in flight, until their L3 write starts (`_l3_writing` then)
        self._backing_up: set[tuple[int, ...]] = set()
        # a backup asked for while one of its prefixes (or a sibling copying a page it would) is
        # being backed up waits for it, so no page is copied (D2H) or written (H2S) twice: in-flight
        # key -> the sequences waiting on it (none a prefix of another: siblings, e.g. two
        # continuations of one prompt, all wait), started when it ends, failed or not, or once its L3
        # write locks its L2 pages (`_start_waiting`)
        self._deferred: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        # backups whose L3 write is in flight: op id -> the tokens it writes (through L2's end), so a
        # sibling's backup about to write a page of them waits for it instead (`_drive_backup`)
        self._l3_writing: dict[int, tuple[int, ...]] = {}
        # write-through backups asked for by the engine's step processing (`backup_soon`), started
        # once the clients of that step's tokens have run
        self._due: list[tuple[int, ...]] = []
        self._due_scheduled = False
        # keys whose last backup failed: under write_back their L1 leaf is evicted unsaved on the next
        # ask instead of vetoed again (regression: while copies kept failing, the veto restarted the
        # backup on every retry and the request that needed the pages never got them)
        # (-> the tree's tick at the failure: a leaf used again since is backed up again; regression)
        # keyed by the id of the L1 node the backup's key ends at (ids are never reused), not by the key: an entry
        # kept no prompt-long token tuple alive (regression, session 58's hunt: under write_back every failed L3
        # write kept its whole key, up to 1,024 of them, ~1.7 GB at qwen3-8b's 40,960-token context, long after
        # the tree dropped the prefix; its node in L2, the veto never read it)
        self._backup_failed: dict[int, int] = {}

    # -- shared helpers ------------------------------------------------------------------------
    def _new(self, kind: OpKind, num_pages: int, request_id: str | None) -> Op:
        op = new_op(next(self._ids), kind, num_pages=num_pages,
                    num_bytes=num_pages * self.mgr.geometry.bytes_per_page, request_id=request_id)
        op.payload.update(locks=[], claims={}, cancel=False)
        return op

    def _lock(self, op: Op, node: Node | None, tier: Tier) -> None:
        if node is None:
            return
        self.mgr.tree.lock(node, tier)
        op.payload["locks"].append((node, tier))

    def _unlock_all(self, op: Op) -> None:
        for node, tier in reversed(op.payload["locks"]):
            self.mgr.tree.unlock(node, tier)
        op.payload["locks"].clear()
        # its last locks went: the suspect prefix they kept goes too (`stop_backups_of`, `stop_restores_of`)
        if op.done:
            for drop in op.payload.get("suspect_drops", ()):
                drop()

    def _claim(self, op: Op, tier: Tier) -> int:
        claim = self.mgr.allocator(tier).new_claim(f"op{op.op_id}:{op.kind.value}")
        op.payload["claims"][tier] = claim
        return claim

    def _close_claim(self, op: Op, tier: Tier) -> None:
        claim = op.payload["claims"].pop(tier, None)
        if claim is not None:
            self._free_claim(claim, tier, _l1_untrusted(op))

    def _free_claim(self, claim, tier: Tier, suspect: bool = False) -> None:
        """Give a claim's pages back. L3 slots freed here must hold nothing readable: a write
        invalidates its slots when submitted and validates them on success, so a backup cancelled
        after its write succeeded (or a duplicate) leaves valid slots behind: invalidated here.
        suspect: the op's L1 pages may hold NaN (`_l1_untrusted`): zeroed, as a dropped suspect prefix's are."""
        slots = self.mgr.allocator(tier).pages_of(claim) if tier is Tier.L3 else []
        if slots and self.mgr.store is not None:
            self.mgr.store.invalidate(slots)
        if suspect and tier is Tier.L1:
            zero_l1_pages(self.mgr, self.mgr.allocator(tier).pages_of(claim))
        self.mgr.release_claim(claim, tier)

    def _publish(self, op: Op, tokens: Sequence[int], tier: Tier, pages: list[int], start: int,
                 keep_claim: bool = False, stamp_from: Tier | None = None) -> None:
        """Hand `pages` (tokens[start:]) to the tree. keep_claim: a copy still reads them, so
        duplicates (pages another op published first) stay the op's until it releases them.
        stamp_from: a backup's source tier, whose last use the pages keep (RadixTree.insert)."""
        claim = op.payload["claims"][tier]
        # duplicates (pages another op published first) stay in the claim: L3 slots invalidated as it is closed
        self.mgr.tree.insert(tokens, tier, pages, claim, start_tokens=start, stamp_from=stamp_from)
        if not keep_claim:
            self._close_claim(op, tier)  # frees duplicates; the op no longer owns the published pages

    def _release(self, op: Op) -> None:
        self._unlock_all(op)
        for tier in list(op.payload["claims"]):
            self._close_claim(op, tier)

    def _not_started(self, op: Op, exc: Exception) -> None:
        """Starting `op` raised before its driver was registered (a copy or read that could not be enqueued,
        an eviction's veto, no running loop, a bug): nothing of it can be awaited, so it ends here, FAILED and
        counted as a driver that raised (`_guard`; a store's refusal, a StorageError, as its kind: a closed file
        L3), its locks and private pages given back, and its caller goes on as for an op not made (a backup is
        skipped, a restore's request recomputes). Regression: the error escaped with the op's locks and pages
        held by no op, for good, and out of admission it crashed the engine loop (every live request failed; a
        prefetch's, out of add_request)."""
        # (a closed FileStore refuses a read as it is submitted, a closed transfer engine a copy: no bug)
        refused = isinstance(exc, StorageError) or getattr(exc, "kind", None) == "closed"
        if not refused:
            log_anyway(log.exception, "op_start_error", op_id=op.op_id, kind=op.kind.value)
        if not op.done:
            apply(op, OpEvent.FAIL, error=f"not started: {exc!r}")
        self._release(op)
        m = self.mgr.metrics
        if op.kind is OpKind.BACKUP:  # (each start counts its op only once it was enqueued)
            m.backups_started += 1
        elif op.kind is OpKind.PREFETCH_L3:
            m.prefetches_started += 1
        else:
            m.restores_started += 1
        m.count_failure(exc.kind if refused else "driver")

    def _register(self, op: Op, coro) -> Op:
        self.live[op.op_id] = op
        task = asyncio.get_running_loop().create_task(self._guard(op, coro))
        task.add_done_callback(lambda t: self._on_task_cancelled(op, coro) if t.cancelled() else self._forget(op))
        # (an interrupt `_guard` let go on, out of the event loop already, is read: else asyncio logged "Task
        # exception was never retrieved" with its traceback as the task was collected, regression)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._tasks[op.op_id] = task
        return op

    def _on_task_cancelled(self, op: Op, coro) -> None:
        """The driver's task itself was cancelled (not op.cancel(), which the driver honours at its
        next step), possibly before it ever ran: end the op and free its pages once the copy it was
        waiting on has settled."""
        coro.close()  # no-op if it ran; otherwise it never will
        if not op.done:
            apply(op, OpEvent.CANCEL, error="driver task cancelled")
            self.mgr.metrics.cancellations += 1
        key = op.payload.pop("backup_key", None)
        if key is not None:  # (a driver that never ran never reached its finally)
            self._backing_up.discard(key)
            self._deferred.pop(key, None)  # (cancelled: the backups waiting for it are dropped)
        self._settle_then_release(op, self._in_flight(op))
        self.live.pop(op.op_id, None)
        self._tasks.pop(op.op_id, None)
        self._wake(op)

    def _wake(self, op: Op) -> None:
        """An op ended (or its pages were freed): wake the engine's loop. Restores and prefetches
        may unblock a parked request: `wakeup` (ends a decode chain, so the request is admitted
        next). A backup unblocks no request at once, only an idle loop waiting for its L1 lock to go:
        `wakeup_idle` (one finished backup per decode step ended every chain and cost batch-32 decode
        its overlap). Under write_back, evictions wait for backups: `wakeup` once its L1 copy is done,
        or as it ends without one (a failed backup's leaf goes unsaved, `write_back_keep`), but not
        after its L3 write, which frees no L1 room (regression: that ended a chain too)."""
        l1_free = op.payload.get("l1_free")
        if op.kind is OpKind.BACKUP and not (self.mgr.write_back and l1_free is not None and not l1_free.done()):
            self.mgr.wakeup_idle()
        else:
            self.mgr.wakeup()

    async def _guard(self, op: Op, coro) -> None:
        try:
            await coro
        except (Exception, KeyboardInterrupt, SystemExit) as exc:
            # a bug in a driver must not leak pages or hang a request; nor a Ctrl-C's KeyboardInterrupt raised in
            # it: the op ends cancelled, as by a cancelled task, and the interrupt goes on (regression: the op was
            # unlisted unended, its locks and pages held for good and check_integrity failing)
            bug = isinstance(exc, Exception)
            if bug:
                # (a line that raises must not skip what follows: regression, the op never ended and a request
                # parked on it waited for good)
                log_anyway(log.exception, "op_driver_error", op_id=op.op_id)
            if not op.done:
                apply(op, OpEvent.FAIL if bug else OpEvent.CANCEL,
                      error=f"driver {'error' if bug else 'interrupted'}: {exc!r}")
            # its pages are freed once a copy or read it enqueued has settled (freed now, a copy
            # still running could write into pages their next owner already uses)
            self._settle_then_release(op, self._in_flight(op))
            if not bug:
                self.mgr.metrics.cancellations += 1
                raise
            self.mgr.metrics.count_failure("driver")
        finally:
            # a cancelled driver stays listed until its done-callback has queued the settling of its
            # pages (regression: a drain starting in between saw neither and returned with them held)
            task = asyncio.current_task()
            if task is None or not task.cancelling():
                self._forget(op)

    def _forget(self, op: Op) -> None:
        """The driver of `op` has ended: unlist it and wake the loop (once)."""
        if self._tasks.pop(op.op_id, None) is not None:
            self.live.pop(op.op_id, None)
            self._wake(op)

    def _fail(self, op: Op, error: str, kind: str) -> None:
        # only write_back's eviction veto reads `_backup_failed` (regression: under the other policies
        # every failed backup's prompt-long key was kept for nothing, up to its cap)
        write_back = self.mgr.write_back
        key = op.payload.get("backup_node") if op.kind is OpKind.BACKUP and write_back else None
        if key is not None:
            self._backup_failed[key] = self.mgr.tree.tick
            if len(self._backup_failed) > 1024:  # (only the latest matter: their leaves are being evicted)
                del self._backup_failed[next(iter(self._backup_failed))]
        apply(op, OpEvent.FAIL, error=error)
        self._release(op)
        # (a request's fallback is counted by the engine, if it then recomputes: Restoring._fell_back)
        self.mgr.metrics.count_failure(kind)

    def _cancelled(self, op: Op) -> bool:
        if op.payload["cancel"] and not op.done:
            apply(op, OpEvent.CANCEL, error="cancelled")
            self._release(op)
            self.mgr.metrics.cancellations += 1
            return True
        return False

    def cancel(self, op: Op | None) -> None:
        """Ask an op to stop at its next step; enqueued copies still settle before pages are freed.
        A read whose checksums wait for a take-on's launch lets them start: none will come."""
        if op is not None and not op.done:
            op.payload["cancel"] = True
            self.start_checks(op)

    async def _wait_transfer(self, op: Op, tr, direction: str) -> None:
        mgr = self.mgr
        inner = op.payload["inflight"] = asyncio.ensure_future(mgr.transfer.wait(tr))
        op.payload["waited"] = tr  # (its completion settles too: `_in_flight`)
        try:
            await asyncio.shield(inner)
        finally:
            if not asyncio.current_task().cancelling():  # cancelled: the task's callback settles it
                op.payload.pop("inflight", None)
                op.payload.pop("waited", None)
        stats = mgr.metrics.directions[direction]
        e2e_s = tr.end_to_end_ns / 1e9
        stats.add(tr.num_bytes, enqueue_s=tr.enqueue_ns / 1e9, setup_s=tr.setup_ns / 1e9,
                  compute_wait_s=tr.compute_wait_ns / 1e9, queue_wait_s=tr.queue_wait_ns / 1e9,
                  seen_wait_s=tr.seen_wait_ns / 1e9, service_s=tr.service_ns / 1e9, end_to_end_s=e2e_s,
                  recurring_s=tr.recurring_ns / 1e9)
        if learnable(tr):
            observe_transfer(mgr, direction, tr.num_bytes, tr.recurring_ns / 1e9)

    async def _wait_landed(self, op: Op, future, deadline_s: float) -> None:
        """Await a verified L3 read's bytes (storage.ReadFuture.landed), not its checksums. Raises
        StorageError for a failed read or past the deadline (the whole read, checksums included,
        then settles before the op's pages are freed: see _storage_failed)."""
        await self._await_io(op, future, future.landed, "s2h", deadline_s)

    async def _wait_io(self, op: Op, future, direction: str, deadline_s: float | None = None,
                       since_ns: int | None = None) -> None:
        """Await an L3 read/write (its end-to-end time counted from `since_ns`, default now). Past
        the deadline the op fails now, but its private pages stay reserved until the I/O settles
        (a late read must not land in reused pages). The deadline counts from `since_ns` too: a prefetch's read waited
        for its landing first, and its checksums got only what was left (regression: a whole deadline again, up to
        twice `io_timeout_s` in all)."""
        t0 = time.monotonic_ns() if since_ns is None else since_ns
        left_s = None if deadline_s is None else max(0.0, deadline_s - (time.monotonic_ns() - t0) / 1e9)
        result = await self._await_io(op, future, future, direction, deadline_s, left_s)
        stats = self.mgr.metrics.directions[direction]
        e2e_s = (time.monotonic_ns() - t0) / 1e9
        # a read verified after its landing (a prefetch about to be taken on) costs the restore its
        # landing: its checksums run under the H2D and the tail's forward (FileStore.read_pages);
        # counted in full, they would teach the model a read slower than the one the restore waits for
        own_ns = result.until_landed_ns or result.service_ns
        recurring_s = (result.queue_wait_ns + own_ns) / 1e9
        stats.add(result.num_bytes, queue_wait_s=result.queue_wait_ns / 1e9,
                  service_s=result.service_ns / 1e9, end_to_end_s=e2e_s, extents=result.num_extents,
                  recurring_s=recurring_s)
        observe_transfer(self.mgr, direction, result.num_bytes, recurring_s)

    async def _await_io(self, op: Op, io, awaited, direction: str, deadline_s: float | None,
                        left_s: float | None = None):
        """Await `awaited` (the I/O future `io`, or its `landed`) with `io` recorded as the op's
        in-flight I/O; past the deadline (`left_s` of it left, default all) raise StorageError("timeout")."""
        fut = asyncio.wrap_future(awaited)
        # left behind (a timeout, a cancelled driver), the settle task awaits the I/O itself: mark
        # this wrapper's late outcome as seen, or a late failure is "Future exception was never retrieved"
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        op.payload["inflight"] = io
        try:
            return await asyncio.wait_for(asyncio.shield(fut), deadline_s if left_s is None else left_s)
        except asyncio.TimeoutError:
            # at least the deadline: learned as such, or a storage that became slower than its
            # deadline would never be timed, and every hit would wait it out before recomputing
            observe_transfer(self.mgr, direction, self._read_bytes(op) if direction == "s2h" else op.num_bytes,
                             deadline_s)
            raise StorageError("timeout", f"{direction} slower than its {deadline_s:.3f} s deadline") from None
        finally:
            if not asyncio.current_task().cancelling():
                op.payload.pop("inflight", None)

    def _in_flight(self, op: Op, *also) -> asyncio.Future | None:
        """What the op has in flight and must see settle before its pages are freed: the I/O or copy
        its driver was awaiting, a copy it enqueued but never awaited (a prefetch taken on to L1
        fails while verifying), and `also`; None when nothing is."""
        pending = [f for f in (op.payload.pop("inflight", None), *also) if f is not None]
        transfer = op.payload.pop("transfer", None)
        if transfer is not None:
            pending.append(asyncio.ensure_future(self.mgr.transfer.wait(transfer)))
        # the copies' completions themselves: an asyncio.run() that ends cancels a task over `wait`, which was taken
        # for the copy's end (regression: pages freed while a DMA, or a fragmented D2H's index copy, ran into them)
        pending += [done for tr in (transfer, op.payload.pop("waited", None))
                    if tr is not None and (done := self.mgr.transfer.completion(tr)) is not None]
        if not pending:
            return None
        return asyncio.gather(*(f if isinstance(f, asyncio.Future) else asyncio.wrap_future(f) for f in pending),
                              return_exceptions=True)

    def _settle_then_release(self, op: Op, future, keep_locks: bool = False) -> None:
        """Hold the op's private pages until its abandoned I/O or copy finished (a concurrent or an
        asyncio future; None: nothing in flight), then free them. keep_locks: its sources' locks too."""
        claims = dict(op.payload["claims"])
        op.payload["claims"].clear()
        if keep_locks:
            self._settling_locked[op.op_id] = op
        else:
            self._unlock_all(op)
        self.start_checks(op)  # a read whose checksums wait for a launch settles only once they ran

        async def settle():
            # its own cancellation (an asyncio.run() that ends cancels every task left) waits for the copy all
            # the same, then goes on (regression: taken for the copy's outcome, the pages were freed at once while
            # an abandoned read still ran into them)
            cancelled = None
            awaited = None if future is None else \
                future if isinstance(future, asyncio.Future) else asyncio.wrap_future(future)
            while awaited is not None and not awaited.done():
                try:
                    await asyncio.shield(awaited)
                except asyncio.CancelledError as exc:
                    cancelled = cancelled or exc
                except BaseException:  # (the copy's failure: it settled)
                    break
            for tier, claim in claims.items():  # (an abandoned L3 write that finished left its slots valid)
                self._free_claim(claim, tier, _l1_untrusted(op))
            if self._settling_locked.pop(op.op_id, None) is not None:
                self._unlock_all(op)
            self._wake(op)
            if cancelled is not None:
                raise cancelled

        task = asyncio.get_running_loop().create_task(settle())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def _storage_failed(self, op: Op, exc: StorageError, future=None, keep_locks: bool = False) -> None:
        """keep_locks: past its deadline, the I/O still reads the op's locked sources (`_settle_then_release`)."""
        late_io = future if exc.kind == "timeout" else None  # the I/O itself has not settled
        if late_io is not None or op.payload.get("transfer") is not None:  # (an H2D of a taken prefetch)
            # a taken prefetch's H2D copied the bytes that failed into its L1 pages: garbage, NaN likely (regression:
            # freed as they were, each later request given one as its last page read NaN in its masked tail, failed)
            op.payload["unverified_l1"] = op.payload.get("transfer") is not None
            apply(op, OpEvent.FAIL, error=str(exc))
            self._settle_then_release(op, self._in_flight(op, late_io), keep_locks and late_io is not None)
            self.mgr.metrics.count_failure(exc.kind)
        else:
            self._fail(op, str(exc), exc.kind)
        if exc.bad_slots:
            # every page the drop frees, not only the bad slots: the rest of their nodes and the
            # prefixes below leave L3 too (regression: they left uncounted, and L3's residency was
            # no longer what was written less what was evicted or lost)
            self.mgr.metrics.storage_missing_pages += self._drop_l3_slots(set(exc.bad_slots))

    def _drop_l3_slots(self, bad: set[int]) -> int:
        """Corrupt or vanished L3 pages lose their residency (and everything below them), from the
        first bad page of their node on: the valid pages before it stay (regression: the whole node
        went, and the next request recomputed a prefix L3 still held). Returns the pages dropped."""
        dropped = 0
        for node in list(self.mgr.tree.iter_nodes()):
            pages = node.pages[Tier.L3]
            if pages is not None and bad.intersection(pages) and node.locks[Tier.L3] == 0:
                # (a node a drop above removed has no L3 pages left; the manager invalidates the slots: on_drop)
                first_bad = next(i for i, slot in enumerate(pages) if slot in bad)
                dropped += len(self.mgr.tree.drop(node, Tier.L3, from_pages=first_bad))
        return dropped

    def _read_bytes(self, op: Op) -> int:
        """What an L3 op reads: its pages [l2, l3) (`_start_s2h`), not its longest copy (num_pages)."""
        return op.payload.get("num_read_pages", op.num_pages) * self.mgr.geometry.bytes_per_page

    def _io_deadline_s(self, num_bytes: int, direction: str = "s2h") -> float:
        # at most 4x io_timeout_s: a read past its deadline is learned as taking it (`_await_io`), so on a storage
        # that hangs each one raised the next one's 1.6x, unbounded (30 s, 43 s, ... 20 min after 10 timeouts)
        timeout_s = self.mgr.config.io_timeout_s
        return min(4 * timeout_s, max(timeout_s, 4 * self.mgr.cost.directions[direction].predict(num_bytes)))

    # -- lifecycle and integrity ---------------------------------------------------------------
    def pending_counts(self) -> dict:
        """Operations not ended, by kind: backups queued (`_due`), waiting for another (`_deferred`: regression,
        /hicache/status and hicache_pending_operations left them out) or live; restores, prefetches; settling."""
        waiting = sum(len(w) for w in self._deferred.values())
        counts = {"backups": len(self._due) + waiting, "restores": 0, "prefetches": 0, "settling": len(self._settling)}
        for op in self.live.values():
            key = {OpKind.BACKUP: "backups", OpKind.PREFETCH_L3: "prefetches"}.get(op.kind, "restores")
            counts[key] += 1
        return counts

    async def wait_op(self, op: Op) -> None:
        task = self._tasks.get(op.op_id)
        if task is not None:
            await asyncio.shield(task)

    async def drain(self, cancel: bool = False) -> None:
        if cancel:
            self._due.clear()
            for op in self.live.values():
                self.cancel(op)
        else:
            self.start_due()
        while self._tasks or self._settling:
            # shielded: a caller that stops waiting (its task cancelled) stops only its wait. A bare
            # gather cancelled the drivers and the settling tasks it awaited (regression: a settling
            # task cancelled so freed an abandoned read's pages while the read still ran into them)
            await asyncio.gather(*(asyncio.shield(t) for t in (*self._tasks.values(), *self._settling)),
                                 return_exceptions=True)

    def lock_holds(self, ops: Iterable[Op] = ()) -> Counter:
        """(node, tier) -> how many locks the live ops, and `ops` (ended ones a request still refers to), hold
        there: their sources', and a restore's published L1 pages held for its request (`hold_published`)."""
        holds: Counter = Counter()
        for op in {id(op): op for op in (*self.live.values(), *self._settling_locked.values(), *ops)}.values():
            holds.update(op.payload.get("locks", ()))
            if op.payload.get("held_l1") is not None:
                holds[(op.payload["held_l1"], Tier.L1)] += 1
        return holds

    def check_integrity(self) -> None:
        """Invariant 2: every live op's sources are locked and still in the tree. And every op started has
        ended once, counted once, or is running (hicache/metrics.py: the op counters)."""
        for op in self.live.values():
            for node, tier in op.payload["locks"]:
                if node.locks[tier] <= 0 or node.pages[tier] is None:
                    raise AssertionError(f"op {op.op_id}: source {node} not locked/resident in {tier.name}")
        m = self.mgr.metrics
        started = m.backups_started + m.restores_started + m.prefetches_started
        ended = (m.backups_done + m.restores_done + m.prefetches_taken + m.prefetches_done
                 + m.op_failures() + m.cancellations)
        running = sum(not op.done for op in self.live.values())
        if started != ended + running:
            raise AssertionError(f"{started} ops started, {ended} counted as ended and {running} running: "
                                 f"{m.as_dict()}")
