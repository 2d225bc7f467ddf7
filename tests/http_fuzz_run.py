"""The HTTP differential fuzz's run (tests/test_http_diff_fuzz_hunt.py): one call through the ASGI
app as a server runs it (clients that leave included), a case's rounds against the server, and the
checks of every answer, of the engine after each round and of the server's counters."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from hicache.faults import Fault, FaultInjector
from hicache.radix import Tier
from hicache_helpers import assert_whole
from http_fuzz_features import check_logprobs, feature_tags, merge_logprobs, prompt_count
from http_fuzz_features import prompt_tokens as prompt_tokens_of
from http_fuzz_cases import (ENGINE_MAX_TOKENS, HANG_GUARD_S, Call, Case, build_case, expect, make_skeleton,
                             make_tokenizer, reference_engine, set_eos)
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app


# -- one HTTP call through the ASGI app ---------------------------------------------------------------
@dataclass
class Reply:
    status: int | None = None
    body: bytes = b""
    events: list = field(default_factory=list)  # a stream's data events (dicts; "[DONE]" as the string)
    disconnected: bool = False
    raised: BaseException | None = None
    sent_status: int | None = None   # what the app answered, whether or not the client was still there
    sent_body: bytes = b""


async def asgi_call(app, path: str, body: bytes, *, spec: str = "2.3", disconnect: tuple | None = None,
                    send_raises: bool = False) -> Reply:
    """POST `body` to `path` as a server would run the app. disconnect: ("body",): the client leaves
    before sending its body; ("events", n): after n body messages; ("after_s", s): s seconds after the
    request began. After a disconnect a send is dropped (uvicorn) or a body's raises OSError (send_raises)."""
    reply = Reply()
    gone = asyncio.Event()      # the client went away, or the response is complete (receive says so)
    body_sent = False
    body_messages = 0

    def leave() -> None:
        reply.disconnected = True
        gone.set()

    async def receive() -> dict:
        nonlocal body_sent
        if disconnect == ("body",):
            leave()
        if not body_sent and not gone.is_set():
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal body_messages
        if message["type"] == "http.response.start":
            reply.sent_status = message["status"]
        elif message["type"] == "http.response.body":
            reply.sent_body += message.get("body", b"")
        if reply.disconnected:
            # (a start is dropped, not raised on: the app then sends the body the metrics check reads)
            if send_raises and message["type"] == "http.response.body":
                raise OSError("the client went away")
            return
        if message["type"] == "http.response.start":
            reply.status = message["status"]
        elif message["type"] == "http.response.body":
            reply.body += message.get("body", b"")
            body_messages += 1
            if not message.get("more_body", False):
                gone.set()  # (uvicorn's receive answers a disconnect once the response is complete)
            elif disconnect is not None and disconnect[0] == "events" and body_messages >= disconnect[1]:
                leave()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    timer = None
    if disconnect is not None and disconnect[0] == "after_s":
        timer = asyncio.get_running_loop().call_later(disconnect[1], leave)
    try:
        await asyncio.wait_for(app(scope, receive, send), HANG_GUARD_S)
    except asyncio.TimeoutError:
        raise
    except Exception as exc:  # judged by the caller (only a disconnect's may leave the app)
        reply.raised = exc
    finally:
        if timer is not None:
            timer.cancel()
    if reply.status == 200 and reply.body.startswith(b"data: "):
        for block in reply.body.decode().split("\n\n"):
            if block.startswith("data: "):
                data = block[len("data: "):]
                reply.events.append(data if data == "[DONE]" else json.loads(data))
    return reply


# -- the run ---------------------------------------------------------------------------------------
def make_server_engine(case: Case) -> Engine:
    config = EngineConfig(model="tiny", device="cpu", page_size=case.page_size, num_pages=case.num_pages,
                          max_new_tokens_limit=ENGINE_MAX_TOKENS, **case.engine)
    hicache = dict(case.hicache)
    faults = None
    if "faults" in hicache:
        faults = FaultInjector()
        faults.arm(Fault.SLOW_READ, times=None, probability=0.5, seed=case.seed, delay_s=hicache.pop("faults"))
    eng = Engine(config.with_hicache(enable=True, **hicache), faults=faults)
    set_eos(eng, case.eos)
    return eng


def check_reply(call: Call, reply: Reply, seen: dict | None = None, tolerate: tuple = ()) -> list[str]:
    """What is wrong with `reply` to `call` (empty: nothing); `seen` counts what was exercised.
    tolerate: error codes that may cut any reply (too_many_requests; shutting_down, aborted at shutdown):
    an error status, or a stream's last event; what was answered before must be a prefix of the answer."""
    out: list[str] = []
    seen = {} if seen is None else seen
    tag = f"status {reply.status}{' gone' if reply.disconnected else ''}"
    seen[tag] = seen.get(tag, 0) + 1
    if reply.raised is not None and not (reply.disconnected and isinstance(reply.raised, OSError)):
        # (starlette raises ClientDisconnect, an OSError's kin, out of a stream whose write failed)
        from starlette.requests import ClientDisconnect
        if not (reply.disconnected and isinstance(reply.raised, ClientDisconnect)):
            out.append(f"the app raised {reply.raised!r}")
    if call.disconnect == ("body",):
        if reply.status not in (None, 499) and error_code(reply.body) not in tolerate:
            out.append(f"left before its body, got {reply.status}")
        return out
    if reply.disconnected and reply.status is None:
        return out  # gone before any answer
    if reply.status not in (None, 200) and error_code(reply.body) in tolerate:
        return out
    if call.status != 200:
        if reply.status != call.status:
            out.append(f"status {reply.status} != {call.status}: {reply.body[:300]!r}")
        elif not json.loads(reply.body).get("error", {}).get("message"):
            out.append(f"an error without a message: {reply.body!r}")
        return out
    if reply.status == 503 and reply.disconnected:  # aborted: the client went away
        return out
    if reply.status != 200:
        return out + [f"status {reply.status}: {reply.body[:300]!r}"]
    chat = call.path.endswith("chat/completions")
    k = len(call.choices)
    got: list[list] = [["", [], None] for _ in range(k)]  # text, ids, finish per choice
    lps: list = [None] * k  # logprobs per choice (a stream's merged)
    usage = None
    if call.stream:
        events = reply.events
        if not reply.disconnected and (not events or events[-1] != "[DONE]"):
            return out + [f"a stream not ended by [DONE]: {reply.body[-300:]!r}"]
        seen_first = [False] * k
        cut = False
        for ev in events:
            if ev == "[DONE]":
                continue
            if "error" in ev:
                cut = True
                if not reply.disconnected and ev["error"].get("code") not in tolerate:
                    out.append(f"an error event: {ev}")
                continue
            if not ev["choices"]:
                usage = ev.get("usage")
                continue
            if call.body.get("stream_options", {}).get("include_usage"):
                if ev.get("usage", "missing") is not None:
                    out.append(f"a choice chunk with usage {ev.get('usage', 'missing')}")
            elif "usage" in ev:
                out.append("a chunk carries 'usage' without stream_options.include_usage")
            ch = ev["choices"][0]
            i = ch["index"]
            if len(ev["choices"]) != 1 or not 0 <= i < k:
                out.append(f"a chunk's choices {ev['choices']} (of {k})")
                continue
            if got[i][2] is not None:
                out.append(f"choice {i}: a chunk after its finish_reason: {ch}")
            if chat:
                delta = ch["delta"]
                if (delta.get("role") == "assistant") != (not seen_first[i]):
                    out.append(f"choice {i}: role in chunk {delta}")
                got[i][0] += delta.get("content", "")
            else:
                got[i][0] += ch["text"]
            seen_first[i] = True
            got[i][1] += ch["token_ids"]
            got[i][2] = ch["finish_reason"]
            if ch["logprobs"] is not None and not ch["token_ids"]:
                out.append(f"choice {i}: logprobs in a chunk without tokens: {ch}")
            lps[i] = merge_logprobs(lps[i], ch["logprobs"])
        if call.body.get("stream_options", {}).get("include_usage") and not (reply.disconnected or cut) \
                and usage is None:
            out.append("no usage chunk")
    else:
        body = json.loads(reply.body)
        usage = body["usage"]
        if [c["index"] for c in body["choices"]] != list(range(k)):
            out.append(f"choice indexes {[c['index'] for c in body['choices']]}")
        for i, ch in enumerate(body["choices"][:k]):
            got[i] = [ch["message"]["content"] if chat else ch["text"], ch["token_ids"], ch["finish_reason"]]
            lps[i] = ch["logprobs"]
    complete = not call.stream or (not cut and bool(events) and events[-1] == "[DONE]")
    for i, c in enumerate(call.choices):
        text, ids, finish = c.expected
        g_text, g_ids, g_finish = got[i]
        how = "string" if call.stops and finish == "stop" and len(ids) <= len(g_ids) else ""
        tag = f"{'stream' if call.stream else 'whole'} {finish}{how and ' (string)'}{'' if complete else ' gone'}"
        seen[tag] = seen.get(tag, 0) + 1
        for feature in feature_tags(c, chat, call.stream):
            seen[feature] = seen.get(feature, 0) + 1
        if complete and (g_text, g_ids, g_finish) != (text, ids, finish):
            out.append(f"choice {i}: got {g_finish} {g_ids} {g_text!r}\n      want {finish} {ids} {text!r}"
                       f"\n      prompt {len(c.ids)} tokens, {c.params}, stops {call.stops}")
        elif not complete and (g_ids != ids[:len(g_ids)] or not text.startswith(g_text)):
            out.append(f"choice {i} (client gone): got {g_ids} {g_text!r}, not a prefix of {ids} {text!r}")
        else:
            k_asked = None if c.params is None else c.params.logprobs
            for p in check_logprobs(chat, k_asked, lps[i], g_ids, c.ref_logprobs, complete):
                out.append(f"choice {i} logprobs: {p}\n      prompt {len(c.ids)} tokens, {c.params}")
    if usage is not None and complete:
        prompt_tokens, prompts = prompt_tokens_of(call.choices), prompt_count(call.choices)  # (each prompt once)
        completion_tokens = sum(len(c.expected[1]) for c in call.choices)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) != (
                prompt_tokens, completion_tokens, prompt_tokens + completion_tokens):
            out.append(f"usage {usage} for {prompt_tokens} prompt + {completion_tokens} completion tokens")
        # (each prompt's last token is always computed: its logits give the first token)
        if cached != sum(usage["cached_tokens_per_tier"].values()) or not 0 <= cached <= prompt_tokens - prompts:
            out.append(f"usage's cached tokens: {usage}")
    return out


def check_metrics(registry, replies: list[tuple[Call, Reply]]) -> list[str]:
    """The server's request counters against what it answered: an admitted request (answered 200, or
    failed / aborted after admission) counts one outcome per choice and its prompt tokens; any other
    one outcome (rejected, or aborted before its body); nothing stays in flight."""
    def value(name: str, **labels) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    outcomes = admitted_prompt_tokens = succeeded = 0
    for call, reply in replies:
        admitted = reply.sent_status == 200 or (reply.sent_status in (500, 503) and
                                                error_code(reply.sent_body) in ("aborted", "engine_error"))
        outcomes += len(call.choices) if admitted else 1
        admitted_prompt_tokens += sum(len(c.ids) for c in call.choices) if admitted else 0  # (each choice's)
        if reply.status == 200 and not reply.disconnected and not call.stream:
            succeeded += len(call.choices)
    out = []
    counted = sum(value("hicache_requests_total", outcome=o) for o in ("success", "aborted", "failed", "rejected"))
    if counted != outcomes:
        out.append(f"metrics: {counted} request outcomes counted for {outcomes} "
                   f"({ {o: value('hicache_requests_total', outcome=o) for o in ('success', 'aborted', 'failed', 'rejected')} })")
    if value("hicache_prompt_tokens_total") != admitted_prompt_tokens:
        out.append(f"metrics: {value('hicache_prompt_tokens_total')} prompt tokens for {admitted_prompt_tokens} admitted")
    if value("hicache_requests_total", outcome="success") < succeeded:
        out.append(f"metrics: {value('hicache_requests_total', outcome='success')} successes for {succeeded} answered")
    if value("hicache_requests_in_flight") != 0:
        out.append(f"metrics: {value('hicache_requests_in_flight')} requests in flight at the end")
    return out


def error_code(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def until_idle(eng: Engine, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while eng.requests or eng.waiting or eng.running or eng.parked:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.002)
    return True


async def run_case(case: Case) -> list[str]:
    await expect(case)
    eng = make_server_engine(case)
    app = create_app(eng, ServerLimits(**case.limits), tokenizer=make_tokenizer(case.tokenizer))
    st = app.state.hc
    problems: list[str] = []
    rng = random.Random(case.seed * 31 + 5)

    busy = ("too_many_requests",) if "max_concurrent_requests" in case.limits else ()
    replies: list[tuple[Call, Reply]] = []

    async def one(n: int, call: Call, tolerate: tuple = busy, delay_s: float = 0.0) -> None:
        if call.delay_s or delay_s:
            await asyncio.sleep(call.delay_s + delay_s)
        try:
            reply = await asgi_call(app, call.path, json.dumps(call.body).encode(), spec=call.spec,
                                    disconnect=call.disconnect, send_raises=call.send_raises)
        except asyncio.TimeoutError:
            problems.append(f"call {n} hung: {call.path} {call.body}")
            return
        replies.append((call, reply))
        for p in check_reply(call, reply, case.seen, tolerate):
            problems.append(f"call {n} {call.path} {json.dumps(call.body)[:400]} "
                            f"(stream {call.stream}, disconnect {call.disconnect}, spec {call.spec}): {p}")

    def left_in_engine(when: str) -> bool:
        if eng.requests or eng.waiting or eng.running or eng.parked or st.in_flight:
            problems.append(f"{when}: left in the engine: {list(eng.requests)} waiting {len(eng.waiting)} "
                            f"running {len(eng.running)} parked {len(eng.parked)}; server in flight {st.in_flight}")
            return True
        return False

    async def settle(r: int) -> bool:
        """After a round: nothing left, every tier whole; then the round's flushes. False: stop."""
        await until_idle(eng)
        if left_in_engine(f"round {r}"):
            return False
        try:
            eng.check_integrity()
            await asyncio.wait_for(eng.stop_loop(), HANG_GUARD_S)
            await asyncio.wait_for(eng.cache.drain(), HANG_GUARD_S)
            assert_whole(eng.cache)
        except (AssertionError, asyncio.TimeoutError) as exc:
            problems.append(f"round {r}: not whole: {exc!r}")
            return False
        for tier in case.flushes[r % len(case.flushes)]:
            if {"l1": Tier.L1, "l2": Tier.L2}[tier] in eng.cache.tree.allocators:
                eng.cache.flush({"l1": Tier.L1, "l2": Tier.L2}[tier])
        await eng.start()
        return True

    order = list(range(len(case.calls)))
    async with app.router.lifespan_context(app):
        if case.rounds_mode == "overlapping":
            calls = []
            for r in range(case.rounds):
                rng.shuffle(order)
                start_s = r * rng.uniform(0, 0.05)
                calls += [one(n, case.calls[n], delay_s=start_s) for n in order]
            await asyncio.gather(*calls)
            await settle(0)
        else:
            for r in range(case.rounds):
                rng.shuffle(order)
                if case.rounds_mode == "shutdown" and r == case.rounds - 1:
                    tolerate = (*busy, "shutting_down", "aborted")
                    tasks = asyncio.gather(*(one(n, case.calls[n], tolerate) for n in order))
                    await asyncio.sleep(rng.uniform(0, 0.05))
                    await asyncio.wait_for(st._spawn_shutdown(), HANG_GUARD_S)  # (what the lifespan's end runs)
                    await tasks
                    late = await asgi_call(app, "/v1/completions", b'{"prompt": [1, 2], "max_tokens": 1}')
                    replies.append((Call("/v1/completions", {}, [], status=503), late))
                    if late.status != 503 or error_code(late.body) != "shutting_down":
                        problems.append(f"a request after shutdown: {late.status} {late.body!r}")
                    left_in_engine("after shutdown")
                    break
                await asyncio.gather(*(one(n, case.calls[n]) for n in order))
                if not await settle(r):
                    break
    problems += check_metrics(st.metrics.registry, replies)
    case.metrics = eng.metrics()
    for tier, n in case.metrics.get("hit_tokens", {}).items():
        case.seen[f"hit {tier}"] = n
    return problems


def describe(case: Case) -> str:
    statuses = [c.status for c in case.calls]
    return (f"seed {case.seed}: page {case.page_size}, L1 {case.num_pages} pages, {case.engine}, {case.hicache}, "
            f"limits {case.limits}, tokenizer {case.tokenizer}, eos {case.eos}, {case.rounds} rounds "
            f"{case.rounds_mode}, "
            f"{len(case.calls)} calls ({statuses.count(400)} refused)")


async def fuzz(seed: int, max_calls: int = 12) -> tuple[Case, list[str]]:
    probe = reference_engine(make_skeleton(seed).page_size)
    case = await build_case(seed, probe, max_calls)
    await probe.shutdown()
    return case, await run_case(case)
