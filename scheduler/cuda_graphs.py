"""CUDA graphs for small forwards: decode batches and the one-token tail that follows a restore.

An eager 1-token forward of an 8B-shaped model is launch-bound (~9 ms against a ~3.5 ms weight-read
floor on an H200), which would eat a restore's gain. Each batch size in `batch_sizes` is captured once
with static input buffers; a step copies its inputs into them and replays. Rows beyond the real batch
write their K/V into a private scratch page and attend to it only, so padding never touches live KV.
"""
from __future__ import annotations

import numpy as np
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
        # pinned staging, filled on the host each step (no per-step pinned allocation)
        self.host_rows = torch.zeros((4, n), dtype=torch.int64, pin_memory=True)  # ids, pos, slot, len
        self.host_tables = torch.full((n, max_pages_per_seq), scratch_page, dtype=torch.int64, pin_memory=True)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._staged: torch.cuda.Event | None = None
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
        ps = self.page_size
        # the previous step's copies out of the staging buffers must be done before we refill them
        if self._staged is not None:
            self._staged.synchronize()
        host = self.host_rows.numpy()  # [4, n]
        tables = self.host_tables.numpy()  # [n, M]
        pos = np.asarray(positions, dtype=np.int64)
        host[0, :rows] = input_ids
        host[1, :rows] = pos
        host[3, :rows] = pos + 1
        for i, pt in enumerate(page_tables):
            if i == 0 or pt is not page_tables[i - 1]:
                row = np.asarray(pt, dtype=np.int64)
            tables[i, : len(pt)] = row
        host[2, :rows] = tables[np.arange(rows), pos // ps] * ps + pos % ps
        host[:, rows:graph_bs] = np.array([[0], [0], [self.scratch_page * ps], [1]])
        tables[rows:graph_bs, 0] = self.scratch_page
        self.ids[:graph_bs].copy_(self.host_rows[0, :graph_bs], non_blocking=True)
        self.positions[:graph_bs].copy_(self.host_rows[1, :graph_bs], non_blocking=True)
        self.out_slots[:graph_bs].copy_(self.host_rows[2, :graph_bs], non_blocking=True)
        self.seq_lens[:graph_bs].copy_(self.host_rows[3, :graph_bs], non_blocking=True)
        # whole rows: one contiguous pinned -> device copy (stale columns past a row's length are masked)
        self.page_tables[:graph_bs].copy_(self.host_tables[:graph_bs], non_blocking=True)
        self.graphs[graph_bs].replay()
        self._staged = torch.cuda.Event()
        self._staged.record()
        return self.logits[graph_bs][:rows]
