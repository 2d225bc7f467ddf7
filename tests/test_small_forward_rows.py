"""The small-forward path (CUDA graphs on the GPU) runs a short prefill as one decode row per new
token sharing the sequence's page table. Check on the CPU that this equals the ordinary prefill."""
import torch

from scheduler.attention import AttentionBatch
from scheduler.config import EngineConfig
from scheduler.engine import Engine


def test_rows_equal_prefill():
    eng = Engine(EngineConfig(model="tiny", num_pages=64, page_size=4))
    model, kv, ps = eng.model, eng.cache.l1.kv, 4
    torch.manual_seed(0)
    prompt = torch.randint(0, 512, (23,)).tolist()
    pages = list(range(10, 16))  # 24 token slots
    prefix = 16  # cached part, computed first
    with torch.inference_mode():
        model(torch.tensor(prompt[:prefix]), AttentionBatch.build([0], [prefix], [pages], ps, "cpu", False), kv)
        saved = kv.clone()
        new = prompt[prefix:]
        ref = model(torch.tensor(new), AttentionBatch.build([prefix], [len(new)], [pages], ps, "cpu", False), kv)
        kv.copy_(saved)
        positions = list(range(prefix, prefix + len(new)))
        rows = AttentionBatch(is_decode=True, prefix_lens=positions, new_lens=[1] * len(new),
                              page_tables=torch.tensor([pages] * len(new)),
                              seq_lens=torch.tensor([p + 1 for p in positions]),
                              out_slots=torch.tensor([pages[p // ps] * ps + p % ps for p in positions]),
                              positions=torch.tensor(positions))
        got = model(torch.tensor(new), rows, kv)  # [rows, V]
    torch.testing.assert_close(got[-1:], ref, rtol=1e-5, atol=1e-5)


def test_graph_staging_rows_equal_prefill():
    """The host staging of a tail graph (B sequences x 16 rows, padding rows on a scratch page) fed
    through the model as one decode batch gives each sequence's prefill logits and touches no live
    page but its own (the CUDA graph replays exactly this batch). Given each sequence's last row
    (as the graph is), the forward returns only those rows' logits, plain and fused alike."""
    import numpy as np

    from scheduler.cuda_graphs import TAIL_ROWS, fill_staging

    eng = Engine(EngineConfig(model="tiny", num_pages=64, page_size=4))
    model, kv, ps = eng.model, eng.cache.l1.kv, 4
    torch.manual_seed(1)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (19, 26)]
    tables = [list(range(10, 17)), list(range(30, 37))]
    prefixes = [16, 20]
    scratch = 60
    with torch.inference_mode():
        for p, t, pre in zip(prompts, tables, prefixes):
            model(torch.tensor(p[:pre]), AttentionBatch.build([0], [pre], [t], ps, "cpu", False), kv)
        saved = kv.clone()
        refs = [model(torch.tensor(p[pre:]), AttentionBatch.build([pre], [len(p) - pre], [t], ps, "cpu", False), kv)
                for p, t, pre in zip(prompts, tables, prefixes)]
        expected_kv = kv.clone()
        kv.copy_(saved)
        shape = (4, TAIL_ROWS)  # 2 real sequences, 2 padding ones
        host = np.zeros((5, shape[0] * shape[1]), dtype=np.int64)
        host_tables = np.full((shape[0], 8), scratch, dtype=np.int64)
        new_ids = [t for p, pre in zip(prompts, prefixes) for t in p[pre:]]
        fill_staging(host, host_tables, shape, new_ids, prefixes, [len(p) - pre for p, pre in zip(prompts, prefixes)],
                     tables, ps, scratch * ps)
        n = shape[0] * shape[1]
        rows = torch.from_numpy(host)
        assert host[4, 2:4].tolist() == [2 * TAIL_ROWS, 3 * TAIL_ROWS]  # padding sequences: their first row

        def batch(last_rows):
            return AttentionBatch(is_decode=True, prefix_lens=[0] * n, new_lens=[1] * n,
                                  page_tables=torch.from_numpy(host_tables), seq_lens=rows[3], out_slots=rows[2],
                                  positions=rows[1], rows_per_seq=TAIL_ROWS, last_rows=last_rows)
        every = model(rows[0], batch(None), kv)  # [n, V]: every row, no last rows given
        kv.copy_(saved)
        for fused in (False, True):  # as the graph runs it: only each sequence's last row
            model.fused = fused
            last = model(rows[0], batch(rows[4, :4]), kv)  # [4, V]
            kv.copy_(saved)
            assert last.shape == (4, every.shape[1])
            torch.testing.assert_close(last, every.index_select(0, rows[4, :4]), rtol=1e-5, atol=1e-5)
        model.fused = False
        model(rows[0], batch(rows[4, :4]), kv)
    for i, ref in enumerate(refs):
        torch.testing.assert_close(last[i:i + 1], ref, rtol=1e-5, atol=1e-5)
    live = torch.ones(kv.shape[2], dtype=torch.bool)
    live[scratch] = False
    torch.testing.assert_close(kv[:, :, live], expected_kv[:, :, live], rtol=1e-6, atol=1e-6)


def test_graph_staging_decode_rows():
    import numpy as np

    from scheduler.cuda_graphs import fill_staging

    host = np.full((5, 4), -7, dtype=np.int64)
    tables = np.full((4, 3), -7, dtype=np.int64)
    fill_staging(host, tables, (4, 1), [11, 12], [5, 8], [1, 1], [[3, 9], [4, 6, 2]], 4, 40)
    assert host[:, :2].tolist() == [[11, 12], [5, 8], [9 * 4 + 1, 2 * 4 + 0], [6, 9], [0, 1]]
    assert host[:4, 2:].tolist() == [[0, 0], [0, 0], [40, 40], [1, 1]]  # padding rows: scratch slot, 1 key
    assert tables[2:, 0].tolist() == [10, 10]


def test_prefill_graph_staging_equals_prefill():
    """A fresh prefill padded to its graph bucket (padding rows after the real ones, K/V to the
    scratch page) gives the plain prefill's logits and the same K/V in the sequence's pages."""
    import numpy as np

    from scheduler.cuda_graphs import fill_prefill_staging

    for fused in (False, True):
        eng = Engine(EngineConfig(model="tiny", num_pages=64, page_size=4))
        model, kv, ps = eng.model, eng.cache.l1.kv, 4
        model.fused = fused
        torch.manual_seed(2)
        prompt = torch.randint(0, 512, (37,)).tolist()
        pages = list(range(20, 30))  # 40 slots for 37 tokens
        scratch, length = 60, 64
        with torch.inference_mode():
            ref = model(torch.tensor(prompt), AttentionBatch.build([0], [37], [pages], ps, "cpu", False), kv)
            expected = kv.clone()
            kv.zero_()
            host = np.zeros((4, length), dtype=np.int64)
            table = np.zeros((1, length // ps), dtype=np.int64)
            fill_prefill_staging(host, table, length, prompt, pages, ps, scratch * ps)
            rows, t = torch.from_numpy(host), torch.from_numpy(table)
            batch = AttentionBatch(is_decode=False, prefix_lens=[0], new_lens=[length], page_tables=t,
                                   seq_lens=rows[3, :1], out_slots=rows[2], positions=rows[1], last_rows=rows[3, :1])
            got = model(rows[0], batch, kv)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        live = torch.ones(kv.shape[2], dtype=torch.bool)
        live[scratch] = False
        torch.testing.assert_close(kv[:, :, live], expected[:, :, live], rtol=1e-6, atol=1e-6)
        assert table[0, :10].tolist() == pages and (table[0, 10:] == scratch).all()
        model.fused = False


def test_decode_graphs_cover_the_engines_max_batch():
    """Session 39. Regression: decode graphs were captured for sizes up to max_batch only, so with 50
    running requests (--max-running-requests 50) decode batches of 49 and 50 ran eagerly."""
    from scheduler.cuda_graphs import TAIL_ROWS, graph_shapes
    for max_batch, largest in ((50, 64), (32, 32), (33, 48), (1, 1), (64, 64), (100, 128), (128, 128), (500, 128)):
        decode = [b for b, rows in graph_shapes(max_batch) if rows == 1]
        assert max(decode) == largest and decode == sorted(decode), (max_batch, decode)
    assert [b for b, rows in graph_shapes(50) if rows == TAIL_ROWS] == [1, 2, 4, 8, 16]


def test_tail_graphs_cover_the_engines_max_batch():
    """Session 45. Regression: tails (up to TAIL_ROWS new tokens over a cached prefix) were captured for at most
    4 sequences, so a prefill of 8 such tails (a beam search's step of 8 beams; 8 chats' next turns at once) ran
    eagerly, ~6 x the time of a graph replay at the 8B shape."""
    from scheduler.cuda_graphs import TAIL_ROWS, graph_shapes
    for max_batch, tails in ((1, [1, 2, 4]), (4, [1, 2, 4]), (5, [1, 2, 4, 8]), (8, [1, 2, 4, 8]),
                             (32, [1, 2, 4, 8, 16]), (64, [1, 2, 4, 8, 16])):
        assert [b for b, rows in graph_shapes(max_batch) if rows == TAIL_ROWS] == tails, max_batch
