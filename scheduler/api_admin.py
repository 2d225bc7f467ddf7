"""An operator's reset of the prefix cache over HTTP, under vLLM's route (registered by scheduler/server.py):

    POST /reset_prefix_cache[?tiers=l1,l2][&reset_external=true]     (or the same fields in a JSON body:
                                                                       {"tiers": ["l1", "l2"], "reset_external": true})
    -> 200 {"success": true, "pages_freed": {"l1": 120, "l2": 300}, "pages_left": {"l1": 8, "l2": 0},
            "skipped": {"l3": "..."}}

Tiers. By default L1 and L2, the engine-local tiers. L3 only when asked: named in `tiers`, or by vLLM's
`reset_external=true` (its flag for the cache outside the engine), because L3 outlives the engine's
memory: a file L3 is the disk cache that refills L2 after evictions (with --hicache-storage-persist, its
prefixes kept across restarts), and a Redis L3 may be shared with other engines. Resetting a Redis L3 drops only
this engine's hints of it: the keys stay in Redis for the engines that read them (RedisStore.invalidate
does nothing) and this engine finds them again at its next hint refresh; to empty Redis itself, flush the
database. A tier this engine lacks (no L2 without --enable-hicache, no L3 with --hicache-storage-ratio 0)
is skipped and named in `skipped`, with a 200: what was asked (nothing of that tier cached here) holds, and
one script resets a fleet whose engines differ. Tier names are l1, l2, l3 (any case); an unknown one, an
empty list, an unknown field or a field given both in the query and the body is a 400 naming it.

What is freed. Each tier by CacheManager.flush_async, in order L1, L2, L3: every unlocked page of the tier (under
write_back, where L2 is not reset too, L1's unsaved pages are first written back, as a write-back cache writes its
dirty pages back before it invalidates, and with L3 reset too their L3 writes land before its flush; with L2 reset
too they go). Requests in flight keep their pages, and so their outputs: their prefixes are locked and their new
pages private to their claims until they end. A page a copy in flight holds stays too. `pages_left` counts what each
tier still held right after its flush; a repeat of a prompt that no running request holds is then recomputed
(cached_tokens 0) and cached again. The pages freed also count in hicache_evicted_pages{tier}; each tier reset
counts in hicache_prefix_cache_resets_total{tier}; one `prefix_cache_reset` log line says what went.

Where it runs. On the engine's event loop, which is the server's (the app lifespan starts the engine
there), between the engine loop's steps' awaits: a flush is synchronous, so it runs while the loop task
is suspended idle, on a forward or on a blocking restore, points at which every page a request or a copy
uses is locked or private (a restore's pages stay held for their request from their publication until it
adopts them, Restores.hold_published); a match and the lock of its result never have an await between
them. So no step is ever mid-way over the tree when it runs (tests/test_diff_fuzz_hunt.py flushes at such
points against a no-cache engine's outputs). Refused with a 503 while the server drains or once the
engine loop failed, as generation is. A reset of the query alone sent by a browser page of an origin that
--allowed-origins does not list (its Origin header) is a 403: no CORS preflight guards it.

Departures from vLLM. vLLM answers an empty 200 (a 409 where running requests hold blocks); here a JSON
body of pages, and never a 409: a reset leaves in-flight requests their pages rather than fail.
`reset_running_requests=true` (vLLM preempts running requests and recomputes them) is a 400: running
requests keep their pages here. vLLM serves the route only with VLLM_SERVER_DEV_MODE and leaves it
outside its --api-key; here it is always served and, with --api-key, asks for the key as the /v1/ routes do
(a reset costs every client its cached prefixes: api_auth's middleware guards it).
"""
from __future__ import annotations

import importlib.metadata

import structlog
from fastapi.responses import Response
from prometheus_client import Counter
from starlette.requests import ClientDisconnect, Request

from hicache.radix import TIERS, Tier
from scheduler.api_models import APIError, read_json_body

log = structlog.get_logger("scheduler.server")

DEFAULT_TIERS = (Tier.L1, Tier.L2)  # the engine-local tiers
FIELDS = ("tiers", "reset_external", "reset_running_requests")
_QUERY_BOOLS = {"true": True, "1": True, "yes": True, "on": True,  # (FastAPI's spellings of a bool query)
                "false": False, "0": False, "no": False, "off": False}
_ABSENT = {Tier.L2: "this engine has no L2 (hicache is off: --enable-hicache)",
           Tier.L3: "this engine has no L3 (--hicache-storage-ratio 0, or hicache off)"}


class PrefixCacheReset:
    """The route's handler for one server (_ServerState `st`): its key, its metrics registry, its engine."""

    def __init__(self, st) -> None:
        self.st = st
        self.resets = Counter("hicache_prefix_cache_resets", "operator resets of each tier (POST "
                              "/reset_prefix_cache); the pages they freed count in hicache_evicted_pages",
                              ["tier"], registry=st.metrics.registry)
        for tier in TIERS:
            self.resets.labels(tier.label)

    async def __call__(self, request) -> dict | Response:
        st = self.st
        st.check_admitting()
        try:
            body = await _body(request, st.limits.max_body_bytes)
        except ClientDisconnect:  # the client left while its body was read: nothing to answer
            return Response(status_code=499)
        if not body and _cross_site(request.headers.get("origin"), st.limits):
            # (the query alone, no body: what a form or a no-cors fetch of another site's page sends, which no CORS
            # preflight guards; regression: such a page reset every tier, L3 too, where a body is refused so that
            # it cannot: api_models.read_json_body)
            raise APIError(403, "a browser page of another origin may not reset the cache (its Origin is not in "
                                "--allowed-origins)", code="cross_site_request", type="permission_error")
        tiers = requested_tiers(request.query_params.multi_items(), body)
        st.check_admitting()  # (the body's read may have awaited a shutdown's start)
        return await reset_tiers(st.engine.cache, tiers, self.resets)


async def _body(request, max_bytes: int) -> dict:
    """The JSON object of the body; {} for none (vLLM's form: query parameters alone, `curl -X POST`; regression: an
    empty body sent chunked, or of a Content-Length "00", was a 400)."""
    return await read_json_body(request, max_bytes, empty_ok=True)


def _cross_site(origin: str | None, limits) -> bool:
    """Whether a request comes from a browser page (its Origin header; clients that are no page send none) of an
    origin --allowed-origins does not let in (ServerLimits.cors, None without the flag)."""
    if origin is None:
        return False
    allowed = limits.cors.allowed_origins if limits.cors is not None else ()
    return "*" not in allowed and origin not in allowed


def refuse_cross_site(request: Request) -> None:
    """A route's dependency where it changes state on a POST with no body, which no CORS preflight guards: a 403 for
    a browser page of an origin --allowed-origins does not list (regression: POST /v1/responses/{id}/cancel, a form
    or a no-cors fetch of another site's page cancelled a background response, its id the client's request_id)."""
    if _cross_site(request.headers.get("origin"), request.app.state.hc.limits):
        raise APIError(403, f"a browser page of another origin may not POST {request.url.path} (its Origin is not in "
                            "--allowed-origins)", code="cross_site_request", type="permission_error")


def requested_tiers(query: list[tuple[str, str]], body: dict) -> tuple[Tier, ...]:
    """The tiers a reset's query parameters and body ask for (DEFAULT_TIERS, plus L3 with reset_external)."""
    fields: dict[str, object] = {}
    for name, value in query:
        _known(name)
        if name == "tiers":  # (comma-separated; repeated: all of them)
            fields["tiers"] = [*fields.get("tiers", []), *value.split(",")]
        elif value.strip().lower() in _QUERY_BOOLS:
            fields[name] = _QUERY_BOOLS[value.strip().lower()]
        else:
            raise APIError(400, f"{name} must be true or false, got {value!r}", param=name, code="invalid_value")
    for name, value in body.items():
        _known(name)
        if name in fields:
            raise APIError(400, f"{name} is given both in the query and in the body: give it once", param=name,
                           code="invalid_value")
        ok = (isinstance(value, list) and all(isinstance(v, str) for v in value) if name == "tiers"
              else isinstance(value, bool))
        if not ok:
            raise APIError(400, f"{name} must be " + ("a list of tier names (l1, l2, l3)" if name == "tiers"
                                                       else "true or false") + f", got {value!r}",
                           param=name, code="invalid_value")
        fields[name] = value
    if fields.get("reset_running_requests"):
        raise APIError(400, "reset_running_requests=true is not supported: running requests keep their pages "
                            "here (their outputs must not change); a reset frees every page no request holds",
                       param="reset_running_requests", code="unsupported_value")
    tiers = set(DEFAULT_TIERS) if "tiers" not in fields else {_tier(name) for name in fields["tiers"]}
    if not tiers:
        raise APIError(400, "tiers names no tier: give l1, l2 and/or l3", param="tiers", code="invalid_value")
    if fields.get("reset_external"):
        tiers.add(Tier.L3)
    return tuple(sorted(tiers))


def _known(name: str) -> None:
    if name not in FIELDS:
        raise APIError(400, f"unknown field {name!r}: /reset_prefix_cache takes {', '.join(FIELDS)}", param=name,
                       code="unknown_field")


def _tier(name: str) -> Tier:
    tier = next((t for t in TIERS if t.label == name.strip().lower()), None)
    if tier is None:
        raise APIError(400, f"unknown tier {name!r} in tiers: the tiers are l1, l2 and l3", param="tiers",
                       code="invalid_value")
    return tier


async def reset_tiers(cache, tiers: tuple[Tier, ...], resets: Counter | None = None) -> dict:
    """Flush `tiers` of `cache` (a CacheManager) in order, skipping those it lacks; the route's answer."""
    freed_pages, left_pages, skipped = {}, {}, {}
    for tier in sorted(tiers):
        if tier not in cache.tree.allocators:
            skipped[tier.label] = _ABSENT[tier]
            continue
        # L1's unsaved pages are written back only to an L2 that stays (regression: a reset of both wrote them
        # to L2 first, whose flush then left them, new or locked by their L3 writes, to be hit again)
        keeps_l2 = Tier.L2 not in tiers or Tier.L2 not in cache.tree.allocators
        # and, where L3 is reset after, their L3 writes land first (regression: they landed after its flush)
        freed_pages[tier.label] = await cache.flush_async(tier, write_back=keeps_l2, through_l3=Tier.L3 in tiers)
        left_pages[tier.label] = cache.tree.num_resident_pages[tier]  # (locked: by requests, copies in flight)
        if resets is not None:
            resets.labels(tier.label).inc()
    log.info("prefix_cache_reset", pages_freed=freed_pages, pages_left=left_pages, skipped=sorted(skipped))
    return {"success": True, "pages_freed": freed_pages, "pages_left": left_pages, "skipped": skipped}


def installed_version() -> str:
    """The installed project's version, GET /version's ("unknown" when it runs from a checkout without being
    installed; here, not in scheduler/server.py, which is at its 500 lines)."""
    try:
        return importlib.metadata.version("hicache")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
