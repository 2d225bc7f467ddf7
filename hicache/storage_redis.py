"""A shared L3 on Redis: content-addressed KV pages that many serving instances read and write (DESIGN.md section 12).

Addressing. A page's Redis key is `hicache:kv:<hex>` with <hex> the chained hash of the token prefix through that
page, salted with model identity, dtype, page size, KV geometry and rank (hicache/page_keys.py). The `slots` the op
drivers pass are only local handles from the tree's L3 allocator (the capacity of this instance's hint table); the key
is what addresses the data, so `invalidate()` is a no-op: another instance may still use the page, and Redis's own
eviction policy (maxmemory + allkeys-lru) decides what stays.

Values. A header binding the value to its key, then the page (hicache/redis_values.py). A missing key or a bad value
fails the operation with StorageError("missing" / "checksum", bad_slots=...) so the caller drops the hint and
recomputes: never a wrong output. Connection errors and timeouts -> "eio" (and a short back-off during which
operations fail at once instead of waiting on a dead server; a command is sent once more only after its connection
dropped, never after a timeout); OOM under `noeviction` -> "enospc". A hint query's OOM, MASTERDOWN, BUSY or LOADING
is the server's passing state (hicache/redis_hints.py `_PASSING_ERRORS`), not scripting refused.

Start. One PING, and the server's limits read (hicache/redis_limits.py): a server that cannot be
used, one that never evicts, and one whose limits refuse a page's value (writes or reads refused at
once, one warning naming the setting) are each one log line; the engine starts all the same.
While they refuse, the limits are read again at most every 30 s (`Refusals`): a fix needs no restart.

I/O. redis.asyncio on the running loop (a new client when the loop changes: `Engine.generate` runs each call on a
fresh loop). Each operation is one command per chunk of at most `chunk_bytes` (MSET / MGET, 8 MiB: a few round trips
a restore; an MGET within the server's output buffer limit, "Start"); packing values (hash + copy) and unpacking them
(verify + copy into the host pages) run on one helper thread when a chunk is large, so the loop keeps serving. A reply
is parsed on the loop, by hiredis (C): a 32 MiB chunk held the loop 13-25 ms (20-25 with redis-py's Python parser),
an 8 MiB one 2.5-3 ms (this 2-core machine; an 8B read of 64 pages).

Hints. Which of a prompt's pages Redis holds, and the pages of a prefix that gave NaN logits
(hicache/redis_hints.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time
from collections.abc import Sequence

import numpy as np
import redis.asyncio as aioredis
import structlog
import torch
from redis import exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from hicache.faults import Fault, FaultInjector
from hicache.geometry import KVGeometry
from hicache.page_keys import PageKeyer, kv_salt
from hicache.redis_hints import PREFIX_SCRIPT, RedisHints
from hicache.redis_limits import Refusals, check_server, redact_url
from hicache.redis_values import HEADER, check_value, pack_value
from hicache.storage import IoResult, StorageError

log = structlog.get_logger("hicache.storage_redis")

KEY_PREFIX = b"hicache:kv:"
OFFLOAD_BYTES = 1 << 20  # chunks at least this large are packed / unpacked on the helper thread


def _retry_dropped_connections() -> Retry:
    """Send a command once more on a fresh connection after its connection dropped (a restarted
    server's first command finds the pooled connection closed), not after a timeout: a hung server
    then held each operation twice its socket timeout (regression)."""
    return Retry(NoBackoff(), 1, supported_errors=(rexc.ConnectionError,))


class RedisStore(RedisHints):
    """L3 pages in Redis, addressed by content keys; see the module docstring."""

    content_addressed = True

    def __init__(self, geometry: KVGeometry, num_slots: int, url: str | None, model_id: str,
                 checksum: bool = True, faults: FaultInjector | None = None, *, rank: int = 0,
                 chunk_bytes: int = 8 << 20, hint_timeout_s: float = 2.0, socket_timeout_s: float = 5.0,
                 connect_timeout_s: float = 2.0, backoff_s: tuple[float, float] = (0.25, 8.0),
                 limits_recheck_s: float | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if not url:
            raise ValueError("the redis L3 backend needs a URL (--hicache-storage-url redis://HOST:PORT/DB)")
        self.geometry, self.num_slots, self.url = geometry, int(num_slots), url
        self.bytes_per_page = geometry.bytes_per_page
        self.model_id, self.checksum, self.faults = model_id, bool(checksum), faults
        self.salt = kv_salt(model_id, geometry, rank=rank)
        self.keyer = PageKeyer(self.salt, geometry.page_size)
        self.value_bytes = HEADER.size + self.bytes_per_page  # one stored value
        self.pages_per_chunk = max(1, min(1024, chunk_bytes // self.value_bytes))
        self.hint_timeout_s, self.backoff_s = hint_timeout_s, backoff_s
        self._client_kwargs = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s,
                                   retry=_retry_dropped_connections(), decode_responses=False,
                                   socket_read_size=1 << 20)
        aioredis.from_url(url, **self._client_kwargs)  # validates the URL now (connects lazily)
        self._redis: aioredis.Redis | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._script_ok, self._prefix_script = True, None
        self._cpu = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-redis-cpu")
        self._tasks: set[asyncio.Task] = set()
        self._deletes: set[asyncio.Task] = set()  # suspect pages' deletions in flight (a hint refresh waits)
        self._suspect: set[bytes] = set()  # suspect pages' keys not deleted yet (never hinted; `delete_suspect`)
        self._rechecking: dict[int, set[bytes]] = {}  # per hint query in flight: the keys written since it asked
        self._closed = False
        self._down_until = 0.0
        self._consecutive_failures = 0
        self.refusals = Refusals(url, self.value_bytes, geometry.page_size, check_server(url, self.value_bytes),
                                 limits_recheck_s, hint_timeout_s)  # what the server's limits refuse now
        self.counters = {"writes": 0, "reads": 0, "pages_written": 0, "pages_read": 0, "bytes_written": 0,
                         "bytes_read": 0, "round_trips": 0, "missing_pages": 0, "corrupt_pages": 0,
                         "hint_queries": 0, "hint_pages_found": 0, "hint_pages_published": 0,
                         "stale_hints_dropped": 0, "hint_skips": 0, "hints_not_needed": 0,
                         "hint_rechecks": 0, "suspect_pages_deleted": 0}
        self.errors: dict[str, int] = {}

    # ---- connection ------------------------------------------------------------------------------
    def _client(self) -> aioredis.Redis:
        loop = asyncio.get_running_loop()
        if self._redis is None or self._loop is not loop:
            # a client's connections belong to the loop that opened them; an old loop is gone
            self._redis = aioredis.from_url(self.url, **self._client_kwargs)
            self._prefix_script = self._redis.register_script(PREFIX_SCRIPT)  # EVALSHA, loads on NOSCRIPT
            self._loop, self._script_ok = loop, True
        return self._redis

    def _check_available(self) -> None:
        if self._closed:
            raise StorageError("closed", f"redis L3 {redact_url(self.url)} is closed")
        wait_s = self._down_until - time.monotonic()
        if wait_s > 0:
            raise StorageError("eio", f"redis L3 {redact_url(self.url)} unavailable (retry in {wait_s:.2f} s)")

    def _succeeded(self) -> None:
        """The server answered (a read that missed a page too): the outage, if any, is over."""
        self._consecutive_failures, self._down_until = 0, 0.0

    def _error(self, exc: BaseException, what: str) -> StorageError:
        """Map a client error to a StorageError, count it, and back off after connection errors."""
        if isinstance(exc, StorageError):
            err = exc
        elif isinstance(exc, rexc.OutOfMemoryError) or (
                isinstance(exc, rexc.ResponseError) and str(exc).startswith("OOM")):
            err = StorageError("enospc", f"redis {what}: out of memory (maxmemory with noeviction): {exc}")
        else:
            err = StorageError("eio", f"redis {what}: {type(exc).__name__}: {exc}")
            now_s = time.monotonic()
            # (one while already backing off is an operation sent before: it does not count, or the ops in
            # flight at one dropped connection doubled the first back-off once each)
            if isinstance(exc, (rexc.ConnectionError, rexc.TimeoutError, OSError, asyncio.TimeoutError)) \
                    and now_s >= self._down_until:
                self._consecutive_failures += 1
                lo, hi = self.backoff_s
                # (the exponent capped: after ~1,025 failures in a row, 2 ** n overflowed a float)
                self._down_until = now_s + min(hi, lo * 2 ** min(self._consecutive_failures - 1, 32))
        self.errors[err.kind] = self.errors.get(err.kind, 0) + 1
        return err

    # ---- keys ------------------------------------------------------------------------------------
    def page_keys(self, tokens: Sequence[int], start_tokens: int, end_tokens: int) -> list[bytes]:
        """Redis keys of the pages covering tokens[start_tokens:end_tokens] (page aligned)."""
        return [KEY_PREFIX + d.hex().encode() for d in self.keyer.keys(tokens, start_tokens, end_tokens)]

    # ---- page I/O --------------------------------------------------------------------------------
    def write_pages(self, host_buffer: torch.Tensor, host_pages: Sequence[int], slots: Sequence[int],
                    keys: Sequence[bytes]) -> asyncio.Future:
        """Store host_buffer[host_pages[i]] under keys[i]; a task resolving to IoResult."""
        return self._submit(False, host_buffer, host_pages, slots, keys)

    def read_pages(self, slots: Sequence[int], host_buffer: torch.Tensor, host_pages: Sequence[int],
                   keys: Sequence[bytes]) -> asyncio.Future:
        """Load keys[i] into host_buffer[host_pages[i]]; a task resolving to IoResult."""
        return self._submit(True, host_buffer, host_pages, slots, keys)

    def _submit(self, is_read: bool, host_buffer: torch.Tensor, host_pages: Sequence[int],
                slots: Sequence[int], keys: Sequence[bytes]) -> asyncio.Future:
        if self._closed:
            raise StorageError("closed", f"redis L3 {redact_url(self.url)} is closed")
        loop = asyncio.get_running_loop()
        pages = self._page_view(host_buffer)
        host_arr = np.asarray(host_pages, dtype=np.int64).reshape(-1)
        slot_arr = np.asarray(slots, dtype=np.int64).reshape(-1)
        keys = list(keys)
        if not len(host_arr) == len(slot_arr) == len(keys):
            raise ValueError(f"{len(host_arr)} host pages, {len(slot_arr)} slots and {len(keys)} keys")
        if len(host_arr) and (host_arr.min() < 0 or host_arr.max() >= pages.shape[0]):
            raise ValueError(f"host page out of range [0, {pages.shape[0]})")
        if len(slot_arr) and (slot_arr.min() < 0 or slot_arr.max() >= self.num_slots):
            raise ValueError(f"slot out of range [0, {self.num_slots})")
        if is_read and len(np.unique(host_arr)) != len(host_arr):
            raise ValueError("duplicate destination host pages in one operation")
        if not len(keys):
            done = loop.create_future()
            done.set_result(IoResult(0, 0, 0, 0))
            return done
        coro = (self._read if is_read else self._write)(pages, host_buffer, host_arr, slot_arr, keys,
                                                        time.monotonic_ns())
        task = loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _page_view(self, host_buffer: torch.Tensor) -> np.ndarray:
        """[num_pages, bytes_per_page] uint8 numpy view of the caller's buffer (no copy)."""
        if not isinstance(host_buffer, torch.Tensor):
            raise TypeError(f"host_buffer must be a torch.Tensor, got {type(host_buffer).__name__}")
        if host_buffer.device.type != "cpu" or not host_buffer.is_contiguous() or host_buffer.dim() == 0:
            raise ValueError("host_buffer must be a contiguous CPU tensor with pages on dim 0")
        flat = host_buffer.detach()
        flat = (flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)).reshape(-1)
        if flat.numel() != host_buffer.shape[0] * self.bytes_per_page:
            raise ValueError(f"host_buffer holds {flat.numel()} bytes for {host_buffer.shape[0]} pages; "
                             f"store pages are {self.bytes_per_page} bytes")
        return flat.numpy().reshape(host_buffer.shape[0], self.bytes_per_page)

    def _chunks(self, n: int, is_read: bool = False):
        per = self.pages_per_chunk
        if is_read and self.refusals.reply_pages is not None:
            per = min(per, self.refusals.reply_pages)  # (each reply within the server's output buffer limit)
        return [(s, min(n, s + per)) for s in range(0, n, per)]

    async def _on_cpu(self, fn, *args):
        """Run fn on the helper thread when the work is large, inline when it is not."""
        if len(args[-1]) * self.bytes_per_page >= OFFLOAD_BYTES:
            try:
                future = asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)
            except RuntimeError:  # close() shut the thread down under an operation in flight (not a bug, nor eio)
                raise StorageError("closed", f"redis L3 {redact_url(self.url)} closed during the operation") from None
            return await future
        return fn(*args)

    def _pack(self, pages: np.ndarray, keys: list[bytes], host: np.ndarray) -> list[bytes]:
        return [pack_value(memoryview(pages[h]), key) for key, h in zip(keys, host.tolist())]

    def _unpack(self, pages: np.ndarray, values: list, keys: list[bytes], host: np.ndarray) -> list[tuple[int, str]]:
        """Copy valid values into their host pages; (index, why) of the invalid ones; a short reply raises."""
        bad = []
        for i, (value, key, h) in enumerate(zip(values, keys, host.tolist(), strict=True)):
            why = check_value(value, key, self.bytes_per_page, self.checksum)
            if why is None:
                pages[h] = np.frombuffer(value, dtype=np.uint8, offset=HEADER.size)
            else:
                bad.append((i, why))
        return bad

    def _injected(self, is_read: bool) -> StorageError | None:
        faults = self.faults
        if faults is None:
            return None
        if is_read and faults.should_fire(Fault.EIO_READ):
            return StorageError("eio", "injected eio_read")
        if not is_read and faults.should_fire(Fault.EIO_WRITE):
            return StorageError("eio", "injected eio_write")
        if not is_read and faults.should_fire(Fault.ENOSPC_WRITE):
            return StorageError("enospc", "injected enospc_write")
        return None

    async def _write(self, pages, buffer_ref, host_arr, slot_arr, keys, submit_ns) -> IoResult:
        self._check_available()
        if await self.refusals.refused_writes(self._client) is not None:
            raise self._error(StorageError("enospc", f"redis write: {self.refusals.writes}"), "write")
        injected = self._injected(False)
        if injected is not None:
            raise self._error(injected, "write")
        client = self._client()
        first_ns, chunks = time.monotonic_ns(), self._chunks(len(keys))
        for lo, hi in chunks:
            # what packing raises is this process's bug, not the server's: it goes out as itself (regression:
            # counted as the write's "eio", as unpacking a read's reply was)
            values = await self._on_cpu(self._pack, pages, keys[lo:hi], host_arr[lo:hi])
            try:
                await client.mset(dict(zip(keys[lo:hi], values)))
                self.counters["round_trips"] += 1
                self._succeeded()  # (before a later chunk's refusal fails the write, as a read's round trip)
            except Exception as exc:
                if await self.refusals.write_failed(self._client, exc) is not None:
                    raise self._error(StorageError("enospc", f"redis write: {self.refusals.writes}"),
                                      "write") from exc
                raise self._error(exc, "write") from exc
        self.refusals.write_succeeded()
        for written in self._rechecking.values():
            written.update(keys)
        if self._suspect:  # (clean pages now, recomputed: this engine's backups copy no dropped page)
            self._suspect.difference_update(keys)
        num_bytes = len(keys) * self.bytes_per_page
        self.counters["writes"] += 1
        self.counters["pages_written"] += len(keys)
        self.counters["bytes_written"] += num_bytes
        return IoResult(num_bytes, len(chunks), first_ns - submit_ns, time.monotonic_ns() - first_ns)

    async def _read(self, pages, buffer_ref, host_arr, slot_arr, keys, submit_ns) -> IoResult:
        self._check_available()
        faults = self.faults
        if faults is not None and faults.should_fire(Fault.SLOW_READ):
            await asyncio.sleep(faults.delay_s(Fault.SLOW_READ))
        if await self.refusals.refused_reads(self._client) is not None:  # (no back-off: hints and writes go on)
            raise self._reads_refused(slot_arr)
        injected = self._injected(True)
        if injected is not None:
            raise self._error(injected, "read")
        client = self._client()
        first_ns, chunks = time.monotonic_ns(), self._chunks(len(keys), True)
        for lo, hi in chunks:
            try:
                values = await client.mget(keys[lo:hi])
                self.counters["round_trips"] += 1
                if len(values) != hi - lo:  # (the server's fault: `_unpack` would raise)
                    raise rexc.DataError(f"MGET of {hi - lo} keys answered {len(values)} values")
                self._succeeded()  # (before a missing page fails the read; regression: it did not count)
            except Exception as exc:
                if await self.refusals.read_failed(self._client, exc) is not None:  # (a limit lowered meanwhile)
                    raise self._reads_refused(slot_arr) from exc
                raise self._error(exc, "read") from exc
            # what unpacking raises is this process's bug, not the server's: it goes out as itself (regression:
            # counted as the read's "eio", or taken for reads refused meanwhile, every slot named bad)
            bad = await self._on_cpu(self._unpack, pages, values, keys[lo:hi], host_arr[lo:hi])
            if bad:
                await self._fail_read(client, bad, lo, slot_arr, keys)
        num_bytes = len(keys) * self.bytes_per_page
        self.counters["reads"] += 1
        self.counters["pages_read"] += len(keys)
        self.counters["bytes_read"] += num_bytes
        return IoResult(num_bytes, len(chunks), first_ns - submit_ns, time.monotonic_ns() - first_ns)

    def _reads_refused(self, slot_arr) -> StorageError:
        return self._error(StorageError("eio", f"redis read: {self.refusals.reads}", bad_slots=slot_arr.tolist()),
                           "read")

    async def _fail_read(self, client, bad: list[tuple[int, str]], lo: int, slot_arr, keys) -> None:
        missing = [lo + i for i, why in bad if why == "missing"]
        corrupt = [lo + i for i, why in bad if why != "missing"]
        self.counters["missing_pages"] += len(missing)
        self.counters["corrupt_pages"] += len(corrupt)
        if corrupt:  # a corrupt value helps no one: delete it so a later write can replace it
            try:
                await client.delete(*[keys[i] for i in corrupt])
            except Exception:  # noqa: BLE001 - best effort
                pass
        kind = "missing" if missing else "checksum"
        bad_slots = sorted(int(slot_arr[i]) for i in missing + corrupt)
        raise self._error(StorageError(kind, f"redis read: {len(missing)} page(s) missing, {len(corrupt)} "
                                             f"corrupt (L3 slots {bad_slots[:8]})", bad_slots=bad_slots), "read")

    # ---- lifecycle -------------------------------------------------------------------------------
    def invalidate(self, slots: Sequence[int]) -> None:
        """No-op: the slot only leaves this instance's hint table; the page may serve others."""

    async def release_loop(self) -> None:
        """The running loop is about to end (`Engine.generate` runs each call on a loop of its own):
        wait for its in-flight operations and close its client; the next loop opens another
        (regression: each call's connections were left to the garbage collector). A close that fails only warns
        (regression: raised, it replaced generate()'s results, and ended a shutdown: the engine never shut down)."""
        loop = asyncio.get_running_loop()
        pending = [t for t in self._tasks if not t.done() and t.get_loop() is loop]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        client = self._redis
        if client is not None and self._loop is loop:
            self._redis, self._loop = None, None
            [error] = await asyncio.gather(client.aclose(), return_exceptions=True)
            if error is not None:  # (a TLS server that stopped answering: its connections go all the same)
                log.warning("l3_redis_close_failed", url=redact_url(self.url), error=f"{type(error).__name__}: {error}")

    async def aclose(self) -> None:
        """Wait for this loop's in-flight operations, then close the client."""
        if self._closed:
            return
        self._closed = True
        await self.release_loop()
        self._redis = None
        self._cpu.shutdown(wait=True)

    def close(self) -> None:
        """Synchronous close: new operations fail; connections go with their loop."""
        self._closed = True
        self._redis = None
        self._cpu.shutdown(wait=False)

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict:
        retry_in_s = max(0.0, self._down_until - time.monotonic())
        return {"backend": "redis", "url": redact_url(self.url), "num_slots": self.num_slots,
                "bytes_per_page": self.bytes_per_page, "model_id": self.model_id, "checksum": self.checksum,
                "closed": self._closed, "available": self._consecutive_failures == 0, "retry_in_s": retry_in_s,
                "writes_refused": self.refusals.writes, "reads_refused": self.refusals.reads,
                "in_flight": sum(not t.done() for t in self._tasks), "errors": dict(self.errors),
                "key_cache": {"hits": self.keyer.hits, "misses": self.keyer.misses}, **self.counters}
