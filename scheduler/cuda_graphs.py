"""CUDA graphs for small forwards: decode batches, the short tail that follows a restore, and short
fresh prefills.

An eager forward of an 8B-shaped model over a few tokens is launch-bound (~400 kernel launches: 25–40
ms against a 4.4 ms weight-read floor on an H200), which would eat a restore's gain. Each shape is
captured once with static input buffers; a step copies its inputs into them and replays. Families:
  - decode (B sequences x 1 row), B in DECODE_SIZES;
  - tail (B sequences x TAIL_ROWS rows), B in TAIL_SIZES. A restored prefix that is not page-aligned
    leaves up to a page of tokens to compute; the attention kernel reads each K/V block once for all
    rows of a sequence (kernels/decode_attention.py), where one-row sequences would read it per row;
  - prefill (one sequence, no cached prefix, padded to a PREFILL_BUCKETS length);
  - verify (B sequences x R rows, every row's logits), B as for tails, with speculative decoding
    (scheduler/speculative.py): a verify step's pending tokens and drafts, R the drafts + 1 rounded up to a
    power of two (`speculative.verify_rows`: 8 rows for 5 drafts, so eight sequences still fit the skinny
    projections' 64 rows);
  - restore (one sequence, 1 or TAIL_ROWS rows) when the transfer engine copies restores in layer
    order: the same forward whose paged attention kernel first spins on that layer's flag of the
    transfer engine (kernels/layer_flags.py), so the tail runs while later layers of its
    prefix are still crossing PCIe (hicache/layer_copy.py). The epoch it waits for is staged with
    the other inputs.
Padding (rows beyond a sequence's new tokens, sequences beyond the real batch, rows beyond a prefill)
writes its K/V into a private scratch page and is discarded, so it never touches live KV. Decode
staging is double-buffered so that a chained step (overlap scheduling) never waits for the one in
flight.
"""
from __future__ import annotations

import contextlib
import gc

import numpy as np
import torch

from kernels import cuda_rt
from kernels.layer_flags import LayerWait
from scheduler.attention import AttentionBatch
from scheduler.model import Qwen3Model
from scheduler.speculative import verify_rows

DECODE_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)  # captured up to the first that holds the max batch
TAIL_ROWS = 16
TAIL_SIZES = (1, 2, 4, 8, 16)  # captured up to the max batch (at least 4)
PREFILL_BUCKETS = tuple(range(64, 513, 64))  # fresh one-sequence prefills, padded up to these lengths


def graph_shapes(max_batch: int) -> list[tuple[int, int]]:
    """The (sequences, rows per sequence) captured: decode batches up to the first of DECODE_SIZES that
    holds `max_batch` (regression: up to `max_batch` only, so with 50 running requests batches of 49 and
    50 ran eagerly), then tails of TAIL_SIZES sequences up to the first that holds `max_batch` (at least 4;
    regression: 4 at most, so a prefill of 8 short tails over cached prefixes, as a beam search's step of 8
    beams, ran eagerly: 37 ms a step at the 8B shape against 6 ms for 4 beams, docs/benchmarks.md session 45)."""
    cover = next((b for b in DECODE_SIZES if b >= max_batch), DECODE_SIZES[-1])
    tails = next((b for b in TAIL_SIZES if b >= max(4, max_batch)), TAIL_SIZES[-1])
    return ([(b, 1) for b in DECODE_SIZES if b <= cover]
            + [(b, TAIL_ROWS) for b in TAIL_SIZES if b <= tails])


class DecodeGraphs:
    """One engine's captured small forwards (the module doc's four families) with their static inputs:
    `shape_for` picks the graph a batch fits, `run` stages its inputs and replays it."""

    def __init__(self, model: Qwen3Model, kv_pool: torch.Tensor, page_size: int, max_pages_per_seq: int,
                 scratch_page: int, max_batch: int = 32, layer_flags=None, verify_rows: int = 0) -> None:
        self.model, self.kv_pool, self.page_size = model, kv_pool, page_size
        self.verify_rows = verify_rows  # the verify family's rows per sequence (0: none captured)
        self.verify_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.verify_logits: dict[tuple[int, int], torch.Tensor] = {}
        self.layer_flags = layer_flags
        self.restore_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.restore_logits: dict[tuple[int, int], torch.Tensor] = {}
        self.device = kv_pool.device
        self.max_pages = max_pages_per_seq
        self.scratch_slot = scratch_page * page_size
        self.shapes = graph_shapes(max_batch)
        rows = max(b * r for b, r in self.shapes)
        seqs = max(b for b, _ in self.shapes)
        i64 = dict(dtype=torch.int64, device=self.device)
        # one device buffer, so a step's inputs cross in one copy: rows [6, N] (ids, positions, out
        # slots, seq lens, last rows, and in [5, 0] a restore's epoch), then page tables [B, M]
        self._rows_len = 6 * rows
        staging = torch.full((self._rows_len + seqs * max_pages_per_seq,), scratch_page, **i64)
        self.rows = staging[:self._rows_len].view(6, rows).zero_()
        self.page_tables = staging[self._rows_len:].view(seqs, max_pages_per_seq)
        self._staging = staging
        # pinned twins, filled on the host each step (double-buffered; no per-step pinned allocation)
        self._host_staging = torch.stack([staging.cpu()] * 2).pin_memory()
        self.host_rows = self._host_staging[:, :self._rows_len].view(2, 6, rows)
        self.host_tables = self._host_staging[:, self._rows_len:].view(2, seqs, max_pages_per_seq)
        self._events = [torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event()]  # reused: staged x2, prefill
        # a step's host side, made once: each pinned twin and numpy views of its rows and tables. On
        # the H200's host every torch call before the replay delays the forward's first kernel by
        # ~20-50 us (a slice, a copy_, an event record's stream lookup): a stress hit's run() took
        # 183 us a call with them, 124 without (docs/benchmarks.md, session 25)
        self._host_views = [(self.host_rows[k].numpy(), self.host_tables[k].numpy()) for k in range(2)]
        self._host_twins = [self._host_staging[k] for k in range(2)]
        self._memcpy = cuda_rt.memcpy_async if cuda_rt.available() else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self._staged: list[torch.cuda.Event | None] = [None, None]
        self._step = 0
        # fresh prefills of one sequence (no cached prefix), padded to a bucket: a short prefill is
        # otherwise host-bound (~400 eager launches for ~9 ms of GPU work at 350 tokens, 8B)
        self.prefill_buckets = [b for b in PREFILL_BUCKETS if -(-b // page_size) <= max_pages_per_seq]
        longest = max(self.prefill_buckets, default=0)
        self.p_rows = torch.zeros((4, max(longest, 1)), **i64)  # ids, positions, out slots, last row  [4, L]
        self.p_table = torch.full((1, max(-(-longest // page_size), 1)), scratch_page, **i64)  # [1, L / S]
        self.host_p_rows = torch.zeros_like(self.p_rows, device="cpu").pin_memory()
        self.host_p_table = torch.full_like(self.p_table, scratch_page, device="cpu").pin_memory()
        self._host_p_views = (self.host_p_rows.numpy(), self.host_p_table.numpy())
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_logits: dict[int, torch.Tensor] = {}
        self._p_staged: torch.cuda.Event | None = None

    def _batch(self, seqs: int, rows_per_seq: int, every_row: bool = False) -> AttentionBatch:
        n = seqs * rows_per_seq
        # a tail's logits: only each sequence's last row (the LM head reads its weight once either way);
        # every_row (a verify step's): all of them
        return AttentionBatch(is_decode=True, prefix_lens=[0] * n, new_lens=[1] * n,
                              page_tables=self.page_tables[:seqs], seq_lens=self.rows[3, :n],
                              out_slots=self.rows[2, :n], positions=self.rows[1, :n], rows_per_seq=rows_per_seq,
                              last_rows=self.rows[4, :seqs] if rows_per_seq > 1 and not every_row else None)

    def _prefill_batch(self, length: int) -> AttentionBatch:
        return AttentionBatch(is_decode=False, prefix_lens=[0], new_lens=[length],
                              page_tables=self.p_table[:, :-(-length // self.page_size)],
                              seq_lens=self.p_rows[3, :1], out_slots=self.p_rows[2, :length],
                              positions=self.p_rows[1, :length], last_rows=self.p_rows[3, :1])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph. A capture fails if any CUDA call that could synchronise runs while
        it is open; this process has other threads that wait on events (transfer completions, L3
        I/O), and garbage from an engine built before (tests, one engine per benchmark tier) may
        be collected mid-capture, its finalisers calling CUDA on this thread. So: garbage is
        collected first, not during, and only this thread's calls count (`capture_error_mode`).
        Seen on the H200 in session 9: 'operation failed due to a previous error during capture'
        in 1-2 of tests/test_gpu.py's engines, varying with the lease."""
        gc.collect()
        with _gc_paused():
            self._capture()

    def _capture(self) -> None:
        self.model.rope_tables(self.max_pages * self.page_size + 1, self.device, self.kv_pool.dtype)
        self.rows[2].fill_(self.scratch_slot)
        self.rows[3].fill_(1)
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for shape in sorted(self.shapes, key=lambda s: -s[0] * s[1]):  # largest first: the rest reuse its memory
                ids = self.rows[0, :shape[0] * shape[1]]
                for _ in range(2):  # warm up (Triton compiles, cuBLAS picks kernels)
                    self.model(ids, self._batch(*shape), self.kv_pool)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    self.logits[shape] = self.model(ids, self._batch(*shape), self.kv_pool)  # [B, V]
                pool = graph.pool()
                self.graphs[shape] = graph
            for shape in [(b, self.verify_rows) for b, r in self.shapes if r > 1] if self.verify_rows else []:
                ids = self.rows[0, :shape[0] * shape[1]]
                self.model(ids, self._batch(*shape, every_row=True), self.kv_pool)  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    self.verify_logits[shape] = self.model(ids, self._batch(*shape, every_row=True),
                                                           self.kv_pool)  # [B * R, V]
                pool = graph.pool()
                self.verify_graphs[shape] = graph
            if self.layer_flags is not None:
                wait_layer = LayerWait(self.layer_flags, self.rows[5, :1])  # the staged epoch
                for shape in [s for s in self.shapes if s[0] == 1]:  # (1, 1) and (1, TAIL_ROWS)
                    ids = self.rows[0, :shape[1]]
                    self.model(ids, self._batch(*shape), self.kv_pool, wait_layer)  # warm-up
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                        self.restore_logits[shape] = self.model(ids, self._batch(*shape), self.kv_pool,
                                                                wait_layer)  # [1, V]
                    pool = graph.pool()
                    self.restore_graphs[shape] = graph
            self.p_rows[1].copy_(torch.arange(self.p_rows.shape[1]))
            self.p_rows[2].fill_(self.scratch_slot)
            for length in sorted(self.prefill_buckets, reverse=True):
                ids = self.p_rows[0, :length]
                self.p_rows[3, 0] = length - 1
                for _ in range(2):
                    self.model(ids, self._prefill_batch(length), self.kv_pool)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    self.prefill_logits[length] = self.model(ids, self._prefill_batch(length), self.kv_pool)  # [1, V]
                pool = graph.pool()
                self.prefill_graphs[length] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def tail_forward_s(self, repeats: int = 3) -> float | None:
        """Median seconds of a replay of the one-sequence tail graph (TAIL_ROWS rows over the
        capture's one-token context), the forward a layer-ordered restore runs under; None without
        it. The first replay is not counted."""
        graph = self.graphs.get((1, TAIL_ROWS))
        if graph is None:
            return None
        times = []
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        times = sorted(times[1:])
        return times[len(times) // 2]

    def prefill_bucket(self, prefix_lens: list[int], new_lens: list[int]) -> int | None:
        """The captured length a fresh one-sequence prefill pads to, or None (tails and batches of
        several sequences use the other graphs or run eagerly)."""
        if len(new_lens) != 1 or prefix_lens[0] != 0 or new_lens[0] <= TAIL_ROWS:
            return None
        return next((b for b in self.prefill_buckets if b >= new_lens[0]), None)

    @torch.inference_mode()
    def run_prefill(self, length: int, input_ids: list[int], page_table: list[int]) -> torch.Tensor:
        """A fresh prefill of len(input_ids) tokens padded to `length` rows: padding rows come after
        every real one (so causal attention keeps them out of the real rows), write their K/V into
        the scratch page and are discarded. -> logits of the last real token [1, V]."""
        if self._p_staged is not None:
            self._p_staged.synchronize()
        fill_prefill_staging(*self._host_p_views, length, input_ids, page_table, self.page_size, self.scratch_slot)
        stream = cuda_rt.current_stream(self.device)
        self._upload(self.p_rows, self.host_p_rows, self.host_p_rows.numel(), stream)
        self._upload(self.p_table, self.host_p_table, self.host_p_table.numel(), stream)
        self._p_staged = self._events[2]
        self._p_staged.record(stream)
        self.prefill_graphs[length].replay()
        return self.prefill_logits[length]

    def _upload(self, dst: torch.Tensor, src: torch.Tensor, count: int, stream: torch.cuda.Stream) -> None:
        """The first `count` int64 of pinned `src` into device `dst` on `stream` (the replay's):
        one cudaMemcpyAsync, or a torch copy where the runtime was not found. (Both contiguous.)"""
        if self._memcpy is None:
            dst.view(-1)[:count].copy_(src.view(-1)[:count], non_blocking=True)
            return
        self._memcpy(dst.data_ptr(), src.data_ptr(), count * 8, stream)

    def shape_for(self, new_lens: list[int], page_tables: list[list[int]]) -> tuple[int, int] | None:
        """The captured (sequences, rows per sequence) that fits this batch, or None (run eagerly)."""
        if not self.graphs or max(len(pt) for pt in page_tables) > self.max_pages:
            return None
        rows = 1 if max(new_lens) == 1 else TAIL_ROWS if max(new_lens) <= TAIL_ROWS else None
        return next((s for s in self.shapes if s[1] == rows and s[0] >= len(new_lens)), None)

    def verify_shape_for(self, new_lens: list[int], page_tables: list[list[int]]) -> tuple[int, int] | None:
        """The verify graph's (sequences, verify_rows) that fits a verify step, or None (run eagerly)."""
        if (not self.verify_graphs or max(new_lens) > self.verify_rows
                or max(len(pt) for pt in page_tables) > self.max_pages):
            return None
        return next((s for s in sorted(self.verify_graphs) if s[0] >= len(new_lens)), None)

    @property
    def verify_max_seqs(self) -> int:
        """The most sequences a verify graph takes (0: none captured)."""
        return max((s[0] for s in self.verify_graphs), default=0)

    def has_restore_graph(self, shape: tuple[int, int] | None) -> bool:
        return shape in self.restore_graphs

    @torch.inference_mode()
    def run(self, shape: tuple[int, int], input_ids: list[int], prefix_lens: list[int], new_lens: list[int],
            page_tables: list[list[int]], ids_device: torch.Tensor | None = None,
            wait_restore: bool = False, restore_epoch: int = 0, verify: bool = False) -> torch.Tensor:
        """Sequence b adds tokens input_ids[sum(new_lens[:b]) : ...] at positions prefix_lens[b] + t; its
        K/V are all written before any row attends, each row seeing keys up to itself (causal).
        ids_device [B] (decode only): the input ids already on the device (a chained step), copied
        over the staged ones on the stream. wait_restore: replay the variant that waits for each
        layer of a layer-ordered restore, up to `restore_epoch` of the layer flags. -> logits of
        each sequence's last new token [B, V]; verify (a verify shape (B, R)): of every row [B * R, V]."""
        seqs, per = shape
        ps = self.page_size
        # two staging buffers alternate; the copies out of this one (two steps ago) must be done before
        # it is refilled. Those copies ran after the step before them, so a chained step never waits
        # for the step in flight.
        k = self._step % 2
        self._step += 1
        if self._staged[k] is not None:
            self._staged[k].synchronize()
        host, tables = self._host_views[k]
        fill_staging(host, tables, shape, input_ids, prefix_lens, new_lens, page_tables, ps, self.scratch_slot)
        host[5, 0] = restore_epoch
        # rows and whole table rows of the batch: one contiguous pinned -> device copy (stale columns
        # past a length are masked)
        stream = cuda_rt.current_stream(self.device)
        self._upload(self._staging, self._host_twins[k], self._rows_len + seqs * self.max_pages, stream)
        self._staged[k] = self._events[k]
        self._staged[k].record(stream)
        if ids_device is not None:
            self.rows[0, :len(ids_device)].copy_(ids_device)  # device to device, after the staged ids
        if verify:
            self.verify_graphs[shape].replay()
            return self.verify_logits[shape][:len(new_lens) * per]
        if wait_restore:
            self.restore_graphs[shape].replay()
            logits = self.restore_logits[shape]  # [1, V]
        else:
            self.graphs[shape].replay()
            logits = self.logits[shape]  # [B, V]: one row per sequence (a tail's last rows)
        return logits[:len(new_lens)]


def fill_staging(host: np.ndarray, tables: np.ndarray, shape: tuple[int, int], input_ids: list[int],
                 prefix_lens: list[int], new_lens: list[int], page_tables: list[list[int]], page_size: int,
                 scratch_slot: int) -> None:
    """Host side of a graph step. host [6, N] (rows 0-4 filled here): ids, positions, out slots,
    seq lens (keys each row sees) and, in row 4, the row of each sequence's last new token (a
    padding sequence: its first row); row 5 holds the restore epoch (`run` sets it); tables [B, M]
    page tables. Padding rows write to `scratch_slot` and see one key."""
    seqs, per = shape
    n = seqs * per
    ps = page_size
    host[:2, :n] = 0  # padding rows: id 0 at position 0, written to the scratch slot, seeing one key
    host[2, :n] = scratch_slot
    host[3, :n] = 1
    tables[:seqs, 0] = scratch_slot // ps
    for b, pt in enumerate(page_tables):
        tables[b, :len(pt)] = pt
    if per == 1:  # decode: one row per sequence, vectorised
        pos = np.asarray(prefix_lens, dtype=np.int64)
        b = np.arange(len(pos))
        host[0, :len(pos)], host[1, :len(pos)], host[4, :len(pos)] = input_ids, pos, b
        host[2, :len(pos)] = tables[b, pos // ps] * ps + pos % ps
        host[3, :len(pos)] = pos + 1
        return
    host[4, len(new_lens):seqs] = np.arange(len(new_lens), seqs) * per  # the graph reads B last rows
    token = 0
    for b, (prefix, new) in enumerate(zip(prefix_lens, new_lens)):
        pos = np.arange(prefix, prefix + new, dtype=np.int64)
        r = slice(b * per, b * per + new)
        host[0, r] = input_ids[token:token + new]
        host[1, r] = pos
        host[2, r] = tables[b, pos // ps] * ps + pos % ps
        host[3, r] = pos + 1
        token += new
        host[4, b] = b * per + new - 1


def fill_prefill_staging(host: np.ndarray, table: np.ndarray, length: int, input_ids: list[int],
                         page_table: list[int], page_size: int, scratch_slot: int) -> None:
    """Host side of a fresh-prefill graph. host [4, L]: ids, positions, out slots, and the last real
    row in host[3, 0]; table [1, L / S]: the sequence's pages, then the scratch page."""
    n, ps = len(input_ids), page_size
    host[0, :length] = 0
    host[0, :n] = input_ids
    host[1, :length] = np.arange(length)
    pages = np.full(table.shape[1], scratch_slot // ps, dtype=np.int64)
    pages[:len(page_table)] = page_table
    table[0] = pages
    pos = np.arange(n)
    host[2, :length] = scratch_slot
    host[2, :n] = pages[pos // ps] * ps + pos % ps
    host[3, 0] = n - 1


@contextlib.contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_graphs(engine) -> None:
    """Capture an engine's graphs (CUDA, `EngineConfig.cuda_graphs`) and hand them to its runner: one L1 page
    held for good as the scratch page padding rows may scribble on; and what a layer-ordered restore's forward
    takes, so the pages its H2D moves meanwhile go in layers under it (CacheManager.whole_first_pages)."""
    scratch = engine.hold_l1_page("cuda-graph-scratch")
    max_pages = min(engine.cache.l1.num_pages, -(-engine.config.max_context_tokens // engine.page_size))
    graphs = DecodeGraphs(engine.model, engine.cache.l1.kv, engine.page_size, max_pages, scratch,
                          max_batch=engine.config.max_running_requests,  # (graph_shapes caps it)
                          layer_flags=engine.runner.layer_flags,
                          verify_rows=0 if engine.config.speculative is None else
                          verify_rows(engine.config.speculative.num_speculative_tokens))
    graphs.capture()
    engine.runner.enable_graphs(graphs)
    engine.cache.overlap_forward_s = graphs.tail_forward_s()
