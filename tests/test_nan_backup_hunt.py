"""A corrupt prefix dropped as suspect while its write-through backup copies it is not published by
that backup (a bug hunt).

`Admission._fail_nan` drops a prefix whose reuse gave NaN logits from every tier but where it is
locked (hicache/suspect.py). A backup copying it holds such locks: its L1 source during the D2H, its
L2 copy during the L3 write. Regression: that backup went on and published its L2 (then L3) copy of
the corrupt pages, and the locked copy stayed once the backup let it go, so the next request for the
prompt reused the NaN pages again and failed too (and the copy had reached L3). Now the backup stops
at its next step without publishing, freeing its destination pages, and the prefix is dropped again
once it ended. CPU, tiny preset; the copies are held in flight by gates (tests/test_faults.py)."""
from __future__ import annotations

import pytest
import torch

from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import WriteGate, assert_whole, until
from test_faults import OTHER, PROMPT, REUSABLE, TransferGate, live_in, make_engine, reference, run_one

TOKENS = tuple(PROMPT[:REUSABLE])  # 6 pages


def _failed_nan(out) -> bool:
    return out.finish_reason == "error" and "NaN" in (out.error or "")


def _corrupt_while_copied(eng, backup) -> None:
    """The prefix's L1 pages turn NaN while its backup's D2H copies them (on a GPU the copy is in
    flight; on the CPU it ran when enqueued): the copy's private L2 pages get the NaN too."""
    mgr = eng.cache
    l1_pages = mgr.tree.match(TOKENS, include_storage=False, touch=False).pages[Tier.L1]
    assert len(l1_pages) * 4 == REUSABLE
    mgr.l1.kv[:, :, torch.tensor(l1_pages, dtype=torch.int64)] = float("nan")
    l2_pages = mgr.allocator(Tier.L2).pages_of(backup.payload["claims"][Tier.L2])
    assert len(l2_pages) == len(l1_pages)
    mgr.l2.page_buffer[torch.tensor(l2_pages, dtype=torch.int64)] = float("nan")


@pytest.mark.asyncio
@pytest.mark.parametrize("held", ["D2H_PENDING", "H2S_PENDING"])
async def test_a_backup_holding_a_suspect_prefix_does_not_publish_it(held):
    """The prefix's backup is held in `held` (its L1 source, or its published L2 copy, locked) when a
    request reuses the corrupt L1 pages and fails: once the backup's copy lands, no tier holds the
    prefix, nothing is private, the next request recomputes it with the no-cache output and only one
    request failed. Another prompt's backup in flight beside it publishes as before."""
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    other_want = await reference(OTHER, 1)
    d2h = TransferGate(eng, "d2h")
    writes = WriteGate(eng.cache.store) if held == "H2S_PENDING" else None
    # one output token each: the prompt's backup is the request's only op
    assert (await run_one(eng, max_tokens=1)).output_ids == want[:1]
    await until(lambda: live_in(eng, OpState.D2H_PENDING))
    [backup] = live_in(eng, OpState.D2H_PENDING)
    assert (await run_one(eng, OTHER, max_tokens=1)).output_ids == other_want
    await until(lambda: len(live_in(eng, OpState.D2H_PENDING)) == 2)
    _corrupt_while_copied(eng, backup)
    eng.check_integrity()
    if writes is not None:  # the backup's L2 copy published (NaN), its L3 write in flight
        d2h.release.set()
        await until(lambda: backup.state is OpState.H2S_PENDING)
        assert eng.cache.tree.match(TOKENS, touch=False).lengths == [REUSABLE, REUSABLE, 0]
        eng.check_integrity()

    bad = await run_one(eng)
    assert bad.cached_tokens["l1"] == REUSABLE and _failed_nan(bad), (bad.cached_tokens, bad.error)
    eng.check_integrity()
    d2h.release.set()
    if writes is not None:
        writes.release()
    await eng.cache.drain()
    eng.check_integrity()
    # no tier serves the corrupt prefix (regression: L2 and L3 held the backup's NaN copy, L1 its own)
    assert eng.cache.tree.match(TOKENS, touch=False).lengths == [0, 0, 0]
    assert not torch.isnan(eng.cache.l1.kv).any()
    assert backup.state is OpState.CANCELLED, backup.state  # (it stopped at its next step)
    # the other prompt's backup was not stopped
    other = tuple(OTHER[:len(OTHER) - len(OTHER) % 4])
    assert eng.cache.tree.match(other, touch=False).lengths == [len(other)] * 3
    assert_whole(eng.cache)

    again = await run_one(eng)
    assert (again.finish_reason, again.output_ids) == ("length", want), (again.finish_reason, again.error)
    assert sum(again.cached_tokens.values()) == 0
    await eng.cache.drain()
    assert eng.cache.metrics.failures.get("nan_logits") == 1
    assert (await run_one(eng)).output_ids == want  # cached again, clean
    await eng.cache.drain()
    assert eng.cache.tree.match(TOKENS, touch=False).lengths == [REUSABLE] * 3
    assert_whole(eng.cache)
    await eng.shutdown()
