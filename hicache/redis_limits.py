"""What a Redis server lets the L3 store (hicache/storage_redis.py) do: read at start, and read
again while it refuses something (`Refusals`), so an operator's fix needs no engine restart.

One PING at start, and the limits read with CONFIG GET: a server that cannot be used is one warning line with the server's reason (the
engine starts all the same); a server whose maxmemory-policy is not allkeys-* is warned of too: it
never evicts a page, so it grows until the host runs out of memory (no maxmemory, Redis's default)
or refuses every write once full. Run it with maxmemory and allkeys-lru. A server whose
proto-max-bulk-len (default 512 MiB, at least 1 MiB) is below one page's value resets the
connection of every write: writes are then refused, at once, with one warning naming the
setting and the page size (reads and hints go on: pages stored before still serve); so are they
where the client-query-buffer-limit (at least 1 MiB) is below one value, which the server holds
whole in a client's query buffer. A `client-output-buffer-limit normal` hard limit sizes the MGET
chunks (the server drops the connection of a reply over it); below one value, reads are refused at
once and hints not queried, with one warning naming the setting (writes go on). Refusing
rather than splitting values keeps one page one key (splitting would need all-or-nothing reads and
evictions of a page's parts). Where CONFIG GET is refused (an application ACL), the first write
that fails so tells: the server answers "invalid bulk length", or (a value of a few MiB) resets the
connection while it still answers a PING; so does a write after a limit was lowered at runtime.

A refusal is not for good: a refused write or read (a hint refresh, where reads are refused), or a
read whose reply was dropped, reads the limits again (CONFIG GET on the store's own client) at most
once every LIMITS_RECHECK_S; between rechecks a refused operation fails at once, with no round
trip. A setting that takes a page's value again lifts its refusal (one info line, and MGET chunks
follow a new output limit); one that still refuses changes nothing and logs nothing. Where the limits
cannot be read (CONFIG refused), the next write is a trial: its failure refuses again, quietly.
"""
from __future__ import annotations

import asyncio
import time
import urllib.parse
from dataclasses import dataclass

import redis
import redis.retry
import structlog
from redis import exceptions as rexc
from redis.backoff import NoBackoff

log = structlog.get_logger("hicache.storage_redis")

LIMITS_RECHECK_S = 30.0  # a refused operation reads the server's limits again at most this often
MIN_BULK_LIMIT_BYTES = 1 << 20  # the smallest proto-max-bulk-len a server takes: smaller values always fit
# What one value may cost in a reply's output buffer (client-output-buffer-limit): its own reply
# block, which the allocator (jemalloc) rounds up by less than a quarter, plus its "$<len>" framing;
# and what the reply's first blocks may add. Measured on redis 7.0: 1 MiB held ten 100 kB values.
REPLY_FRAMING_BYTES = 64
REPLY_SLACK_BYTES = 16 << 10
_LIMITS = ("proto-max-bulk-len", "client-query-buffer-limit", "client-output-buffer-limit")
OUTPUT_LIMIT = "client-output-buffer-limit"


@dataclass(frozen=True)
class ServerLimits:
    """What a server's settings say of one page's value (None: not known, CONFIG refused or a
    look-alike server): the setting, and its bytes, over which a value cannot be written; and the
    `client-output-buffer-limit normal` hard limit in bytes (0: none)."""

    writes_known: bool = False
    value_limit: tuple[str, int] | None = None
    output_limit_bytes: int | None = None


def limits_from_config(config: dict, value_bytes: int) -> ServerLimits:
    """The limits in CONFIG GET's answers (`config`: name -> value, as text)."""
    bulk_limit = str(config.get("proto-max-bulk-len", ""))
    query_limit = str(config.get("client-query-buffer-limit", ""))
    value_limit = None
    if bulk_limit.isdigit() and int(bulk_limit) < value_bytes:  # (a look-alike server may say "")
        value_limit = ("proto-max-bulk-len", int(bulk_limit))
    elif query_limit.isdigit() and int(query_limit) < value_bytes + 2:
        # a value's bulk (+ CRLF) is held whole in the query buffer, over which the server drops
        # the connection (the MSET around it is not: its earlier values have left the buffer)
        value_limit = ("client-query-buffer-limit", int(query_limit))
    fields = str(config.get(OUTPUT_LIMIT, "")).split()
    output_limit_bytes = None
    if "normal" in fields[:-1]:  # (else CONFIG refused, or a look-alike server: the reads tell)
        hard = fields[fields.index("normal") + 1]
        output_limit_bytes = int(hard) if hard.isdigit() else 0
    return ServerLimits(bulk_limit.isdigit() or query_limit.isdigit(), value_limit, output_limit_bytes)


async def read_limits(client, value_bytes: int) -> ServerLimits:
    """The limits, read again on the store's redis.asyncio client."""
    config: dict = {}
    for name in _LIMITS:  # (one name a call: CONFIG GET takes several only from redis 7)
        try:
            config.update(await client.config_get(name))
        except rexc.ResponseError:  # CONFIG refused (ACL) or renamed
            break
    return limits_from_config(config, value_bytes)


# redis-py also takes them as query arguments; ssl_password: a rediss:// client key's passphrase (regression: shown
# unmasked by /hicache/status, open without the API key)
_SECRET_QUERY_KEYS = frozenset({"password", "username", "ssl_password"})


def redact_url(url: str) -> str:
    """The URL with its password masked, in the userinfo (redis://user:pass@host) or the query
    (redis://host/0?password=...), for logs and status."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None:
        parts = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1))
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(k in _SECRET_QUERY_KEYS for k, _ in query):
        masked = [(k, "***" if k in _SECRET_QUERY_KEYS else v) for k, v in query]
        parts = parts._replace(query=urllib.parse.urlencode(masked, safe="*"))
    return urllib.parse.urlunsplit(parts)


def check_server(url: str, value_bytes: int) -> ServerLimits:
    """One synchronous PING at start, so a server that cannot be used shows up in the log as one
    line with the server's reason (the engine still starts: a store that cannot be reached only
    costs hits); one warning for a server that never evicts; and the limits above (which
    `Refusals` warns of)."""
    try:
        with redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0,
                                  retry=redis.retry.Retry(NoBackoff(), 0)) as client:
            client.ping()
            try:
                info = client.info("memory")
            except rexc.NoPermissionError:  # (the usual application ACL, "+@all -@dangerous", has no INFO)
                info = {}
            config = {}
            for name in _LIMITS:  # (one name a call: CONFIG GET takes several only from redis 7)
                try:
                    config.update(client.config_get(name))
                except rexc.ResponseError:  # CONFIG refused (ACL) or renamed: the first write tells
                    break
    except Exception as exc:  # noqa: BLE001 - any failure only means "not usable now"
        # (redis-py 8's repr is "network:ConnectionError": the server's reason is in str())
        log.warning("l3_redis_unreachable", url=redact_url(url), error=f"{type(exc).__name__}: {exc}",
                    effect="requests recompute what L3 would restore until it answers")
        return ServerLimits()
    maxmemory, policy = info.get("maxmemory"), info.get("maxmemory_policy")
    log.info("l3_redis_connected", url=redact_url(url), maxmemory=maxmemory, maxmemory_policy=policy)
    if policy is not None and not (maxmemory and str(policy).startswith("allkeys-")):
        log.warning("l3_redis_never_evicts", url=redact_url(url), maxmemory=maxmemory, maxmemory_policy=policy,
                    effect=("pages are never evicted: it grows until the host runs out of memory" if not maxmemory
                            else "pages are never evicted: once full, every write fails"),
                    fix="set maxmemory and maxmemory-policy allkeys-lru")
    return limits_from_config(config, value_bytes)


class Refusals:
    """Why the store's writes or reads are refused now (None: they are not), and the most page
    values one MGET reply may hold (None: no limit known); read again as the module docstring says,
    on the client that `connect` (the store's) returns, called only then.
    Writes go allowed -> refused (a setting refuses: one warning; a failed write on trial: quietly)
    -> allowed (the setting takes a page's value: one info line) or -> on trial (the limits
    unknown: the next write is sent; its success lifts, its failure refuses). `timeout_s` bounds a
    read of the limits."""

    def __init__(self, url: str, value_bytes: int, page_size_tokens: int, limits: ServerLimits,
                 recheck_s: float | None = None, timeout_s: float = 2.0) -> None:
        self.url, self.value_bytes, self.page_size_tokens = url, value_bytes, page_size_tokens
        self.recheck_s = LIMITS_RECHECK_S if recheck_s is None else recheck_s
        self.timeout_s = timeout_s
        self.writes: str | None = None  # why a write fails at once
        self.reads: str | None = None  # why a read fails at once (and hints are not queried)
        self.reply_pages: int | None = None
        self._write_setting: str | None = None  # the setting refusing writes, or whose refusal is on trial
        self._on_trial = False
        self._next_check_s = time.monotonic() + self.recheck_s
        self._learn(limits)

    async def refused_writes(self, connect) -> str | None:
        """Why a write fails at once now (None: send it); the limits read again first where due."""
        if self.writes is not None and time.monotonic() >= self._next_check_s:
            await self._recheck(connect)
        return self.writes

    async def refused_reads(self, connect) -> str | None:
        """Why a read fails at once now (None: send it); the limits read again first where due."""
        if self.reads is not None and time.monotonic() >= self._next_check_s:
            await self._recheck(connect)
        return self.reads

    async def read_failed(self, connect, exc: BaseException) -> str | None:
        """A read failed: where its connection dropped (a reply over an output limit lowered at
        runtime drops it) and a recheck is due, the limits read again; why reads are refused now."""
        if isinstance(exc, rexc.ConnectionError) and time.monotonic() >= self._next_check_s:
            await self._recheck(connect)
        return self.reads

    async def write_failed(self, connect, exc: BaseException) -> str | None:
        """Why writes are refused now, where a failed write says the server refuses a page's value
        (see the module docstring); None where it failed otherwise."""
        if self.writes is not None:
            return self.writes  # (refused meanwhile, by a write sent beside it)
        if self.value_bytes <= MIN_BULK_LIMIT_BYTES:
            return None
        if isinstance(exc, rexc.ResponseError):
            refused = "invalid bulk length" in str(exc)
        elif isinstance(exc, rexc.ConnectionError) and isinstance(exc.__cause__, (ConnectionResetError,
                                                                                  BrokenPipeError)):
            # reset while sending, on the retry's fresh connection (not refused: a server restarting)
            try:
                refused = bool(await connect().ping())  # up and answering: it is the write it drops
            except Exception:  # noqa: BLE001 - down: an ordinary outage
                refused = False
        else:
            refused = False
        if refused:
            self._next_check_s = time.monotonic() + self.recheck_s  # (a trial only after the interval)
            self._refuse_writes("proto-max-bulk-len", None)
        return self.writes

    def write_succeeded(self) -> None:
        if self._on_trial:
            self._lift_writes()

    async def _recheck(self, connect) -> None:
        self._next_check_s = time.monotonic() + self.recheck_s  # (before the await: one recheck at a time)
        try:
            limits = await asyncio.wait_for(read_limits(connect(), self.value_bytes), self.timeout_s)
        except Exception:  # noqa: BLE001 - down or slow: nothing learned, the refusals stand
            return
        self._learn(limits)

    def _learn(self, limits: ServerLimits) -> None:
        if limits.value_limit is not None:
            self._refuse_writes(*limits.value_limit)
        elif limits.writes_known:
            self._lift_writes()
        elif self.writes is not None:  # unknown: the next write tells
            self.writes, self._on_trial = None, True
        if limits.output_limit_bytes is not None:
            self._limit_replies(limits.output_limit_bytes)

    def _refuse_writes(self, setting: str, limit: int | None) -> None:
        """A setting refuses a page's value: every later write fails at once; one warning where
        that setting did not refuse already (nor was on trial)."""
        fix = (f"CONFIG SET {setting} {self.value_bytes + 2} or more (this store checks again within "
               f"{self.recheck_s:g} s), or a smaller --page-size")
        if setting != self._write_setting:
            log.warning("l3_redis_value_too_large", url=redact_url(self.url), **{setting.replace("-", "_"): limit},
                        value_bytes=self.value_bytes, page_size_tokens=self.page_size_tokens,
                        effect="no page is written to L3 (pages already there are still read)", fix=fix)
        self._write_setting, self._on_trial = setting, False
        self.writes = (f"the server refuses values of {self.value_bytes} bytes (one page of {self.page_size_tokens} "
                       f"tokens) over its {setting}" + (f" of {limit} bytes" if limit is not None else "")
                       + ": no page is written to this L3")

    def _lift_writes(self) -> None:
        if self._write_setting is not None:
            log.info("l3_redis_limits_lifted", url=redact_url(self.url), setting=self._write_setting,
                     value_bytes=self.value_bytes, effect="pages are written to L3 again")
        self.writes, self._write_setting, self._on_trial = None, None, False

    def _limit_replies(self, hard_bytes: int) -> None:
        """Size MGET chunks to the server's `client-output-buffer-limit normal` hard limit: it drops
        the connection of a reply over it (every read then failed as "eio" with a back-off). Where
        not even one page's value fits, no read can succeed: reads are refused at once and hints not
        queried (no restore is tried), with one warning naming the setting."""
        value_cost_bytes = self.value_bytes + self.value_bytes // 4 + REPLY_FRAMING_BYTES
        self.reply_pages = None if hard_bytes == 0 else (hard_bytes - REPLY_SLACK_BYTES) // value_cost_bytes
        if self.reply_pages is None or self.reply_pages >= 1:  # (0: no limit, Redis's default)
            if self.reads is not None:
                log.info("l3_redis_limits_lifted", url=redact_url(self.url), setting=OUTPUT_LIMIT,
                         value_bytes=self.value_bytes, effect="pages are read from L3 again")
            self.reads = None
            return
        if self.reads is None:
            log.warning("l3_redis_reply_too_large", url=redact_url(self.url), client_output_buffer_limit=hard_bytes,
                        value_bytes=self.value_bytes, page_size_tokens=self.page_size_tokens,
                        effect="no page is read from L3 (requests recompute it)",
                        fix=f"CONFIG SET client-output-buffer-limit \"normal {value_cost_bytes + REPLY_SLACK_BYTES} "
                            f"0 0\" or more (0: no limit; this store checks again within {self.recheck_s:g} s), "
                            "or a smaller --page-size")
        self.reads = (f"the server cannot send back values of {self.value_bytes} bytes (one page of "
                      f"{self.page_size_tokens} tokens) under its client-output-buffer-limit normal of "
                      f"{hard_bytes} bytes: no page is read from this L3")
