"""What a Redis server lets the L3 store (hicache/storage_redis.py) do, found out once at start.

One PING at start, and the limits read with CONFIG GET: a server that cannot be used is one warning line with the server's reason (the
engine starts all the same); a server whose maxmemory-policy is not allkeys-* is warned of too: it
never evicts a page, so it grows until the host runs out of memory (no maxmemory, Redis's default)
or refuses every write once full. Run it with maxmemory and allkeys-lru. A server whose
proto-max-bulk-len (default 512 MiB, at least 1 MiB) is below one page's value resets the
connection of every write: writes are then refused for good, at once, with one warning naming the
setting and the page size (reads and hints go on: pages stored before still serve); so are they
where the client-query-buffer-limit (at least 1 MiB) is below one value, which the server holds
whole in a client's query buffer. A `client-output-buffer-limit normal` hard limit sizes the MGET
chunks (the server drops the connection of a reply over it); below one value, reads are refused at
once and hints not queried, with one warning naming the setting (writes go on). Refusing
rather than splitting values keeps one page one key (splitting would need all-or-nothing reads and
evictions of a page's parts). Where CONFIG GET is refused (an application ACL), the first write
that fails so tells: the server answers "invalid bulk length", or (a value of a few MiB) resets the
connection while it still answers a PING.
"""
from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

import redis
import redis.retry
import structlog
from redis import exceptions as rexc
from redis.backoff import NoBackoff

log = structlog.get_logger("hicache.storage_redis")

MIN_BULK_LIMIT_BYTES = 1 << 20  # the smallest proto-max-bulk-len a server takes: smaller values always fit
# What one value may cost in a reply's output buffer (client-output-buffer-limit): its own reply
# block, which the allocator (jemalloc) rounds up by less than a quarter, plus its "$<len>" framing;
# and what the reply's first blocks may add. Measured on redis 7.0: 1 MiB held ten 100 kB values.
REPLY_FRAMING_BYTES = 64
REPLY_SLACK_BYTES = 16 << 10
_LIMITS = ("proto-max-bulk-len", "client-query-buffer-limit", "client-output-buffer-limit")


@dataclass
class ServerLimits:
    """What the store may do with this server: why writes or reads are refused (None: they are
    not), and the most page values one MGET reply may hold (None: no limit known)."""

    writes_refused: str | None = None
    reads_refused: str | None = None
    reply_pages: int | None = None


_SECRET_QUERY_KEYS = frozenset({"password", "username"})  # redis-py also takes them as query arguments


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


def check_server(url: str, value_bytes: int, page_size_tokens: int) -> ServerLimits:
    """One synchronous PING at start, so a server that cannot be used shows up in the log as one
    line with the server's reason (the engine still starts: a store that cannot be reached only
    costs hits); one warning for a server that never evicts; and the limits above."""
    limits = ServerLimits()
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
        return limits
    maxmemory, policy = info.get("maxmemory"), info.get("maxmemory_policy")
    log.info("l3_redis_connected", url=redact_url(url), maxmemory=maxmemory, maxmemory_policy=policy)
    bulk_limit = str(config.get("proto-max-bulk-len", ""))
    query_limit = str(config.get("client-query-buffer-limit", ""))
    if bulk_limit.isdigit() and int(bulk_limit) < value_bytes:  # (a look-alike server may say "")
        limits.writes_refused = refuse_writes(url, value_bytes, page_size_tokens, int(bulk_limit))
    elif query_limit.isdigit() and int(query_limit) < value_bytes + 2:
        # a value's bulk (+ CRLF) is held whole in the query buffer, over which the server drops
        # the connection (the MSET around it is not: its earlier values have left the buffer)
        limits.writes_refused = refuse_writes(url, value_bytes, page_size_tokens, int(query_limit),
                                              "client-query-buffer-limit")
    _limit_replies(limits, url, str(config.get("client-output-buffer-limit", "")), value_bytes, page_size_tokens)
    if policy is not None and not (maxmemory and str(policy).startswith("allkeys-")):
        log.warning("l3_redis_never_evicts", url=redact_url(url), maxmemory=maxmemory, maxmemory_policy=policy,
                    effect=("pages are never evicted: it grows until the host runs out of memory" if not maxmemory
                            else "pages are never evicted: once full, every write fails"),
                    fix="set maxmemory and maxmemory-policy allkeys-lru")
    return limits


def refuse_writes(url: str, value_bytes: int, page_size_tokens: int, limit: int | None = None,
                  setting: str = "proto-max-bulk-len") -> str:
    """The server refuses a page's value (proto-max-bulk-len, client-query-buffer-limit): one
    warning; returns why every later write fails at once."""
    log.warning("l3_redis_value_too_large", url=redact_url(url), **{setting.replace("-", "_"): limit},
                value_bytes=value_bytes, page_size_tokens=page_size_tokens,
                effect="no page is written to L3 (pages already there are still read)",
                fix=f"CONFIG SET {setting} {value_bytes + 2} or more and restart the engine, "
                    "or a smaller --page-size")
    return (f"the server refuses values of {value_bytes} bytes (one page of {page_size_tokens} tokens) over "
            f"its {setting}" + (f" of {limit} bytes" if limit is not None else "") + ": no page is written to this L3")


def _limit_replies(limits: ServerLimits, url: str, output_limits: str, value_bytes: int,
                   page_size_tokens: int) -> None:
    """Size MGET chunks to the server's `client-output-buffer-limit normal` hard limit: it drops
    the connection of a reply over it (every read then failed as "eio" with a back-off). Where
    not even one page's value fits, no read can succeed: reads are refused at once and hints not
    queried (no restore is tried), with one warning naming the setting."""
    fields = output_limits.split()
    if "normal" not in fields[:-1]:
        return  # CONFIG refused, or a look-alike server: the reads tell
    hard = fields[fields.index("normal") + 1]
    hard_bytes = int(hard) if hard.isdigit() else 0
    if hard_bytes == 0:  # (0: no limit, Redis's default)
        return
    value_cost_bytes = value_bytes + value_bytes // 4 + REPLY_FRAMING_BYTES
    limits.reply_pages = (hard_bytes - REPLY_SLACK_BYTES) // value_cost_bytes
    if limits.reply_pages >= 1:
        return
    limits.reads_refused = (f"the server cannot send back values of {value_bytes} bytes (one page of "
                            f"{page_size_tokens} tokens) under its client-output-buffer-limit normal of "
                            f"{hard_bytes} bytes: no page is read from this L3")
    log.warning("l3_redis_reply_too_large", url=redact_url(url), client_output_buffer_limit=hard_bytes,
                value_bytes=value_bytes, page_size_tokens=page_size_tokens,
                effect="no page is read from L3 (requests recompute it)",
                fix=f"CONFIG SET client-output-buffer-limit \"normal {value_cost_bytes + REPLY_SLACK_BYTES} "
                    "0 0\" or more (0: no limit) and restart the engine, or a smaller --page-size")
