"""Restore and prefetch drivers: L2 -> L1, L3 -> L2 (-> L1), part of `OpRunner`
(hicache/operations.py holds the shared machinery: locks, claims, waits, failure and release).

A restore locks its source tiers, reserves private destination pages, enqueues S2H and/or H2D and
publishes each tier's pages once its copy completed; an L2 restore may land layer by layer under
its tail's forward (`layerwise`). A prefetch (`PREFETCH_L3`) is the L3 -> L2 half alone, started
when a request is queued; once its read landed, while the read's checksums are still being
verified, the request may take it on to L1 (`take_to_l1`), so that hashing runs beside the H2D and
the tail's forward instead of before them.
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence

import structlog

from hicache.log_gate import log_anyway
from hicache.ops import Op, OpEvent, OpKind, OpState, apply
from hicache.radix import Node, Tier
from hicache.storage import StorageError

# A prefetch that will be taken on to L1 once its bytes land verifies them after the landing only
# up to this size: then the checksums finish under the H2D and the tail's forward. Longer, they
# outlast those and the whole restore waits (H200, 8B, warm, p50 of four runs each: 350 / 1,000
# tokens (49 / 146 MB) 9.64 -> 8.94 / 14.18 -> 13.47 ms after landing, 3,500 (516 MB) 36.8 ->
# 39.1 ms; docs/benchmarks.md, session 18).
VERIFY_AFTER_LANDING_MAX_BYTES = 192 << 20
# Up to HOLD_CHECKS_MAX_BYTES it starts them only once the forward that waits for the take-on was
# launched (`start_checks`): the verify threads hashing beside the loop had made the forward's launch
# ~1.2 ms instead of ~0.6 (H200, 8B, 350 tokens, 49 MB, session 22). Longer reads hash for longer
# than that forward runs and start at the landing. If no one starts them, the driver does,
# HOLD_CHECKS_MAX_S after the landing (a request that did not take the prefetch on, or went away).
HOLD_CHECKS_MAX_BYTES = 64 << 20
HOLD_CHECKS_MAX_S = 0.005
# ops a request may wait for rather than copy their pages again (`restore_in_flight`); those reading L3
RESTORE_KINDS = (OpKind.RESTORE_L2, OpKind.RESTORE_L3, OpKind.PREFETCH_L3)
L3_READS = (OpKind.RESTORE_L3, OpKind.PREFETCH_L3)

log = structlog.get_logger("hicache.ops")


class Restores:
    """Mixin of `OpRunner`: the restore and prefetch half of its drivers."""

    def start_restore(self, tokens: Sequence[int], match, source: str, request_id: str | None,
                      layerwise: bool = False, take_soon: bool = False, tail_tokens: int = 0) -> Op | None:
        """source "l2" / "l3": restore tokens[l1_len : tier_len] into L1 (through L2 for an L3 hit).
        source "prefetch": promote the L3 part into L2 only (PREFETCH_L3), which the request that
        queued it restores from L2 later or takes on to L1 once the read landed (`take_to_l1`).
        None when the needed pages cannot be had right now (a restore's caller recomputes; a
        prefetch is simply not made).

        layerwise (L2 restores): copy in layer order where the transfer engine can (then
        op.payload["layerwise"] is True, op.payload["l1_pages"] are the pages being filled and
        op.payload["transfer"] is the copy, whose layer flags a forward may wait for right away).
        take_soon (prefetches): the caller expects to take the read on to L1 as soon as it lands
        (`take_to_l1`), so a file store's checksums wait for the landing instead of slowing it
        (reads up to VERIFY_AFTER_LANDING_MAX_BYTES). tail_tokens: what the forward that waits for a
        layer-ordered restore computes (CacheManager.whole_first_pages)."""
        mgr, ps = self.mgr, self.mgr.page_size
        l1, l2, l3 = match.lengths
        if (l2 <= l1) if source == "l2" else (l3 <= max(l1, l2)):
            return None  # nothing to copy (a stale match): zero-page copies are not transfers
        if source == "l2":
            op = self._new(OpKind.RESTORE_L2, (l2 - l1) // ps, request_id)
            op.payload["tokens"] = tuple(tokens[:l2])  # what it publishes (restore_in_flight)
            try:  # (until its driver is registered: `_not_started`)
                self._lock(op, match.handles[Tier.L1], Tier.L1)
                started = self._start_h2d(op, tuple(tokens[:l2]), match, l1, layerwise, tail_tokens)
            except Exception as exc:
                self._not_started(op, exc)
                return None
            if not started:
                self._release(op)
                return None
            mgr.metrics.restores_started += 1
            return self._register(op, self._drive_restore(op, tuple(tokens[:l2])))
        kind = OpKind.RESTORE_L3 if source == "l3" else OpKind.PREFETCH_L3
        op = self._new(kind, (l3 - min(l1, l2)) // ps, request_id)
        op.payload["tokens"] = tuple(tokens[:l3])
        try:
            self._lock(op, match.handles[Tier.L1], Tier.L1)
            future = self._start_s2h(op, match, tokens, take_soon and kind is OpKind.PREFETCH_L3)
        except Exception as exc:
            self._not_started(op, exc)
            return None
        if future is None:
            self._release(op)
            return None
        op.payload.update(l2_start=l2, l3_end=l3)
        mgr.metrics.restores_started += kind is OpKind.RESTORE_L3
        mgr.metrics.prefetches_started += kind is OpKind.PREFETCH_L3
        return self._register(op, self._drive_restore(op, tuple(tokens[:l3]), future, l2))

    def restore_in_flight(self, tokens: Sequence[int], match, request_id: str | None = None,
                          kinds: tuple[OpKind, ...] = RESTORE_KINDS, through: int | None = None) -> Op | None:
        """A live op of `kinds`, not `request_id`'s, that will publish a page of `tokens` beyond what
        `match` holds (beyond its L1 prefix for a restore into L1, beyond its L1 and L2 for a
        prefetch, which lands in L2), or, given `through`, every page of `tokens` up to that length.
        A request about to copy the same pages waits for it instead (regression: requests sharing a
        prefix that only L2 or L3 held, arriving together, each restored it into L1 pages of its
        own, freed as duplicates, and each read it from storage)."""
        ps, (l1, l2) = self.mgr.page_size, match.lengths[:2]
        for op in self.live.values():
            theirs = op.payload.get("tokens")
            if (op.kind not in kinds or theirs is None or op.done or op.payload["cancel"]
                    or op.request_id == request_id):
                continue
            upto = through  # (else: the page after what we hold is theirs too)
            if upto is None:
                upto = (max(l1, l2) if op.kind is OpKind.PREFETCH_L3 else l1) + ps
            if upto <= min(len(theirs), len(tokens)) and tuple(tokens[:upto]) == theirs[:upto]:
                return op
        return None

    def stop_restores_of(self, path: Sequence[Node], then: Callable[[frozenset[Tier]], object]) -> int:
        """`stop_backups_of` for restores and prefetches: the prefix whose nodes are `path` was
        dropped as suspect (hicache/suspect.py) but where locked. Each op of RESTORE_KINDS that locks
        one of them, or a node below (the pages it copies were computed on top of them), stops at its
        next step: its copy settles, it publishes nothing (a prefetch taken on to L1 neither, though
        its read verified: `_drive_restore`), its private L1 pages, which its H2D may have filled
        with the suspect K/V, go back zeroed (`_free_claim`), and its request recomputes as after a
        failed restore (scheduler/restoring.py). As it ends, its locks gone, `then(tiers)` runs with
        the tiers it held the prefix in (`_unlock_all`: not in a done-callback, since a loop turn
        before it could unpark its request onto the kept head), and once more when a request that
        ran its forward behind it lets go of the L1 head it locked meanwhile (`drop_suspect_again`).
        Regression: it published its copy of the corrupt pages and its request (or the next one)
        failed on them too. One cancelled before (its request aborted) is stopped as well. Returns
        how many it stopped."""
        on_path = set(path)

        stopped = 0
        for op in list(self.live.values()):
            if op.kind not in RESTORE_KINDS or op.done:
                continue
            held = frozenset(tier for node, tier in op.payload["locks"] if node.on_or_below(on_path))
            if held:
                op.payload["suspect"] = True
                op.payload.setdefault("suspect_drops", []).append(functools.partial(then, held))
                self.cancel(op)
                stopped += 1
        return stopped

    def drop_suspect_again(self, op: Op | None) -> None:
        """A request ran its forward behind `op` (`hold_published`), stopped as suspect
        (`stop_restores_of`), and locked the L1 head below its pages until now: the drops that ran
        as the op ended, under that lock, run again (regression: the head stayed in L1, and the
        request, back in the queue to recompute, reused it and failed)."""
        for drop in op.payload.pop("suspect_drops", ()) if op is not None else ():
            drop()

    def reading_s(self) -> float:
        """Seconds of the storage reads in flight (restores' and prefetches' whose bytes have not
        landed), each priced alone on the s2h line: a read started now lands behind them
        (CostModel.decide's reading_s)."""
        predict = self.mgr.cost.directions["s2h"].predict
        return sum(predict(self._read_bytes(op)) for op in self.live.values()
                   if op.kind in L3_READS and op.state is OpState.S2H_PENDING and not op.payload["cancel"])

    def _start_s2h(self, op: Op, match, tokens: Sequence[int], take_soon: bool = False):
        mgr, ps = self.mgr, self.mgr.page_size
        l2, l3 = match.lengths[Tier.L2], match.lengths[Tier.L3]
        self._lock(op, match.handles[Tier.L3], Tier.L3)  # before allocating: see start_backup
        self._lock(op, match.handles[Tier.L2], Tier.L2)
        claim = self._claim(op, Tier.L2)
        host_pages = mgr.alloc_pages(Tier.L2, (l3 - l2) // ps, claim)
        if host_pages is None:
            return None
        apply(op, OpEvent.START)
        op.payload["host_pages"] = host_pages
        op.payload["num_read_pages"] = len(host_pages)  # [l2, l3): shorter than num_pages when L2 holds more than L1
        options = mgr.page_keys(tokens, l2, l3)
        if (take_soon and getattr(mgr.store, "can_check_after_landing", False)
                and len(host_pages) * mgr.l2.geometry.bytes_per_page <= VERIFY_AFTER_LANDING_MAX_BYTES):
            held = len(host_pages) * mgr.l2.geometry.bytes_per_page <= HOLD_CHECKS_MAX_BYTES
            options["hold_checks" if held else "checksums_after_landing"] = True
        future = mgr.store.read_pages(match.pages[Tier.L3][l2 // ps: l3 // ps], mgr.l2.page_buffer, host_pages,
                                      **options)
        # in flight from now on, not only once the driver awaits it: a driver task cancelled before
        # its first step frees the op's pages once this settled (regression: freed at once, the
        # read then landed in L2 pages a backup had taken meanwhile)
        op.payload["read"] = op.payload["inflight"] = future
        return future

    def hold_published(self, op: Op) -> None:
        """A request runs its forward on `op`'s L1 pages before they are published (a layer-ordered
        restore, or a prefetch taken on): once published, keep them locked for it (`release_held`)."""
        op.payload["hold_l1"] = True

    def release_held(self, op: Op) -> None:
        """The request of `hold_published` took the pages over, dropped them or ended: the restore
        stops holding them, or will not hold them once done."""
        op.payload["hold_l1"] = False
        held = op.payload.pop("held_l1", None)
        if held is not None:
            self.mgr.tree.unlock(held, Tier.L1)

    def start_checks(self, op: Op | None) -> None:
        """Let a prefetch read opened with held checksums (`hold_checks`, a read expected to
        be taken on) start them: at its forward's launch, when its request declines it, when the op
        is cancelled or abandoned, or `HOLD_CHECKS_MAX_S` after its landing. Idempotent; a no-op for
        any other op."""
        read = op.payload.get("read") if op is not None else None
        if read is not None and hasattr(read, "start_checks"):
            read.start_checks()

    def _start_h2d(self, op: Op, tokens: tuple[int, ...], match, l1_start: int, layerwise: bool = False,
                   tail_tokens: int = 0) -> bool:
        mgr, ps = self.mgr, self.mgr.page_size
        end = len(tokens)
        self._lock(op, match.handles[Tier.L2], Tier.L2)
        claim = self._claim(op, Tier.L1)
        l1_pages = mgr.alloc_pages(Tier.L1, (end - l1_start) // ps, claim)
        if l1_pages is None:
            return False
        apply(op, OpEvent.START)
        host_pages = match.pages[Tier.L2][l1_start // ps: end // ps]
        transfer = (mgr.transfer.h2d_layerwise(host_pages, l1_pages, mgr.whole_first_pages(len(l1_pages), tail_tokens))
                    if layerwise and l1_pages else None)
        op.payload["layerwise"] = transfer is not None
        if transfer is None and l1_pages:
            transfer = mgr.transfer.h2d(host_pages, l1_pages)
        # payload["transfer"] is set from the enqueue until the driver starts awaiting the copy (it
        # pops it into payload["inflight"]): `_in_flight` and `_storage_failed` read "a copy may still
        # run" from it, and admission reads a layer-ordered copy's epoch from it in the same loop turn
        op.payload.update(l1_pages=l1_pages, l1_start=l1_start, l1_end=end, transfer=transfer)
        return True

    def take_to_l1(self, op: Op, match, tail_tokens: int = 0) -> bool:
        """A prefetch whose read landed (S2H_LANDED: its checksums are still being verified) goes on
        to L1 for the request that queued it: the H2D starts now, layer by layer, from the L2
        prefix `match` holds below the promoted range and from the op's still-private L2 pages, so
        the request's tail forward can start as well (op.payload as for a layerwise restore). The
        op publishes its L2 pages once the checksums passed and its L1 pages once the H2D is done;
        a failed checksum fails it, and the forward's output goes with it (Admission.adopt_restored).
        False, with nothing changed, when it cannot be taken: not landed, cancelled, L1 now holds
        part of the promoted range, L2 no longer holds all of [l1, l2_start), no L1 pages, no
        layer-ordered copy on this machine, or its H2D raised as it was enqueued (logged). The L2
        pages [l1, l2_start) it copies from stay locked by the lock `_start_s2h` took on the L2
        prefix; the promoted ones are the op's own."""
        mgr, ps = self.mgr, self.mgr.page_size
        l2_start, end = op.payload.get("l2_start", 0), op.payload.get("l3_end", 0)
        l1 = match.lengths[Tier.L1]
        if (op.state is not OpState.S2H_LANDED or op.payload["cancel"] or l1 > l2_start
                or match.lengths[Tier.L2] < l2_start):
            return False
        # [n] host pages in token order: the published L2 prefix [l1, l2_start), then the promoted pages
        host_pages = list(match.pages[Tier.L2][l1 // ps: l2_start // ps]) + list(op.payload["host_pages"])
        num_locks = len(op.payload["locks"])
        try:
            self._lock(op, match.handles[Tier.L1], Tier.L1)  # allocating may evict: keep the L1 prefix
            l1_pages = mgr.alloc_pages(Tier.L1, len(host_pages), self._claim(op, Tier.L1))
            transfer = (mgr.transfer.h2d_layerwise(host_pages, l1_pages,
                                                   mgr.whole_first_pages(len(l1_pages), tail_tokens))
                        if l1_pages else None)
        except Exception:  # (the prefetch goes on to L2 for its request; regression: it crashed the engine loop)
            log_anyway(log.exception, "take_to_l1_error", op_id=op.op_id)
            transfer = None
        if transfer is None:
            self._close_claim(op, Tier.L1)
            for node, tier in reversed(op.payload["locks"][num_locks:]):
                mgr.tree.unlock(node, tier)
            del op.payload["locks"][num_locks:]
            return False
        apply(op, OpEvent.START)
        op.payload.update(layerwise=True, l1_pages=l1_pages, l1_start=l1, l1_end=end, transfer=transfer)
        mgr.metrics.prefetches_taken += 1  # (it ends as a restore)
        mgr.metrics.restores_started += 1
        return True

    async def _drive_restore(self, op: Op, tokens: tuple[int, ...], future=None, l2_start: int = 0) -> None:
        """Drive RESTORE_L2, RESTORE_L3 and PREFETCH_L3 ops (OpKind, hicache/ops.py): with a read
        `future`, first the S2H step (a prefetch ends there, published in L2, unless its request
        took it on meanwhile); then, for an L3 restore, the H2D's start from the promoted pages;
        then the H2D step all three may end with."""
        t0 = time.monotonic_ns()
        if future is not None:
            if not await self._read_step(op, tokens, future, l2_start, t0):
                return
            if op.kind is OpKind.RESTORE_L3 and not await self._start_h2d_from_read(op, tokens):
                return
        await self._h2d_step(op, tokens, t0)

    async def _read_step(self, op: Op, tokens: tuple[int, ...], future, l2_start: int, t0: int) -> bool:
        """S2H_PENDING: the read waited for and published in L2. Whether the op goes on to an H2D (False: it
        ended here: failed, cancelled, or a prefetch no request took on)."""
        mgr = self.mgr
        deadline_s = self._io_deadline_s(self._read_bytes(op))
        try:
            if op.kind is OpKind.PREFETCH_L3 and getattr(future, "landed", None) is not None:
                await self._wait_landed(op, future, deadline_s)
                if not op.payload["cancel"]:  # (a cancelled one is for no request to take)
                    apply(op, OpEvent.S2H_LANDED)
                    mgr.wakeup()  # the request parked on this prefetch may take it on to L1 now
                if hasattr(future, "start_checks"):  # held for the take-on's launch, or not held
                    asyncio.get_running_loop().call_later(
                        0.0 if op.payload["cancel"] else HOLD_CHECKS_MAX_S, future.start_checks)
            await self._wait_io(op, future, "s2h", deadline_s, since_ns=t0)
        except StorageError as exc:
            self._storage_failed(op, exc, future)
            return False
        taken = op.state is OpState.H2D_VERIFYING  # its H2D is in flight: cancel after it settled
        if taken and op.payload.get("suspect"):  # (`stop_restores_of`: not even its L2 pages)
            apply(op, OpEvent.CANCEL, error="suspect prefix")
            self._settle_then_release(op, self._in_flight(op))  # (its H2D still reads them)
            mgr.metrics.cancellations += 1
            return False
        if not taken and self._cancelled(op):
            return False
        apply(op, OpEvent.S2H_DONE)
        self._publish(op, tokens, Tier.L2, op.payload.pop("host_pages"), l2_start, keep_claim=taken)
        mgr.metrics.promotions += 1
        mgr.reuse[Tier.L3].on_read(op.payload["num_read_pages"])
        if taken:  # the H2D still reads these pages: nothing may evict them (locks go at the end)
            self._lock(op, mgr.tree.match(tokens, include_storage=False).handles[Tier.L2], Tier.L2)
        elif op.kind is OpKind.PREFETCH_L3:
            self._unlock_all(op)
            mgr.metrics.prefetches_done += 1
            return False
        else:
            self._unlock_all_but_l1(op)
        return True

    async def _start_h2d_from_read(self, op: Op, tokens: tuple[int, ...]) -> bool:
        """An L3 restore's H2D started from the pages its read promoted to L2 (waiting for write_back to free L1
        room where it is coming). Whether it started (False: the op failed or was cancelled)."""
        mgr = self.mgr
        tried = len(op.payload["locks"])
        while True:
            match = mgr.tree.match(tokens, include_storage=False)
            l1_start = match.lengths[Tier.L1]
            # L1 may have grown meanwhile (another request computed or restored part of it): the
            # restored pages land after that prefix, so lock it: allocating may evict it
            self._lock(op, match.handles[Tier.L1], Tier.L1)
            if match.lengths[Tier.L2] >= len(tokens) and self._start_h2d(op, tokens, match, l1_start):
                break
            if match.lengths[Tier.L2] < len(tokens) or not mgr.l1_room_coming():
                break
            # backups are copying the leaves its room comes from: wait for their copies (the read
            # locked in L2), then try again, as a request computing its prompt does (regression:
            # failed, counted in failures["no_pages"], and its request then restored it from L2)
            self._close_claim(op, Tier.L1)
            await mgr.l1_room_saved()
            if self._cancelled(op):
                return False
            for node, tier in reversed(op.payload["locks"][tried:]):
                mgr.tree.unlock(node, tier)
            del op.payload["locks"][tried:]
        if op.state is not OpState.H2D_PENDING:
            # its read stays published in L2; only L1 lacked room (requests admitted while it
            # read took it): its request decides again rather than recompute (regression:
            # scheduler/restoring.py `_unpark`)
            op.payload["l1_room_lost"] = match.lengths[Tier.L2] >= len(tokens)
            self._fail(op, "no L1 pages for the H2D step", "no_pages")
            return False
        return True

    async def _h2d_step(self, op: Op, tokens: tuple[int, ...], t0: int) -> None:
        """H2D_PENDING: the copy to L1 waited for, its pages published in L1 (held for the request whose forward
        read them layer by layer), the op's locks released."""
        mgr = self.mgr
        transfer = op.payload.pop("transfer")
        if transfer is not None:  # None: L1 already held everything, nothing to copy
            try:
                await self._wait_transfer(op, transfer, "h2d")
            except Exception as exc:
                self._fail(op, str(exc), getattr(exc, "kind", "transfer"))  # ("closed": after close())
                return
        if self._cancelled(op):
            return
        apply(op, OpEvent.H2D_DONE)
        l1_pages = op.payload.pop("l1_pages")
        if op.kind is OpKind.RESTORE_L2:
            mgr.reuse[Tier.L2].on_read(len(l1_pages))
        self._publish(op, tokens, Tier.L1, l1_pages, op.payload["l1_start"])
        if op.payload.get("hold_l1"):
            # the request whose forward read these pages layer by layer takes them over at its next
            # tick (scheduler/restoring.py adopt_restored): held for it until then (`release_held`).
            # Unlocked, they were evictable in between: admission counted them as room, and a
            # request admitted on it found no page mid-decode (l1_overcommit), or they were evicted
            held = mgr.tree.match(tokens[:op.payload["l1_end"]], include_storage=False).handles[Tier.L1]
            mgr.tree.lock(held, Tier.L1)
            op.payload["held_l1"] = held
        self._release(op)  # unlocks; a taken prefetch's duplicate L2 pages (if any) are freed now
        mgr.metrics.restores_done += 1
        mgr.metrics.restore_s += (time.monotonic_ns() - t0) / 1e9

    def _unlock_all_but_l1(self, op: Op) -> None:
        keep = [(n, t) for n, t in op.payload["locks"] if t is Tier.L1]
        for node, tier in reversed(op.payload["locks"]):
            if tier is not Tier.L1:
                self.mgr.tree.unlock(node, tier)
        op.payload["locks"] = keep
