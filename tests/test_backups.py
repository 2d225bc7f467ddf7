"""Backups that overlap: one asked for while a backup of its prefix is in flight waits for it and
copies only the pages beyond, so no page crosses PCIe or reaches L3 twice (hicache/operations.py,
OpRunner.start_backup); and a backup whose copy cannot even be enqueued falls back like a failed one."""
import pytest

from test_faults import OTHER, PAGE, PROMPT, TransferGate, finish, make_engine, reference, run_one, until


@pytest.mark.asyncio
async def test_backup_extending_one_in_flight_copies_each_page_once():
    """A request publishes its prompt (backup 1 in flight) and then a longer sequence sharing it
    (backup 2): backup 2 waits for backup 1 and copies only the pages beyond it, so the prefix
    crosses PCIe (and reaches L3) once, not twice."""
    eng = make_engine(num_pages=64)
    await eng.start()
    cache = eng.cache
    gate = TransferGate(eng, "d2h")
    short, long_ = tuple(PROMPT[:4 * PAGE]), tuple(PROMPT[:6 * PAGE])
    claim = cache.new_claim("test")
    pages = cache.alloc_l1(6, claim)
    cache.insert_l1(short, pages[:4], claim, 0)  # publishing starts backup 1 (held by the gate)
    await until(lambda: len(cache.runner.live) == 1)
    cache.insert_l1(long_, pages[4:], claim, 4 * PAGE)  # backup 2 is deferred behind it
    assert cache.runner.start_backup(short[:2 * PAGE]) is None  # a prefix of one in flight: covered
    assert len(cache.runner.live) == 1
    gate.release.set()
    await cache.drain()
    d2h = eng.metrics()["directions"]["d2h"]["bytes"]
    assert d2h == 6 * cache.geometry.bytes_per_page  # 4 + 2 pages, none twice
    assert cache.tree.match(long_, include_storage=True, touch=False).lengths == [6 * PAGE] * 3
    cache.release_claim(claim)
    await finish(eng)


@pytest.mark.asyncio
async def test_backup_whose_copy_cannot_be_enqueued_falls_back_with_accounting_whole(monkeypatch):
    """A device->host copy whose kernel launch raises inside the loop (a bug in a launcher, seen on
    the H200) fails that backup: the request completes with the recompute output, the failure is
    counted, no tier keeps a private page, and the loop keeps serving."""
    import hicache.transfer as transfer_mod

    def broken(*args, **kwargs):
        raise IndexError("tuple index out of range")
    monkeypatch.setattr(transfer_mod, "gather_pages", broken)
    eng = make_engine()
    first = await run_one(eng)
    assert first.output_ids == await reference(PROMPT)
    await eng.cache.drain()
    assert eng.cache.metrics.failures.get("transfer", 0) >= 1
    second = await run_one(eng, OTHER)  # the loop is alive
    assert second.output_ids == await reference(OTHER)
    await finish(eng)
