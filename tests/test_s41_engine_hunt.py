"""Bug hunt of session 41's engine changes: deferred sampling of chained decode steps with guided rows
(`Engine._run_decode_chain` / `_launch` / `_sample`, `ModelRunner.launch(defer_sample=True)` / `sample`,
`step_extras.ask`), and priority scheduling (`EngineConfig.scheduling_policy`, `request.enqueue`, used by
`Engine.add_request` and `Restoring._requeue`). The referee: a chained engine answers as one without overlap
scheduling, a request that ended keeps nothing on the device, the queue admits by (priority, arrival), and
every tier is whole after."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import pytest

from hicache_helpers import finish, read_stream, until
from scheduler import step_extras
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.guided import GuidedSpec
from scheduler.request import SamplingParams
from scheduler.tokenizer import BYTE_OFFSET, ByteTokenizer
from test_guided import ckpt_eng  # noqa: F401 (fixture: a checkpoint with a tokenizer and EOS 256)

EOS = 256  # (ckpt_eng's)


def _b(ch: str) -> int:
    """The tiny model's byte-tokenizer id of a character."""
    return ord(ch) + BYTE_OFFSET


def _asks_of_ended_rows(monkeypatch) -> list[str]:
    """Spy on `step_extras.ask`: the rids of ended requests whose rows it gave a mask or penalty inputs."""
    seen, ask = [], step_extras.ask

    def spy(reqs, binput, eos_ids=()):
        ask(reqs, binput, eos_ids)
        masked = binput.token_masks[0] if binput.token_masks is not None else []
        penalized = [i for i, p in enumerate(binput.penalties or []) if p is not None]
        seen.extend(reqs[i].rid for i in sorted({*masked, *penalized}) if reqs[i].state.done)
    monkeypatch.setattr(step_extras, "ask", spy)
    return seen


# -- 1. a deferred step's rows whose request ended at the step before --------------------------------------
@pytest.mark.asyncio
async def test_a_request_ended_before_its_deferred_sampling_gets_no_mask_and_keeps_no_penalty_state(monkeypatch):
    """Regression: a chained step with guided rows samples once the step before it is processed (`Engine._sample`);
    a request that ended at that step (its grammar complete, an abort) still had its row's mask made from its
    stopped or errored matcher and its penalty inputs asked (`step_extras.ask`), which made it a new PenaltyState
    after `finish` had dropped it: its [V] counts (and prompt mask) stayed on the device with the Request."""
    ended_asks = _asks_of_ended_rows(monkeypatch)
    eng = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=4096))
    tok = ByteTokenizer(eng.vocab_size)
    await eng.start()
    whole = eng.add_request(tok.encode("a: "), SamplingParams(max_tokens=20, guided=GuidedSpec("regex", "abc"),
                                                              frequency_penalty=1.0, repetition_penalty=1.2))
    aborted = eng.add_request(tok.encode("b: "), SamplingParams(max_tokens=30, guided=GuidedSpec("regex", "[a-z]{25}"),
                                                                presence_penalty=0.5, logit_bias={_b("q"): 2.0}))
    other = eng.add_request(tok.encode("c: "), SamplingParams(max_tokens=30, guided=GuidedSpec("regex", "[0-9]{20}")))
    await until(lambda: len(aborted.output) >= 5)
    await eng.abort(aborted.rid)
    got = [await read_stream(r) for r in (whole, aborted, other)]
    assert got[0] == ([_b("a"), _b("b"), _b("c")], "stop") and got[1][1] == "abort" and got[2][1] == "stop"
    assert eng.stats["chained_steps"] >= 10
    assert [r.penalty_state for r in (whole, aborted, other)] == [None] * 3
    assert not ended_asks
    await finish(eng)


# -- 2. verified: every way a guided row ends, chained (deferred) as unchained ------------------------------
def _answers(config: EngineConfig, prompts: list[list[int]], params: list[SamplingParams]):
    eng = Engine(config)
    out = eng.generate(prompts, params)
    eng.check_integrity()
    return ([(r.output_ids, r.finish_reason, r.error, [round(lp.logprob, 4) for lp in r.logprobs or ()]) for r in out],
            eng.stats["chained_steps"])


def test_guided_rows_ending_at_a_step_whose_next_is_deferred_answer_as_unchained(ckpt_eng):
    """Rows that end at step N while N + 1 was launched deferred: the grammar complete, a stop id, max_tokens, a
    grammar whole before its first token, a grammar stuck after one (an error), EOS (favoured, held by min_tokens,
    taken under ignore_eos), beside penalized, biased, seeded and logprobs rows: an engine chaining its steps
    answers what one without overlap scheduling does, and the other rows are unchanged."""
    tiny = EngineConfig(model="tiny", device="cpu", max_total_tokens=4096)
    tok = ByteTokenizer(512)
    params = [SamplingParams(max_tokens=30, guided=GuidedSpec("regex", "ab"), frequency_penalty=1.0),
              SamplingParams(max_tokens=30, guided=GuidedSpec("regex", "[a-z]{3,20}"), stop_token_ids=(_b("q"),),
                             temperature=1.0, seed=1, logprobs=1),
              SamplingParams(max_tokens=4, guided=GuidedSpec("regex", "[0-9]{9}"), temperature=1.0, seed=2, top_p=0.9),
              SamplingParams(max_tokens=30, temperature=0.7, seed=4, presence_penalty=1.0, logit_bias={_b("x"): 5.0},
                             min_tokens=5),
              SamplingParams(max_tokens=30, guided=GuidedSpec("regex", "")),
              SamplingParams(max_tokens=30, guided=GuidedSpec("grammar", 'start: "a" <[511]>'))]
    prompts = [tok.encode(f"say {i}: ") for i in range(len(params))]
    ckpt = ckpt_eng.config
    ckpt_params = [
        SamplingParams(max_tokens=20, guided=GuidedSpec("regex", "[0-9]{2,8}"), logit_bias={EOS: 4.0}, temperature=1.0,
                       seed=1),
        SamplingParams(max_tokens=20, guided=GuidedSpec("regex", "[0-9]{2,8}"), min_tokens=5, logit_bias={EOS: 50.0}),
        SamplingParams(max_tokens=20, guided=GuidedSpec("regex", "[a-z]{3,12}"), ignore_eos=True, frequency_penalty=1.0,
                       logprobs=3),
        SamplingParams(max_tokens=20, min_tokens=7, temperature=0.9, seed=2, repetition_penalty=1.4),
        SamplingParams(max_tokens=20, guided=GuidedSpec("regex", ""), min_tokens=3)]
    ckpt_prompts = [ckpt_eng.tok.encode(f"q{i}=").ids for i in range(len(ckpt_params))]
    for config, ps, ws in ((tiny, prompts, params), (ckpt, ckpt_prompts, ckpt_params)):
        chained, steps = _answers(config, ps, ws)
        unchained, none = _answers(dataclasses.replace(config, overlap_schedule=False), ps, ws)
        assert chained == unchained and steps >= 10 and none == 0
    ends = [(reason, error is not None) for _, reason, error, _ in _answers(tiny, prompts, params)[0]]
    assert ends == [("stop", False), ("stop", False), ("length", False), ("length", False), ("stop", False),
                    ("error", True)]


# -- 3. verified: aborts, stops and arrivals mid-chain, under backups ---------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy", [None, "write_through", "write_back"])
async def test_aborts_and_a_new_request_mid_chain_beside_backups(write_policy):
    """A guided chain whose requests are aborted (one as a caller's stop) and joined by a new guided request
    mid-chain (its pending sampling runs, then the chain ends), with L2 backups: each answer is what its grammar
    allows, the stopped one publishes what it computed, and every tier is whole after."""
    config = EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4, max_prefill_tokens=64)
    if write_policy:
        config = config.with_hicache(enable=True, host_ratio=2.0, transfer_backend="torch", policy="always",
                                     write_policy=write_policy)
    eng = Engine(config)
    tok = ByteTokenizer(eng.vocab_size)
    await eng.start()
    words = GuidedSpec("regex", "[a-z]{20}")
    reqs = [eng.add_request(tok.encode(f"p{i} " * 3), SamplingParams(max_tokens=24, guided=words, **kw))
            for i, kw in enumerate([{}, {"repetition_penalty": 1.3}, {"temperature": 1.0, "seed": 3}, {"logprobs": 2}])]
    await until(lambda: len(reqs[0].output) >= 4)
    await eng.abort(reqs[0].rid)
    await eng.abort(reqs[1].rid, stop=True)
    late = eng.add_request(tok.encode("late "), SamplingParams(max_tokens=6, guided=GuidedSpec("regex", "[0-9]{3}")))
    got = [await read_stream(r) for r in reqs + [late]]
    assert [reason for _, reason in got] == ["abort", "stop", "stop", "stop", "stop"]
    assert all(re.fullmatch("[a-z]+", tok.decode(tokens)) for tokens, _ in got[:4])
    assert re.fullmatch("[0-9]{3}", tok.decode(got[4][0])) and eng.stats["chained_steps"] >= 10
    assert eng.stats["finished"] == 4 and eng.stats["aborted"] == 1
    await finish(eng)


# -- 4. verified: a random chained workload with guided rows, each request as alone -------------------------
GUIDED_SPECS = [GuidedSpec("regex", "[a-z]{2,9}"), GuidedSpec("regex", "[0-9]{3}"), GuidedSpec("regex", ""),
                GuidedSpec("choice", json.dumps(["yes", "no", "maybe"])), GuidedSpec("regex", "(ab)+c")]


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tight", [False, True], ids=["plain", "tight-l1-write-back"])
async def test_a_chained_workload_with_guided_rows_gets_what_each_gets_alone(seed, tight):
    """Session 38's and 39's differential hunts (staggered submits, closed streams, stop ids, min_tokens,
    penalties, logit_bias, logprobs, seeded sampling; an L1 of two or three requests under write_back, whose
    pages may wait for backups) with most requests guided: each request's tokens, finish and logprobs are what
    it gets alone on an engine without overlap scheduling, and the tiers are whole after."""
    import random

    from hicache_helpers import assert_whole
    from test_decode_chain_s38_hunt import assert_as_alone, random_workload, run_alone, run_staggered
    from test_memory_wait_s39_hunt import PAGE_TOKENS, WB, tight_l1_pages, tight_workload

    rng = random.Random(seed)
    workload = [(p, dataclasses.replace(q, guided=rng.choice(GUIDED_SPECS)) if i % 3 != 2 else q, d, c)
                for i, (p, q, d, c) in enumerate((tight_workload if tight else random_workload)(seed))]
    kw = dict(num_pages=tight_l1_pages(workload * 2), hicache=WB, max_prefill_tokens=5) if tight else {}
    if tight:
        workload = workload + workload
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE_TOKENS, **{"num_pages": 256, **kw}))
    got = await asyncio.wait_for(run_staggered(eng, workload), 60)
    assert_as_alone(got, await run_alone(workload), workload)
    assert eng.stats["chained_steps"] > 0
    assert_whole(eng.cache)
    await eng.shutdown()


# -- 5. verified: priority scheduling --------------------------------------------------------------------
async def _ended(reqs) -> None:
    for req in reqs:
        await until(lambda: req.state.done)


@pytest.mark.asyncio
async def test_a_later_urgent_request_passes_a_head_blocked_on_memory_and_a_less_urgent_one_does_not():
    """The queue's head waits for L1 room (`Admission.memory_blocked`) while a long request decodes chained: a
    later request of a lower priority value that fits is admitted at once (its arrival ends the chain; the head
    is no longer first), one of a higher value that fits waits behind the head (no jumping the order), and the
    head runs once room comes back."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4, scheduling_policy="priority",
                              decode_reserve_ratio=1.0))  # (each reserving all its max_tokens)
    await eng.start()
    long = eng.add_request([1] * 20, SamplingParams(max_tokens=200))  # (55 of 64 pages)
    await until(lambda: len(long.output) >= 2)
    head = eng.add_request([2] * 8, SamplingParams(max_tokens=40))  # (12 pages: no room)
    await until(lambda: eng.admission.memory_blocked is not None)
    assert eng.admission.memory_blocked[0] == head.rid and not long.state.done
    later = eng.add_request([3] * 3, SamplingParams(max_tokens=2, priority=1))
    urgent = eng.add_request([4] * 3, SamplingParams(max_tokens=2, priority=-1))
    assert list(eng.waiting) == [urgent, head, later]
    await _ended([long, head, later, urgent])
    assert urgent.finish_s < long.finish_s < head.first_token_s < later.first_token_s
    assert len(long.output) == 200 and eng.stats["chained_steps"] > 150
    await finish(eng)


@pytest.mark.asyncio
async def test_a_simulated_engine_admits_by_priority_then_arrival():
    """--simulate (no logits) takes a priority, and its queue keeps the same order."""
    eng = Engine(EngineConfig(model="qwen3-0.6b", simulate=True, max_running_requests=1, scheduling_policy="priority"))
    priorities = [0, 5, -1, 5, 0, -1]
    reqs = [eng.add_request([10 + i, 11, 12], SamplingParams(max_tokens=2, priority=p))
            for i, p in enumerate(priorities)]
    await eng.start()
    await _ended(reqs)
    assert [reqs.index(r) for r in sorted(reqs, key=lambda r: r.first_token_s)] == [2, 5, 0, 4, 1, 3]
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("priorities, order", [([0, 0, 0], [0, 1, 2]), ([5, 0, -1], [2, 1, 0]),
                                               ([0, 1, -1], [2, 0, 1])])
async def test_requests_parked_on_an_l3_read_come_back_by_priority_then_arrival(priorities, order):
    """Three requests share a prefix only L3 holds: the first's prefetch reads it, the others park on that read
    (followers), the first parks again once its read is seen landed (its checksums slowed; restores not
    overlapped, so it does not take the read on). When the read ends all go back to the queue (`_requeue`) and
    are admitted by (priority, arrival); greedy answers as an engine without cache, the L3 read counted once."""
    import random

    from hicache.faults import Fault, FaultInjector
    from hicache_helpers import capture_op_logs
    from test_followups_hunt import reference
    from test_restore_bookkeeping_hunt import VOCAB, admission_order, make_engine, prefix_in_l3, results

    rng = random.Random(32)
    prefix = [rng.randrange(VOCAB) for _ in range(32)]
    prompts = [prefix + [2, 3], prefix + [4, 5, 6], prefix + [7]]
    faults = FaultInjector()
    eng = make_engine(faults=faults, restore_overlap=False)
    eng.config = dataclasses.replace(eng.config, scheduling_policy="priority")
    await eng.start()
    await prefix_in_l3(eng, prefix)
    faults.arm(Fault.SLOW_VERIFY, times=None, delay_s=0.2)
    with capture_op_logs() as logs:
        reqs = [eng.add_request(p, SamplingParams(max_tokens=3, priority=q)) for p, q in zip(prompts, priorities)]
        out = await results(reqs)
    assert [r.output_ids for r in out] == await reference(prompts, 3)
    assert admission_order(logs) == [reqs[i].rid for i in order]
    assert sum(r.cached_tokens["l3"] for r in out) == 32 and sum(r.cached_tokens["l1"] for r in out) == 64
    await finish(eng)


def test_the_scheduling_policy_flag_of_the_server_and_the_replay():
    from scheduler import replay_args, serve
    from scheduler.config import config_from_args

    args = serve.build_parser().parse_args(["--model", "tiny", "--scheduling-policy", "priority"])
    assert config_from_args(args).scheduling_policy == "priority"
    args = replay_args.build_parser("replay").parse_args(["--simulate", "--device", "cpu", "--scheduling-policy",
                                                         "priority"])
    assert replay_args.config_from_replay_args(args).scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--scheduling-policy", "lifo"])
