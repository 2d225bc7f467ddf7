"""A backup queued (not yet started) in the step that drops a suspect prefix (a bug hunt).

`Admission._fail_nan` drops a prefix whose reuse gave NaN logits from every tier but where it is
locked (hicache/suspect.py). Write-through backups that a step's processing asks for start only once
that step's tokens reached their clients (`OpRunner.backup_soon`), so one asked for by a request
sharing the prefix and published in the same step as the drop starts after the drop. It starts
through `start_backup`, which matches the tree anew: it can copy only the L1 pages that survived the
drop, those a running request (or an op) locks, which the drop keeps and later requests reuse by
design (tests/test_nan_prefix_hunt.py), exactly as a backup asked for after the drop would. These
tests pin that: nothing dropped is copied, nothing NaN reaches L2 or L3, the tree stays whole after
every step and the next request for the prompt gets the no-cache engine's output. CPU, tiny preset."""
from __future__ import annotations

import pytest
import torch

from hicache.radix import Tier
from scheduler.request import SamplingParams
from test_faults import OTHER, PAGE, PROMPT, REUSABLE, make_engine, reference, run_one

TOKENS = tuple(PROMPT[:REUSABLE])  # 6 pages
SHARED = 4 * PAGE  # the clean head the bystander reuses; pages 4 and 5 are poisoned
BYSTANDER = list(PROMPT[:SHARED]) + list(OTHER)


def _check_every_step(eng) -> list[int]:
    """Run check_integrity after every batch's processing (the engine's own method, wrapped)."""
    steps = [0]
    after = eng._after_batch

    def checked(*args, **kwargs):
        after(*args, **kwargs)
        eng.check_integrity()
        steps[0] += 1
    eng._after_batch = checked
    return steps


def _tree_pages_finite(eng) -> None:
    """No page the tree holds in L1 or L2 holds NaN."""
    mgr = eng.cache
    for node in mgr.tree.iter_nodes():
        if node is mgr.tree.root:
            continue
        if node.pages[Tier.L1]:
            assert not torch.isnan(mgr.l1.kv[:, :, torch.tensor(node.pages[Tier.L1])]).any()
        if node.pages[Tier.L2]:
            assert not torch.isnan(mgr.l2.page_buffer[torch.tensor(node.pages[Tier.L2])]).any()


@pytest.mark.asyncio
@pytest.mark.parametrize("bystander_first", [True, False])
@pytest.mark.parametrize("bystander_tokens", [1, 8])
@pytest.mark.parametrize("deferred", [True, False])
async def test_a_backup_queued_in_the_dropping_step_copies_nothing_dropped(bystander_first, bystander_tokens, deferred):
    """PROMPT cached in every tier, its pages 4-5 poisoned in L1. The bystander (PROMPT's clean head
    + OTHER) and PROMPT's request are prefilled in one batch: the bystander publishes its prompt
    (its backup queued, `backup_soon`) and locks the head; PROMPT's request fails and drops its
    reused prefix, all but the locked head. The queued backup starts after the drop (with
    bystander_tokens=1 the bystander finished in that step too): it copies the head and the
    bystander's pages, clean, and nothing of the dropped pages 4-5. deferred=False (the backup starts
    when asked, in the step: a live backup the drop stops) ends in the same tiers: the deferral
    changes nothing of what is published."""
    want = await reference(PROMPT)
    bystander_want = await reference(BYSTANDER, bystander_tokens)
    eng = make_engine()
    await eng.start()
    assert (await run_one(eng)).output_ids == want
    await eng.cache.drain()
    assert eng.cache.tree.match(TOKENS, touch=False).lengths == [REUSABLE] * 3
    eng.cache.defer_backups = deferred
    steps = _check_every_step(eng)
    m = eng.cache.tree.match(TOKENS, include_storage=False, touch=False)
    eng.cache.l1.kv[:, :, torch.tensor(m.pages[Tier.L1][SHARED // PAGE:])] = float("nan")
    eng.check_integrity()

    params = SamplingParams(max_tokens=bystander_tokens, ignore_eos=True)
    queued_at_drop: list = []
    kept_l1_tokens: list[int] = []
    drop = eng.admission._fail_nan

    def fail_nan(req):  # records what was queued when the drop ran and what L1 kept (it runs the real one)
        queued_at_drop.extend(eng.cache.runner._due)
        drop(req)
        kept_l1_tokens.append(eng.cache.tree.match(TOKENS, include_storage=False, touch=False).lengths[Tier.L1])
    eng.admission._fail_nan = fail_nan
    started_after_drop: list = []  # (tokens, op) of backups started once the drop ran
    start_backup = eng.cache.runner.start_backup

    def recorded_start(tokens, *args, **kwargs):
        op = start_backup(tokens, *args, **kwargs)
        if kept_l1_tokens:
            started_after_drop.append((tuple(tokens), op))
        return op
    eng.cache.runner.start_backup = recorded_start
    if bystander_first:
        bystander = eng.add_request(BYSTANDER, params)
        bad = eng.add_request(PROMPT, SamplingParams(max_tokens=4))
    else:
        bad = eng.add_request(PROMPT, SamplingParams(max_tokens=4))
        bystander = eng.add_request(BYSTANDER, params)
    outs = {}
    for req in (bystander, bad):
        tokens = []
        while True:
            ev = await req.queue.get()
            if ev.token_id is not None:
                tokens.append(ev.token_id)
            if ev.finished:
                break
        outs[req.rid] = tokens
    assert bad.finish_reason == "error" and "NaN" in bad.error, bad.error
    assert bad.hit_tokens["l1"] == REUSABLE
    assert (bystander.finish_reason, outs[bystander.rid]) == ("length", bystander_want)
    assert bystander.hit_tokens["l1"] == SHARED
    if bystander_first and deferred:  # the bystander's backup was queued, not started, when the drop ran
        published = tuple(BYSTANDER[:len(BYSTANDER) - len(BYSTANDER) % PAGE])
        assert [tuple(t) for t in queued_at_drop] == [published], queued_at_drop
    await eng.cache.drain()
    if bystander_first and deferred:
        # and started after it: with the head kept under the running bystander it copied the head
        # and the bystander's pages (what a backup asked for after the drop copies too); with the
        # bystander gone before the drop, the tree had nothing of it left to copy
        first_tokens, first_op = started_after_drop[0]
        assert first_tokens == published
        assert (first_op is not None) == (bystander_tokens > 1), first_op
    eng.check_integrity()
    assert steps[0] >= 1

    # the dropped pages left every tier; the head the bystander still locked at the drop (when it
    # had not finished before it in that step) stays, and was backed up clean with its own pages
    # (not deferred, a bystander that finished first has its backup lock the head at the drop: the
    # drop stops it and drops the head again once it ended)
    request_locked_at_drop = bystander_tokens > 1 or not bystander_first
    kept = SHARED if request_locked_at_drop else 0
    assert kept_l1_tokens == [kept if deferred or request_locked_at_drop else SHARED], kept_l1_tokens
    assert eng.cache.tree.match(TOKENS, touch=False).lengths == [kept] * 3
    bystander_key = tuple((BYSTANDER + outs[bystander.rid])[:-1])
    bystander_key = bystander_key[:len(bystander_key) - len(bystander_key) % PAGE]
    assert eng.cache.tree.match(bystander_key, touch=False).lengths == [len(bystander_key) if kept else 0] * 3
    _tree_pages_finite(eng)
    assert not torch.isnan(eng.cache.l1.kv).any()

    again = await run_one(eng)
    assert (again.finish_reason, again.output_ids) == ("length", want), (again.finish_reason, again.error)
    await eng.cache.drain()
    assert eng.cache.metrics.failures.get("nan_logits") == 1
    assert (await run_one(eng)).output_ids == want
    await eng.cache.drain()
    eng.check_integrity()
    await eng.shutdown()
