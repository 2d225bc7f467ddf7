"""OpenAI-compatible HTTP server (FastAPI on uvicorn + uvloop) in front of one Engine.

    POST /v1/completions        prompt: token ids or text, or a list of prompts (`n` choices each, one
                                engine request a choice); stream: server-sent events; stop: token ids or strings
    POST /v1/chat/completions   with a chat template: the checkpoint's, --chat-template's, or a request's own
                                (--trust-request-chat-template)
    POST /v1/responses          OpenAI's Responses API, served as a chat completion (api_responses.py); kept
                                responses (responses_store.py): GET|DELETE /v1/responses/{id}, GET .../input_items;
                                background ones (responses_background.py): POST .../cancel, GET ...?stream=true
    POST /tokenize   POST /detokenize       vLLM's: text <-> token ids with the server's tokenizer (api_tokenize.py)
    GET  /v1/models   GET /v1/models/{id}   GET /health (GET|POST /ping too)   GET /metrics (Prometheus)
    GET  /hicache/status (engine.status())     (each GET route answers HEAD too)
    POST /reset_prefix_cache    vLLM's operator reset: L1 and L2 flushed (L3 when asked), pages per tier (api_admin.py)
    --api-key guards /v1/ and the reset, --allowed-origins adds CORS (api_auth.py); --served-model-name: names served
    a body's request_id or X-Request-Id names the response and the engine's rids (request_ids.py)

The engine runs on the server's event loop: the app lifespan starts it and, at shutdown, stops admitting (503), lets
in-flight requests (queued or running) finish within --shutdown-grace-s, aborts the rest, drains transfers and removes
a temporary L3 file (Engine.shutdown). A client that disconnects has its request aborted and its pages freed. Every
refused request gets a JSON error body naming the field or limit (api_models.APIError); bad input is always a 4xx.

    python -m scheduler.server --model tiny --enable-hicache --port 8000     (or: hicache-serve ...)
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import numbers
import os
import sys
import time
import weakref
from contextlib import asynccontextmanager
from dataclasses import dataclass

import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from scheduler.api_admin import PrefixCacheReset, installed_version as _version, refuse_cross_site
from scheduler.api_auth import CORSSettings, install_access
from scheduler.api_beam_search import BeamSearches
from scheduler.api_inputs import choice_params, model_not_found, named_refusal, parse_prompts
from scheduler.api_models import APIError, internal_error, jsonable, read_json_body, validation_error
from scheduler.api_responses import ResponsesShape
from scheduler.responses_background import BackgroundResponses
from scheduler.responses_store import ResponsesStore
from scheduler.sse_response import SSEResponse
from scheduler.api_tokenize import chat_unavailable, detokenize, tokenize
from scheduler.chat_template import CONTENT_FORMATS
from scheduler.choices import Choices
from scheduler.engine import Engine
from scheduler.generation import Generation, abort_quietly, eos_id
from scheduler.generation_defaults import GenerationDefaults
from scheduler.prom import ServerMetrics
from scheduler.reasoning import PARSERS as REASONING_PARSERS
from scheduler.request import RequestError
from scheduler.request_ids import RequestIdHeaders, resolve_ids
from scheduler.tokenizer import load_tokenizer
from scheduler.tool_calls import PARSERS as TOOL_PARSERS

log = structlog.get_logger("scheduler.server")


@dataclass(frozen=True)
class ServerLimits:
    max_prompt_tokens: int = 0          # 0: the engine's limit (_ServerState.prompt_limit)
    max_tokens_limit: int = 0           # 0: the engine's max_new_tokens_limit
    max_concurrent_requests: int = 1024  # generation requests being served at once (429 above)
    max_body_bytes: int = 2 << 20       # request body (413 above)
    shutdown_grace_s: float = 10.0      # time in-flight requests get to finish at shutdown
    default_max_tokens: int = 16
    # for the sampling fields a request leaves out (hicache-serve --generation-config auto: the checkpoint's
    # generation_config.json); all None: OpenAI's neutral defaults
    sampling_defaults: GenerationDefaults = GenerationDefaults()
    reasoning_parser: str | None = None  # a chat's thinking as reasoning_content (scheduler/reasoning.py)
    tool_call_parser: str | None = None  # tool_choice "auto": calls read out of answers (scheduler/tool_calls.py)
    chat_template: str | None = None  # --chat-template's text: the tokenizer's chats rendered by it (its own replaced)
    trust_request_chat_template: bool = False  # a chat's own `chat_template` rendered, not refused (api_inputs)
    chat_template_content_format: str = "auto"  # how messages' content reaches templates (chat_template.py)
    api_key: str | None = dataclasses.field(default=None, repr=False)  # /v1/ asks for it; status: true/false
    served_model_names: tuple[str, ...] = ()  # a request's `model`, the first reported; (): the model's names
    cors: CORSSettings | None = None  # --allowed-origins and companions (api_auth.py); None: no CORS headers
    enable_request_id_headers: bool = False  # X-Request-Id on every response (request_ids.RequestIdHeaders)
    responses_store_max: int = 1000  # Responses kept for previous_response_id and GET (responses_store.py); 0: none
    responses_store_max_mib: int = 64  # and at most this many MiB of their JSON

    def __post_init__(self) -> None:
        """The in-process API's numbers, checked as hicache-serve checks its flags (serve.py): a ValueError naming the
        field (regression: a NaN grace aborted every request at once, a NaN max_concurrent_requests admitted all)."""
        for name, least in (("max_prompt_tokens", 0), ("max_tokens_limit", 0), ("max_concurrent_requests", 1),
                            ("max_body_bytes", 1), ("default_max_tokens", 1), ("responses_store_max", 0),
                            ("responses_store_max_mib", 1)):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
                raise ValueError(f"ServerLimits.{name} must be an integer >= {least}, got {value!r}")
            object.__setattr__(self, name, int(value))  # (numpy's integers as Python's)
        # (vLLM's flags' choices; regression: a parser's typo, "" too, ran the one parser there is)
        for name, allowed, off in (("chat_template_content_format", CONTENT_FORMATS, ()),
                                   ("reasoning_parser", REASONING_PARSERS, (None,)),
                                   ("tool_call_parser", TOOL_PARSERS, (None,))):  # (None: no parser)
            if (value := getattr(self, name)) not in (*allowed, *off):
                or_none = " or None" if off else ""
                raise ValueError(f"ServerLimits.{name} must be one of {', '.join(allowed)}{or_none}, got {value!r}")
        grace_s = self.shutdown_grace_s
        if not isinstance(grace_s, numbers.Real) or isinstance(grace_s, bool) or math.isnan(grace_s):
            raise ValueError(f"ServerLimits.shutdown_grace_s must be a number of seconds, got {grace_s!r}")


class _ServerState:
    def __init__(self, engine: Engine, limits: ServerLimits, tokenizer) -> None:
        self.engine, self.limits, self.tokenizer = engine, limits, tokenizer
        names = limits.served_model_names or (  # (given: those alone, as vLLM's --served-model-name)
            engine.config.model, os.path.basename(engine.config.model.rstrip("/")), engine.model_id)
        self.model_name = names[0]
        self.metrics = ServerMetrics(engine, self.model_name)  # (vLLM's families labelled model_name)
        self.served_names = dict.fromkeys(names)  # (in order, /v1/models' first: /hicache/status lists them)
        self.in_flight, self.draining = 0, False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.shutdown_task: asyncio.Task | None = None
        self.engine_error: str | None = None
        self.created = int(time.time())
        self.responses = ResponsesStore(limits.responses_store_max, limits.responses_store_max_mib << 20)
        self.background = BackgroundResponses(self.responses)  # (background responses' runs)

    def begin_shutdown(self) -> None:
        """Stop admitting (503) and start the engine's shutdown: in-flight requests get the grace
        period, then are aborted (their streams end with an error event). Safe from a signal handler."""
        self.draining = True
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._spawn_shutdown)

    def _spawn_shutdown(self) -> asyncio.Task:
        self.draining = True
        if self.shutdown_task is None:  # (the engine's --log-json let go as it ends, after `_shutdown`'s lines)
            self.shutdown_task = asyncio.ensure_future(self._shutdown())
            self.shutdown_task.add_done_callback(lambda _: self.engine.release_logging())
        return self.shutdown_task

    async def _shutdown(self) -> None:
        try:  # (not letting its log go: regression, the lines below went to stdout, and the JSON log had no trace)
            await self.engine.shutdown(self.limits.shutdown_grace_s, release_log=False)
        except Exception:  # a crashed loop re-raises here, or a tier's close (then no crash: regression, named one)
            log.exception("engine_shutdown_after_loop_crash" if self.engine_error else "engine_shutdown_failed")
            self.engine_error = self.engine_error or "the engine's shutdown failed"  # (hicache-serve exits 1)
        finally:  # background responses had the grace too: those still going cancelled and awaited
            await self.background.close()

    def on_loop_done(self, task: asyncio.Task) -> None:
        """The engine loop died (it fails its live requests itself): refuse new ones, fail /health."""
        if not task.cancelled() and task.exception() is not None:
            self.engine_error = f"the engine loop failed: {task.exception()!r}"

    def check_admitting(self) -> None:
        task = getattr(self.engine, "_loop_task", None)
        if task is not None and task.done():  # (its done-callback runs a turn later: regression, a request
            self.on_loop_done(task)           # admitted in the crash's turn was queued into the dead engine)
        if self.engine_error:
            raise APIError(503, self.engine_error, code="engine_failed")
        if self.draining:
            raise APIError(503, "the server is shutting down and admits no new requests", code="shutting_down")
        if not self.engine.accepting:  # shut down under the app (a library user's shutdown(), or a stop_loop() under
            # way): /health fails too (regression: it said ok while every completion was refused)
            raise APIError(503, "the engine is stopping or shut down and admits no new requests", code="shutting_down")
        if self.engine.loop_stopped:  # (not started again: a request would wait queued until start(); regression:
            # /health said ok, and a load balancer's requests hung)
            raise APIError(503, "the engine loop is stopped (stop_loop) and serves no requests; start() resumes it",
                           code="shutting_down")

    @property
    def prompt_limit(self) -> int:
        """--max-prompt-tokens (the server's or the engine's), within the tokens one request can hold: the
        L1 pool and the model's positions (Engine.max_prompt_tokens; regression: the pool's 8,192 tokens
        were reported and enforced first, past the tiny preset's 4,096 positions)."""
        limit = self.engine.max_prompt_tokens
        return min(limit, self.limits.max_prompt_tokens) if self.limits.max_prompt_tokens > 0 else limit

    @property
    def max_tokens_limit(self) -> int:
        limit = self.engine.config.max_new_tokens_limit
        return min(limit, self.limits.max_tokens_limit) if self.limits.max_tokens_limit > 0 else limit


def create_app(engine: Engine, limits: ServerLimits | None = None, tokenizer=None) -> FastAPI:
    limits = limits or ServerLimits()
    if tokenizer is None:
        tokenizer = load_tokenizer(engine.config.model, engine.vocab_size)
        if tokenizer is None:
            log.warning("no_tokenizer", model=engine.config.model,
                        detail="no tokenizer.json: prompts are taken as token ids only, chat is refused")
    if limits.chat_template is not None and tokenizer is not None:  # (ValueError where it does not compile)
        tokenizer.use_chat_template(limits.chat_template)
    if tokenizer is not None and (eos := eos_id(tokenizer, None)) is not None and 0 <= eos < engine.vocab_size:
        engine.add_eos_token_id(eos)  # (its eos_token ends an answer, as vLLM's)
    st = _ServerState(engine, limits, tokenizer)
    engine.guides.use(tokenizer)  # (structured outputs' grammars see the bytes of each id this server's text has)
    # the app holds the state (app.state.hc); routes reach it, and the engine, by a weak proxy: FastAPI caches every
    # route's function for good (fastapi.dependencies.models), so a route holding the engine kept each app's alive
    # (regression, session 58's hunt: 20 apps made and dropped in one process left 20 engines, weights and KV pools)
    app_state, st = st, weakref.proxy(st)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        st.loop = asyncio.get_running_loop()
        st.loop.run_in_executor(None, engine.guides.warm)  # (off the loop; a first guided request no longer waits)
        await engine.start()
        task = getattr(engine, "_loop_task", None)
        if task is not None:
            task.add_done_callback(st.on_loop_done)
        try:
            yield
        finally:
            await st._spawn_shutdown()

    app = FastAPI(title="hicache", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hc = app_state
    install_access(app, limits)
    if limits.enable_request_id_headers:  # (added last: the outer middleware, a 401's response carries it too)
        app.add_middleware(RequestIdHeaders)

    async def error_response(_request, exc: Exception) -> JSONResponse:
        if isinstance(exc, RequestValidationError):  # FastAPI's 422 becomes a 400 naming the field
            exc = validation_error(exc)
        elif isinstance(exc, StarletteHTTPException):  # unknown route (404), wrong method (405)
            # (its headers too: a 405's Allow, which RFC 9110 requires, was dropped; and every route's of the path,
            # where starlette names the first's: /ping's GET route answered "Allow: GET, HEAD" to its POST)
            allow = ", ".join(sorted({m for r in app.router.routes if getattr(r, "methods", None)
                                      and r.matches(_request.scope)[0] is not Match.NONE for m in r.methods}))
            headers = exc.headers if exc.status_code != 405 else {**(exc.headers or {}), "Allow": allow}
            exc = APIError(exc.status_code, f"{exc.detail}: {_request.method} {_request.url.path}",
                           code=f"http_{exc.status_code}", type="invalid_request_error", headers=headers)
        elif not isinstance(exc, APIError):
            exc = internal_error(exc)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    for exc_type in (APIError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, error_response)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, st, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, st, chat=True)

    @app.post("/v1/responses")
    async def responses(request: Request):
        shape = ResponsesShape(st.responses)
        with shape.named_errors():
            return await _generate(request, st, chat=True, shape=shape)

    # a kept response (responses_store.py; GET's below), its id a path's rest: a request_id may hold "/", which the
    # SDK sends as it is (regression: such a response was kept, and followed, but never found by GET or DELETE)
    @app.post("/v1/responses/{response_id:path}/cancel", dependencies=[Depends(refuse_cross_site)])  # (no body)
    async def response_cancel(response_id: str):  # (a background response's; before the routes below)
        return JSONResponse(await st.background.cancel(response_id))

    @app.delete("/v1/responses/{response_id:path}")
    async def response_delete(response_id: str):  # (a background response running: cancelled first)
        return await st.background.delete(response_id)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):  # (no generation slot: the engine is not involved)
        return await tokenize(request, st)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await detokenize(request, st)

    reset_prefix_cache = PrefixCacheReset(st)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache_route(request: Request):  # (on the engine's loop, between its steps' awaits)
        return await reset_prefix_cache(request)

    def model_card(name: str) -> dict:  # (vLLM's: one per --served-model-name; regression: the first alone)
        return {"id": name, "object": "model", "created": st.created, "owned_by": "hicache",
                "root": st.engine.model_id, "max_model_len": st.engine.max_kv_tokens}

    # GET routes answer HEAD too (RFC 9110; `curl -I`, uptime checks): FastAPI's got a 405
    get = functools.partial(app.api_route, methods=["GET", "HEAD"])

    @get("/v1/responses/{response_id:path}/input_items")  # (before the response's route, which would take it)
    async def response_input_items(response_id: str, order: str = "desc", limit: int = 20, after: str | None = None,
                                   before: str | None = None):
        return JSONResponse(st.responses.input_items(response_id, order, limit, after, before))

    @get("/v1/responses/{response_id:path}")
    async def response_kept(response_id: str, stream: bool = False, starting_after: int | None = None):
        return st.background.get(response_id, stream, starting_after)  # (as sent: no re-encoding)

    @get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in limits.served_model_names or [st.model_name]]}

    @get("/v1/models/{model:path}")
    async def model(model: str):  # the openai SDK's models.retrieve (it was a 404 for the served model)
        if model in ("", "/"):  # (/v1/models/: the list, as others redirect a trailing slash; it was a 404 "model ''")
            return await models()
        model = model if model in st.served_names else model.removesuffix("/")  # (a listed name may end in "/")
        if model not in st.served_names:
            raise model_not_found(model, st.served_names, st.model_name)
        return model_card(model)

    @get("/health")
    async def health():
        st.check_admitting()
        return {"status": "ok", "model": st.model_name}

    @app.post("/ping")
    @get("/ping")
    async def ping():  # (vLLM's: SageMaker's health check)
        return await health()

    @get("/version")
    async def version():  # (vLLM's: what clients and dashboards probe)
        return {"version": _version()}

    @get("/metrics")
    async def metrics():
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @get("/hicache/status")
    async def status():
        s = st.engine.status()
        # the limits requests are held to: a 0 in ServerLimits means the engine's, reported as such
        # (regression: hicache-serve reported a prompt limit of 0)
        effective = {**dataclasses.asdict(st.limits), "api_key": bool(st.limits.api_key),  # (never the key itself)
                     "chat_template": st.limits.chat_template is not None,  # (its text: the tokenizer's below)
                     "max_prompt_tokens": st.prompt_limit, "max_tokens_limit": st.max_tokens_limit,
                     "served_model_names": list(st.served_names)}  # (regression: [] where none was given)
        s["server"] = {"in_flight": st.in_flight, "draining": st.draining, "limits": effective,
                       "tokenizer": getattr(st.tokenizer, "kind", None),
                       "chat_template": getattr(st.tokenizer, "chat_template", None) is not None}
        return JSONResponse(jsonable(s))

    return app


# -- generation --------------------------------------------------------------------------------------
class _Slot:
    """Places of --max-concurrent-requests, one per engine request (K prompts with n choices hold K * n);
    released exactly once."""

    def __init__(self, st: _ServerState) -> None:
        self.st, self.count = st, 0
        self.add(1)

    def add(self, count: int) -> None:
        st = self.st
        if st.in_flight + count > st.limits.max_concurrent_requests:
            raise APIError(429, f"too many concurrent requests (limit {st.limits.max_concurrent_requests}, "
                                f"--max-concurrent-requests); retry later", code="too_many_requests",
                           headers={"Retry-After": "1"})
        st.metrics.in_flight.inc(count)  # (first: where it raises, no place is held)
        st.in_flight += count
        self.count += count

    def release(self) -> None:
        st, self.st = self.st, None
        if st is not None:
            st.in_flight -= self.count
            st.metrics.in_flight.dec(self.count)


async def _generate(request: Request, st: _ServerState, chat: bool, shape: ResponsesShape | None = None):
    """A completion's or a chat's body served; shape: another API's body served as a chat's, its output
    rendered its way (/v1/responses)."""
    arrival = time.perf_counter()
    try:
        st.check_admitting()
        # the body before a slot: a client stalled mid-upload must not hold one of
        # --max-concurrent-requests (its size is capped by --max-body-bytes either way)
        body = await read_json_body(request, st.limits.max_body_bytes)
        st.check_admitting()
        slot = _Slot(st)
    except APIError:
        st.metrics.outcome("rejected")
        raise
    except ClientDisconnect:  # the client left while its body was read: nothing to answer
        st.metrics.outcome("aborted")
        return Response(status_code=499)
    gens: list[Generation] = []
    try:
        if chat and (err := chat_unavailable(st.tokenizer, st.model_name, body)):
            raise err
        if shape is not None:
            body = shape.chat_body(body)
        api_req, prompts, params = parse_prompts(
            body, chat, tokenizer=st.tokenizer, served_names=st.served_names, model_name=st.model_name,
            vocab_size=st.engine.vocab_size, prompt_limit=st.prompt_limit, max_tokens_limit=st.max_tokens_limit,
            default_max_tokens=st.limits.default_max_tokens, context_tokens=st.engine.max_kv_tokens,
            sampling_defaults=st.limits.sampling_defaults, auto_tools=st.limits.tool_call_parser is not None,
            trust_templates=st.limits.trust_request_chat_template,
            content_format=st.limits.chat_template_content_format)
        beams = BeamSearches.of(st, api_req, params, chat, arrival)  # use_beam_search (None: not asked)
        k, n = len(prompts), api_req.n or 1
        total = k * n  # engine requests: choice prompt_index * n + j, OpenAI's order
        if total > st.limits.max_concurrent_requests:  # each choice is a request: waiting would never do
            what = f"a batch of {k} prompts" if n == 1 else f"{k} prompt(s) with n={n} ({total} choices)"
            raise APIError(400, f"{what} exceeds --max-concurrent-requests ({st.limits.max_concurrent_requests}); "
                                f"each choice counts as a request", param="prompt" if n == 1 else "n",
                           code="batch_too_large")
        slot.add(total - 1)
        rids = resolve_ids(request, (api_req if shape is None else shape.req).request_id, chat, shape is None)
        if params.guided is not None:  # its grammar compiled off the loop (once per spec; validate then finds it):
            try:  # ~0.3 s for a required tool_choice over 1,000 tools held every stream (regression)
                await asyncio.get_running_loop().run_in_executor(None, st.engine.guides.check, params.guided)
            except RequestError as exc:
                raise _refused(st, exc, 0, k, api_req) from None
        for i, ids in enumerate(prompts):  # every prompt is checked before any is queued (choices' seeds: in range)
            try:
                (beams or st.engine).validate(ids, params)
            except RequestError as exc:
                raise _refused(st, exc, i, k, api_req) from None
        for i, ids in enumerate(prompts):
            if beams is not None:  # the prompt's search, its n beams as its choices (scheduler/api_beam_search.py)
                gens += beams.choices(ids, rids, index=i, batch_size=k)
                continue
            for j in range(n):
                try:
                    ereq = st.engine.add_request(ids, choice_params(params, j),
                                                 rid=rids.engine_rid(i * n + j, total))
                except RequestError as exc:
                    raise _refused(st, exc, i, k, api_req) from None
                try:
                    gens.append(Generation(st, ereq, api_req, chat, arrival, index=i, batch_size=k, choice=j, n=n))
                except BaseException:  # (queued, but in no Generation that the clean-up below aborts)
                    await abort_quietly(st.engine, ereq)
                    raise
        # until a response holds the requests, a raise is cleaned up below (regression: one here, in a counter,
        # Choices, the Responses output or a background start, left the slot held for good and the requests running)
        st.metrics.prompt_tokens.inc(sum(len(g.req.prompt) for g in gens))  # (each choice's: vLLM's child requests)
        choices = Choices(gens, chat, rids.response_id, api_req, st.model_name)
        if shape is not None:
            try:
                choices = shape.output(choices)
                if shape.req.background:  # its task holds the slot, detached from this request
                    return st.background.start(choices, slot, api_req.stream)
            finally:
                shape.release_claim()  # (its run, where it started, is kept under the id by now)
        if api_req.stream:
            return SSEResponse(choices.sse(), choices, slot, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    except APIError:
        await _abort_all(st, gens)  # a batch's prompts queued before one was refused
        slot.release()
        if shape is not None:
            shape.release_claim()
        st.metrics.outcome("rejected")
        raise
    except BaseException as exc:  # cancelled (the client went away), or a bug (a 500)
        await _abort_all(st, gens)
        slot.release()
        if shape is not None:
            shape.release_claim()
        st.metrics.outcome("aborted" if isinstance(exc, asyncio.CancelledError) else "failed")
        raise
    try:
        return await choices.complete(request)
    finally:
        slot.release()


def _refused(st: _ServerState, exc: RequestError, index: int, batch_size: int, api_req) -> APIError:
    """The engine refused prompt `index` of a request: a 400 naming it (a 503 while shutting down, or
    once the engine loop failed); a grammar it refused, by the field that asked for it."""
    exc = named_refusal(exc, api_req)
    try:
        st.check_admitting()
    except APIError as err:
        return err
    if st.draining or not st.engine.accepting:
        return APIError(503, f"the server is shutting down: {exc}", code="shutting_down")
    if batch_size == 1:
        return APIError(400, str(exc), param=exc.param or "prompt", code="invalid_request")
    return APIError(400, f"prompt {index} of the batch: {exc}", param=exc.param or f"prompt.{index}",
                    code="invalid_request")


async def _abort_all(st: _ServerState, gens: list[Generation]) -> None:
    for gen in gens:
        # (its prompt's tally too: refused, it never ends, and the tally kept its count above 0 and the request's
        # body, its whole prompt, until the next request: regression)
        gen.prompt_choices.ended(0)
        await abort_quietly(st.engine, gen.req)


if __name__ == "__main__":  # python -m scheduler.server: the command line (scheduler/serve.py)
    from scheduler.serve import main

    sys.exit(main())
