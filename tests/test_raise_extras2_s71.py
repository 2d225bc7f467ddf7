"""Session 71's second raise hunt over one request's own step work (Engine.fail_own_work, commit 79e9e03), on the
paths its first tests (test_raise_extras_s71.py) leave out:

- a request admitted behind an overlapped restore (an L2 restore whose tail forward runs layer by layer behind the
  H2D: a `wait_restore` batch, Restoring._admit_overlapped) whose own step inputs raise in `ask_or_fail` BEFORE its
  launch, or whose logprobs read raises after its forward and before the restore is adopted
  (`after_overlapped_forward`): it fails alone with its error, the restore op ends CANCELLED once its copy settled
  (the client is answered while the copy is still held back), the forward launched for no one is dropped, every
  page and lock comes back, the request decoding beside it gets its no-cache output, and a fresh request for the
  SAME prefix restores it from L2 and gets the no-cache output;
- the only request of its batch failing in `ask_or_fail`: a prefill chunk after the first (its published chunks
  stay whole and serve the same prompt again), a plain decode step, a chained decode step's launch (overlap
  scheduling: its step before still in flight) and a guided chained step's deferred sampling (`_sample`);
- `Speculator.verifies` (the chain's look-ahead) raising for one request while a chained step is in flight for it;
- a request's logprobs read raising in a verify step (`_keep_verify_logprobs`): the others keep their tokens and
  their logprobs as a fault-free run gives them;
- (the bug this hunt found) the logprobs of a request that ended before its step's tokens came (a chained step's
  row of a request that stopped at the step before; a verify step's rows of a request whose own inputs failed as
  the step was launched) were still read, and a raise reading them, found in no LIVE request's rows, crashed the
  loop: every other request failed. They are no one's now, and not read (`step_extras._logprobs_or_fail`).

Each ends with the loop the same task, a fresh request served and `check_integrity()` passing."""
from __future__ import annotations

import asyncio

import pytest

from hicache_helpers import capture_op_logs
from scheduler import step_extras
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import Request, RequestState, SamplingParams
from scheduler.speculative import SpeculativeConfig, TokenHistory
from test_faults import OTHER, PROMPT, REUSABLE, TransferGate, make_engine, reference, until
from test_lifecycle_hunt import assert_nothing_queued, assert_whole
from test_mutation_spec_s65 import request, speculator
from test_raise_extras_s71 import HANG_GUARD_S, REGEX, SPEC, culprit_of, make, patch, prompts
from test_restore_overlap import _prefix_only_in_l2

OTHER_TOKENS = 10  # the request decoding beside the overlapped restore: long enough to outlive it


async def run(eng: Engine, prompt: list[int], params: SamplingParams):
    [out] = await asyncio.wait_for(eng.generate_async([prompt], params), HANG_GUARD_S)
    return out


def says(result, what: str) -> None:
    assert result.finish_reason == "error" and what in result.error and "injected" in result.error, result.error


def restore_ends(logs: list[dict]) -> list[str]:
    """The states the L2 restores logged past their copy (H2D_PENDING): how they ended, in order."""
    return [e["to_state"] for e in logs if e.get("event") == "op" and e.get("kind") == "restore_l2"
            and e["to_state"] not in ("L2", "H2D_PENDING")]


# -- behind an overlapped restore ---------------------------------------------------------------------------------
@pytest.mark.parametrize("gated", [False, True], ids=["copy settles at once", "copy held back"])
@pytest.mark.parametrize("fault", ["logit_bias", "logprobs"])
@pytest.mark.asyncio
async def test_own_work_that_raises_behind_an_overlapped_restore_fails_it_alone(monkeypatch, fault, gated):
    """The culprit restores PROMPT's prefix from L2 overlapped with its tail forward (alone in its batch, as an
    overlapped restore always is) while OTHER decodes: its logit_bias row raises as its step inputs are made (before
    its launch: the op is not adopted yet), or its logprobs read raises after the forward (before
    `after_overlapped_forward` adopts the op). Held back (gated), the copy is still in flight when its client is
    answered: the op is cancelled and ends once the copy settles."""
    eng = make_engine(num_pages=64)
    await eng.start()
    want, other_want = await reference(PROMPT), await reference(OTHER, OTHER_TOKENS)
    await _prefix_only_in_l2(eng)
    loop = eng._loop_task
    gate = TransferGate(eng, "h2d") if gated else None
    if fault == "logit_bias":
        params = SamplingParams(max_tokens=4, logit_bias={7: 1.0})
        undo = patch(monkeypatch, step_extras, "_row", lambda req, *a: req.prompt == PROMPT)
        what = "making this request's step inputs (logit_bias)"
    else:
        params = SamplingParams(max_tokens=4, logprobs=3)
        undo = patch(monkeypatch, eng.runner, "logprobs_of", lambda handle, wants: wants is not None and 3 in wants)
        what = "reading this request's logprobs"
    with capture_op_logs() as logs:
        other = asyncio.create_task(eng.generate_async([OTHER], SamplingParams(max_tokens=OTHER_TOKENS)))
        await until(lambda: any(r.output for r in eng.running))  # (OTHER decodes: the culprit is admitted beside)
        culprit = await run(eng, PROMPT, params)
        says(culprit, what)
        assert eng.stats["restore_overlaps"] == 1, "the culprit did not take the overlapped restore's path"
        if gated:  # answered while its restore's copy is held back: the op was asked to stop, not waited for
            assert restore_ends(logs) == []
            gate.release.set()
        [other_out] = await asyncio.wait_for(other, HANG_GUARD_S)
        undo()
        await eng.cache.drain()
    assert restore_ends(logs) == ["CANCELLED"]
    assert other_out.finish_reason == "length" and other_out.output_ids == other_want
    assert_nothing_queued(eng)
    assert_whole(eng)
    again = await run(eng, PROMPT, SamplingParams(max_tokens=4))  # the same prefix: restored again, and right
    assert again.output_ids == want and again.cached_tokens["l2"] == REUSABLE, again.cached_tokens
    assert eng._loop_task is loop, "the engine loop crashed: generate_async started a new one"
    await eng.cache.drain()
    assert_nothing_queued(eng)
    assert_whole(eng)
    await eng.shutdown()


# -- the only request of its batch ----------------------------------------------------------------------------------
LONG = PROMPT + OTHER  # 39 tokens: 5 prefill chunks of 8


def lone_engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=128, **kw).with_hicache(
        enable=True))


LONE_CASES = {  # step: (engine config, the culprit's params, (owner, name) to raise, when it raises, its error says)
    "prefill chunk": (dict(max_prefill_tokens=8), SamplingParams(max_tokens=6, logit_bias={7: 1.0}),
                      (step_extras, "_row"), lambda req: 0 < req.cached_len < len(LONG), "logit_bias"),
    "plain decode": (dict(overlap_schedule=False), SamplingParams(max_tokens=8, presence_penalty=0.5),
                     (step_extras, "_row"), lambda req: len(req.output) >= 3, "penalties"),
    "chained decode": (dict(), SamplingParams(max_tokens=8, presence_penalty=0.5),
                       (step_extras, "_row"), lambda req: len(req.output) >= 3, "penalties"),
    "guided chained decode": (dict(), SamplingParams(max_tokens=12, guided=REGEX),
                              (step_extras, "fill_masks"), lambda req: len(req.output) >= 3, "grammar mask"),
}


@pytest.mark.parametrize("step", list(LONE_CASES))
@pytest.mark.asyncio
async def test_the_only_request_of_its_batch_failing_in_ask_leaves_the_engine_whole(monkeypatch, step):
    """Nothing else is left to launch: the step goes out with no live row (its tokens dropped by `after_step`), the
    request fails with its error, and the engine serves its prompt again (a prefill's chunks published before the
    fault reused) with the no-cache output."""
    config, params, (owner, name), when, what = LONE_CASES[step]
    eng = lone_engine(**config)
    raised = []

    def raises_for(*args):
        culprit = culprit_of_long(eng)
        if culprit is None or not when(culprit):
            return False
        raised.append((culprit.state.value, culprit.cached_len, len(culprit.output)))
        return True
    undo = patch(monkeypatch, owner, name, raises_for)
    culprit = await run(eng, LONG, params)
    undo()
    says(culprit, what)
    loop = eng._loop_task
    assert raised and raised[0][0] == ("prefill" if step == "prefill chunk" else "decode"), raised
    if "chained" in step:
        assert eng.stats["chained_steps"] > 0
    assert_nothing_queued(eng)
    assert_whole(eng)
    again = await run(eng, LONG, SamplingParams(max_tokens=6))
    assert again.output_ids == await reference(LONG, 6)
    if step == "prefill chunk":  # the chunks published before the fault serve it
        assert again.cached_tokens["l1"] >= 8, again.cached_tokens
    assert eng._loop_task is loop
    assert_nothing_queued(eng)
    assert_whole(eng)
    await eng.shutdown()


def culprit_of_long(eng: Engine):
    return next((r for r in eng.requests.values() if r.prompt == LONG), None)


# -- speculative decoding ---------------------------------------------------------------------------------------------
CHAINING = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2, draft_policy="always",
                             cache_lookup=False)  # (2-grams repeat seldom in these prompts: most steps chain)


async def clean_then_faulty(eng: Engine, params: list[SamplingParams], inject):
    """A fault-free run of the three requests, then the same with `inject()` -> (clean, faulty, the loop task)."""
    clean = await asyncio.wait_for(eng.generate_async(prompts(eng), params), HANG_GUARD_S)
    assert all(r.finish_reason == "length" for r in clean), [r.error for r in clean]
    loop = eng._loop_task
    undo = inject()
    faulty = await asyncio.wait_for(eng.generate_async(prompts(eng), params), HANG_GUARD_S)
    undo()
    return clean, faulty, loop


async def served_whole(eng: Engine, loop) -> None:
    fresh = await run(eng, prompts(eng)[2][::-1], SamplingParams(max_tokens=6))
    assert fresh.finish_reason == "length" and eng._loop_task is loop
    assert_nothing_queued(eng)
    assert_whole(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_chain_look_ahead_that_raises_fails_its_request_alone(monkeypatch):
    """`Speculator.verifies` (whether the step after the one in flight may verify, asked as a chained step is
    planned) raises in the culprit's prompt lookup at its third look: the culprit fails with its own step in flight
    (its token dropped), the chain goes on for the others, whose outputs are the fault-free run's."""
    eng = make(CHAINING)
    before = CHAINING.prompt_lookup_min - 1
    looks = []

    def raises_for(history, *args):
        culprit = culprit_of(eng)
        if culprit is None or culprit.spec_history is not history or args != (1, before, before):
            return False  # (`verifies` asks propose(1, before, before); `draft` asks propose(k, min, max))
        looks.append(len(culprit.output))
        return len(looks) >= 3
    params = [SamplingParams(max_tokens=16)] * 3
    chained = eng.stats["chained_steps"]
    clean, faulty, loop = await clean_then_faulty(eng, params, lambda: patch(
        monkeypatch, TokenHistory, "propose", raises_for))
    says(faulty[0], "looking up this request's speculative drafts")
    assert [r.output_ids for r in faulty[1:]] == [r.output_ids for r in clean[1:]]
    assert [r.finish_reason for r in faulty[1:]] == ["length", "length"]
    assert len(looks) == 3 and eng.stats["chained_steps"] > chained
    await served_whole(eng, loop)


@pytest.mark.asyncio
async def test_logprobs_that_raise_in_a_verify_step_fail_their_request_alone(monkeypatch):
    """Reading a verify step's logprobs raises where the culprit's rows (it asks 3, the others 1) are two or more
    (its drafts' rows: only a verify step has those): it fails, and the others keep their tokens and logprobs."""
    eng = make(SPEC)
    params = [SamplingParams(max_tokens=12, logprobs=3)] + [SamplingParams(max_tokens=12, logprobs=1)] * 2
    clean, faulty, loop = await clean_then_faulty(eng, params, lambda: patch(
        monkeypatch, eng.runner, "logprobs_of", lambda handle, wants: wants is not None and wants.count(3) > 1))
    says(faulty[0], "reading this request's logprobs")
    assert eng.speculator.stats["verify_steps"] > 0
    for got, ref in zip(faulty[1:], clean[1:]):
        assert got.finish_reason == "length" and got.output_ids == ref.output_ids
        assert len(got.logprobs) == len(got.output_ids)
        for lp, ref_lp in zip(got.logprobs, ref.logprobs):
            assert [t for t, _ in lp.top] == [t for t, _ in ref_lp.top]
            assert lp.logprob == pytest.approx(ref_lp.logprob, abs=1e-4)
    await served_whole(eng, loop)


# -- the rows of a request that ended before its step's tokens came ----------------------------------------------------
@pytest.mark.parametrize("ended", ["stopped at the step before a chained step", "its inputs failed at a verify step"])
@pytest.mark.asyncio
async def test_logprobs_of_a_request_ended_before_its_step_are_not_read(monkeypatch, ended):
    """Regression: reading a step's logprobs raises where it reads the rows of the culprit (it asks 3, the other 1)
    once the culprit has ended. Chained: it stops by a stop token (one of its 4th or later) while the next step, its
    row in it, is in flight. Verify: its own step inputs raise as a verify step is launched (it fails,
    `ask_or_fail`), its rows still in the step. Its logprobs were read anyway, the raise was found in no live
    request's rows, and the loop crashed with the other request. Now they are not read: the other request finishes
    as in a fault-free run."""
    eng = make(SPEC if ended.startswith("its inputs") else None)
    first, other = prompts(eng)[:2]
    params = [SamplingParams(max_tokens=12, logprobs=3), SamplingParams(max_tokens=12, logprobs=1)]
    clean = await asyncio.wait_for(eng.generate_async([first, other], params), HANG_GUARD_S)
    seen: list[Request] = []  # the culprit, once live
    undos = []
    if ended.startswith("stopped"):  # at its first token past the third that it had not sampled before
        out = clean[0].output_ids
        stop = next(t for i, t in enumerate(out) if i >= 3 and t not in out[:i])
        params[0] = SamplingParams(max_tokens=12, logprobs=3, stop_token_ids=[stop])
    else:
        def inputs_raise(reqs, binput, *a):
            return binput.verify_drafts is not None and any(r is s and not r.state.done for r in reqs for s in seen)
        undos.append(patch(monkeypatch, step_extras, "ask", inputs_raise))

    def read_raises(handle, wants):
        culprit = culprit_of(eng)
        if culprit is not None and not seen:
            seen.append(culprit)
        return bool(seen) and seen[0].state.done and wants is not None and 3 in wants
    undos.append(patch(monkeypatch, eng.runner, "logprobs_of", read_raises))
    loop = eng._loop_task
    faulty = await asyncio.wait_for(eng.generate_async([first, other], params), HANG_GUARD_S)
    for undo in undos:
        undo()
    if ended.startswith("stopped"):
        assert faulty[0].finish_reason == "stop" and eng.stats["chained_steps"] > 0
    else:
        says(faulty[0], "making this request's step inputs (logprobs)")
    assert faulty[1].finish_reason == "length", faulty[1].error
    assert faulty[1].output_ids == clean[1].output_ids
    assert len(faulty[1].logprobs) == len(faulty[1].output_ids)
    await served_whole(eng, loop)


def test_the_drafts_of_a_request_ended_before_its_verify_step_came_back_count_nowhere():
    """A request that ended before its verify step's tokens came (failed by its own inputs as the step launched, or
    aborted) takes none of them: its drafts are counted in none of vLLM's counters and the draft policy learns
    nothing from them (regression: they were counted accepted, and learned)."""
    spec = speculator(SpeculativeConfig(num_speculative_tokens=2, draft_policy="cost"))
    ended, live = request([1, 2, 3]), request([4, 5, 6])
    ended.state = RequestState.FAILED
    learned = []
    spec.policy.observe_request = lambda req, accepted: learned.append(req)

    def after_step(req, chunk, token, same_step=False):
        req.output.append(token)

    assert spec.after_verify([ended, live], [[5, 6], [3, 4]], [[5, 6, 9], [3, 8, 2]], after_step) == 2
    stats = spec.stats
    assert (stats["drafts"], stats["draft_tokens"], stats["accepted_tokens"]) == (1, 2, 1)
    assert stats["accepted_per_pos"][:2] == [1, 0] and learned == [live] and ended.output == []
