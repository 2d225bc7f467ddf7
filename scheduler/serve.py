"""hicache-serve: the command line of the OpenAI-compatible HTTP server (scheduler/server.py): the
engine's flags and the server's, checked before anything is built (a flag that cannot be used is
one line on stderr and exit status 2), then the engine, the app and uvicorn (uvloop), with SIGINT /
SIGTERM starting the engine's shutdown grace at once.

    python -m scheduler.server --model tiny --enable-hicache --port 8000     (or: hicache-serve ...)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import socket
import sys
import threading
from dataclasses import replace
from pathlib import Path

import uvicorn

from scheduler import sigterm
from scheduler.api_auth import CORSSettings, api_key_from, json_str_list, key_problem
from scheduler.chat_template import CONTENT_FORMATS, ChatTemplate, read_chat_template
from scheduler.config import HICACHE_NEEDS_PREFIX_CACHE, add_engine_args, config_from_args
from scheduler.engine import Engine
from scheduler.generation_defaults import GENERATION_CONFIG_FILE, GenerationDefaults, read_generation_defaults
from scheduler.memory_plan import pools_line
from scheduler.presets import is_preset, model_config_of
from scheduler.reasoning import PARSERS
from scheduler.tool_calls import PARSERS as TOOL_PARSERS
from scheduler.server import ServerLimits, create_app
from scheduler.server import __doc__ as SERVER_DOC
from scheduler.tokenizer import load_tokenizer


INTERRUPTED_STATUS = 128 + signal.SIGINT  # (the shell's status of a process Ctrl-C killed, as the replay's)


class _Server(uvicorn.Server):
    """uvicorn's server, told at SIGINT/SIGTERM so admission stops and the engine's grace period
    starts at once (uvicorn waits for connections a little longer than the grace, so aborted streams
    can end cleanly); exits 0 after a clean shutdown instead of re-raising the signal. A second signal forces the
    exit: the engine's grace ends (`on_force`), its requests aborted, and it still shuts down."""

    def __init__(self, config: uvicorn.Config, on_exit, on_force, engine_shutdown=lambda: None,
                 grace_s: float = 0.0) -> None:
        super().__init__(config)
        self._on_exit, self._on_force = on_exit, on_force
        self._engine_shutdown = engine_shutdown  # -> the engine's shutdown task, once on_exit began it
        self._grace_s = grace_s

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:  # a second SIGTERM forces too (a supervisor's; regression: uvicorn forces at a second
            # SIGINT only, and the server waited out its whole grace)
            self.force_exit = True
            self._on_force()
        self._on_exit()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        # once the engine's grace ran out, a stream whose client reads no more cannot end (regression: uvicorn waited
        # past the grace for it, then cancelled its handler, a traceback): its connection is ended as at a forced exit
        ending = asyncio.ensure_future(self._end_handlers_after_engine(self._grace_s))
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()
        if self.force_exit and not self.lifespan.shutdown_event.is_set():
            # uvicorn skips the app's lifespan shutdown when forced (regression: asyncio.run then cancelled the
            # engine's shutdown and every stream's handler, a traceback each): the engine shuts down, its grace
            # ended, its tiers closed (a kept L3's index saved), and the handlers end
            await self.lifespan.shutdown()
            await self._end_handlers()

    async def _end_handlers_after_engine(self, grace_s: float) -> None:
        """`_end_handlers` once the engine shut down, not before the grace ran out (other responses get it too)."""
        grace = asyncio.ensure_future(asyncio.sleep(grace_s))
        try:
            while (task := self._engine_shutdown()) is None:  # (on_exit spawns it on this loop: soon)
                await asyncio.sleep(0.1)
            await asyncio.wait([task, grace])
        finally:
            grace.cancel()
        await self._end_handlers()

    async def _end_handlers(self) -> None:
        """Let the handlers write the last events of the requests the engine aborted, for up to a second; then drop
        the connections of those still going (a client that reads no more), which ends them, not cancelled."""
        for attempt in range(60):
            if not self.server_state.tasks:
                return
            if attempt == 10:
                for connection in list(self.server_state.connections):
                    # abort, not close: close() waits for the write buffer to flush, which a client that reads no
                    # more never lets happen (regression: its handler waited to write, and was cancelled, a traceback)
                    connection.transport.abort()
            await asyncio.sleep(0.1)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none (None), a switch's (False) or a 0 the
    help explains ("0: ..."); previously --help stated no default at all."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == 0:
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    # (no docstring under python -OO: no description rather than a crash at start)
    parser = argparse.ArgumentParser(prog="hicache-serve", description=SERVER_DOC and SERVER_DOC.split("\n\n")[0],
                                     formatter_class=_HelpFormatter)
    add_engine_args(parser)  # includes --max-prompt-tokens
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000,
                   help="TCP port, 0 to 65535 (0 picks a free one; the log says which)")
    s.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask")
    s.add_argument("--max-concurrent-requests", type=int, default=ServerLimits.max_concurrent_requests,
                   help="generation requests served at once (429 above); each choice is one: a /v1/completions "
                        "list of K prompts with n choices (or n beams) takes K × n places (400 when that is above "
                        "this)")
    s.add_argument("--max-body-bytes", type=int, default=ServerLimits.max_body_bytes,
                   help="largest request body in bytes (413 above)")
    s.add_argument("--shutdown-grace-s", type=float, default=ServerLimits.shutdown_grace_s,
                   help="seconds in-flight requests get to finish at shutdown (negative: 0)")
    s.add_argument("--generation-config", default="auto", metavar="{auto,vllm,DIR}",
                   help="auto: a checkpoint's generation_config.json sets the temperature, top_p, top_k, min_p "
                        "and repetition_penalty of requests that leave them out (as vLLM's default); vllm: "
                        "OpenAI's neutral defaults; a directory: its generation_config.json's (as vLLM's)")
    s.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                   help="a chat answer's thinking (<think> ... </think>) sent as the message's reasoning_content, "
                        "the rest as its content (vLLM's flag; qwen3 and deepseek_r1 split alike)")
    s.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                   help="the chat template (a Jinja file, or the template itself) that renders chats, in place of the "
                        "checkpoint's; also gives the presets' byte tokenizer a chat (vLLM's flag)")
    s.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                   help="how a message's content reaches the chat template: string, its text parts joined; openai, "
                        "OpenAI's list of parts, a string as one (for templates that loop over a message's content); "
                        "auto: the one each template reads, from its Jinja source (vLLM's flag)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat with the template its request sends (`chat_template`, or chat_template_kwargs' "
                        "key), in place of the server's; refused (400) without this flag, as a template is code the "
                        "server runs (vLLM's flag)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve a chat's tool_choice \"auto\" (the default with tools): the model's tool calls read out "
                        "of its answer by --tool-call-parser (vLLM's flags)")
    s.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default=None,
                   help="the format of the model's tool calls: hermes, <tool_call>{json}</tool_call> (Qwen2.5, Qwen3)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="the /v1/ routes and /reset_prefix_cache ask for 'Authorization: Bearer KEY' (401 otherwise; "
                        "/health, /ping, /metrics, /version, /tokenize, /detokenize and /hicache/status stay open, "
                        "as vLLM's); without the flag, the environment's HICACHE_API_KEY if set")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names a request's model may use (those alone), the first the one /v1/models and "
                        "responses report; without it, the model's path, its last part and its id")
    s.add_argument("--allowed-origins", type=json_str_list, default=None, metavar="JSON",
                   help='CORS: the origins browser pages may call from, a JSON list (\'["*"]\': any); '
                        'without it no CORS headers are sent')
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth headers)")
    s.add_argument("--allowed-methods", type=json_str_list, default=["*"], metavar="JSON",
                   help="CORS: the methods allowed, a JSON list (only with --allowed-origins)")
    s.add_argument("--allowed-headers", type=json_str_list, default=["*"], metavar="JSON",
                   help="CORS: the request headers allowed, a JSON list (only with --allowed-origins)")
    s.add_argument("--responses-store-max", type=int, default=ServerLimits.responses_store_max, metavar="N",
                   help="Responses (/v1/responses, store true) kept in memory for previous_response_id and "
                        "GET /v1/responses/{id}, the least recently used dropped first; 0: none kept")
    s.add_argument("--responses-store-max-mib", type=int, default=ServerLimits.responses_store_max_mib, metavar="MIB",
                   help="and at most this many MiB of their JSON (a response's, its input's, the conversation it "
                        "ends, a background one's events'; in memory some five times that, less where turns share "
                        "their conversation); one larger alone is not kept")
    s.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries X-Request-Id: the request's own, else the id it ran under (vLLM's)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    s.add_argument("--disable-access-log", action="store_true", help="no uvicorn line per HTTP request")
    return parser


def _check_server_args(args: argparse.Namespace) -> str | None:
    """The reason the server-only flags cannot be used, or None."""
    for name in ("max_tokens_limit", "max_concurrent_requests", "max_body_bytes"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.responses_store_max < 0:
        return f"--responses-store-max must be >= 0 (0: none kept), got {args.responses_store_max}"
    if not 1 <= args.responses_store_max_mib <= 1 << 30:
        return f"--responses-store-max-mib must be in [1, 2**30], got {args.responses_store_max_mib}"
    if not 0 <= args.port <= 65535:  # (65536 + n bound port n while the log said 65536 + n)
        return f"--port must be in [0, 65535], got {args.port}"
    if not args.host:  # (an unset variable's "": uvicorn listened on every interface, the default being 127.0.0.1)
        return "--host must not be empty (0.0.0.0 or :: for every interface)"
    if problem := _bind_problem(args.host, args.port):
        return problem
    if args.generation_config not in ("auto", "vllm") and (not args.generation_config or not os.path.isfile(
            os.path.join(args.generation_config, GENERATION_CONFIG_FILE))):  # (vLLM's third form; "": not the cwd)
        return f"--generation-config must be auto, vllm or a directory holding {GENERATION_CONFIG_FILE}, " \
               f"got {args.generation_config!r}"
    if args.api_key == "":  # (no key at all, unlike an empty HICACHE_API_KEY, which reads as unset)
        return "--api-key must not be empty (leave it out for no key)"
    if (key := api_key_from(args.api_key)) and (why := key_problem(key)):  # (before the model loads)
        return f"{'--api-key' if args.api_key is not None else 'HICACHE_API_KEY'} {why}"
    if args.served_model_name is not None and not all(args.served_model_name):
        return f"--served-model-name: a name must not be empty, got {args.served_model_name}"
    if math.isnan(args.shutdown_grace_s):  # (NaN was a grace of 0)
        return "--shutdown-grace-s must be a number of seconds, got nan"
    if args.enable_hicache and args.disable_prefix_cache:  # (served, with L2/L3 idle)
        return f"--enable-hicache cannot be used with --disable-prefix-cache: {HICACHE_NEEDS_PREFIX_CACHE}"
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):  # (vLLM's: the two go together)
        return "--enable-auto-tool-choice and --tool-call-parser go together: give both or neither"
    if args.enable_hicache and args.hicache_storage_path is not None and args.hicache_storage_backend == "file":
        # (another backend: HiCacheConfig's "only used by --hicache-storage-backend file" is the problem)
        problem = _storage_path_problem(args.hicache_storage_path)
        if problem:
            return f"--hicache-storage-path {args.hicache_storage_path!r}: {problem}"
    if args.log_json == "":  # (an unset variable's: the log was silently off, where the replay refuses it)
        return "--log-json must not be empty (leave it out for no log file)"
    if args.log_json:  # created here so that a path that cannot be is one line, not a traceback
        try:
            Path(args.log_json).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--log-json: cannot create the directory of {args.log_json}: {exc.strerror or exc}"
        if Path(args.log_json).is_dir() or not os.access(Path(args.log_json).parent, os.W_OK):
            return f"--log-json: cannot write {args.log_json}"
    return None


def _bind_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on (host, port), found before the model is built (regression: a port in use or
    a host that does not resolve was uvicorn's error, exit 3, after a long load); None: it can (a socket bound
    and closed; the port could still be taken in between)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"--host {host!r}: {exc.strerror or exc}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds)
        try:
            sock.bind(address)
        except OSError as exc:
            return f"--port {port} on --host {host}: {exc.strerror or exc}"
    return None


def _generation_defaults(args: argparse.Namespace) -> GenerationDefaults:
    """The sampling defaults of requests: with --generation-config auto and a checkpoint directory, its
    generation_config.json's (read before the model loads: a bad value is one line, naming the file and
    the key), with a directory that one's; a preset or --generation-config vllm: OpenAI's neutral ones."""
    if args.generation_config not in ("auto", "vllm"):
        return read_generation_defaults(args.generation_config)
    if args.generation_config == "vllm" or is_preset(args.model) or not os.path.isdir(args.model):
        return GenerationDefaults()
    return read_generation_defaults(args.model)


def _tokenizer(model: str):
    """The server's tokenizer (scheduler/tokenizer.py load_tokenizer), read before the weights load: a tokenizer file
    it cannot read is one line naming it, not a traceback after a long load; None: none (create_app says so)."""
    if is_preset(model):
        return load_tokenizer(model, model_config_of(model).vocab_size)
    return load_tokenizer(model, 0) if os.path.isdir(model) else None


def _access_limits(args: argparse.Namespace) -> dict:
    """ServerLimits' access fields from the flags (scheduler/api_auth.py): the key (the flag's, else
    HICACHE_API_KEY's), the served names, CORS (None without --allowed-origins: no CORS, as before)."""
    cors = None if args.allowed_origins is None else CORSSettings(
        tuple(args.allowed_origins), args.allow_credentials, tuple(args.allowed_methods), tuple(args.allowed_headers))
    return {"api_key": api_key_from(args.api_key), "served_model_names": tuple(args.served_model_name or ()),
            "cors": cors}


def _storage_path_problem(path: str) -> str | None:
    """Why the L3 file cannot go at `path`, where that is plain before the model loads (an empty path,
    an unset variable's, was read as the current directory; a directory, or one that does not exist,
    was refused after the weights were loaded, naming no flag); None: the file's own checks decide
    (hicache/storage_file.py: links, other owners, locks, free space)."""
    if not path:
        return "empty (leave it out for a temporary file)"
    if os.path.isdir(path):
        return "a directory; give a file's path"
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"its directory {directory} does not exist"
    return None


def _idle_hicache_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The --hicache-* flags given away from their defaults while --enable-hicache is off (they change
    nothing then: the server used to start without a word, L1 alone)."""
    if args.enable_hicache:
        return []
    return [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
            if "hicache" in name and name != "enable_hicache" and value != parser.get_default(name)]


def _server(parser: argparse.ArgumentParser, args: argparse.Namespace, engine: Engine,
            sampling_defaults: GenerationDefaults, chat_template: str | None, tokenizer) -> _Server:
    """The app on `engine` and the uvicorn server that will run it, what they use said on stderr."""
    print(f"hicache-serve: {pools_line(engine.status())}", file=sys.stderr)
    if idle := _idle_hicache_flags(parser, args):
        print(f"hicache-serve: ignored without --enable-hicache (L1 only): {', '.join(idle)}", file=sys.stderr)
    if sampling_defaults.describe():
        print(f"hicache-serve: {sampling_defaults.describe()}", file=sys.stderr)
    limits = ServerLimits(max_prompt_tokens=args.max_prompt_tokens, max_tokens_limit=args.max_tokens_limit,
                          max_concurrent_requests=args.max_concurrent_requests, max_body_bytes=args.max_body_bytes,
                          shutdown_grace_s=max(0.0, args.shutdown_grace_s), sampling_defaults=sampling_defaults,
                          reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                          chat_template=chat_template, trust_request_chat_template=args.trust_request_chat_template,
                          chat_template_content_format=args.chat_template_content_format,
                          enable_request_id_headers=args.enable_request_id_headers,
                          responses_store_max=args.responses_store_max,
                          responses_store_max_mib=args.responses_store_max_mib,
                          **_access_limits(args))
    if limits.api_key:  # (where the key came from; never the key)
        print(f"hicache-serve: the /v1/ routes ask for the API key of "
              f"{'--api-key' if args.api_key else 'HICACHE_API_KEY'}", file=sys.stderr)
    if limits.cors is None and (idle := [f for f in ("allow_credentials", "allowed_methods", "allowed_headers")
                                         if getattr(args, f) != parser.get_default(f)]):
        print(f"hicache-serve: ignored without --allowed-origins (no CORS): "
              f"{', '.join('--' + f.replace('_', '-') for f in idle)}", file=sys.stderr)
    app = create_app(engine, limits, tokenizer=tokenizer)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, loop="uvloop", lifespan="on",
                               log_level=args.log_level, access_log=not args.disable_access_log,
                               # (past the grace, the engine's shutdown then `_end_handlers` end what is left
                               # first: with 2 s, a loaded machine let uvicorn cancel a stalled client's handler)
                               timeout_graceful_shutdown=limits.shutdown_grace_s + 5.0)
    return _Server(uv_config, on_exit=app.state.hc.begin_shutdown, on_force=engine.end_grace,
                   engine_shutdown=lambda: app.state.hc.shutdown_task, grace_s=limits.shutdown_grace_s)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = _check_server_args(args)
    if problem:
        print(f"hicache-serve: {problem}", file=sys.stderr)
        return 2
    try:
        config = replace(config_from_args(args), max_new_tokens_limit=args.max_tokens_limit)
        sampling_defaults = _generation_defaults(args)
        chat_template = None if args.chat_template is None else read_chat_template(args.chat_template)
        if chat_template is not None:
            ChatTemplate(chat_template)  # (one that does not compile: refused before the model loads)
        tokenizer = _tokenizer(config.model)
    except ValueError as exc:  # (a CheckpointError is one)
        print(f"hicache-serve: {exc}", file=sys.stderr)
        return 2
    try:  # (SIGTERM before uvicorn takes it raises, as Ctrl-C does: regression, its default killed the process as the
        # engine was built, e.g. in a GPU's graph capture, past the cache's adopting a kept L3's index: it was lost)
        with sigterm.raises():
            server = _start(parser, args, config, sampling_defaults, chat_template, tokenizer)
    except sigterm.Terminated:
        print("hicache-serve: terminated (SIGTERM) while starting; the engine closed", file=sys.stderr)
        return sigterm.EXIT_STATUS
    except KeyboardInterrupt:  # (as the replay's Ctrl-C; regression: a traceback, where SIGTERM's is one line)
        print("hicache-serve: interrupted (Ctrl-C) while starting; the engine closed", file=sys.stderr)
        return INTERRUPTED_STATUS
    if server is None:
        return 2
    server.run()
    # not a clean stop where its engine loop crashed or its shutdown failed: 1, for a supervisor to see (regression: 0)
    return 1 if server.config.app.state.hc.engine_error else 0


def _start(parser: argparse.ArgumentParser, args: argparse.Namespace, config, sampling_defaults: GenerationDefaults,
           chat_template: str | None, tokenizer) -> _Server | None:
    """The engine and the server that will run it; None: the engine refused to start (said on stderr)."""
    try:
        engine = Engine(config)
    except ValueError as exc:
        print(f"hicache-serve: {exc}", file=sys.stderr)
        return None
    except (OSError, RuntimeError, MemoryError) as exc:  # (a pool larger than the machine: a traceback)
        print(f"hicache-serve: cannot start the engine: {str(exc).splitlines()[0] if str(exc) else repr(exc)}",
              file=sys.stderr)
        return None
    try:  # (uvicorn's lifespan shuts the engine down once it runs the app; till then a raise, or a Ctrl-C, must
        # close it: regression, its tiers stayed open and the kept L3's index it adopted, deleted as read, was lost)
        return _server(parser, args, engine, sampling_defaults, chat_template, tokenizer)
    except BaseException:
        engine.cache.abandon()  # (an index adopted is saved again as it was read; the L3 file unlocked)
        engine.runner.close()
        engine.release_logging()  # (its --log-json let go, as its shutdown does: main() may run in-process)
        raise


if __name__ == "__main__":
    sys.exit(main())
