"""A backup holding a prefix dropped as suspect lets no request reuse it once it ended (a bug hunt,
after tests/test_nan_backup_hunt.py).

`drop_suspect_prefix` (hicache/suspect.py) keeps the nodes of the prefix that a backup locks (its L1
source during the D2H, its published L2 copy during the L3 write) and drops them again in those
tiers once the backup ended (`OpRunner.stop_backups_of`). Two gaps:
- the re-drop ran in a done-callback of the backup's driver task, loop turns after its locks went:
  in between the kept prefix was in the tree, and a request admitted then reused it and failed
  too. Now it runs as the backup's last locks go (`_unlock_all`, as a stopped restore's does).
- a backup already cancelled for another reason (a shutdown's drain, `drain(cancel=True)`) was
  skipped: its locks kept the prefix and no re-drop was recorded, so the locked head stayed cached
  after it ended. Now its re-drop is recorded too.
CPU manager; the backup's copy is held in flight by a gate (tests/test_faults.py,
tests/hicache_helpers.py)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hicache.ops import OpKind, OpState
from hicache.suspect import drop_suspect_prefix
from hicache_helpers import WriteGate, assert_whole, make_manager, until, write_prefix
from test_faults import TransferGate

TOKENS = tuple(range(100, 124))  # 6 pages
HEAD_TOKENS = 16  # the suspect prefix: its nodes, and the backup's locks on them, cover TOKENS' head


def _held_backup(mgr, held: OpState):
    """TOKENS computed into L1, their write-through backup held in `held` (its D2H, or its L3 write
    with its L2 copy published) -> (the backup, its gate's release)."""
    if held is OpState.D2H_PENDING:
        release = TransferGate(SimpleNamespace(cache=mgr), "d2h").release.set
    else:
        release = WriteGate(mgr.store).release
    write_prefix(mgr, TOKENS)
    [backup] = [op for op in mgr.runner.live.values() if op.kind is OpKind.BACKUP]
    return backup, release


def _lengths(mgr) -> list[int]:
    return mgr.tree.match(TOKENS, touch=False).lengths


# what the backup locks (and drop_suspect_prefix keeps) in each held state
_KEPT = {OpState.D2H_PENDING: [24, 0, 0], OpState.H2S_PENDING: [0, 24, 0]}


@pytest.mark.asyncio
@pytest.mark.parametrize("held", [OpState.D2H_PENDING, OpState.H2S_PENDING], ids=lambda s: s.name)
async def test_the_suspect_prefix_is_gone_as_the_stopped_backup_ends(held):
    """The backup is stopped (its prefix's head dropped as suspect while it locks it). Whatever runs
    first once its driver ended (a request admitted then would match the prefix) finds no tier
    holding it (regression: the re-drop ran in a done-callback queued behind it, and the kept
    prefix was still in the tree)."""
    mgr = make_manager()
    backup, release = _held_backup(mgr, held)
    await until(lambda: backup.state is held)
    seen_at_end: list[list[int]] = []
    # (queued before the stop's own work: runs first once the driver ended, as an admission could)
    mgr.runner._tasks[backup.op_id].add_done_callback(lambda _: seen_at_end.append(_lengths(mgr)))
    drop_suspect_prefix(mgr, TOKENS[:HEAD_TOKENS])
    assert backup.payload["cancel"] and _lengths(mgr) == _KEPT[held], _lengths(mgr)  # (locked: kept)
    mgr.check_integrity()
    release()
    await mgr.drain()
    assert backup.state is OpState.CANCELLED, backup.state
    assert seen_at_end == [[0, 0, 0]], seen_at_end  # (regression: _KEPT[held])
    assert _lengths(mgr) == [0, 0, 0]
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("held", [OpState.D2H_PENDING, OpState.H2S_PENDING], ids=lambda s: s.name)
async def test_a_backup_cancelled_before_its_prefix_is_dropped_as_suspect_keeps_none_of_it(held):
    """The backup was cancelled by a shutdown's drain (`drain(cancel=True)`) and still holds its
    locks (its copy in flight) when its prefix's head is dropped as suspect. Once it ended, no tier
    holds the prefix (regression: it was skipped as already cancelled, and the head it locked stayed
    cached); it is not cancelled twice."""
    mgr = make_manager()
    backup, release = _held_backup(mgr, held)
    await until(lambda: backup.state is held)
    drain = asyncio.get_running_loop().create_task(mgr.drain(cancel=True))
    await until(lambda: backup.payload["cancel"])
    assert backup.state is held  # (its copy in flight: it still holds its locks)
    dropped, kept_tokens = drop_suspect_prefix(mgr, TOKENS[:HEAD_TOKENS])
    assert kept_tokens == HEAD_TOKENS and _lengths(mgr) == _KEPT[held], (dropped, _lengths(mgr))
    mgr.check_integrity()
    release()
    await drain
    assert backup.state is OpState.CANCELLED, backup.state
    assert mgr.metrics.cancellations == 1
    assert _lengths(mgr) == [0, 0, 0]  # (regression: _KEPT[held])
    assert_whole(mgr)
    await mgr.close()
