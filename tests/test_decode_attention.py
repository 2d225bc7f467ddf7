import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.decode_attention import decode_attention_torch, decode_attention_triton  # noqa: E402


@pytest.mark.parametrize("page_size,hq,hkv", [(1, 4, 2), (4, 4, 4), (16, 8, 2)])
def test_triton_decode_matches_reference(page_size, hq, hkv):
    torch.manual_seed(0)
    d, pages = 16, 40
    k = torch.randn(pages, page_size, hkv, d)
    v = torch.randn(pages, page_size, hkv, d)
    seq_lens = torch.tensor([1, 7, 37, 3 * page_size + 1], dtype=torch.int64)
    seq_lens = seq_lens.clamp(max=(pages // 4) * page_size)
    perm = torch.randperm(pages)
    max_pages = pages // 4
    page_tables = perm[: 4 * max_pages].reshape(4, max_pages).to(torch.int64)
    q = torch.randn(4, hq, d)
    ref = decode_attention_torch(q, k, v, page_tables, seq_lens, 0.25)
    got = decode_attention_triton(q, k, v, page_tables, seq_lens, 0.25)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_split_count_falls_with_the_sequences_of_a_one_row_decode():
    """16 splits for a few (sequence, KV head) pairs and for multi-row tails; 8, then 4, as a one-row decode
    of more sequences has programs enough (kernels/decode_attention.py `default_splits`)."""
    from kernels.decode_attention import NUM_SPLITS, default_splits
    assert [default_splits(n, 1) for n in (8, 32, 33, 64, 65, 256, 512)] == [16, 16, 8, 8, 4, 4, 4]
    assert all(default_splits(n, r) == NUM_SPLITS for n in (8, 64, 512) for r in (2, 16))


@pytest.mark.parametrize("batch,hkv", [(20, 2), (40, 2)])
def test_many_sequence_decode_with_fewer_splits_matches_reference(batch, hkv):
    """A one-row decode of enough sequences to take 8 and 4 splits: every length, from one key to a few
    pages past a split's share, equals the reference."""
    torch.manual_seed(2)
    d, page_size, max_pages, hq = 16, 4, 12, 4
    pages = batch * max_pages
    k = torch.randn(pages, page_size, hkv, d)
    v = torch.randn(pages, page_size, hkv, d)
    page_tables = torch.randperm(pages).reshape(batch, max_pages).to(torch.int64)
    seq_lens = torch.tensor([1 + (7 * i) % (max_pages * page_size) for i in range(batch)], dtype=torch.int64)
    q = torch.randn(batch, hq, d)
    ref = decode_attention_torch(q, k, v, page_tables, seq_lens, 0.25)
    got = decode_attention_triton(q, k, v, page_tables, seq_lens, 0.25)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows_per_seq,hq,hkv,tensor_cores", [(2, 4, 2, False), (5, 8, 2, False), (16, 4, 1, False),
                                                               (5, 8, 2, True)])
def test_triton_multi_row_matches_reference(rows_per_seq, hq, hkv, tensor_cores):
    """R query tokens per sequence (the tail after a restore): causal per row, padding rows finite."""
    torch.manual_seed(1)
    d, page_size, pages, b = 16, 4, 48, 3
    k = torch.randn(pages, page_size, hkv, d)
    v = torch.randn(pages, page_size, hkv, d)
    max_pages = pages // b
    page_tables = torch.randperm(pages)[: b * max_pages].reshape(b, max_pages).to(torch.int64)
    prefixes = [0, 9, max_pages * page_size - rows_per_seq]
    lens = []
    for prefix in prefixes:
        real = rows_per_seq - 1 if prefix == 9 else rows_per_seq  # sequence 1 has one padding row
        lens += [prefix + t + 1 for t in range(real)] + [1] * (rows_per_seq - real)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    q = torch.randn(b * rows_per_seq, hq, d)
    ref = decode_attention_torch(q, k, v, page_tables, seq_lens, 0.25, rows_per_seq)
    got = decode_attention_triton(q, k, v, page_tables, seq_lens, 0.25, rows_per_seq, tensor_cores=tensor_cores)
    tol = 2e-3 if tensor_cores else 1e-5  # tensor cores: the interpreter may emulate TF32 rounding
    torch.testing.assert_close(got, ref, rtol=tol * 10, atol=tol)
    # one row at a time through the one-row kernel gives the same answer
    for r in (0, rows_per_seq - 1, 2 * rows_per_seq - 2, b * rows_per_seq - 1):
        one = decode_attention_triton(q[r:r + 1], k, v, page_tables[r // rows_per_seq:r // rows_per_seq + 1],
                                      seq_lens[r:r + 1], 0.25, tensor_cores=tensor_cores)
        torch.testing.assert_close(got[r:r + 1], one, rtol=tol, atol=tol)


def test_rows_mismatch_is_an_error():
    q = torch.zeros(3, 4, 16)
    with pytest.raises(ValueError, match="rows"):
        decode_attention_triton(q, torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16),
                                torch.zeros(2, 2, dtype=torch.int64), torch.ones(3, dtype=torch.int64), 0.25, 2)


def test_attention_waits_for_its_layer_flag_first():
    """wait=(flags, expected, status, layer, spins): a landed layer passes (same output, status
    clear); a flag that never reaches the epoch gives up after its spins and sets status."""
    torch.manual_seed(3)
    d, page_size, pages = 16, 4, 16
    k, v = torch.randn(pages, page_size, 2, d), torch.randn(pages, page_size, 2, d)
    tables, lens, q = torch.arange(16).reshape(2, 8), torch.tensor([20, 31]), torch.randn(2, 4, d)
    plain = decode_attention_triton(q, k, v, tables, lens, 0.25)
    flags, status = torch.tensor([5, 3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    expected = torch.tensor([5])
    landed = decode_attention_triton(q, k, v, tables, lens, 0.25, wait=(flags, expected, status, 0, 50))
    torch.testing.assert_close(landed, plain)
    assert status.item() == 0
    decode_attention_triton(q, k, v, tables, lens, 0.25, wait=(flags, expected, status, 1, 50))
    assert status.item() == 1


@pytest.mark.parametrize("merge_rows", [1, 4, 16])
def test_merge_row_blocks_give_the_same_result(merge_rows):
    """The merge kernel's rows per program (4 by default: a 16-row tail of 4 query heads per KV head
    is 16 programs per head) only moves work between programs: each block merges its own rows, the
    last block of a head partly past the real rows."""
    torch.manual_seed(3)
    d, page_size, pages, rows, hq, hkv = 16, 4, 24, 3, 6, 2  # 9 real rows per KV head: ragged blocks
    k, v = torch.randn(pages, page_size, hkv, d), torch.randn(pages, page_size, hkv, d)
    page_tables = torch.randperm(pages)[:20].reshape(2, 10).to(torch.int64)
    seq_lens = torch.tensor([30 + t for t in range(rows)] + [12 + t for t in range(rows)], dtype=torch.int64)
    q = torch.randn(2 * rows, hq, d)
    ref = decode_attention_torch(q, k, v, page_tables, seq_lens, 0.25, rows)
    got = decode_attention_triton(q, k, v, page_tables, seq_lens, 0.25, rows, merge_rows=merge_rows)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows_per_seq,block,prefetch_pages", [(1, 2, True), (1, 4, True), (1, 8, True),
                                                                (3, 2, True), (3, 4, True), (3, 8, True),
                                                                (1, 2, False), (3, 8, False)])
def test_prefetched_page_numbers_give_the_same_result(rows_per_seq, block, prefetch_pages):
    """PREFETCH_PAGES loads the next block's page numbers one step early (the default): blocks
    shorter than a page, as long as one, spanning two, several to a split (2 splits of up to 64
    keys); splits that end mid-page, and an empty split (a 2-key sequence), all read the keys a
    plain step reads."""
    torch.manual_seed(5)
    d, page_size, pages, hq, hkv = 16, 4, 40, 4, 2
    k, v = torch.randn(pages, page_size, hkv, d), torch.randn(pages, page_size, hkv, d)
    page_tables = torch.randperm(pages)[:36].reshape(2, 18).to(torch.int64)
    lens = []
    for prefix in (1, 61):
        lens += [prefix + t + 1 for t in range(rows_per_seq)]
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    q = torch.randn(2 * rows_per_seq, hq, d)
    ref = decode_attention_torch(q, k, v, page_tables, seq_lens, 0.25, rows_per_seq)
    got = decode_attention_triton(q, k, v, page_tables, seq_lens, 0.25, rows_per_seq, block=block, splits=2,
                                  prefetch_pages=prefetch_pages)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_tails_ask_for_pdl_unless_switched_off(monkeypatch):
    """One-row decode and a multi-row tail both ask kernels/pdl.py (a tail's split kernel is then
    spread one program an SM on the GPU: tests/test_gpu.py), but not a tail waiting for a restore's
    layers; TAIL_PDL False launches a tail's attention the ordinary way (sessions 25-27)."""
    from kernels import decode_attention

    asked = []
    monkeypatch.setattr(decode_attention.pdl, "launch_kwargs", lambda device: asked.append(device) or {"PDL": False})
    k = torch.randn(8, 4, 1, 16)
    tables = torch.arange(8, dtype=torch.int64).reshape(2, 4)
    decode_attention_triton(torch.randn(4, 2, 16), k, k, tables, torch.tensor([3, 4, 9, 10]), 0.25, 2)
    assert len(asked) == 1  # (one answer for the split kernel and the merge)
    decode_attention_triton(torch.randn(2, 2, 16), k, k, tables, torch.tensor([4, 10]), 0.25)
    assert len(asked) == 2
    # a tail that waits for its layers of a restore: the ordinary launch (under PDL and spread it
    # slowed the restore beside it on the H200, session 28)
    flags, status = torch.tensor([5], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    decode_attention_triton(torch.randn(4, 2, 16), k, k, tables, torch.tensor([3, 4, 9, 10]), 0.25, 2,
                            wait=(flags, torch.tensor([5]), status, 0, 50))
    assert len(asked) == 2 and status.item() == 0
    monkeypatch.setattr(decode_attention, "TAIL_PDL", False)
    decode_attention_triton(torch.randn(4, 2, 16), k, k, tables, torch.tensor([3, 4, 9, 10]), 0.25, 2)
    assert len(asked) == 2
