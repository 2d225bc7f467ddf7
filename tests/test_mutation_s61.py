"""Guards session 61 added (each verified failing on its mutant or on the code before its fix): a chat
stream's last chunk counts the thought held at its end (choices.py's C10 of session 60); /metrics' failure
kinds said to be an operation's or not; a write_back backup's end waking the loop (operations.py's P9)."""
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

    async def close(self) -> None:
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
