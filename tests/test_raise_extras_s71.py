"""Session 71's raise hunt over the engine loop's per-request step work (scheduler/step_extras.py, the matcher's
advance in Admission.after_step, the Speculator's drafts): a raise there that belongs to ONE request (an odd grammar
that trips llguidance, an odd logit_bias or min_tokens, a bans or logprobs corner case, its drafts' lookup) crashed
the whole loop: every live request failed, and a server then refused every later request (503 "the engine loop
failed") until restarted. Now that request alone fails, its error naming what raised (Engine.fail_own_work), its
pages and locks given back as any failed request's; the others in its batch finish with the outputs a fault-free
run gives (greedy: deterministic), the loop task is the same one (generate_async restarts a crashed loop quietly)
and serves a fresh request, and `check_integrity()` passes. A raise no request makes alone (the batch's own) still
crashes the loop, as a runner's or a sampler's does (pinned last)."""
from __future__ import annotations

import asyncio

import pytest

from scheduler import step_extras
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.guided import Guide, GuidedSpec
from scheduler.request import SamplingParams
from scheduler.speculative import SpeculativeConfig, Speculator
from scheduler.token_bans import RowBans
from scheduler.tokenizer import ByteTokenizer
from test_lifecycle_hunt import assert_nothing_queued, assert_whole

HANG_GUARD_S = 20  # a run with no end by then would wait forever
TEXTS = ("the culprit: ", "another one, ", "a third, plain ")
REGEX = GuidedSpec("regex", "[a-z]{6,12}")


def make(speculative=None) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", dtype="float32", page_size=4, num_pages=512,
                               speculative=speculative).with_hicache(enable=True))


def prompts(eng: Engine) -> list[list[int]]:
    tok = ByteTokenizer(eng.vocab_size)
    return [tok.encode(t) for t in TEXTS]


def culprit_of(eng: Engine):
    """The live request of the culprit's prompt (TEXTS[0]), or None."""
    first = prompts(eng)[0]
    return next((r for r in eng.requests.values() if r.prompt == first), None)


async def fault_spares_the_others(eng: Engine, params: list[SamplingParams], inject, says: str) -> None:
    """A fault-free run of the three requests, then the same with `inject()` making the culprit's own work raise:
    the culprit fails naming `says`, the others get their fault-free outputs, the loop is the same task, a fresh
    request is served after, and the engine is whole."""
    clean = await asyncio.wait_for(eng.generate_async(prompts(eng), params), HANG_GUARD_S)
    assert all(r.finish_reason in ("stop", "length") for r in clean), [r.error for r in clean]
    loop = eng._loop_task
    undo = inject()
    faulty = await asyncio.wait_for(eng.generate_async(prompts(eng), params), HANG_GUARD_S)
    undo()
    assert faulty[0].finish_reason == "error" and says in faulty[0].error and "injected" in faulty[0].error, \
        faulty[0].error
    assert [r.output_ids for r in faulty[1:]] == [r.output_ids for r in clean[1:]], \
        "the other requests' outputs changed (or they failed with the culprit)"
    assert [r.finish_reason for r in faulty[1:]] == [r.finish_reason for r in clean[1:]]
    assert eng._loop_task is loop, "the engine loop crashed: generate_async started a new one"
    assert eng.cache.metrics.failures.get("request_work", 0) >= 1, "the culprit's failure was not counted"
    [fresh] = await asyncio.wait_for(eng.generate_async([prompts(eng)[2][::-1]], SamplingParams(max_tokens=6)),
                                     HANG_GUARD_S)
    assert fresh.finish_reason == "length" and eng._loop_task is loop
    assert_nothing_queued(eng)
    assert_whole(eng)
    await eng.shutdown()


def patch(monkeypatch, owner, name, raises_for):
    """Wrap owner.name so that it raises where raises_for(*args) holds; -> undo."""
    real = getattr(owner, name)

    def wrapped(*args, **kw):
        if raises_for(*args):
            raise RuntimeError(f"injected: {name} raised")
        return real(*args, **kw)
    monkeypatch.setattr(owner, name, wrapped)
    return lambda: monkeypatch.setattr(owner, name, real)


def culprit_output(eng: Engine) -> list[int] | None:
    culprit = culprit_of(eng)
    return None if culprit is None else culprit.output


def culprit_guide(eng: Engine, guide) -> bool:
    culprit = culprit_of(eng)
    return culprit is not None and guide is culprit.guide


GUIDED = [SamplingParams(max_tokens=12, guided=REGEX), SamplingParams(max_tokens=12, guided=REGEX),
          SamplingParams(max_tokens=12)]


@pytest.mark.asyncio
async def test_a_guided_mask_that_raises_fails_its_request_alone(monkeypatch):
    """fill_masks (llguidance's batched executor) raises for a batch holding the culprit's matcher: each request is
    asked alone to find it, it fails, and the step's masks are made again without it."""
    eng = make()
    await fault_spares_the_others(eng, GUIDED, lambda: patch(
        monkeypatch, step_extras, "fill_masks", lambda guides, *a: any(culprit_guide(eng, g) for g in guides)),
        "grammar mask")


@pytest.mark.asyncio
async def test_a_matcher_that_raises_as_it_takes_a_token_fails_its_request_alone(monkeypatch):
    """The culprit's matcher raises as it consumes its third token (after the step: `Admission.after_step`)."""
    eng = make()
    taken = []

    def raises_for(guide, token):
        taken.append(1) if culprit_guide(eng, guide) else None
        return culprit_guide(eng, guide) and len(taken) >= 3
    await fault_spares_the_others(eng, GUIDED, lambda: patch(monkeypatch, Guide, "accept", raises_for),
                                  "advancing this request's grammar")


@pytest.mark.parametrize("name, params, says", [
    ("_row", SamplingParams(max_tokens=8, presence_penalty=0.5, logit_bias={7: 2.0}), "penalties, logit_bias"),
    ("_held_stops", SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=[9]), "min_tokens"),
], ids=["penalties", "min_tokens"])
@pytest.mark.asyncio
async def test_penalty_inputs_that_raise_fail_their_request_alone(monkeypatch, name, params, says):
    """Making the culprit's penalties / logit_bias row, or its min_tokens' held stop ids, raises (in `ask`, before
    the step): it fails, and the others (asking the same) are penalized as without the fault."""
    eng = make()
    await fault_spares_the_others(eng, [params, params, SamplingParams(max_tokens=8)], lambda: patch(
        monkeypatch, step_extras, name, lambda req, *a: req is culprit_of(eng)), says)


BANNED = SamplingParams(max_tokens=8, bad_words_token_ids=[[70, 71]])


@pytest.mark.asyncio
async def test_token_bans_that_raise_as_they_are_made_fail_their_request_alone(monkeypatch):
    eng = make()
    await fault_spares_the_others(eng, [BANNED, BANNED, SamplingParams(max_tokens=8)], lambda: patch(
        monkeypatch, step_extras, "RowBans", lambda allowed, words, output, state: culprit_output(eng) is output),
        "token bans")


@pytest.mark.asyncio
async def test_token_bans_that_raise_as_they_judge_a_token_fail_their_request_alone(monkeypatch):
    """`RowBans.sampled_banned` raises for the culprit's token (after the step: `fail_broken_bans`)."""
    eng = make()
    await fault_spares_the_others(eng, [BANNED, BANNED, SamplingParams(max_tokens=8)], lambda: patch(
        monkeypatch, RowBans, "sampled_banned", lambda row, token: culprit_output(eng) is row.output_ids),
        "against its token bans")


@pytest.mark.asyncio
async def test_logprobs_that_raise_as_they_are_read_fail_their_request_alone(monkeypatch):
    """Reading the step's logprobs raises for the culprit's row (it asks 3, the others 1): each request's rows are
    read alone to find it, and the others keep theirs."""
    eng = make()
    params = [SamplingParams(max_tokens=8, logprobs=3), SamplingParams(max_tokens=8, logprobs=1),
              SamplingParams(max_tokens=8, logprobs=1)]

    def inject():
        return patch(monkeypatch, eng.runner, "logprobs_of", lambda handle, wants: wants is not None and 3 in wants)
    await fault_spares_the_others(eng, params, inject, "reading this request's logprobs")


SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1, draft_policy="always")


@pytest.mark.parametrize("guided", [False, True], ids=["prompt lookup", "grammar's valid drafts"])
@pytest.mark.asyncio
async def test_drafts_that_raise_fail_their_request_alone(monkeypatch, guided):
    """Proposing the culprit's drafts raises (`Speculator.split`: its prompt lookup, or its grammar's check of
    them): it fails, and the step goes on without it."""
    eng = make(SPEC)
    params = [SamplingParams(max_tokens=12, guided=REGEX if guided else None)] * 2 + [SamplingParams(max_tokens=12)]
    owner, name = (Guide, "valid_drafts") if guided else (Speculator, "draft")
    await fault_spares_the_others(eng, params, lambda: patch(
        monkeypatch, owner, name, lambda obj, *a: culprit_guide(eng, obj) if guided else a[0] is culprit_of(eng)),
        "speculative drafts")
    assert eng.speculator.stats["verify_steps"] > 0


@pytest.mark.asyncio
async def test_a_mask_raise_no_request_makes_alone_still_crashes_the_loop(monkeypatch):
    """fill_masks raises for any batch of two matchers, never for one alone: the batch's own bug, not a request's.
    The loop crashes as before (every live request gets its error; the next call starts a new loop)."""
    eng = make()
    await asyncio.wait_for(eng.generate_async(prompts(eng), GUIDED), HANG_GUARD_S)
    loop = eng._loop_task
    undo = patch(monkeypatch, step_extras, "fill_masks", lambda guides, *a: len(guides) > 1)
    out = await asyncio.wait_for(eng.generate_async(prompts(eng), GUIDED), HANG_GUARD_S)
    undo()
    assert all(r.finish_reason == "error" for r in out[:2]), [r.finish_reason for r in out]
    assert loop.done() and loop.exception() is not None
    [fresh] = await asyncio.wait_for(eng.generate_async([prompts(eng)[2]], SamplingParams(max_tokens=4)),
                                     HANG_GUARD_S)
    assert fresh.finish_reason == "length" and eng._loop_task is not loop
    assert_whole(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_prompt_logprobs_that_raise_fail_only_the_requests_that_asked(monkeypatch):
    """A prefill step's prompt logprobs are read as a whole (a row's fit the others' by position): where that read
    raises, the requests that asked for them fail, and the others in the step go on (regression: the loop crashed)."""
    eng = make()
    params = [SamplingParams(max_tokens=8, prompt_logprobs=2)] + [SamplingParams(max_tokens=8)] * 2
    await fault_spares_the_others(eng, params, lambda: patch(
        monkeypatch, eng.runner, "prompt_logprobs_of", lambda handle, wants: wants is not None),
        "reading this step's prompt logprobs")
