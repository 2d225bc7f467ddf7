"""The cache manager: one tree over the tiers that exist, their pools and allocators, the L3 store,
the transfer engine, the cost model and the live operations. Knows nothing of requests or models:
callers hand it token ids and L1 pages. This module keeps the pages and tiers' bookkeeping; the cost
policy's questions (decide, worth_writing, backup_pays_off, ...) are answered by CostPolicy
(hicache/cost_policy.py), the status and store checks by hicache/inspection.py, each behind a
method of the same name here.

Contract (what callers may rely on):
  - `match()` first starts due backups (they lock L1 pages and may evict L2 leaves); the walk itself
    changes no residency but may split nodes. Lock a handle before reading its pages across an
    await; an unlocked handle may be evicted by the next allocation.
  - `alloc_l1()` evicts unlocked L1 leaves (LRU) to make room; it never evicts a locked node, and
    nothing when eviction could not make room; but under write_back it evicts the saved leaves, backs
    up the unsaved ones and may return None, the caller waiting for that room (`l1_room_coming()`).
  - `insert_l1()` publishes a caller's private pages (and, under write_through, queues their
    L1 -> L2 backup); pages the tree already had come back, still private, to free.
  - Everything here runs on the event loop's thread; nothing is thread-safe.
  - Operations (backup / restore / prefetch) lock their sources and keep their destinations private
    until the copy completed; see hicache/operations.py.
  - `check_integrity()` verifies the tree, every allocator, every live operation's locks, and that every
    operation started is counted once as ended or is running (hicache/metrics.py).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import structlog
import torch

from hicache import inspection, l3_index
from hicache.allocator import PageAllocator
from hicache.config import HiCacheConfig
from hicache.cost_model import CostModel, Decision
from hicache.cost_policy import CostPolicy
from hicache.faults import FaultInjector
from hicache.geometry import KVGeometry
from hicache.kernel_calibration import Calibration, calibrate
from hicache.metrics import Metrics
from hicache.operations import OpRunner
from hicache.ops import OpKind, OpState
from hicache.pools import DevicePool, HostPool
from hicache.radix import MatchResult, Node, RadixTree, Tier
from hicache.reuse import TierReuse
from hicache.transfer import TransferEngine
from kernels.chooser import choose_backends

log = structlog.get_logger("hicache.manager")


class CacheManager:
    def __init__(self, geometry: KVGeometry, l1_pages: int, device: torch.device | str,
                 config: HiCacheConfig | None = None, faults: FaultInjector | None = None,
                 simulate: bool = False) -> None:
        self.geometry = geometry
        self.simulate = simulate
        self.page_size = geometry.page_size
        self.config = config or HiCacheConfig()
        self.faults = faults
        self.metrics = Metrics()
        self.reuse = {Tier.L2: TierReuse(), Tier.L3: TierReuse()}  # write admission by observed reuse
        self._flushing = False
        self.l1 = DevicePool(geometry, l1_pages, torch.device(device), simulate=simulate)
        self.l2: HostPool | None = None
        self.store = None
        self.transfer: TransferEngine | None = None
        self.backends = None
        self.kernel_calibration: Calibration | None = None  # (CUDA: what the copy kernel was timed at, at start)
        # the engine sets this (scheduler/cuda_graphs.py: its tail forward, timed once its graphs are
        # captured): how long the forward that waits for a layer-ordered restore takes
        self.overlap_forward_s: float | None = None
        # the engine sets this: write-through backups of what insert_l1 publishes start once the
        # step's tokens reached their clients (OpRunner.backup_soon), not in the middle of the step
        self.defer_backups = False
        # the engine's loop sets this each admission pass (Admission.prefill_batch): seconds of GPU
        # work queued, which a restore of what is written now would run beside (worth_writing)
        self.busy_s = 0.0
        # the engine's loop sets these: wakeup ends a decode chain (a request may be runnable),
        # wakeup_idle only wakes a loop that has nothing to run (see OpRunner._wake)
        self.wakeup: Callable[[], None] = lambda: None
        self.wakeup_idle: Callable[[], None] = lambda: None
        try:
            self._build(l1_pages)
        except BaseException:  # (regression: a failure past the L3 store's open, e.g. its index unreadable, left
            self.abandon_all()  # its file locked)
            raise

    def _build(self, l1_pages: int) -> None:
        """The tiers below L1 (L2's pool, L3's store, the transfer engine), the radix tree over them (adopting a
        kept L3 file's index), the cost model and policy, and the op runner."""
        allocators: dict[Tier, PageAllocator] = {Tier.L1: self.l1.allocator}
        cfg = self.config
        if cfg.enable:
            host_pages = cfg.host_pages(l1_pages, self.geometry.bytes_per_page)
            if host_pages < 1:
                raise ValueError("hicache: L2 would hold no page; raise --hicache-ratio / --hicache-size-gb")
            self.l2 = HostPool(self.geometry, host_pages, pin=self.l1.device.type == "cuda", simulate=self.simulate)
            allocators[Tier.L2] = self.l2.allocator
            storage_pages = cfg.storage_pages(host_pages, self.geometry.bytes_per_page)
            if storage_pages > 0:
                self.store = self._open_store(storage_pages)
                if not getattr(self.store, "persistent", False) and getattr(self.store, "is_temp", True) is False:
                    # a path truncated as it opened: no index of it stays (at once: regression, a start that
                    # failed before the tree was built left it, and the next run with the flag adopted it)
                    l3_index.discard(self.store.path)
                allocators[Tier.L3] = PageAllocator(storage_pages, "l3")
            if self.simulate:
                from hicache.simulated import NullTransferEngine
                self.transfer = NullTransferEngine(self.geometry)
            else:
                self.backends = choose_backends(self.l1.kv, cfg.transfer_backend)
                self.transfer = TransferEngine(self.l1, self.l2, self.backends, self.faults,
                                               kernel_max_pages=cfg.kernel_restore_max_tokens // self.page_size)
                if cfg.kernel_calibration:  # (before any page is in use: the probe writes L1 pages)
                    self.kernel_calibration = calibrate(self.transfer, self.transfer.kernel_max_pages)
        self.tree = RadixTree(self.page_size, allocators)
        self.tree.on_evict = self._on_evict
        self.tree.on_drop = self._on_drop
        adopted = None
        if getattr(self.store, "persistent", False):  # what the file held at the last clean close
            adopted = l3_index.load(self)
            self.metrics.storage_adopted_pages = adopted.pages
        self.cost = CostModel(cfg, self.geometry.bytes_per_token)
        self.cost.learning = not self.simulate  # simulated copies take no time: keep the priors
        if adopted is not None and adopted.cost_samples:  # (timed on this machine by the engine before)
            l3_index.learn_costs(self, adopted.cost_samples, adopted.cost_references)
        self.cost_policy = CostPolicy(self)  # restore or recompute, write or not (the methods below)
        self.runner = OpRunner(self)

    def _open_store(self, storage_pages: int):
        cfg = self.config
        if self.simulate:
            from hicache.simulated import NullStore
            return NullStore(self.geometry, storage_pages)
        if cfg.storage_backend == "redis":
            from hicache.storage_redis import RedisStore
            return RedisStore(self.geometry, storage_pages, cfg.storage_url, model_id=cfg.model_id,
                              checksum=cfg.storage_checksum, faults=self.faults)
        from hicache.page_keys import kv_salt
        from hicache.storage import FileStore
        # (key_salt: each slot's checksum bound to its page's prefix key, as a Redis value to its key)
        return FileStore(self.geometry, storage_pages, path=cfg.storage_path, io_workers=cfg.io_workers,
                         checksum=cfg.storage_checksum, faults=self.faults, persistent=cfg.storage_persist,
                         key_salt=kv_salt(cfg.model_id, self.geometry))

    # -- tiers ---------------------------------------------------------------------------------
    @property
    def has_l2(self) -> bool:
        return self.l2 is not None

    @property
    def has_l3(self) -> bool:
        return self.store is not None

    @property
    def write_back(self) -> bool:  # (write_policy "write_back", with an L2: L1 keeps a prefix until it is saved)
        return self.has_l2 and self.config.write_policy == "write_back"

    def allocator(self, tier: Tier) -> PageAllocator:
        return self.tree.allocators[tier]

    def _on_evict(self, tier: Tier, node: Node, pages: list[int]) -> None:
        self.metrics.evictions_pages[tier.label] += len(pages)
        # a shared store's page outlives its local hint (other instances may read it): dropping the
        # hint says nothing of its reuse (counted, a writer whose pages others read stopped writing)
        shared = tier is Tier.L3 and getattr(self.store, "content_addressed", False)
        if tier in self.reuse and not self._flushing and not shared:
            self.reuse[tier].on_evicted(len(pages))
        if tier is Tier.L3 and self.store is not None:
            self.store.invalidate(pages)

    def _on_drop(self, tier: Tier, pages: list[int]) -> None:
        """Pages the tree dropped (corrupt or vanished): an L3 slot stops being readable in the store
        (regression: they stayed valid, and a stale read of a freed slot passed its checks)."""
        if tier is Tier.L3 and self.store is not None:
            self.store.invalidate(pages)

    def flush(self, tier: Tier, written_back: bool = False) -> int:
        """Evict every unlocked page of `tier` (an operator's flush, a benchmark's reset), but an L1 page
        write_back has not saved: it starts its backup (OpRunner.write_back_keep; not without a running
        loop) and stays (regression: the flush dropped every unsaved prefix). `flush_async` waits for
        those backups and leaves L1 empty. Write admission does not count a flush (it says nothing
        about the workload). Returns pages freed."""
        keep = None
        if tier is Tier.L1:
            self.runner.start_due()
            if self.write_back and not written_back:
                try:
                    asyncio.get_running_loop()
                    keep = self.runner.write_back_keep
                except RuntimeError:  # no loop to copy on: unsaved pages stay
                    keep = lambda node: not self.runner.saved_in_l2_or_l3(node)  # noqa: E731
        self._flushing = True
        try:
            return self.tree.evict(tier, self.allocator(tier).num_pages, keep=keep)
        finally:
            self._flushing = False

    async def flush_async(self, tier: Tier, write_back: bool = True, through_l3: bool = False) -> int:
        """`flush` after the backups in flight copied their L1 pages to L2 and, under write_back, every
        unlocked L1 page L2 and L3 lack was written back (OpRunner.write_back_l1), as a write-back cache
        writes its dirty pages back, then invalidates (not with `write_back` False: a flush of L2 follows,
        and they go). Every unlocked L1 page goes (L3 writes may still run; `through_l3`: waited for, a flush of
        L3 follows). written_back=True: the flush must not ask the write-back veto again (regression: it started
        a probe backup and left the leaf in L1 mid-copy). Returns pages freed."""
        if tier is Tier.L1:
            await self.runner.write_back_l1(unsaved=self.write_back and write_back, through_l3=through_l3)
        return self.flush(tier, written_back=True)

    # -- matching and L1 pages for requests ----------------------------------------------------
    def match(self, tokens: Sequence[int]) -> MatchResult:
        """The tiers' longest prefix of `tokens`. Due backups (OpRunner.backup_soon) start first:
        they lock the L1 pages they copy and may evict L2 leaves, which must not happen between a
        caller's match and its use of the result."""
        self.runner.start_due()
        return self.tree.match(tokens, include_storage=self.has_l3)

    def lock(self, node: Node | None, tier: Tier = Tier.L1) -> None:
        self.tree.lock(node, tier)

    def unlock(self, node: Node | None, tier: Tier = Tier.L1) -> None:
        self.tree.unlock(node, tier)

    def new_claim(self, label: str, tier: Tier = Tier.L1) -> int:
        return self.allocator(tier).new_claim(label)

    def release_claim(self, claim: int, tier: Tier = Tier.L1) -> int:
        """Free every page still private to `claim` and forget it; returns the pages freed."""
        alloc = self.allocator(tier)
        pages = alloc.pages_of(claim)
        alloc.free(pages, claim)
        alloc.close_claim(claim)
        return len(pages)

    def available_l1_pages(self) -> int:
        return self.l1.allocator.num_free + self.tree.evictable_pages(Tier.L1)

    def alloc_pages(self, tier: Tier, num_pages: int, claim: int) -> list[int] | None:
        """Private pages of `tier`, evicting that tier's unlocked LRU leaves when needed; None, with
        nothing evicted, when even evicting every unlocked page would not make room (regression: a
        backup longer than L2 or L3 could hold wiped that tier and was then skipped)."""
        alloc = self.allocator(tier)
        if alloc.num_free < num_pages:
            if tier is Tier.L1:  # due backups lock what they copy before L1 evicts
                self.runner.start_due()
            if alloc.num_free + self.tree.evictable_pages(tier) < num_pages:
                return None
            keep = self._write_back_keep(num_pages - alloc.num_free) if tier is Tier.L1 else None
            self.tree.evict(tier, num_pages - alloc.num_free, keep=keep)
        return alloc.alloc(num_pages, claim)

    def _write_back_keep(self, want_pages: int) -> Callable[[Node], bool] | None:
        """Under write_back, the veto of an L1 eviction that frees `want_pages`: unsaved LRU leaves
        are backed up first (Backups.write_back_keep), until backups of `want_pages` are on their
        way (those whose copy runs count: a retry while they run is no reason for more); later
        unsaved leaves stay unsaved, saved ones still go (regression: every unsaved leaf of L1 was
        vetoed and copied to L2 to free one page, and each retry copied more)."""
        if not self.write_back:
            return None
        on_way_pages = sum(op.num_pages for op in self.runner.live.values()
                           if op.kind is OpKind.BACKUP and op.state is OpState.D2H_PENDING)

        def keep(node: Node) -> bool:
            nonlocal on_way_pages
            if self.runner.saved_in_l2_or_l3(node):
                return False
            if on_way_pages >= want_pages:
                return True
            if self.runner.write_back_keep(node):
                on_way_pages += len(node.pages[Tier.L1])
                return True
            return False
        return keep

    def l1_room_coming(self) -> bool:
        """Whether L1 pages that an allocation could not have now are on their way: backups are copying L1
        pages, evictable once copied (under write_back the leaves an eviction must free, saved first; under
        write_through the pages a due backup locked as the allocation started it, pages the caller had counted
        on), so a caller that found no room waits for them rather than give up. (Regression, session 55: under
        write_through a preempted request's resumption failed its L3 restore's H2D, failures["no_pages"].)"""
        return self.backups_copying()

    def backups_copying(self) -> bool:
        """Whether a backup is copying L1 pages (its D2H): they are locked until copied, then evictable."""
        return any(op.kind is OpKind.BACKUP and op.state is OpState.D2H_PENDING for op in self.runner.live.values())

    async def l1_room_saved(self) -> None:
        """Wait until a backup that `l1_room_coming` counts has copied its L1 pages (its leaf may go
        now; the caller allocates again)."""
        copying = [op.payload["l1_free"] for op in self.runner.live.values()
                   if op.kind is OpKind.BACKUP and op.state is OpState.D2H_PENDING]
        if copying:
            await asyncio.wait(copying, return_when=asyncio.FIRST_COMPLETED)

    def alloc_l1(self, num_pages: int, claim: int) -> list[int] | None:
        return self.alloc_pages(Tier.L1, num_pages, claim)

    def insert_l1(self, tokens: Sequence[int], pages: Sequence[int], claim: int, start_tokens: int,
                  backup: bool = True) -> list[int]:
        """Publish a request's private pages for tokens[start_tokens:] (page aligned). Returns the
        duplicates of what L1 already held: still private to `claim`, for the caller to free.
        backup=False: no write-through backup now (a prompt chunk's pages: `back_up_l1` with the
        prompt's, later)."""
        if len(tokens) <= start_tokens:
            return []
        duplicates = self.tree.insert(tokens, Tier.L1, pages, claim, start_tokens=start_tokens)
        if backup:
            self.back_up_l1(tokens)
        return duplicates

    def back_up_l1(self, tokens: Sequence[int]) -> None:
        """Under write_through, back up the published L1 prefix `tokens` (what L2 lacks of it)."""
        if self.has_l2 and self.config.write_policy == "write_through":
            if self.defer_backups:
                self.runner.backup_soon(tokens)
            else:
                self.runner.start_backup(tokens)

    def free_pages(self, tier: Tier, pages: Sequence[int], claim: int) -> None:
        self.allocator(tier).free(pages, claim)

    def note_hit(self, tokens: Sequence[int], match: MatchResult) -> None:
        """A request reused this prefix: count hits per node (write_through_selective backs up the L1 hit's nodes on
        their second, as SGLang's per-node count; a node's count is never above its parent's). Regression: only the
        deepest node's count was asked, and a conversation's history, matched each turn through the node its last
        turn published, was never backed up."""
        for node in match.path:
            node.hits += 1
        if not (self.has_l2 and self.config.write_policy == "write_through_selective"):
            return
        hot_tokens = 0  # the L1 hit's nodes hit twice, from the root
        for node in match.path:
            if node.hits < 2 or hot_tokens + len(node.key) > match.lengths[Tier.L1]:
                break
            hot_tokens += len(node.key)
        if hot_tokens:
            self.runner.start_backup(tuple(tokens[:hot_tokens]))

    # -- the cost policy's questions: CostPolicy answers them (hicache/cost_policy.py) ------------
    def whole_first_pages(self, num_pages: int, tail_tokens: int = 0) -> int:
        return self.cost_policy.whole_first_pages(num_pages, tail_tokens)

    def decide(self, match: MatchResult, *args, **kwargs) -> Decision:  # (the options: CostPolicy.decide)
        return self.cost_policy.decide(match, *args, **kwargs)

    def declines_restore(self, match: MatchResult, decision: Decision) -> bool:
        return self.cost_policy.declines_restore(match, decision)

    def worth_writing(self, tier: str, num_tokens: int) -> bool:
        return self.cost_policy.worth_writing(tier, num_tokens)

    def backup_worth_its_cost(self, new_tokens: int) -> bool:
        return self.cost_policy.backup_worth_its_cost(new_tokens)

    def l3_write_pays_off(self) -> bool:
        return self.cost_policy.l3_write_pays_off()

    def l3_reuse_probe(self) -> bool:
        return self.cost_policy.l3_reuse_probe()

    def backup_pays_off(self, num_tokens: int) -> bool:
        return self.cost_policy.backup_pays_off(num_tokens)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        self.cost_policy.observe_prefill(num_tokens, seconds)

    def observe_outcome(self, source: str, plan: tuple, actual_s: float) -> None:
        self.cost_policy.observe_outcome(source, plan, actual_s)

    # -- shared (content-addressed) L3 ---------------------------------------------------------
    def page_keys(self, tokens: Sequence[int], start_tokens: int, end_tokens: int) -> dict:
        """Extra keyword arguments for store I/O: the content keys of pages [start, end) when the
        store is content addressed (shared between instances) or binds its checksums to them (a file
        L3 with checksums, FileStore.binds_keys: a slot read under another prefix fails), else nothing."""
        if not (getattr(self.store, "content_addressed", False) or getattr(self.store, "binds_keys", False)):
            return {}
        return {"keys": self.store.page_keys(tokens, start_tokens, end_tokens)}

    async def refresh_l3_hints(self, tokens: Sequence[int]) -> None:
        """For a shared store, L3 residency is a hint: ask the store which pages of this prefix exist
        (batched) and record them in the tree before the request is matched."""
        refresh = getattr(self.store, "refresh_hints", None)
        if refresh is not None:
            await refresh(self, tokens)

    async def recheck_l3_hints(self, tokens: Sequence[int], hinted_tokens: int) -> bool:
        """Before a backup writes to a shared store past tokens[:hinted_tokens], which the tree hints
        are there: drop the hints of pages gone since (RedisStore.recheck_hints). A local file L3's
        residency is this process's own writes, never a hint: nothing to check. Returns whether the
        store was asked (the tree may have changed)."""
        recheck = getattr(self.store, "recheck_hints", None)
        if recheck is None:
            return False
        await recheck(self, tokens, hinted_tokens)
        return True

    # -- lifecycle -----------------------------------------------------------------------------
    def pending_ops(self) -> int:
        return len(self.runner.live)

    def pending_restores(self) -> int:
        """Live restores and prefetches (what a parked request waits for); backups excluded."""
        return sum(op.kind is not OpKind.BACKUP for op in self.runner.live.values())

    async def drain(self, cancel: bool = False) -> None:
        """Wait until no operation is in flight: start the backups queued by `backup_soon` (a request that just
        finished queued its own), then wait for every op's driver, for the backups that start as those they
        waited for end, and for every abandoned copy's settling. Not: write_back's unsaved L1 pages (saved as
        they are evicted, or by `flush_async`), nor what requests still running queue after it returned.
        cancel: drop the queued backups and ask every live op to stop (shutdown's)."""
        await self.runner.drain(cancel=cancel)

    async def release_loop(self) -> None:
        """The running loop ends (the tiers stay open): a store holding connections of this loop
        closes them (the Redis L3)."""
        release = getattr(self.store, "release_loop", None)
        if release is not None:
            await release()

    def abandon(self) -> None:
        """Close what this manager opened, at once, for an engine that failed to start (no operation ran): the
        transfer's streams and the L3 store, whose file lock a retry on the same path needs (regression: it stayed
        locked until the half-built engine was collected). An index adopted from a kept file is saved again, as it
        was read (regression: deleted as it was read, the next start lost the whole L3). The store closes whatever
        the streams' close or the save raised (as `close`; regression: its file stayed locked, a retry was refused)."""
        store_open = self.store is not None and not getattr(self.store, "closed", False)
        try:
            if self.transfer is not None:
                self.transfer.close()
            if store_open and self.metrics.storage_adopted_pages and hasattr(self, "runner"):
                l3_index.save(self)
        finally:
            if store_open:
                self.store.close()

    def abandon_all(self) -> None:
        """`abandon`, then let go at once of all it holds, its pools' tensors with the rest: its tree's callbacks,
        cost policy and op runner refer back to it, a cycle only the cyclic gc frees (regression: a refused engine's
        L1 and pinned L2 stayed allocated till then, and a retry in the same process found that much less memory)."""
        try:
            self.abandon()
        finally:
            vars(self).clear()

    async def close(self) -> None:
        await self.runner.drain(cancel=True)
        try:
            if self.transfer is not None:
                self.transfer.close()
            if getattr(self.store, "persistent", False) and not self.store.closed:
                l3_index.save(self)  # (nothing moves now: the next engine on this file adopts it)
        finally:
            # the store closes whatever that raised (a device error re-raised by the copy streams' synchronize):
            # regression, its file, threads and lock stayed, and the next engine on the path was refused
            if self.store is not None:
                closer = getattr(self.store, "aclose", None)
                if closer is not None:
                    await closer()
                else:
                    self.store.close()

    # -- observability and integrity (the views: hicache/inspection.py) --------------------------
    def tier_status(self, tier: Tier) -> dict | None:
        return inspection.tier_status(self, tier)

    def status(self) -> dict:
        return inspection.manager_status(self)

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        self.runner.check_integrity()
        inspection.check_store(self.store, self.tree)
