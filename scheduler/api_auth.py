"""Who may call the HTTP server (scheduler/server.py), as vLLM's flags say: an API key for the /v1/ routes
(--api-key, or HICACHE_API_KEY when the flag is absent) and CORS headers for browser pages
(--allowed-origins, --allow-credentials, --allowed-methods, --allowed-headers).

The key check is a pure ASGI middleware: it answers a refused request itself (a 401 with the server's
JSON error body and `WWW-Authenticate: Bearer`) and hands every other one on untouched, so streamed
responses pass through it as they are. As vLLM, /v1 is guarded (and, unlike vLLM, which serves it only in its dev mode, the
cache reset /reset_prefix_cache); /health, /metrics, /version,
/tokenize, /detokenize and /hicache/status stay open (probes and scrapers hold no key). CORS, when
--allowed-origins is given, is starlette's CORSMiddleware, installed outside the key check: a preflight
(OPTIONS, which carries no Authorization header) is answered without a key, and a 401 carries the CORS
headers so the page that asked can read it. The key is compared in constant time and never logged or
reported (/hicache/status says only whether one is asked).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from scheduler.api_models import APIError


@dataclass(frozen=True)
class CORSSettings:
    """starlette's CORSMiddleware's settings (vLLM's flags and defaults, but the origins: without
    --allowed-origins the server sends no CORS headers at all, ServerLimits.cors None)."""
    allowed_origins: tuple[str, ...] = ()
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)


def api_key_from(flag: str | None) -> str | None:
    """--api-key, else HICACHE_API_KEY (as vLLM reads VLLM_API_KEY); an empty variable is no key."""
    return flag if flag is not None else os.environ.get("HICACHE_API_KEY") or None


def key_problem(key: str) -> str | None:
    """Why no client could send `key` in 'Authorization: Bearer KEY' (None: one can), in words that never show it: a
    header's value loses the whitespace around it (the token too, _bearer_token) and holds no control character.
    (Regression: HICACHE_API_KEY read from a secret file's trailing newline started a server that refused every
    /v1/ request, "a wrong API key was given", to clients sending that very key.)"""
    if key != key.strip(" \t"):
        return "starts or ends with whitespace, which no request's header can carry"
    if any(ch < " " and ch != "\t" or ch == "\x7f" for ch in key):
        return "holds a control character (a newline?), which no request's header can carry"
    return None


def json_str_list(text: str) -> list[str]:
    """An argparse type: a JSON list of strings (vLLM's form of --allowed-origins and its companions)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'a JSON list of strings, e.g. \'["http://localhost:3000"]\', got {text!r}')
    return value


def install_access(app, limits) -> None:
    """The key check and CORS on `app` (ServerLimits.api_key, .cors); neither when not asked (the
    app is then exactly as without this module). Added last, CORS is the outer middleware."""
    if limits.api_key:
        if why := key_problem(limits.api_key):
            raise ValueError(f"ServerLimits.api_key {why}")
        app.add_middleware(APIKeyMiddleware, key=_Key(limits.api_key))
    if limits.cors is not None:
        c = limits.cors
        app.add_middleware(CORSMiddleware, allow_origins=list(c.allowed_origins), allow_credentials=c.allow_credentials,
                           allow_methods=list(c.allowed_methods), allow_headers=list(c.allowed_headers))


class _Key:
    """The API key; its repr never shows it (app.user_middleware's repr, a traceback's locals)."""
    __slots__ = ("_bytes",)

    def __init__(self, key: str) -> None:
        self._bytes = key.encode()

    def __repr__(self) -> str:
        return "_Key(<hidden>)"

    def matches(self, token: bytes) -> bool:
        return secrets.compare_digest(token, self._bytes)


def _guarded(path: str) -> bool:
    """/v1/ and the operator's cache reset (scheduler/api_admin.py: it costs every client its cached prefixes)."""
    return path == "/v1" or path.startswith("/v1/") or path == "/reset_prefix_cache"


def _bearer_token(headers) -> bytes | None:
    """The token of the request's `Authorization: Bearer TOKEN` (the scheme in any case, RFC 9110), or None."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class APIKeyMiddleware:
    """Refuses a guarded request (/v1/, the reset) without `Authorization: Bearer KEY` (401); passes everything
    else on."""

    def __init__(self, app, key: _Key) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not _guarded(scope["path"]):
            return await self.app(scope, receive, send)
        token = _bearer_token(scope["headers"])
        if token is not None and self.key.matches(token):
            return await self.app(scope, receive, send)
        err = APIError(401, ("a wrong API key" if token else "no API key") + " was given: this server's /v1/ "
                            "routes and /reset_prefix_cache need the header 'Authorization: Bearer KEY', KEY its --api-key",
                       code="invalid_api_key", type="authentication_error", headers={"WWW-Authenticate": "Bearer"})
        await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)
