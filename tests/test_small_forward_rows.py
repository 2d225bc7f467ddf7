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
