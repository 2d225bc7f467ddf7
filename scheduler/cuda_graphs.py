"""CUDA graphs for small forwards: decode batches and the one-token tail that follows a restore.

An eager 1-token forward of an 8B-shaped model is launch-bound (~9 ms against a ~3.5 ms weight-read
floor on an H200), which would eat a restore's gain. Each batch size in `batch_sizes` is captured once
with static input buffers; a step copies its inputs into them and replays. Rows beyond the real batch
write their K/V into a private scratch page and attend to it only, so padding never touches live KV.
"""
from __future__ import annotations

import torch

from scheduler.attention import AttentionBatch
from scheduler.model import Qwen3Model


class DecodeGraphs:
    def __init__(self, model: Qwen3Model, kv_pool: torch.Tensor, page_size: int, max_pages_per_seq: int,
                 scratch_page: int, max_batch: int = 32) -> None:
        self.model, self.kv_pool, self.page_size = model, kv_pool, page_size
        self.device = kv_pool.device
        self.max_pages = max_pages_per_seq
        self.scratch_page = scratch_page
        self.batch_sizes = [b for b in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128) if b <= max_batch]
        n = self.batch_sizes[-1]
        i64 = dict(dtype=torch.int64, device=self.device)
        self.ids = torch.zeros(n, **i64)                                  # [B]
        self.positions = torch.zeros(n, **i64)                            # [B]
        self.out_slots = torch.full((n,), scratch_page * page_size, **i64)  # [B]
        self.page_tables = torch.full((n, max_pages_per_seq), scratch_page, **i64)  # [B, M]
        self.seq_lens = torch.ones(n, **i64)                              # [B]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _batch(self, bs: int) -> AttentionBatch:
        return AttentionBatch(is_decode=True, prefix_lens=[0] * bs, new_lens=[1] * bs,
                              page_tables=self.page_tables[:bs], seq_lens=self.seq_lens[:bs],
                              out_slots=self.out_slots[:bs], positions=self.positions[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        self.model.rope_tables(self.max_pages * self.page_size + 1, self.device, self.kv_pool.dtype)
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its memory
                for _ in range(2):  # warm up (Triton compiles, cuBLAS picks kernels)
                    self.model(self.ids[:bs], self._batch(bs), self.kv_pool)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[bs] = self.model(self.ids[:bs], self._batch(bs), self.kv_pool)  # [bs, V]
                pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def fits(self, num_rows: int, page_tables: list[list[int]]) -> bool:
        return (bool(self.graphs) and num_rows <= self.batch_sizes[-1]
                and max(len(pt) for pt in page_tables) <= self.max_pages)

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], page_tables: list[list[int]]) -> torch.Tensor:
        """One row per new token: token `input_ids[i]` at `positions[i]` of the sequence whose pages
        are `page_tables[i]` (rows of one sequence share its table; their K/V are all written before
        any row attends, so row i seeing keys < position+1 is exactly causal). -> logits [rows, V]."""
        rows = len(input_ids)
        graph_bs = next(b for b in self.batch_sizes if b >= rows)
        ps, pad = self.page_size, graph_bs - rows
        scratch_slot = self.scratch_page * ps
        slots = [pt[p // ps] * ps + p % ps for pt, p in zip(page_tables, positions)]
        host = torch.tensor([input_ids + [0] * pad, positions + [0] * pad, slots + [scratch_slot] * pad,
                             [p + 1 for p in positions] + [1] * pad], dtype=torch.int64)  # [4, graph_bs]
        host_pt = torch.full((graph_bs, self.max_pages), self.scratch_page, dtype=torch.int64)
        for i, pt in enumerate(page_tables):
            host_pt[i, : len(pt)] = torch.tensor(pt, dtype=torch.int64)
        host, host_pt = host.pin_memory(), host_pt.pin_memory()
        self.ids[:graph_bs].copy_(host[0], non_blocking=True)
        self.positions[:graph_bs].copy_(host[1], non_blocking=True)
        self.out_slots[:graph_bs].copy_(host[2], non_blocking=True)
        self.seq_lens[:graph_bs].copy_(host[3], non_blocking=True)
        self.page_tables[:graph_bs].copy_(host_pt, non_blocking=True)
        self.graphs[graph_bs].replay()
        return self.logits[graph_bs][:rows]
