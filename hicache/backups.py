"""Backup drivers: L1 -> L2 (-> L3) write-through and write-back copies, part of `OpRunner`
(hicache/operations.py holds the shared machinery: locks, claims, waits, failure and release).

A backup locks its L1 source (and the L2 prefix it extends), reserves private L2 pages, enqueues the
D2H copy and publishes the pages once it completed; then, where L3 is worth writing, the same for
H2S. A backup asked for while one of its prefixes is being backed up, or a sibling that copies a page
it would copy (two prompts sharing a prefix that L2 lacks), waits for that one and, once it ended
(failed too) or its L3 write holds its pages in L2, copies only the pages beyond what it published
(one asked for once that L3 write started starts at once: its key is no longer in flight).
Likewise an L3 write that would write a page an L3 write in flight writes (siblings sharing a prefix
that L2 holds and L3 lacks, or one that waited as above) waits for it and then writes only what L3
still lacks. Backups that the engine's step processing asks for start
once that step's tokens reached their clients (`backup_soon`).
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence

import structlog

from hicache.ops import Op, OpEvent, OpKind, apply
from hicache.radix import MatchResult, Node, Tier
from hicache.storage import StorageError

log = structlog.get_logger("hicache.ops")


class Backups:
    """Mixin of `OpRunner`: the backup half of its drivers."""

    def write_back_keep(self, node: Node) -> bool:
        """Eviction veto for write_back: an L1 leaf that neither L2 nor L3 holds is backed up first,
        unless its last backup failed and nothing used it since: then it goes unsaved (as a
        write-through backup that failed only costs time). One that L3 holds is saved (regression:
        it was copied to L2 again, L1 waiting for it, when L2 had evicted it)."""
        if not self.mgr.write_back or self.saved_in_l2_or_l3(node):
            return False
        failed_at = self._backup_failed.pop(node.node_id, None)
        if failed_at is not None and node.stamp[Tier.L1] <= failed_at:
            return False  # (one used since is backed up again; regression: it went unsaved)
        # kept while a backup of it runs, or waits for the one of its prefix (start_backup defers it)
        key = self._tokens_of(node)
        return self.start_backup(key) is not None or any(key in waiting for waiting in self._deferred.values())

    @staticmethod
    def saved_in_l2_or_l3(node: Node) -> bool:
        """Whether L1 may lose `node` without losing its KV under write_back (L2 or L3 holds it)."""
        return node.pages[Tier.L2] is not None or node.pages[Tier.L3] is not None

    def _tokens_of(self, node: Node) -> tuple[int, ...]:
        """The tokens from the root through `node`."""
        tokens: list[int] = []
        while node is not None and node is not self.mgr.tree.root:
            tokens[:0] = node.key
            node = node.parent
        return tuple(tokens)

    def stop_backups_of(self, path: Sequence[Node], then: Callable[[frozenset[Tier]], object]) -> int:
        """The prefix whose nodes are `path` was dropped as suspect (hicache/suspect.py) but where
        locked. Each backup that locks one of them, or a node below (pages computed on top of them),
        stops at its next step: its copy settles, it publishes nothing and frees its destination
        pages (`_cancelled`), and the backups waiting for it are dropped. As it ends, its locks gone,
        `then(tiers)` runs with the tiers it held the prefix in (`_unlock_all`; regression: it
        published its L2, then L3, copy of the corrupt pages, and its locked source stayed, so the
        next request for the prompt failed on them again; then, run in a done-callback of its task,
        loop turns after its locks went, it left the kept prefix to a request admitted in between).
        One already cancelled (a drain that cancels) is not stopped again, but its `then` runs as
        well (regression: it was skipped, and the head it locked stayed cached). Returns how many it
        stopped."""
        on_path = set(path)

        stopped = 0
        for op in list(self.live.values()):
            if op.kind is not OpKind.BACKUP or op.done:
                continue
            held = frozenset(tier for node, tier in op.payload["locks"] if node.on_or_below(on_path))
            if held:
                op.payload.setdefault("suspect_drops", []).append(functools.partial(then, held))
                if not op.payload["cancel"]:
                    self.cancel(op)
                    stopped += 1
        return stopped

    async def write_back_l1(self, unsaved: bool, through_l3: bool = False) -> None:
        """Before a flush of L1 (and a shared L3's save at shutdown): start due backups and, with
        `unsaved`, a backup of every unlocked L1 leaf that L2 and L3 lack (a write-back cache's flush
        writes its dirty pages back, then invalidates; regression: the flush dropped every unsaved
        prefix from every tier); then wait until those backups, the ones in flight and the ones
        waiting on them have copied their pages to L2 (their L1 sources stay locked until then, and
        the flush would skip them). Their L3 writes go on after (`through_l3`: waited for too, for a flush of L3
        that follows: regression, they landed after it). A backup refused (admission, an L2
        full of locked pages) or failed leaves its pages unsaved, and the flush evicts them, as an
        eviction evicts what its policy did not save."""
        self.start_due()
        if unsaved:
            leaves = [n for n in self.mgr.tree.iter_nodes()
                      if n is not self.mgr.tree.root and n.pages[Tier.L1] is not None and not self.saved_in_l2_or_l3(n)
                      and not n.locks[Tier.L1] and not any(c.pages[Tier.L1] is not None for c in n.children.values())]
            for node in leaves:
                self.start_backup(self._tokens_of(node))
        # only these keys' backups (and those they defer) are waited for, so that a flush during
        # load ends although new backups keep starting
        keys = set(self._backing_up) | {w for waiting in self._deferred.values() for w in waiting}
        # and, for a flush of L3, the L3 writes in flight now, whose keys left `_backing_up` as they started
        # (regression: a backup caught in H2S_PENDING published its pages in L3 after the reset of L3, and held
        # them in L2 through the reset of L2, where one caught in D2H_PENDING was waited for)
        l3_writes = set(self._l3_writing) if through_l3 else set()
        while True:
            waits = []
            for op in self.live.values():
                if op.kind is not OpKind.BACKUP:
                    continue
                key = op.payload.get("backup_key", ())  # (gone: it is ending; () matches every key: waited for)
                ours = any(k[:len(key)] == key for k in keys) or op.op_id in l3_writes
                if ours and through_l3 and op.op_id in self._tasks:
                    waits.append(self._tasks[op.op_id])
                elif ours and not op.payload["l1_free"].done():
                    waits.append(op.payload["l1_free"])
                elif any(w in keys for w in self._deferred.get(key, ())) and op.op_id in self._tasks:
                    waits.append(self._tasks[op.op_id])  # one of ours starts when this one ends (its L3 write too)
            if not waits:
                return
            await asyncio.wait(waits)

    async def save_for_others(self, timeout_s: float) -> None:
        """A shared L3, or a file kept for the next engine (--hicache-storage-persist), only (an open one: a
        temporary file goes with the process): for at most `timeout_s`,
        let the backups under way finish their L3 writes and, under write_back or write_through, back up
        the unsaved L1 leaves, in rounds while a round saves something (L2 may not hold them all beside
        the L3 writes); the shutdown's cancelling drain then ends the rest. (Regressions, tests/test_redis_engine.py and
        tests/test_shutdown_save_s39_hunt.py: a shutdown cancelled them, other instances never got the
        pages; a second shutdown backed up onto the closed tiers; one round saved 11 of 44 pages;
        write_through's refused backups were never saved.)"""
        store = self.mgr.store
        outlives = getattr(store, "content_addressed", False) or getattr(store, "persistent", False)
        if timeout_s <= 0 or not outlives or getattr(store, "closed", False):
            return
        # write_back's unsaved leaves, and write_through's whose backups were refused (L2 full of locked
        # pages); write_through_selective saved what it chose to
        every_leaf = self.mgr.write_back or (self.mgr.has_l2 and self.mgr.config.write_policy == "write_through")
        tree = self.mgr.tree

        def unsaved_nodes() -> int:  # (unlocked: write_back_l1 skips locked leaves, and locks hold their path)
            return sum(1 for n in tree.iter_nodes() if n is not tree.root and n.pages[Tier.L1] is not None
                       and not n.locks[Tier.L1] and not self.saved_in_l2_or_l3(n))

        async def save() -> None:
            left = unsaved_nodes() if every_leaf else 0
            while True:
                await self.write_back_l1(unsaved=every_leaf)
                await self.drain()  # (their L3 writes: drain waits for every op)
                if not every_leaf:
                    return
                now = unsaved_nodes()
                if not now or now >= left:
                    return  # (all saved, or the last round saved nothing: refused or failed)
                left = now

        try:
            await asyncio.wait_for(save(), timeout_s)
        except TimeoutError:
            log.warning("l3_save_timed_out", timeout_s=round(timeout_s, 3), live_ops=len(self.live))

    def backup_soon(self, tokens: Sequence[int]) -> None:
        """Start a backup of `tokens` once every callback ready now has run. The engine publishes a
        request's pages while it processes a step, before that step's tokens reach their clients
        (they run when the loop next turns); enqueueing a backup costs ~0.3-0.6 ms of loop time, so
        a batch of 32 prompts that ended together would otherwise delay its last token by ~20 ms
        (docs/benchmarks.md, session 13). Two hops: the first callback runs where it was queued,
        possibly before later tokens of the same step were emitted; the second is queued behind
        them. Due backups also start before anything could evict their pages unsaved or outdate a
        match (`CacheManager.match`, `alloc_pages` when L1 must evict, `flush`) and when the runner
        drains; a drain that cancels drops them. (Starting them only before a match that finds L2
        or L3 pages, so that a prefill batch's backups ran under the next batch's forward, was
        measured and dropped: first tokens of a 32-prompt burst no sooner, docs/benchmarks.md.)"""
        self._due.append(tuple(tokens))
        if self._due_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): due until a match, an allocation or a drain in one
            return
        self._due_scheduled = True
        loop.call_soon(loop.call_soon, self.start_due)

    @property
    def has_due(self) -> bool:
        return bool(self._due)

    def start_due(self) -> None:
        """Start every backup `backup_soon` queued, in the order asked (nothing when none is, or where no loop runs
        to drive them: they stay due)."""
        self._due_scheduled = False  # (a hop still scheduled then finds nothing, or what came since)
        if not self._due or not _loop_running():
            return
        due, self._due = self._due, []
        for tokens in due:
            self.start_backup(tokens)

    def start_backup(self, tokens: Sequence[int], request_id: str | None = None,
                     l3_writer_key: tuple[int, ...] | None = None) -> Op | None:
        """Back up the L1 pages of `tokens` (page-aligned) that L2 lacks; L3 follows in the driver. The
        op, or None when there is nothing to copy, a backup in flight covers it, it waits for one
        (`_defer`), write admission refuses it, or L2 has no unlocked room.
        l3_writer_key: the backup this one waited for, whose L3 write (in flight) locks its L2
        pages (`_start_waiting`): no longer waited for, unless L2 is full of locked pages (then
        until it ends), as one that extends a backup whose L3 write is in flight waits then."""
        mgr, ps = self.mgr, self.mgr.page_size
        tokens = tuple(tokens[: len(tokens) - len(tokens) % ps])
        if tokens in self._backing_up or not tokens or any(tokens in w for w in self._deferred.values()):
            return None  # (a waiting one starts when the backup it waits for ends)
        if not _loop_running():  # (a synchronous caller's insert: no loop to drive its copy; regression, each such
            return None  # backup started, could not make its future, and failed as a driver error)
        for key in self._backing_up:
            if tokens[:len(key)] == key or key[:len(tokens)] == tokens:
                if len(tokens) > len(key):  # extends an in-flight backup: start when it ends
                    self._defer(key, tokens)
                return None  # (a prefix of one in flight is covered by it)
        m = mgr.tree.match(tokens, include_storage=mgr.has_l3, touch=False)
        n1, n2 = m.lengths[Tier.L1], m.lengths[Tier.L2]
        if n1 <= n2:
            return None
        # a backup in flight that copies the page after L2's end (a sibling: another prompt sharing
        # the prefix L2 lacks) copies the shared part: wait for it, then copy only what L2 still
        # lacks (regression: prompts sharing a new prefix each copied it to L2 and wrote it to L3)
        for key in self._backing_up:
            if key[:n2 + ps] == tokens[:n2 + ps]:
                self._defer(key, tokens)
                return None
        # a probe of refused L2 writes (CostModel.worth_writing) goes ahead: the checks after it
        # price the same H2D estimate (saving recompute minus that H2D, <= 0 once the write is
        # refused; break-even reads 100 % of what is written, and nothing is read back from a tier
        # restores skip), so they refused it, and counted their own probes only on its asks
        # (regression: one L2 write in restore_explore_every**2 refused asks, 1 in 1,024); so does
        # one that L2's checks refuse for an L3 write probe (`_l3_write_probe`)
        l3_probe = False
        if not mgr.worth_writing("l2", n1) or not (
                mgr.cost.write_probe or (mgr.backup_worth_its_cost(n1 - n2) and mgr.backup_pays_off(n1))
                or (l3_probe := self._l3_write_probe(n1))):
            mgr.metrics.policy_skips["write_l2"] += 1
            return None
        op = self._new(OpKind.BACKUP, (n1 - n2) // ps, request_id)
        op.payload["l3_probe"] = l3_probe
        try:  # (until its driver is registered: `_not_started`)
            # set once its L1 source is unlocked: its D2H ended, or the op did (write_back_l1 waits on it)
            l1_free = asyncio.get_running_loop().create_future()
            # lock the sources first: allocating L2 pages evicts L2 leaves, and the L2 prefix [0, n2)
            # that the new pages extend must survive it
            self._lock(op, m.handles[Tier.L1], Tier.L1)
            self._lock(op, m.handles[Tier.L2], Tier.L2)
            claim = self._claim(op, Tier.L2)
            host_pages = mgr.alloc_pages(Tier.L2, (n1 - n2) // ps, claim)
            if host_pages is not None:
                apply(op, OpEvent.START)
                tr = mgr.transfer.d2h(m.pages[Tier.L1][n2 // ps: n1 // ps], host_pages)
        except Exception as exc:
            self._not_started(op, exc)
            return None
        if host_pages is None:  # L2 full of locked pages: skip, never wait
            self._release(op)
            l3_writer_key = l3_writer_key or self._extended_l3_writer(tokens)
            if l3_writer_key is not None:  # (but for the L3 write whose end unlocks some)
                self._defer(l3_writer_key, tokens)
                return None
            mgr.metrics.policy_skips["write_l2"] += 1
            return None
        mgr.metrics.backups_started += 1
        key = tokens[:n1]
        self._backing_up.add(key)
        # backup_node: the L1 node whose path is `key` (split, it keeps that path), by id (`_fail`)
        op.payload.update(transfer=tr, backup_key=key, backup_node=m.handles[Tier.L1].node_id, l1_free=l1_free)
        self._register(op, self._drive_backup(op, key, n2, host_pages))
        self._tasks[op.op_id].add_done_callback(lambda _: l1_free.done() or l1_free.set_result(None))
        return op

    def _l3_write_probe(self, num_tokens: int) -> bool:
        """A backup L2's checks refused asks for its L3 write here (counted by worth_writing and, past
        it, by L3's reuse gate, once: `_drive_backup` does not ask again), and goes ahead if that is
        the probe of refused L3 writes or of an unproductive L3 (`l3_reuse_probe`): an L3 write goes
        through L2, so asked only after the backups L2 lets through, either probe came once in
        16 times its period where L2 is not read back (regression)."""
        mgr = self.mgr
        return (mgr.has_l3 and not self._l3_writes_paused() and mgr.worth_writing("l3", num_tokens)
                and (mgr.cost.write_probe or mgr.l3_reuse_probe()))

    def _l3_writes_paused(self) -> bool:
        """L3 refuses writes for now (FileStore backs off after an ENOSPC: a sparse file on a full
        disk): the backup skips its L3 write, a `write_l3` policy skip, instead of failing (regression:
        every backup tried and failed), before the cost model is asked (its probes stay for writes)."""
        retry_in_s = getattr(self.mgr.store, "write_retry_in_s", None)
        return retry_in_s is not None and retry_in_s() > 0

    def _defer(self, key: tuple[int, ...], tokens: tuple[int, ...]) -> None:
        """`tokens` waits for the backup of `key` in flight; a waiting prefix of it is covered by it."""
        waiting = self._deferred.setdefault(key, [])
        if any(w[:len(tokens)] == tokens for w in waiting):
            return
        waiting[:] = [w for w in waiting if tokens[:len(w)] != w] + [tokens]

    async def _drive_backup(self, op: Op, tokens: tuple[int, ...], start: int, host_pages) -> None:
        mgr, ps = self.mgr, self.mgr.page_size
        try:
            try:
                await self._wait_transfer(op, op.payload.pop("transfer"), "d2h")
            except Exception as exc:
                self._fail(op, str(exc), getattr(exc, "kind", "transfer"))  # ("closed": after close())
                return
            if self._cancelled(op):
                return
            apply(op, OpEvent.D2H_DONE)
            self._publish(op, tokens, Tier.L2, host_pages, start, stamp_from=Tier.L1)  # (no use: LRU as in L1)
            self._unlock_all(op)
            # its L1 pages may be evicted now: a request waiting for pages must not sleep through
            # the L3 write that follows (regression: it waited for the whole op)
            self._wake(op)  # (before l1_free is set: under write_back, `_wake` ends the chain for it)
            op.payload["l1_free"].set_result(None)
            n = len(tokens)
            # a probe of refused L3 writes goes ahead as an L2 one does (start_backup): the reuse
            # gate finds nothing read back from a tier restores skip on that same estimate, and
            # counted its own probes only on these asks (regression: one L3 write in
            # restore_explore_every * 16 refused asks once L3 was unproductive)
            if not mgr.has_l3 or self._l3_writes_paused() or not (op.payload["l3_probe"] or (
                    mgr.worth_writing("l3", n) and (mgr.cost.write_probe or mgr.l3_write_pays_off()))):
                self._skip_l3(op, refused=mgr.has_l3)
                return
            m = await self._l3_gap(op, tokens)
            if m is None:  # (cancelled while it waited)
                return
            n2, n3 = m.lengths[Tier.L2], m.lengths[Tier.L3]
            if n3 >= n2 or self._l3_writes_paused():  # (paused while it waited for a write)
                self._skip_l3(op, refused=n3 < n2)
                return
            self._lock(op, m.handles[Tier.L2], Tier.L2)  # before allocating: see start_backup
            self._lock(op, m.handles[Tier.L3], Tier.L3)
            claim = self._claim(op, Tier.L3)
            slots = mgr.alloc_pages(Tier.L3, (n2 - n3) // ps, claim)
            if slots is None:
                self._release(op)
                self._skip_l3(op, refused=True)
                return
            # from here the op's size is its L3 write's, the pages L3 lacks (its events, the timeline and a timeout's
            # sample say so; regression: they carried the D2H's, which may be more or fewer pages)
            op.num_pages = len(slots)
            op.num_bytes = op.num_pages * mgr.geometry.bytes_per_page
            apply(op, OpEvent.START)
            try:  # (a closed FileStore refuses as the write is submitted; the Redis L3 fails its future)
                future = mgr.store.write_pages(mgr.l2.page_buffer, m.pages[Tier.L2][n3 // ps: n2 // ps], slots,
                                               **mgr.page_keys(tokens, n3, n2))
            except StorageError as exc:
                self._storage_failed(op, exc)
                return
            self._l3_writing[op.op_id] = tokens[:n2]
            # its pages are in L2, locked by this write: the backups waiting for its D2H start now,
            # and those asked for from now on (extensions) at once (their L3 writes wait for this
            # one where they share a page), not after slow storage (regression: a write_back
            # eviction needing both leaves, and a flush, waited for it; then an extension asked for
            # during the write did)
            self._backing_up.discard(tokens)
            self._start_waiting(tokens, failed=False, stopped=False, l2_locked=True)
            # bounded as a read is (regression: a write on a storage that hangs held its L2 pages locked, and a
            # reset of L3 that waits for it unanswered, for good)
            try:
                await self._wait_io(op, future, "h2s", self._io_deadline_s(op.num_bytes, "h2s"))
            except StorageError as exc:
                # past its deadline its slots stay reserved until it settles; so do its L2 pages where it still packs
                # them into values shared under its keys (a content-addressed store: a page L2 reused meanwhile was
                # stored as this prefix's; regression), not where they land in its own slots, freed unreadable
                self._storage_failed(op, exc, future, keep_locks=getattr(mgr.store, "content_addressed", False))
                return
            if self._cancelled(op):
                return
            apply(op, OpEvent.H2S_DONE)
            self._publish(op, tokens[:n2], Tier.L3, slots, n3, stamp_from=Tier.L2)
            self._unlock_all(op)
            mgr.metrics.backups_done += 1
        finally:
            # (the key goes with it: a cancelled task's done-callback must not clear it a second
            # time, under a newer backup of the same tokens; regression)
            op.payload.pop("backup_key", None)
            # (a key whose L3 write started went then: a newer backup of `tokens`, copying a tail
            # that L2 lost before that write locked it, may hold it now)
            if self._l3_writing.pop(op.op_id, None) is None:  # (its waiters wake when this task ends)
                self._backing_up.discard(tokens)
            task = asyncio.current_task()
            self._start_waiting(tokens, failed=not op.succeeded,
                                stopped=op.payload["cancel"] or (task is not None and task.cancelling() > 0))

    def _skip_l3(self, op: Op, refused: bool) -> None:
        """The backup ends with its D2H: nothing written to L3 (`refused`: counted as the policy's, or L3's room's,
        refusal; not where there is no L3, or L3 holds the prefix already)."""
        if refused:
            self.mgr.metrics.policy_skips["write_l3"] += 1
        apply(op, OpEvent.SKIP_L3)
        self.mgr.metrics.backups_done += 1

    async def _l3_gap(self, op: Op, tokens: tuple[int, ...]) -> MatchResult | None:
        """The tree's match of `tokens` (L3 lacks m.lengths[L2] - m.lengths[L3] tokens of them) once no L3 write in
        flight writes the page after L3's end; None where `op` was cancelled while it waited."""
        mgr, rechecked = self.mgr, False
        while True:
            m = mgr.tree.match(tokens, include_storage=True, touch=False)
            n2, n3 = m.lengths[Tier.L2], m.lengths[Tier.L3]
            writer = self._l3_writer_of(tokens[:n2], n3) if n3 < n2 else None
            if writer is None:
                # a shared L3's hints of the pages it would skip may be stale (flushed, restarted,
                # evicted) while L1/L2 serve them: dropped, the write puts them back (regression:
                # they never reached Redis again; RedisStore.recheck_hints says why here)
                if rechecked or not n3 or not await mgr.recheck_l3_hints(tokens, n3):
                    return m
                rechecked = True
            else:
                # an L3 write in flight writes the page after L3's end (a sibling's: another prompt
                # sharing the prefix L3 lacks, which L2 held, so their D2Hs did not overlap): wait
                # for it, then write only what L3 still lacks; after a failed one the first to go
                # writes alone, the others wait for it (regression: each sibling wrote the prefix)
                await asyncio.wait((writer,))
            if self._cancelled(op):
                return None

    def _l3_writer_of(self, tokens: tuple[int, ...], start_tokens: int) -> asyncio.Task | None:
        """The driver of an L3 write in flight that writes page `start_tokens` of `tokens` (the page
        after L3's end), or None. Its L3 prefix is locked, so it cannot write below that end."""
        end_tokens = start_tokens + self.mgr.page_size
        for op_id, written in self._l3_writing.items():
            if written[:end_tokens] == tokens[:end_tokens] and len(written) >= end_tokens:
                return self._tasks.get(op_id)
        return None

    def _extended_l3_writer(self, tokens: tuple[int, ...]) -> tuple[int, ...] | None:
        """The key of a backup whose L3 write is in flight and which `tokens` extends, or None."""
        for op_id in self._l3_writing:
            key = self.live[op_id].payload.get("backup_key", ()) if op_id in self.live else ()
            if key and tokens[:len(key)] == key:
                return key
        return None

    def _start_waiting(self, key: tuple[int, ...], failed: bool, stopped: bool, l2_locked: bool = False) -> None:
        """The backup of `key` ended: each backup waiting for it starts now and copies what L2 still
        lacks, succeeded or failed (regression: a failed one dropped them, and under write_through
        their pages never reached L2 unless published again). After a failure they all share pages
        it left unsaved in L2 or L3, which backups running side by side would each copy or write:
        so the first that starts goes alone, the others wait for it (and start when it ends). A
        backup asked to stop (a drain that cancels) or whose driver task was cancelled drops them,
        as that drain drops due backups. l2_locked: it has not ended, its L3 write started and
        locks its pages in L2, so they start already; one that finds L2 full of locked pages waits
        on for its end (regression: started at its D2H's end, before that lock, one evicted its
        pages from L2 unwritten to L3; waiting for its end, they waited for slow storage)."""
        later = self._deferred.pop(key, [])
        if stopped:
            return
        first = None
        for waiting in later:
            if first is not None:
                self._defer(first, waiting)
                continue
            op = self.start_backup(waiting, l3_writer_key=key if l2_locked else None)
            if op is not None and failed:
                first = op.payload["backup_key"]


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
