"""A shared Redis L3's hints (hicache/storage_redis.py's RedisStore is a RedisHints): which of a prompt's full pages
Redis holds, published in the tree as L3 slots, and the pages of a prefix whose reuse gave NaN logits, deleted.

Hints. `refresh_hints(mgr, tokens)` asks which of the prompt's full pages exist, in one round trip (a tiny Lua script
that TOUCHes the keys in order and returns how many exist contiguously from the first; TOUCH refreshes their LRU age,
as a read is likely to follow; a plain pipeline of EXISTS where scripting is refused), then publishes local L3 slots
for the pages beyond the tree's current L3 match and drops hints whose pages are gone. A backup about to write to L3
past hinted pages asks the same of those pages first (`recheck_hints`): hints of a prefix that L1/L2 serve are never
refreshed otherwise, and a flush, a restart or an eviction would keep it out of Redis for good.

Suspect pages. A prefix whose reuse gave NaN logits (hicache/suspect.py) is deleted from Redis, off the request's
path; keys whose deletion failed are never hinted until deleted or written again (`delete_suspect`).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog
from redis import exceptions as rexc

from hicache.page_keys import publish_l3_hints
from hicache.radix import Tier
from hicache.storage import StorageError

if TYPE_CHECKING:
    from hicache.manager import CacheManager

log = structlog.get_logger("hicache.storage_redis")

# How many keys exist contiguously from the first one (TOUCH also refreshes their LRU age).
PREFIX_SCRIPT = """
for i, k in ipairs(KEYS) do
  if redis.call('TOUCH', k) == 0 then return i - 1 end
end
return #KEYS
"""
# (regressions: BUSY was taken for scripting refused; redis-py 8 strips OOM's and MASTERDOWN's codes from messages)
_PASSING_ERRORS = (rexc.OutOfMemoryError, rexc.MasterDownError, rexc.BusyLoadingError, rexc.TryAgainError)
_PASSING_CODES = ("OOM", "BUSY", "MASTERDOWN", "LOADING", "TRYAGAIN")


class RedisHints:
    """RedisStore's hints and suspect pages (its client, back-off, counters and tasks are the store's)."""

    # ---- hints -----------------------------------------------------------------------------------
    async def count_present(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` exist contiguously from the first (one round trip)."""
        self._check_available()
        client = self._client()
        try:
            if self._script_ok:
                try:
                    return int(await self._prefix_script(keys=list(keys)))
                except rexc.ResponseError as exc:
                    if isinstance(exc, _PASSING_ERRORS) or str(exc).startswith(_PASSING_CODES):
                        raise
                    # (NOSCRIPT after redis-py's reload: flushed again in between; EXISTS this once. Regression:
                    # taken for scripting refused, this client never ran the script again)
                    if not isinstance(exc, rexc.NoScriptError):
                        self._script_ok = False  # scripting refused (ACL, disabled): plain EXISTS instead
                        log.warning("l3_redis_no_scripting", error=str(exc))
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            found = await pipe.execute()
            return next((i for i, n in enumerate(found) if not n), len(keys))
        except Exception as exc:
            raise self._error(exc, "existence query") from exc

    async def refresh_hints(self, mgr: "CacheManager", tokens: Sequence[int]) -> None:
        """Record in mgr's tree which of tokens' full pages Redis holds (see the module docstring).
        No query when L3 cannot help: restores disabled, or L1/L2 already hold every full page."""
        ps = self.geometry.page_size
        end = len(tokens) - len(tokens) % ps
        if end == 0 or self._closed or mgr.config.policy == "never" or await self.refusals.refused_reads(self._client):
            return
        tokens = tuple(tokens[:end])
        local = mgr.tree.match(tokens, include_storage=False, touch=False)
        if max(local.lengths[Tier.L1], local.lengths[Tier.L2]) >= end:
            self.counters["hints_not_needed"] += 1
            return
        if time.monotonic() < self._down_until:
            self.counters["hint_skips"] += 1  # backing off a dead server: no hints, no wait
            return
        await self.settle_deletes()  # (else it could find a suspect prefix about to be deleted)
        keys = self.page_keys(tokens, 0, end)
        suspect = [k for k in keys if k in self._suspect]
        if suspect:
            self.delete_suspect(suspect)  # (again: their deletion failed)
            await self.settle_deletes()
        self.counters["hint_queries"] += 1
        hinted_tokens = mgr.tree.match(tokens, include_storage=True, touch=False, split=False).lengths[Tier.L3]
        try:
            present = await asyncio.wait_for(self._present_now(keys), self.hint_timeout_s)
        except asyncio.TimeoutError:
            raise self._error(asyncio.TimeoutError(), f"existence query slower than {self.hint_timeout_s} s") \
                from None
        self._succeeded()
        held = present  # what the tree may hint: the reply, or more
        if present * ps >= hinted_tokens:
            # L3 pages the tree gained while the query was in flight were written since (this engine's own
            # writes publish once done): the reply is older than them, not a sign they vanished (regression:
            # dropped as stale, and the next backup wrote them to Redis again)
            now_tokens = mgr.tree.match(tokens, include_storage=True, touch=False, split=False).lengths[Tier.L3]
            held = max(present, now_tokens // ps)
        if self._suspect:  # (still there: not hinted, the request recomputes them)
            first = next((i for i, k in enumerate(keys[:held]) if k in self._suspect), held)
            present, held = min(present, first), first
        self.counters["hint_pages_found"] += present
        published, dropped = publish_l3_hints(mgr, tokens, held * ps)
        self.counters["hint_pages_published"] += published
        self.counters["stale_hints_dropped"] += dropped

    async def _present_now(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, Redis holds (`count_present`), counting those this store wrote while
        the query was in flight: the reply may be older than such a write (a sibling backup's, after its recheck
        dropped the same stale hints), which published them (regression, in the refresh and the recheck: the hints
        that write had just published were dropped as stale, and the pages written to Redis again)."""
        written: set[bytes] = set()  # (filled by `_write`)
        self._rechecking[id(written)] = written
        try:
            present = await self.count_present(keys)
        finally:
            del self._rechecking[id(written)]
        while present < len(keys) and keys[present] in written:
            present += 1
        return present

    async def recheck_hints(self, mgr: "CacheManager", tokens: Sequence[int], hinted_tokens: int) -> None:
        """A backup is about to write tokens' pages to L3 past tokens[:hinted_tokens] (page aligned),
        which the tree hints are there: check that they still are, in one round trip, and drop the
        hints from the first page gone on, so that the write puts them back.
        Why at the write: an engine holding a prefix in L1/L2 never queries its hints (refresh_hints
        skips them by design) nor reads its pages, so its hints outlived a flush, a restart or an LRU
        eviction of the pages, and its backups wrote only the new pages: the prefix never reached
        Redis again and other instances lost its hits (regression). A restart's run_id or a sentinel
        key would miss single keys that LRU evicts (the usual case under allkeys-lru: this engine
        never touches the keys of what it serves locally), and aged hints would re-query per request;
        this costs one small script call per backup that gets to its L3 write over hinted pages, off
        the request's path; its TOUCH also keeps the prefix this engine extends young in Redis's LRU.
        A check that fails (a server down) leaves the hints: the write that follows tells (as it
        does at once where writes are refused: no check then; the limits read again first where due,
        else a write that a raised limit lets through skipped the check: regression)."""
        ps = self.geometry.page_size
        hinted_tokens -= hinted_tokens % ps
        if (hinted_tokens <= 0 or self._closed or time.monotonic() < self._down_until
                or await self.refusals.refused_writes(self._client) is not None):
            return
        tokens = tuple(tokens[:hinted_tokens])
        self.counters["hint_rechecks"] += 1
        keys = self.page_keys(tokens, 0, hinted_tokens)
        try:
            present = await asyncio.wait_for(self._present_now(keys), self.hint_timeout_s)
        except asyncio.TimeoutError:
            self._error(asyncio.TimeoutError(), f"existence query slower than {self.hint_timeout_s} s")
            return
        except StorageError:  # (counted by count_present)
            return
        self._succeeded()
        if present * ps < hinted_tokens:
            _, dropped = publish_l3_hints(mgr, tokens, present * ps)
            self.counters["stale_hints_dropped"] += dropped

    # ---- suspect pages ---------------------------------------------------------------------------
    def delete_suspect(self, keys: Sequence[bytes]) -> None:
        """Delete `keys`, pages of a prefix whose reuse gave NaN logits (hicache/suspect.py), best
        effort and off the request's path. A NaN page passes its checks (the checksum is its own), so
        the next hint refresh found the pages again and every request for that prefix, on every
        instance, restored them and failed (regression). A read of a deleted key fails "missing" and
        recomputes. Keys not deleted (the server down, backed off, timing out, or refusing DEL) are
        kept until a deletion or a write of this store's replaces them: a hint refresh of their
        prompt asks again to delete them and never hints them (regression: it found them again, and
        the next request restored them and failed too)."""
        if not keys or self._closed:
            return
        self._suspect.update(keys)
        if time.monotonic() < self._down_until:
            return
        task = asyncio.get_running_loop().create_task(self._delete(list(keys)))
        self._tasks.add(task)
        self._deletes.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._deletes.discard)

    async def _delete(self, keys: list[bytes]) -> None:
        try:
            deleted = await self._client().delete(*keys)
        except Exception as exc:  # noqa: BLE001 - best effort (counted; a connection error backs off)
            self._error(exc, "delete")
            return
        self._succeeded()
        self._suspect.difference_update(keys)
        self.counters["suspect_pages_deleted"] += int(deleted)

    async def settle_deletes(self) -> None:
        """Wait for this loop's deletions in flight, at most the hint timeout."""
        loop = asyncio.get_running_loop()
        pending = [t for t in self._deletes if t.get_loop() is loop]
        if pending:
            await asyncio.wait(pending, timeout=self.hint_timeout_s)
