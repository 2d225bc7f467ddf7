"""Review of session 71's per-request failure isolation (scheduler/step_extras.py `ask_or_fail`, `keep_logprobs`).

A request failed by its own step inputs as its step is launched (`ask_or_fail`: its logit_bias row raised) keeps
its rows in the batch: `ask_or_fail` says "a done row asks nothing", and its logprobs are no longer read
(`_logprobs_or_fail`). Its PROMPT logprobs were still asked and read: a raise reading that failed request's prompt
rows then failed the other requests that asked prompt logprobs in the step (innocent: their rows were fine), or,
where none did, found no live asker and crashed the engine loop (every live request failed). Now a done row asks no
logprobs of either kind, as it asks no penalties, bans or mask.
And the lock-holder referee (hicache/radix.py `check_lock_holders`): a node locked fewer times than its children (its
own count negative, a count gone wrong) passed, its negative count dropped before the comparison. Now it fails.
"""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from hicache.radix import Tier
from scheduler import step_extras
from scheduler.request import SamplingParams
from test_lifecycle_hunt import assert_nothing_queued, assert_whole
from test_radix import make_tree, put
from test_raise_extras_s71 import HANG_GUARD_S, make, patch, prompts

CULPRIT_K = 3  # the culprit's prompt_logprobs: its rows are the ones whose read raises


@pytest.mark.parametrize("others_ask", [False, True], ids=["no other asker", "another asks prompt logprobs"])
@pytest.mark.asyncio
async def test_a_request_failed_at_launch_asks_no_prompt_logprobs(monkeypatch, others_ask):
    eng = make()
    params = [SamplingParams(max_tokens=6, prompt_logprobs=CULPRIT_K, logit_bias={7: 1.0}),
              SamplingParams(max_tokens=6, prompt_logprobs=1 if others_ask else None),
              SamplingParams(max_tokens=6)]
    clean = await asyncio.wait_for(eng.generate_async(prompts(eng), params), HANG_GUARD_S)
    assert all(r.finish_reason == "length" for r in clean), [r.error for r in clean]
    loop = eng._loop_task
    culprit_prompt = prompts(eng)[0]
    undo_row = patch(monkeypatch, step_extras, "_row", lambda req, *a: req.prompt == culprit_prompt)
    undo_read = patch(monkeypatch, eng.runner, "prompt_logprobs_of",
                      lambda handle, wants: any(w is not None and w[0] == CULPRIT_K for w in wants or ()))
    faulty = await asyncio.wait_for(eng.generate_async(prompts(eng), params), HANG_GUARD_S)
    undo_read()
    undo_row()
    assert faulty[0].finish_reason == "error" and "logit_bias" in faulty[0].error, faulty[0].error
    assert [r.finish_reason for r in faulty[1:]] == ["length", "length"], [r.error for r in faulty[1:]]
    assert [r.output_ids for r in faulty[1:]] == [r.output_ids for r in clean[1:]]
    if others_ask:
        assert faulty[1].prompt_logprobs == clean[1].prompt_logprobs
    assert eng._loop_task is loop, "the engine loop crashed"
    assert_nothing_queued(eng)
    assert_whole(eng)
    await eng.shutdown()



def test_the_referee_catches_a_node_locked_fewer_times_than_its_child():
    """A child locked once (its prefix: its parent counts the lock too) whose parent's count then lost one: the
    child's holder is the only one, and the counts no longer add up; the check fails."""
    tree, allocs = make_tree(4, pages=16)
    put(tree, allocs, list(range(8)))
    put(tree, allocs, list(range(4)) + [90, 91, 92, 93])  # (splits the first: a parent of 4 tokens, two children)
    node = tree.match(list(range(8)), touch=False).handles[Tier.L1]
    assert node.parent is not tree.root
    tree.lock(node, Tier.L1)
    holds = Counter({(node, Tier.L1): 1})
    tree.check_lock_holders(holds)  # (whole: one holder, one lock)
    node.parent.locks[Tier.L1] -= 1  # (a count gone wrong)
    with pytest.raises(AssertionError, match="below their children"):
        tree.check_lock_holders(holds)
