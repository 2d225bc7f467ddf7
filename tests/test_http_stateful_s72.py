"""The Responses API's stored state under random interleavings of HTTP calls (a hypothesis stateful test, session 72):
kept responses (`store`), `previous_response_id` chains, `background` responses with GET (whole or streamed), cancel and
DELETE, whole and streamed creations, chat completions beside them, clients that leave a stream early, the store's bound
(--responses-store-max: least recently used first, never a running one), --max-concurrent-requests.

One app in-process (the real engine, tiny preset, CPU, float32, greedy) driven through ASGI from the machine's own loop,
which runs only inside a rule. The MODEL: the kept ids in order of use, each one's stored Response and request, each
chain's conversation as input items. When a run ends it reads off a log of the store's calls (`put` with the runs going
then, `_use`, `delete`), deciding itself what each does (what the bound drops; what a GET, cancel, DELETE or follow-up
must answer then); runs may be held, as slow readers. After every rule: each status is the model's (200 / 400 / 404 /
429, the field named; never a 500); the store holds the model's ids in its order; a finished response's GET equals what
its client was given; `check_integrity()`; the slots held are the runs going. Once the runs ended, each finished answer
(a follow-up's, a chat's) equals that of its conversation sent whole as one `input` (`store` false): text, status,
prompt tokens. At teardown no run, slot or engine request is left. Every wait is bounded (HANG_GUARD_S).
HICACHE_HTTP_STATEFUL_EXAMPLES / _STEPS raise the budget, HICACHE_HTTP_STATEFUL_HUNT=1 draws random examples.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import ByteTokenizer
from test_server_crash_hunt import post_scope

HANG_GUARD_S = 20.0
MAX_CONCURRENT = 2
STORE_MAX = 2
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
TEXTS = ("hi", "tell me more", "why?", "ok")
RUNNING, ENDED = ("queued", "in_progress"), ("completed", "incomplete", "cancelled")


class Reply:
    def __init__(self, status: int | None, body: bytes, left: bool) -> None:
        self.status, self.body, self.left = status, body, left

    def json(self) -> dict:
        return json.loads(self.body)

    def events(self) -> list[dict]:
        data = [ln[6:] for ln in self.body.decode().split("\n") if ln.startswith("data: ")]
        return [json.loads(d) for d in data if d != "[DONE]"]

    def error_param(self) -> str | None:
        return self.json()["error"]["param"]


async def asgi(app, method: str, path: str, body: dict | None = None, query: str = "", leave_after: int | None = None,
               spec: str = "2.3") -> Reply:
    """One HTTP call as a server runs the app; leave_after: the client goes away after that many body messages
    (later sends dropped, as uvicorn drops them)."""
    data, read, gone = b"" if body is None else json.dumps(body).encode(), [], asyncio.Event()
    status, chunks, left = [], [], []

    async def receive() -> dict:
        if not read:
            read.append(1)
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if left:
            return
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                gone.set()
            elif leave_after is not None and len(chunks) >= leave_after:
                left.append(1)
                gone.set()
    scope = {**post_scope(path, data), "method": method, "query_string": query.encode(),
             "asgi": {"version": "3.0", "spec_version": spec}}
    await asyncio.wait_for(app(scope, receive, send), HANG_GUARD_S)
    return Reply(status[0] if status else None, b"".join(chunks), bool(left))


def output_text(response: dict) -> str:
    return "".join(p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"])


class Resp:
    """The model's view of one request that was answered 200: its body, the conversation before its input (input
    items), the finished Response its client was given (or GET first read: `seen`)."""

    def __init__(self, body: dict, history: list[dict]) -> None:
        self.rid, self.body, self.history = body.get("request_id"), body, history
        self.background, self.seen = bool(body.get("background")), None

    def turn(self) -> list[dict]:
        """Its conversation up to its input, as input items."""
        text = self.body["input"]
        return self.history + ([{"role": "user", "content": text}] if isinstance(text, str) else list(text))


class HTTPMachine(RuleBasedStateMachine):
    """Rules are HTTP calls to one app; the model: `order` (the kept ids, least recently used first), `stored` (each
    kept id's last stored Response), `holder` (the request each kept id holds)."""

    @initialize()
    def setup(self):
        self.loop = asyncio.new_event_loop()
        self.eng = Engine(EngineConfig(model="tiny", device="cpu", dtype="float32", page_size=4, num_pages=128,
                                       max_new_tokens_limit=16))
        tok = ByteTokenizer(self.eng.vocab_size)
        tok.use_chat_template(TEMPLATE)
        self.app = create_app(self.eng, ServerLimits(shutdown_grace_s=0.0, max_concurrent_requests=MAX_CONCURRENT,
                                                     responses_store_max=STORE_MAX), tokenizer=tok)
        self.hc = self.app.state.hc
        self.lifespan = self.app.router.lifespan_context(self.app)
        self._run(self.lifespan.__aenter__())
        # the kept ids (the least recently used first), each one's stored Response and the request it holds
        self.order, self.stored, self.holder = [], {}, {}
        self.run_holder: dict = {}  # a background run -> its request
        self.pending: Resp | None = None  # the request being made (what its puts keep)
        self.ids: list[str] = []
        self.answers: list[Resp] = []  # finished answers, to compare once quiet
        self.refs: dict[str, dict] = {}  # a conversation's whole answer (store false), by its body's JSON
        self.gate: asyncio.Event | None = None  # (held: the background runs started whole read no event)
        self._spy()
        self._gate_runs()

    def _gate_runs(self) -> None:
        """A background response started whole reads its events only while no `gate` is held (`_create`): a slow
        consumer, so that it is still running when later rules come (on the CPU a run ends within a few calls)."""
        background, start = self.hc.background, self.hc.background.start

        def gated_start(out, slot, stream):
            events = out.events

            async def gated():
                async with contextlib.aclosing(events()) as each:
                    async for event in each:
                        while self.gate is not None:
                            await self.gate.wait()
                        yield event
            if not stream:
                out.events = gated
            return start(out, slot, stream)
        background.start = gated_start

    def _spy(self) -> None:
        """Log the store's calls in order (the model replays them: `_replay`)."""
        store, self.log, self.done = self.hc.responses, [], 0

        def logged(call, entry):
            def logging(*args):
                self.log.append(entry(*args))
                return call(*args)
            return logging
        store.put = logged(store.put, lambda stored, run=None: ("put", stored.id, stored.response, run,
                                                                {r.id for r in self._runs()}))
        store._use = logged(store._use, lambda response_id, param=None: ("use", response_id))
        store.delete = logged(store.delete, lambda response_id: ("delete", response_id))

    def _runs(self) -> set:
        return {run for run in self.hc.background.running if not run.finished}

    def _run(self, coro):
        return self.loop.run_until_complete(asyncio.wait_for(coro, HANG_GUARD_S))

    def _call(self, method: str, path: str, body: dict | None = None, pending: Resp | None = None,
              **kw) -> tuple[Reply, list[tuple], set, set]:
        """A call (`pending`: the request it makes, what its puts keep); -> its reply, what the model saw of the store
        meanwhile (`_replay`), the runs going before and after it."""
        before, self.pending = self._runs(), pending
        reply = self._run(asgi(self.app, method, path, body, **kw))
        assert reply.status is not None and reply.status < 500, reply.body
        seen, self.pending = self._replay(), None
        return reply, seen, before, self._runs()

    def _replay(self) -> list[tuple]:
        """The store's calls since the last replay applied to the model; -> each with what the model held as it came:
        ("use", id, its request or None, its stored Response), ("put", id, Response, its request), ("skip", id),
        ("delete", id, kept)."""
        seen = []
        for entry in self.log[self.done:]:
            kind, rid = entry[:2]
            kept = rid in self.order
            if kind == "use":
                seen.append(("use", rid, self.holder.get(rid) if kept else None, self.stored.get(rid)))
                if kept:
                    self.order.remove(rid)
                    self.order.append(rid)
            elif kind == "delete":
                seen.append(("delete", rid, kept))
                if kept:
                    self._drop(rid)
            else:
                _, rid, response, run, running = entry
                if run is None and rid in running:  # (a background run of the id goes on: not replaced)
                    seen.append(("skip", rid))
                    continue
                resp = self.run_holder.setdefault(run, self.pending) if run is not None else self.pending
                assert resp is not None and resp.rid == rid, f"a put of {rid} nobody asked for"
                if kept:
                    self.order.remove(rid)
                self.order.append(rid)
                self.stored[rid], self.holder[rid] = response, resp
                for old in [i for i in self.order if i != rid and i not in running]:
                    if len(self.order) <= STORE_MAX:
                        break
                    self._drop(old)
                seen.append(("put", rid, response, resp))
                if response["status"] not in RUNNING and resp.seen is None:
                    self._answered(resp, response)
        self.done = len(self.log)
        return seen

    def _drop(self, rid: str) -> None:
        self.order.remove(rid)
        del self.stored[rid], self.holder[rid]

    def _answered(self, resp: Resp, answer: dict) -> None:
        """resp's finished answer, to compare (once the engine is quiet) with its conversation sent whole."""
        resp.seen = answer
        if answer["status"] in ("completed", "incomplete"):
            self.answers.append(resp)

    def _pick(self, pick: int) -> str:
        """One the model keeps (pick < 15), one of the last few ids made (< 30), any of them (< 40), or an unknown."""
        if self.order and pick < 15:
            return self.order[-1 - pick % len(self.order)]
        if not self.ids or pick >= 40:
            return f"unknown-{pick}"
        return self.ids[-1 - pick % min(4, len(self.ids))] if pick < 30 else self.ids[pick % len(self.ids)]

    def _admitted(self, reply: Reply, seen: list[tuple], before: set, after: set) -> bool:
        """Not a 429, which only --max-concurrent-requests runs going throughout the call give (and nothing else)."""
        if reply.status == 429:
            assert len(before) >= MAX_CONCURRENT and not [s for s in seen if s[0] != "put"], (reply.body, seen)
            return False
        assert len(after & before) < MAX_CONCURRENT, f"every slot was held throughout: a 429 was due ({reply.body})"
        return True

    def _fresh(self) -> str:
        self.ids.append(f"r{len(self.ids)}")
        return self.ids[-1]

    FLAGS = {"store": st.sampled_from([True, None, False]), "background": st.booleans(), "stream": st.booleans(),
             "text": st.sampled_from(TEXTS), "instructions": st.sampled_from([None, "be brief"]),
             "max_tokens": st.sampled_from([1, 4, 12]), "hold": st.booleans()}

    @rule(**FLAGS, prev=st.one_of(st.none(), st.integers(0, 45)), as_items=st.booleans(),
          reuse=st.one_of(st.none(), st.integers(0, 39)))
    def create(self, prev, reuse, **flags):
        """POST /v1/responses: stored or not, background or not, streamed or not, following a response made (or
        an unknown id), under a fresh request_id or one already used."""
        rid = self._pick(reuse) if reuse is not None and self.ids else self._fresh()
        self._create(rid, None if prev is None else self._pick(prev), **flags)

    @rule(**FLAGS, pick=st.integers(0, 9))
    def follow_up(self, pick, **flags):
        """A follow-up of one the model keeps (of the last few used)."""
        self._create(self._fresh(), self.order[-1 - pick % len(self.order)] if self.order else None, **flags)

    def _create(self, rid, previous, store, background, stream, text, instructions, max_tokens, hold,
                as_items=False):
        """hold: from now on (until `wait`) the background runs started whole read no event (`_gate_runs`)."""
        if hold and self.gate is None:
            self.gate = asyncio.Event()
        body = {"model": "tiny", "input": [{"role": "user", "content": text}] if as_items else text,
                "max_output_tokens": max_tokens, "temperature": 0, "request_id": rid, "stream": stream,
                "background": background, **({} if store is None else {"store": store}),
                **({} if instructions is None else {"instructions": instructions}),
                **({} if previous is None else {"previous_response_id": previous})}
        resp = Resp(body, [])
        reply, seen, before, after = self._call("POST", "/v1/responses", body, resp)
        if not self._admitted(reply, seen, before, after):
            return
        old_runs = {run for run in before if run.id == rid}
        if reply.status == 400 and reply.error_param() == "request_id":
            assert old_runs, reply.body  # (only a run of the id may refuse it)
            return
        assert not (old_runs & after), f"{rid} names a background response running throughout: a 400 was due"
        uses = [s for s in seen if s[0] == "use"]  # (only the previous response looked up, and used)
        assert all(s[1] == previous for s in uses) and bool(uses) == (previous is not None), seen
        if previous is not None:
            _, _, holder, prior = uses[0]
            if holder is None:
                assert reply.status == 404 and reply.error_param() == "previous_response_id", reply.body
                return
            if prior["status"] in (*RUNNING, "failed", "cancelled"):
                assert reply.status == 400 and reply.error_param() == "previous_response_id", reply.body
                return
            resp.history = holder.turn() + prior["output"]
        if background and store is False:
            assert reply.status == 400 and reply.error_param() == "background", reply.body
            return
        if reply.status == 400 and reply.error_param() in ("input", "max_output_tokens"):  # (a long chain: past the
            resp.seen = reply.json()  # pool's 512 tokens; the conversation sent whole must be refused alike)
            self.answers.append(resp)
            return
        assert reply.status == 200, reply.body
        puts = [s[2] for s in seen if s[0] == "put" and s[3] is resp]  # (not a run's of the id before)
        if stream:
            events = reply.events()
            assert [e["sequence_number"] for e in events] == list(range(len(events))), events
            answer = events[-1]["response"]
            assert events[-1]["type"] == f"response.{answer['status']}" and answer["status"] in ENDED, events[-1]
        else:
            answer = reply.json()
            assert not background or answer["status"] == "queued", answer
        assert answer["id"] == rid and answer["previous_response_id"] == previous, answer
        assert answer["background"] is background and answer["store"] is (store is not False), answer
        if store is False:
            assert not puts, f"{rid} was kept with store false"
        elif not background:
            assert puts == [answer], (puts, answer)
        else:
            assert puts and puts[0]["status"] == "queued", puts
        if answer["status"] not in RUNNING:
            if resp.seen is None:
                self._answered(resp, answer)
            assert resp.seen == answer, "a background stream's last Response is not the one kept"

    @rule(pick=st.integers(0, 45), stream=st.booleans(), after=st.sampled_from([None, 0, 3, 1000]))
    def get(self, pick, stream, after):
        """GET /v1/responses/{id}, or a background one's events (stream=true, starting_after)."""
        rid = self._pick(pick)
        stream = stream and self.gate is None  # (a stream is followed to its end: not while runs are held)
        query = "" if not stream else "stream=true" + ("" if after is None else f"&starting_after={after}")
        reply, seen, _, _ = self._call("GET", f"/v1/responses/{rid}", query=query)
        uses = [s for s in seen if s[0] == "use"]
        assert uses and all(s[1] == rid for s in uses), f"GET of {rid} looked up: {seen}"
        holder, kept = uses[0][2:]
        if holder is None:
            assert reply.status == 404 and reply.json()["error"]["code"] == "response_not_found", reply.body
            return
        if stream and not holder.background:
            assert reply.status == 400 and reply.error_param() == "stream", reply.body
            return
        assert reply.status == 200, reply.body
        if stream:
            events = reply.events()
            first = 0 if after is None else after + 1
            assert [e["sequence_number"] for e in events] == list(range(first, first + len(events))), events
            if events:  # (followed to its end)
                assert events[-1]["response"] == holder.seen, "the stream's last Response is not the one kept"
            return
        got = reply.json()
        if got["status"] in RUNNING:
            assert holder.background and kept["status"] in RUNNING, got
        else:
            assert got == holder.seen, "GET differs from what its client was given"

    @rule(pick=st.integers(0, 45))
    def cancel(self, pick):
        """POST /v1/responses/{id}/cancel."""
        rid = self._pick(pick)
        reply, seen, before, after = self._call("POST", f"/v1/responses/{rid}/cancel")
        uses = [s for s in seen if s[0] == "use"]
        assert uses and all(s[1] == rid for s in uses), f"cancel of {rid} looked up: {seen}"
        holder, kept = uses[0][2:]
        if holder is None:
            assert reply.status == 404, reply.body
            return
        if not holder.background:
            assert reply.status == 400 and reply.error_param() == "response_id", reply.body
            return
        assert reply.status == 200, reply.body
        got = reply.json()
        assert got["status"] in ENDED and rid not in {run.id for run in after}, got
        assert got == holder.seen, "the cancel's answer is not the Response kept"
        if kept["status"] not in RUNNING:
            assert self.stored.get(rid) in (None, kept), "a cancel of an ended response changed it"

    @rule(pick=st.integers(0, 45))
    def delete(self, pick):
        """DELETE /v1/responses/{id} (a running background one cancelled)."""
        rid = self._pick(pick)
        reply, seen, _, after = self._call("DELETE", f"/v1/responses/{rid}")
        deletes = [s for s in seen if s[0] == "delete" and s[1] == rid]
        if not (deletes and deletes[0][2]):
            assert reply.status == 404, reply.body
            return
        assert reply.status == 200 and reply.json() == {"id": rid, "object": "response.deleted", "deleted": True}
        assert rid not in self.order and rid not in {run.id for run in after}, "deleted, it is kept or runs"

    @rule(text=st.sampled_from(TEXTS), stream=st.booleans(), max_tokens=st.sampled_from([1, 4, 12]))
    def chat(self, text, stream, max_tokens):
        """A chat completion beside the responses: its text is that of the same input as a Response."""
        body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 0, "stream": stream}
        reply, seen, before, after = self._call("POST", "/v1/chat/completions", body)
        assert not [s for s in seen if s[0] != "put"], seen
        if not self._admitted(reply, seen, before, after):
            return
        assert reply.status == 200, reply.body
        content = ("".join(c["choices"][0]["delta"].get("content") or "" for c in reply.events() if c["choices"])
                   if stream else reply.json()["choices"][0]["message"]["content"])
        resp = Resp({"input": text, "max_output_tokens": max_tokens}, [])
        resp.seen = {"chat": True, "output": [{"type": "message", "content": [{"text": content}]}]}
        self.answers.append(resp)

    @rule(background=st.booleans(), store=st.booleans(), leave_after=st.integers(1, 6),
          spec=st.sampled_from(["2.3", "2.4"]), text=st.sampled_from(TEXTS))
    def abandon(self, background, store, leave_after, spec, text):
        """A stream whose client goes away after a few body messages: a foreground response is not kept unless it
        ended first (then as it ended); a background one runs on."""
        rid = self._fresh()
        body = {"model": "tiny", "input": text, "max_output_tokens": 12, "temperature": 0, "request_id": rid,
                "stream": True, "background": background and store, "store": store}
        resp = Resp(body, [])
        reply, seen, before, after = self._call("POST", "/v1/responses", body, resp, leave_after=leave_after, spec=spec)
        if not self._admitted(reply, seen, before, after):
            return
        assert reply.status == 200, reply.body
        puts = [s[2] for s in seen if s[0] == "put" and s[3] is resp]
        if not store:
            assert not puts
        elif not body["background"]:
            assert len(puts) <= 1 and all(p["status"] in ENDED for p in puts), puts
            assert puts or reply.left, "a stream read to its end was not kept"

    @rule(when=st.integers(0, 2))
    def wait(self, when):
        """(One time in three) every background run ended (bounded); the finished answers compared with their
        conversation whole."""
        if not when:
            self._quiet()

    def _quiet(self) -> None:
        gate, self.gate = self.gate, None  # (the runs held read on)
        if gate is not None:
            gate.set()

        async def ended():
            while self._runs():
                await asyncio.wait([run.task for run in self._runs()])
        self._run(ended())
        self._replay()
        answers, self.answers = self.answers, []
        for resp in answers:
            self._compare(resp)

    def _compare(self, resp: Resp) -> None:
        """resp's answer is that of its conversation sent whole as one input (store false, in the foreground)."""
        body = {"model": "tiny", "input": resp.turn(), "max_output_tokens": resp.body["max_output_tokens"],
                "temperature": 0, "store": False, **{k: v for k, v in resp.body.items() if k == "instructions"}}
        key = json.dumps(body, sort_keys=True)
        if key not in self.refs:
            reply, seen, _, _ = self._call("POST", "/v1/responses", body)
            assert reply.status in (200, 400) and not seen, (reply.body, seen)
            self.refs[key] = reply.json()
        ref, got = self.refs[key], resp.seen
        if ref.get("error") or got.get("error"):  # (a refusal, or a Response that failed)
            assert got == ref, (resp.rid, got, ref)
            return
        assert output_text(got) == output_text(ref), (resp.rid, output_text(got), output_text(ref))
        if "chat" not in got:
            assert got["status"] == ref["status"], (resp.rid, got["status"], ref["status"])
            assert got["usage"]["input_tokens"] == ref["usage"]["input_tokens"], (resp.rid, got["usage"], ref["usage"])

    @invariant()
    def consistent(self):
        if not hasattr(self, "hc"):
            return
        self._replay()
        assert list(self.hc.responses._kept) == self.order, (list(self.hc.responses._kept), self.order)
        self.eng.check_integrity()
        runs = self._runs()
        assert self.hc.in_flight == len(runs) == len(self.hc.background.running), (self.hc.in_flight, runs)
        assert len(self.eng.requests) <= len(runs), self.eng.requests

    def teardown(self):
        if not hasattr(self, "hc"):
            return
        try:
            if sys.exc_info()[0] is None:  # (after a failed step the app may hang: shrinking would wait on it)
                self._quiet()
                assert self.hc.in_flight == 0 and not self.hc.background.running and not self.eng.requests
        finally:  # (a run held at its gate is cancelled there)
            try:
                self._run(self.lifespan.__aexit__(None, None, None))
                self.eng.check_integrity()
            finally:
                self.loop.close()


def test_http_state_machine():
    hunt = bool(os.environ.get("HICACHE_HTTP_STATEFUL_HUNT"))  # (random seeds: a hunt by hand)
    run_state_machine_as_test(HTTPMachine, settings=settings(
        max_examples=int(os.environ.get("HICACHE_HTTP_STATEFUL_EXAMPLES", "25")),
        stateful_step_count=int(os.environ.get("HICACHE_HTTP_STATEFUL_STEPS", "20")),
        deadline=None, derandomize=not hunt, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
