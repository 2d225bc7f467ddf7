"""Guards session 61 added (each verified failing on its mutant or on the code before its fix): a chat
stream's last chunk counts the thought held at its end (choices.py's C10 of session 60); /metrics' failure
kinds said to be an operation's or not; a write_back backup's end waking the loop (operations.py's P9); an
SSE stream's ends (sse_response.py's S2-S8); the ops' referee failing where it must, a cancelling drain, bad L3
slots' drop, freed pages waking the loop (operations.py's P24, P28, P36-P38)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from scheduler.api_models import ChatCompletionRequest, Usage
from scheduler.choices import Choices
from scheduler.request import TokenEvent
from scheduler.tokenizer import HFTokenizer
from tokenizer_files import write_byte_tokenizer


class _ChatGen:
    """What Choices reads of a chat choice's Generation: its prompt, its events (text, ids, end, logprobs
    entries), its usage so far, close."""

    def __init__(self, tok, prompt: list[int], items: list[tuple]) -> None:
        self.req = SimpleNamespace(prompt=prompt, prompt_logprobs=None, params=SimpleNamespace(guided=None))
        self.st = SimpleNamespace(tokenizer=tok, engine=SimpleNamespace(vocab_size=256),
                                  limits=SimpleNamespace(reasoning_parser="qwen3"))
        self.items, self.logprobs, self.stop_reason, self.sent, self.index = items, None, None, 0, 0

    async def events(self):
        for item in self.items:
            self.sent += len(item[1])
            yield item

    def usage(self) -> Usage:
        return Usage.of(len(self.req.prompt), self.sent, {})

    async def close(self, outcome: str = "aborted") -> None:
        pass


def test_a_chat_stream_s_last_chunk_counts_the_thought_held_at_its_end(tmp_path):
    """continuous_usage_stats with --reasoning-parser: an answer cut (length) inside its thought, its last ids the
    start of "</think>" (eight byte ids here, so held by the counter), counts them as thought in its last chunk,
    as the split shows them as reasoning and as the usage chunk after it does: 2 + 5, not the 2 settled before."""
    tok = HFTokenizer(str(write_byte_tokenizer(tmp_path)))
    prompt = tok.encode("<user>hi\n<assistant><think>\n")  # (the prompt opened the thought)
    end = TokenEvent("r", None, 1, finished=True, finish_reason="length")
    gen = _ChatGen(tok, prompt, [("ab", tok.encode("ab"), None, []), ("</thi", tok.encode("</thi"), end, [])])
    api_req = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
                                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    choices = Choices([gen], True, "chatcmpl-r", api_req, "tiny")

    async def read():
        return [json.loads(c[6:]) for c in [c async for c in choices.sse()] if c != "data: [DONE]\n\n"]
    *chunks, usage = asyncio.run(read())
    assert "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks) == "ab</thi"
    thought = [c["usage"]["completion_tokens_details"]["reasoning_tokens"] for c in chunks]
    assert thought == [0, 2, 7] and usage["usage"]["completion_tokens_details"] == {"reasoning_tokens": 7}


def test_operation_failures_help_names_each_kind_as_an_operation_s_or_not():
    """hicache_operation_failures holds a request's and a store's failures too (l1_overcommit, hint_refresh,
    nan_logits: `Metrics.op_failures` leaves them out of the op counts' identity); its HELP says which kinds are
    operations' (session 61: it said "failed operations by kind" of all of them)."""
    from prometheus_client.parser import text_string_to_metric_families

    from hicache.metrics import FAILURE_KINDS, NOT_OP_FAILURES
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.prom import ServerMetrics
    text = ServerMetrics(Engine(EngineConfig(model="tiny", device="cpu", num_pages=16))).render().decode()
    [fam] = [f for f in text_string_to_metric_families(text) if f.name == "hicache_operation_failures"]
    ops, _, others = fam.documentation.partition(" and ")
    assert all(k in ops for k in FAILURE_KINDS if k not in NOT_OP_FAILURES), fam.documentation
    assert all(k in others and k not in ops for k in NOT_OP_FAILURES), fam.documentation
    assert sorted(s.labels["kind"] for s in fam.samples if s.name.endswith("_total")) == sorted(FAILURE_KINDS)


def test_a_write_back_backup_ending_before_its_l1_copy_wakes_the_loop_not_only_when_idle():
    """A backup's end wakes an idle loop only (`wakeup_idle`: a decode chain goes on), except under write_back
    while its L1 copy is not done (it failed before freeing L1: its leaf goes unsaved and an eviction waiting on
    it can go on): then `wakeup`, which ends the chain (operations.py's P9 of session 61's mutation check)."""
    import concurrent.futures as cf

    from hicache.operations import OpRunner
    from hicache.ops import OpKind, new_op
    woken = []
    for write_back in (False, True):
        mgr = SimpleNamespace(write_back=write_back, wakeup=lambda: woken.append("wakeup"),
                              wakeup_idle=lambda: woken.append("idle"))
        runner, pending, copied = OpRunner(mgr), cf.Future(), cf.Future()
        copied.set_result(None)
        for l1_free in (None, copied, pending):
            op = new_op(1, OpKind.BACKUP, num_pages=1, num_bytes=1)
            if l1_free is not None:
                op.payload["l1_free"] = l1_free
            runner._wake(op)
        runner._wake(new_op(2, OpKind.RESTORE_L2, num_pages=1, num_bytes=1))
    assert woken == ["idle", "idle", "idle", "wakeup"] + ["idle", "idle", "wakeup", "wakeup"]


class _Ends:
    """What an SSEResponse ends: its choices (abort, close), its slot (release), its generator, its watcher."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def abort(self) -> None:
        self.events.append("abort")

    async def close(self) -> None:
        self.events.append("close")

    def release(self) -> None:
        self.events.append("release")

    async def body(self):
        try:
            yield "data: a\n\n"
            await asyncio.Event().wait()  # (a token that never comes)
            yield "data: b\n\n"
        finally:
            self.events.append("generator closed")


def _sse(ends: _Ends, spec: str | None, receive, send) -> None:
    from scheduler.sse_response import SSEResponse

    async def call() -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"} | ({"spec_version": spec} if spec else {})}
        try:
            await asyncio.wait_for(SSEResponse(ends.body(), ends, ends)(scope, receive, send), 10)
        except Exception as exc:
            ends.events.append(type(exc).__name__)
        await asyncio.sleep(0)  # (a cancelled watcher's receive sees its cancellation)
        ends.events.append("returned")
    asyncio.run(call())


def test_a_stream_whose_write_fails_closes_its_generator_and_choices_and_stops_watching():
    """ASGI 2.4 (the server stopping, or a write to a gone client that raised): the stream's generator is closed,
    its choices closed (aborting what has not ended), its slot freed, and the watcher of the client's disconnect
    cancelled before the response returns (sse_response.py's S3, S4, S6 of session 61's mutation check)."""
    ends = _Ends()

    async def receive():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            ends.events.append("watcher cancelled")
            raise

    async def send(message):
        await asyncio.sleep(0)  # (the watcher waits on the client by now)
        if message["type"] == "http.response.body" and message.get("body"):
            raise OSError("broken pipe")
    _sse(ends, "2.4", receive, send)
    assert ends.events[:3] == ["generator closed", "close", "release"] and ends.events[-1] == "returned", ends.events
    assert sorted(ends.events[3:-1]) == ["ClientDisconnect", "watcher cancelled"], ends.events


def test_a_client_gone_before_its_first_token_aborts_the_stream_before_asgi_2_4():
    """An ASGI server before spec 2.4 (the default where it names none): Starlette listens for the disconnect,
    alone, through the receive that aborts the requests, and ends the stream (sse_response.py's S7, S8)."""
    ends, sent = _Ends(), []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message["type"])
    _sse(ends, None, receive, send)
    # (aborted once: only Starlette's listener receives, no watcher of ours beside it)
    assert ends.events[0] == "abort" and ends.events.count("abort") == 1 and ends.events[-1] == "returned", ends.events
    assert "TimeoutError" not in ends.events and {"close", "release", "generator closed"} <= set(ends.events)


def _runner():
    from hicache.metrics import Metrics
    from hicache.operations import OpRunner
    return OpRunner(SimpleNamespace(metrics=Metrics()))


def test_the_referee_catches_an_unlocked_source_and_an_op_counted_off():
    """OpRunner.check_integrity (in the manager's): a live op whose source is no longer locked, or no longer
    resident, fails it; so do op counters that do not add up (an op started that never ended nor runs). The
    referee of every test must be able to fail (operations.py's P37, P38)."""
    import pytest

    from hicache.ops import OpKind, new_op
    from hicache.radix import Tier
    runner = _runner()
    runner.check_integrity()
    op = runner.live[1] = new_op(1, OpKind.RESTORE_L2, num_pages=1, num_bytes=1)
    runner.mgr.metrics.restores_started += 1
    node = SimpleNamespace(locks={Tier.L2: 1}, pages={Tier.L2: [3]})
    op.payload["locks"] = [(node, Tier.L2)]
    runner.check_integrity()
    node.locks[Tier.L2] = 0
    with pytest.raises(AssertionError, match="not locked/resident in L2"):
        runner.check_integrity()
    node.locks[Tier.L2], node.pages[Tier.L2] = 1, None
    with pytest.raises(AssertionError, match="not locked/resident in L2"):
        runner.check_integrity()
    del runner.live[1]
    with pytest.raises(AssertionError, match="1 ops started, 0 counted as ended and 0 running"):
        runner.check_integrity()


def test_a_drain_that_cancels_drops_the_backups_still_due():
    """drain(cancel=True) (a shutdown without its grace): backups queued to start when the loop next turns are
    dropped, not left to start after it (operations.py's P36)."""
    runner = _runner()
    runner._due.append((1, 2, 3, 4))
    asyncio.run(runner.drain(cancel=True))
    assert not runner.has_due and runner.pending_counts()["backups"] == 0


def test_bad_l3_slots_drop_their_pages_from_the_first_bad_one_except_where_a_read_holds_them():
    """A failed read's bad slots: each node holding one loses its L3 pages from the first bad one on, counted;
    a node an op holds locked in L3 (another read of it runs) is left to that op (operations.py's P28)."""
    from hicache.radix import Tier
    dropped = []

    def drop(node, tier, from_pages):
        dropped.append((node.name, from_pages))
        return node.pages[tier][from_pages:]
    free = SimpleNamespace(name="free", pages={Tier.L3: [4, 5, 6]}, locks={Tier.L3: 0}, parent=object())
    held = SimpleNamespace(name="held", pages={Tier.L3: [7, 8]}, locks={Tier.L3: 1}, parent=object())
    clean = SimpleNamespace(name="clean", pages={Tier.L3: [9]}, locks={Tier.L3: 0}, parent=object())
    runner = _runner()
    runner.mgr.tree = SimpleNamespace(iter_nodes=lambda: [free, held, clean], drop=drop)
    assert runner._drop_l3_slots({5, 8}) == 2 and dropped == [("free", 1)]


def test_an_op_s_pages_freed_after_its_copy_settled_wake_the_loop():
    """An abandoned op's pages, held until its copy settled, wake the loop once freed (a request may be waiting
    for that room; operations.py's P24)."""
    import concurrent.futures as cf

    from hicache.ops import OpKind, new_op
    woken = []
    runner = _runner()
    runner.mgr.wakeup, runner.mgr.write_back = (lambda: woken.append("wakeup")), False
    op = new_op(1, OpKind.RESTORE_L2, num_pages=1, num_bytes=1)
    op.payload.update(locks=[], claims={}, cancel=False)  # (as OpRunner._new makes every op)
    copy = cf.Future()

    async def go():
        runner._settle_then_release(op, copy)
        await asyncio.sleep(0.01)
        assert woken == [] and runner.pending_counts()["settling"] == 1
        copy.set_result(None)
        await runner.drain()
    asyncio.run(go())
    assert woken == ["wakeup"] and runner.pending_counts()["settling"] == 0
