"""Guards found unpinned by session 60's mutation check of scheduler/engine.py, runner.py, engine_lifecycle.py and
api_responses.py: what a Responses body may carry and how its errors read, the engine's limits, a request's end and
what a step hands back. No server."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from scheduler.api_models import APIError
from scheduler.api_responses import ResponsesShape, input_items, items_messages, parse_request
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, RequestState, SamplingParams
from hicache_helpers import capture_op_logs, until
import test_restore_overlap as overlap
from test_cancel_hunt import PARAMS, SECOND, ReadGate, make_engine, prefix_only_in_l3


def _refusal(body: dict) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(body)
    return info.value


# -- api_responses ----------------------------------------------------------------------------------------
def test_an_item_of_a_type_not_taken_is_named_as_unsupported():
    """An item_reference (or any type outside the four taken) is an 'unsupported_value' 400 that names its type
    and says to send previous_response_id, not the discriminator's "does not match any of the expected tags"."""
    err = _refusal({"input": [{"type": "item_reference", "id": "msg_1"}]})
    assert (err.status, err.param, err.code) == (400, "input", "unsupported_value")
    assert "'item_reference'" in err.message and "previous_response_id" in err.message


def test_service_tier_default_is_taken_as_neutral():
    """service_tier "default" (as "auto" and null) changes nothing here and is taken; "flex" is refused."""
    assert parse_request({"input": "hi", "service_tier": "default"}).service_tier == "default"
    assert parse_request({"input": "hi", "service_tier": "auto"}).service_tier == "auto"
    assert _refusal({"input": "hi", "service_tier": "flex"}).param == "service_tier"


def test_two_input_items_of_one_id_are_a_400_naming_both():
    """input_items' `after` cursor names an item by its id: two items of one id are refused, naming the second
    and the first it repeats."""
    item = {"type": "message", "id": "m1", "role": "user", "content": "a"}
    err = _refusal({"input": [item, {**item, "content": "b"}]})
    assert err.status == 400 and err.param == "input"
    assert "item 1: duplicate id 'm1' (item 0's)" in err.message
    parse_request({"input": [item, {**item, "id": "m2"}]})  # (distinct ids: taken)


def test_two_reasoning_items_of_one_turn_are_its_thinking_line_by_line():
    """Reasoning items sent back in one assistant turn make its reasoning_content, one line each (as a reasoning
    item's own parts are joined), not run together."""
    req = parse_request({"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "r1", "summary": [], "content": [{"type": "reasoning_text", "text": "a"}]},
        {"type": "reasoning", "id": "r2", "summary": [{"type": "summary_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]}]})
    assert items_messages(input_items(req)) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "text", "text": "x"}], "reasoning_content": "a\nb"}]


@pytest.mark.parametrize("chat_param, param", [
    ("messages.2.content", "input"),  # (a message's index is not an item's: instructions and history come first)
    ("prompt", "input"),
    ("response_format.json_schema", "text.json_schema"),
    ("reasoning_effort", "reasoning.effort"),
    ("temperature", "temperature"),
])
def test_a_chat_paths_error_names_the_responses_field(chat_param, param):
    shape = ResponsesShape()
    shape.chat_body({"input": "x", "instructions": "be brief"})
    with pytest.raises(APIError) as info, shape.named_errors():
        raise APIError(400, "bad", param=chat_param)
    assert info.value.param == param


# -- engine.py: what one request may ask ------------------------------------------------------------------
def _refused(eng: Engine, prompt: list[int], **params) -> RequestError | None:
    try:
        eng.validate(prompt, SamplingParams(**params))
    except RequestError as exc:
        return exc
    return None


def test_prompt_and_max_tokens_are_sized_in_whole_pages_at_the_pools_edge():
    """8 pages of 4 tokens: a prompt of exactly 32 tokens (the whole pool) is taken with max_tokens 1, refused with
    2 (33 tokens of K/V need a 9th page; rounded up, not down), and the refusal names max_tokens, the field to lower
    (the prompt alone fits); a prompt of 33 is past the prompt limit."""
    eng = Engine(EngineConfig(model="tiny", num_pages=8, page_size=4))
    assert _refused(eng, [1] * 32, max_tokens=1) is None
    err = _refused(eng, [1] * 32, max_tokens=2)
    assert err is not None and "needs 9 pages" in str(err) and err.param == "max_tokens"
    err = _refused(eng, [1] * 30, max_tokens=4)  # (33 tokens: 8.25 pages)
    assert err is not None and "needs 9 pages" in str(err)
    assert _refused(eng, [1] * 30, max_tokens=3) is None
    assert "exceeds the limit of 32" in str(_refused(eng, [1] * 33, max_tokens=1))


def test_prompt_and_max_tokens_may_reach_the_models_last_position():
    """prompt + max_tokens - 1 K/V tokens up to max_position_embeddings (4096 for tiny) are taken: one more is
    refused naming the model's positions."""
    eng = Engine(EngineConfig(model="tiny", num_pages=1100, page_size=4))
    assert eng.model_config.max_position_embeddings == 4096
    assert _refused(eng, [1] * 4000, max_tokens=97) is None
    err = _refused(eng, [1] * 4000, max_tokens=98)
    assert err is not None and "4096 positions" in str(err) and err.param == "max_tokens"


def test_a_simulated_engine_refuses_logprobs():
    """--simulate has no logits: a request asking for logprobs is refused up front, naming the field."""
    eng = Engine(EngineConfig(model="tiny", num_pages=8, page_size=4, simulate=True))
    err = _refused(eng, [1], logprobs=1)
    assert err is not None and err.param == "logprobs"


def test_an_added_eos_id_reaches_the_guides():
    """add_eos_token_id: structured outputs' grammars end at the new id too (Guides.eos_ids), not only the sampler."""
    eng = Engine(EngineConfig(model="tiny", num_pages=8, page_size=4))
    eng.add_eos_token_id(7)
    assert 7 in eng.model_config.eos_token_ids and 7 in eng.guides.eos_ids


@pytest.mark.asyncio
async def test_status_counts_a_decoding_request_as_running():
    """status()'s engine section counts each queue under its own key: a request in decode is running, not parked."""
    eng = Engine(EngineConfig(model="tiny", num_pages=16, page_size=4))
    await eng.start()
    try:
        req = eng.add_request([1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))
        await until(lambda: len(req.output) >= 1, 30)
        s = eng.status()["engine"]
        assert (s["waiting"], s["parked"], s["running"]) == (0, 0, 1)
    finally:
        await eng.shutdown()


def test_a_priority_needs_the_priority_policy():
    """A request's priority is refused (naming 'priority') unless --scheduling-policy priority, as vLLM's: under
    fcfs it would be silently ignored."""
    err = _refused(Engine(EngineConfig(model="tiny", num_pages=8, page_size=4)), [1], priority=1)
    assert err is not None and err.param == "priority" and "--scheduling-policy priority" in str(err)
    eng = Engine(EngineConfig(model="tiny", num_pages=8, page_size=4, scheduling_policy="priority"))
    assert _refused(eng, [1], priority=1) is None


def test_a_token_id_of_another_type_is_named_by_its_type():
    """A numpy integer (or a float) in a prompt is refused as not an int, with the hint to convert it, not as
    "outside the vocabulary" (regression: np.int64(1) was said to be outside it)."""
    eng = Engine(EngineConfig(model="tiny", num_pages=8, page_size=4))
    for bad, kind in ((np.int64(2), "int64"), (2.0, "float")):
        err = _refused(eng, [1, bad])
        assert err is not None and f"is a {kind}, not an int" in str(err) and "outside" not in str(err)
    assert "outside the vocabulary [0, 512)" in str(_refused(eng, [1, 512]))

# -- engine_lifecycle.py ----------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_continuing_clients_next_request_is_refused_once_the_grace_ended():
    """A beam search's next step (continuing=True) is taken in a shutdown's grace only: once the grace ended (the
    loop stopping, the tiers closed) it is refused, not queued on a shut-down engine where nothing runs it."""
    eng = Engine(EngineConfig(model="tiny", num_pages=16, page_size=4))
    await eng.start()
    eng.continuing += 1  # (a beam search under way)
    await eng.shutdown(grace_s=0)
    with pytest.raises(RequestError, match="shut down"):
        eng.add_request([1, 2], continuing=True)
    assert not eng.waiting and not eng.requests


@pytest.mark.asyncio
async def test_an_abort_with_no_loop_running_ends_the_request_at_once():
    """abort() of a queued request while no loop runs (never started, or stop_loop()'d) ends it there and then:
    its last event sent, counted as aborted (not finished), nothing left queued."""
    eng = Engine(EngineConfig(model="tiny", num_pages=16, page_size=4))
    req = eng.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    assert await eng.abort(req.rid)
    ev = req.queue.get_nowait()
    assert ev.finished and ev.finish_reason == "abort"
    assert (eng.stats["aborted"], eng.stats["finished"]) == (1, 0)
    assert not eng.waiting and not eng.requests
    await eng.shutdown()


# -- runner.py ----------------------------------------------------------------------------------------------
def test_prompt_logprobs_of_a_batchs_second_sequence_are_its_own_rows():
    """Two prompts in one prefill asking prompt logprobs of different k: the second's rows start after the first's,
    each row scores the prompt token after it (its last token, the greedy one, has the greedy step's logprob and
    rank 1), and each gets its own k alternatives."""
    eng = Engine(EngineConfig(model="tiny", num_pages=64, page_size=4, enable_prefix_cache=False))
    head = [5, 6, 7, 8]
    greedy = eng.generate([head], SamplingParams(max_tokens=1, temperature=0, logprobs=1))[0]
    tok, logprob = greedy.output_ids[0], greedy.logprobs[0].logprob
    first, second = eng.generate([[1, 2, 3], head + [tok]], [SamplingParams(max_tokens=1, prompt_logprobs=1),
                                                            SamplingParams(max_tokens=1, prompt_logprobs=3)])
    last = second.prompt_logprobs[-1]
    assert last.rank == 1 and last.logprob == pytest.approx(logprob, abs=1e-4) and last.top[0][0] == tok
    assert [len(lp.top) for lp in second.prompt_logprobs[1:]] == [3] * 4
    assert [len(lp.top) for lp in first.prompt_logprobs[1:]] == [1] * 2


@pytest.mark.asyncio
async def test_a_parked_request_aborted_reports_no_cached_tokens():
    """A request parked behind its L3 restore and aborted never was served from the cache: its result's
    cached_tokens are all 0 (as the hit metrics, which never counted them), not the hits its admission planned."""
    eng = make_engine(prefetch=False)
    await eng.start()
    await prefix_only_in_l3(eng)
    gate = ReadGate(eng.cache.store)
    req = eng.add_request(SECOND, PARAMS)
    await until(lambda: req.state is RequestState.PARKED)
    assert req.hit_tokens["l3"] > 0  # (planned)
    assert await eng.abort(req.rid)
    gate.release()
    await until(lambda: req.state.done)
    assert req.finish_reason == "abort" and req.result().cached_tokens == {"l1": 0, "l2": 0, "l3": 0}
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_request_aborted_before_taking_over_its_overlapped_restore_reports_no_cached_tokens():
    """Its forward ran behind an L2 restore (restore overlap) that had not published when it was aborted: it never
    took the restore over, so its result's cached_tokens are all 0 (Restoring.adopt_restored never counted them) and
    its timeline says the overlapped restore was discarded before it ended."""
    eng = overlap.make_engine()
    await eng.start()
    await overlap._prefix_only_in_l2(eng)
    gate = overlap.TransferGate(eng, "h2d")
    task = asyncio.create_task(overlap.run_one(eng))
    await until(lambda: any(r.overlap_result is not None for r in eng.running))
    [req] = eng.running
    assert req.hit_tokens["l2"] > 0  # (planned)
    with capture_op_logs() as logs:
        assert await eng.abort(req.rid)
        await until(lambda: req.overlap_op.payload["cancel"])
        gate.release.set()
        result = await task
    assert result.finish_reason == "abort" and result.cached_tokens == {"l1": 0, "l2": 0, "l3": 0}
    # (its timeline drops the hits its prefill_start named: the metrics never counted them)
    assert [e["state"] for e in logs if e.get("rid") == req.rid] == ["restore_overlap_discarded", "aborted"]
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_shutdowns_grace_runs_the_requests_queued_where_no_loop_ever_started():
    """shutdown(grace_s) with requests queued on an engine whose loop never started runs them within the grace
    (they finish, with their tokens), not aborts them at once."""
    eng = Engine(EngineConfig(model="tiny", num_pages=16, page_size=4))
    req = eng.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    await eng.shutdown(grace_s=30)
    assert req.finish_reason == "length" and len(req.output) == 3
    assert (eng.stats["finished"], eng.stats["aborted"]) == (1, 0)


@pytest.mark.asyncio
async def test_after_stop_loop_raised_a_crash_a_new_request_is_told_of_the_crash(monkeypatch):
    """stop_loop() on a crashed loop raises its error and leaves the engine not 'stopping': add_request names the
    crash (start() runs a new loop), not "the engine loop is stopping (stop_loop)" for good."""
    eng = Engine(EngineConfig(model="tiny", num_pages=16, page_size=4))
    await eng.start()

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(eng.admission, "decode_batch", broken)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    await until(lambda: eng._loop_task.done(), 30)
    with pytest.raises(RuntimeError, match="boom"):
        await eng.stop_loop()
    assert eng.accepting
    with pytest.raises(RequestError, match="the engine loop crashed"):
        eng.add_request([1])
    with pytest.raises(RuntimeError, match="boom"):  # (shutdown re-raises the crash, and still cleans up)
        await eng.shutdown()


def test_each_steps_tokens_are_observed_as_launched():
    """runner.observe_step_tokens (vllm:iteration_tokens_total) sees each forward's tokens: a prefill's prompt
    tokens, then one per decoding row."""
    eng = Engine(EngineConfig(model="tiny", num_pages=64, page_size=4, enable_prefix_cache=False))
    seen: list[int] = []
    eng.runner.observe_step_tokens = seen.append
    eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert seen == [5, 1, 1]


def test_logprobs_are_the_models_not_the_biased_or_masked_ones():
    """logprobs read the raw logits: a token forced by logit_bias or by allowed_token_ids has its model logprob
    (well below 0), not the ~0 of the biased or masked distribution it was sampled from."""
    eng = Engine(EngineConfig(model="tiny", num_pages=64, page_size=4))
    # (apart: a batch with logit_bias scores a copy of the logits, and its bans then mask that copy)
    [biased] = eng.generate([[5, 6, 7]],
                            SamplingParams(max_tokens=2, temperature=0, logprobs=1, logit_bias={42: 100.0}))
    [allowed] = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, logprobs=1,
                                                         allowed_token_ids=[42, 43]))
    assert biased.output_ids == allowed.output_ids == [42, 42]
    assert [lp.logprob for lp in biased.logprobs] == pytest.approx([lp.logprob for lp in allowed.logprobs])
    assert all(lp.logprob < -1 for lp in biased.logprobs + allowed.logprobs)


def test_a_verify_steps_sampled_rows_are_drawn_not_taken_greedily(monkeypatch):
    """A sampled request's tokens in a verify step are drawn from its distribution (rejection sampling of its
    drafts), not its likeliest tokens: at temperature 1 among the 2 likeliest, some token a verify step yielded is
    not the likeliest at its position (its logprobs' top 1). Regression guard: the whole output differing from
    greedy decoding (test_speculative_sampled.py) held from the prefill's draw alone."""
    import torch
    from test_speculative import SPEC, looping_prompts, make_engine as make_spec_engine, record_steps

    eng = make_spec_engine(SPEC)
    steps = record_steps(monkeypatch)
    torch.manual_seed(3)
    [res] = eng.generate(looping_prompts(5, 20, 8, 32, need=3)[:1],
                         SamplingParams(max_tokens=24, temperature=1.0, top_k=2, logprobs=1))
    verified = [s.out_before + i for s in steps for i in range(len(s.taken))]
    assert verified, "no verify step ran"
    assert any(res.output_ids[i] != res.logprobs[i].top[0][0] for i in verified)
    eng.check_integrity()
