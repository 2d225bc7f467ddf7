"""hicache/workspaces.py `PageLists`: the copy kernels' page lists, written by the host into
buffers reused once their transfer settled (GPU side: tests/test_gpu_transfers.py, whose copy-kernel
transfers run one after another on reused lists)."""
from hicache.workspaces import PageLists


def test_a_list_holds_both_rows_and_is_reused_best_fit_once_given_back():
    lists = PageLists(pin=False)
    buf, pages = lists.acquire([5, 9, 2], [60, 3, 8])
    assert pages.shape == (2, 3) and pages.is_contiguous()
    assert pages.tolist() == [[5, 9, 2], [60, 3, 8]]
    small, _ = lists.acquire(list(range(3)), list(range(3)))  # the first is still its transfer's
    assert small.data_ptr() != buf.data_ptr()
    big, _ = lists.acquire(list(range(500)), list(range(500, 1000)))
    assert big.numel() >= 1000
    for b in (buf, small, big):
        lists.release(b)
    again, pages = lists.acquire([1] * 10, [2] * 10)
    assert again.numel() == min(buf.numel(), small.numel())  # the smallest that fits
    assert pages.tolist() == [[1] * 10, [2] * 10]  # rewritten, nothing of an earlier list
    reused_big, pages = lists.acquire(list(range(400)), list(range(400)))
    assert reused_big.data_ptr() == big.data_ptr()
    assert pages[1].tolist() == list(range(400))
    lists.release(None)  # a transfer that took none


def test_at_most_max_idle_lists_are_kept_the_smallest_dropped():
    lists = PageLists(pin=False)
    taken = [lists.acquire([0] * n, [0] * n)[0] for n in (64 * (i + 1) for i in range(PageLists.MAX_IDLE + 2))]
    for buf in taken:
        lists.release(buf)
    kept = sorted(b.numel() for b in lists._idle)
    assert len(kept) == PageLists.MAX_IDLE
    assert kept == sorted(b.numel() for b in taken)[-PageLists.MAX_IDLE:]
