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
