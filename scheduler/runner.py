"""Runs one batch on the model: builds the attention metadata, runs the forward over the paged L1
pool, samples, and hands back token ids when the device is done (polled between the loop's other
tasks; with `gpu_wait="block"`, waited for in a worker thread)."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from kernels import cuda_rt
from kernels.layer_flags import LayerWait
from scheduler.attention import AttentionBatch
from scheduler.guided import apply_masks
from scheduler.model import Qwen3Model
from scheduler.penalty_state import RowPenalties, apply_penalties
from scheduler.request import MAX_LOGPROBS
from scheduler.sampling import mark_nan, prompt_row_logprobs, sample, token_logprobs, unpack_logprobs
from scheduler.speculative import graph_rows, sampled_rows, verify_bans, verify_penalties
from scheduler.token_bans import RowBans, apply_bans


@dataclass
class BatchInput:
    input_ids: list[int] = field(default_factory=list)  # new tokens of all sequences, batch order
    prefix_lens: list[int] = field(default_factory=list)  # per sequence, as every list below
    new_lens: list[int] = field(default_factory=list)
    page_tables: list[list[int]] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)
    is_decode: bool = False
    top_ks: list[int] = field(default_factory=list)    # per sequence (empty: no top-k in the batch)
    min_ps: list[float] = field(default_factory=list)  # per sequence (empty: no min_p in the batch)
    wait_restore: bool = False    # the one sequence's prefix is still landing layer by layer (layer flags)
    restore_epoch: int = 0        # ... up to this epoch of the transfer engine's layer flags (CUDA)
    logprobs: list[int | None] | None = None  # per sequence, the k its request asked for (None: it did
                                              # not); None: no sequence asked, and nothing extra runs
    penalties: list[RowPenalties | None] | None = None  # per sequence, its penalties', logit_bias' and min_tokens'
                                                        # inputs (None: it has none); None: no sequence has, and
                                                        # nothing extra runs
    # per sequence, (k, the prompt tokens its first rows predict) where its request asks for prompt logprobs, or
    # None; None: no sequence asks (else the batch runs eagerly, keeping every row's hidden state)
    prompt_logprobs: list[tuple[int, list[int]] | None] | None = None
    # per sequence, its allowed_token_ids' and bad words' inputs (None: it has none; scheduler/token_bans.py);
    # None: no sequence has, and nothing extra runs
    bans: list[RowBans | None] | None = None
    # (the guided sequences' positions, their allowed tokens as bitmasks [R, words] int32 on the host;
    # scheduler/guided.py); None: no sequence is guided
    token_masks: tuple[list[int], torch.Tensor] | None = None
    # a verify step (scheduler/speculative.py): per sequence, the drafts after its pending token (its input ids
    # are that token, then these); every row's greedy token comes back. None: an ordinary step
    verify_drafts: list[list[int]] | None = None


class Batch(NamedTuple):
    """One forward of the engine's loop (scheduler/admission.py makes them)."""
    reqs: list                # [Request], in the batch's order
    chunk_tokens: list[int]   # per request, the tokens it computes in this forward (1 a decode step)
    binput: BatchInput


class StepHandle(NamedTuple):
    """A launched step, for `collect` (and for chaining the next decode step to it)."""

    host: Any                             # sampled ids on the host once `event` passed: pinned [B] int64, or a list
    event: torch.cuda.Event | None        # recorded after the copy to `host`; None: `host` holds them already
    ids: Any                              # the sampled ids where they were produced: [B] on the device, or a list
    logprobs: Any = None                  # (values, ids) of `token_logprobs`, on the host with `host`; None: not asked
    prompt_logprobs: Any = None           # (values, ids, ranks) of the prompt rows that asked, on the host with `host`
    row_stride: int = 0                   # a verify step's: sequence b's rows start at b * row_stride (0: packed)


class PendingSample(NamedTuple):
    """A launched forward whose sampling waits (`ModelRunner.sample`): a chained decode step whose guided
    rows' masks need the step before it processed on the host (scheduler/guided.py)."""

    logits: torch.Tensor  # [B, V] on the device (a graph's output buffer: sampled before the graph's next replay)


def _scored(logits: torch.Tensor, penalties: list | None, bans: list | None, masks: tuple | None,
            inflight_ids: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] as the rows that ask score them: penalties with logit_bias and min_tokens (a biased, penalized
    copy), then allowed_token_ids and bad words (banned tokens at -inf; a copy unless penalized), then guided rows'
    masks ((rows, masks): what their grammars do not allow at -inf, a copy). logits itself where no row asks
    (logprobs and NaN marks always read the raw)."""
    scored = logits
    if penalties is not None:
        scored = apply_penalties(logits, penalties, inflight_ids)
    if bans is not None:
        scored = apply_bans(scored, bans, inflight_ids, copy=scored is logits)
    if masks is not None:
        scored = apply_masks(scored, *masks)
    return scored


class ModelRunner:
    OUT_RING = 4  # pinned output buffers reused round-robin (see __init__)

    def __init__(self, model: Qwen3Model, kv_pool: torch.Tensor, page_size: int, device: torch.device,
                 spin_wait: bool = True) -> None:
        self.model = model
        self.spin_wait = spin_wait  # EngineConfig.gpu_wait
        self.kv_pool = kv_pool
        self.page_size = page_size
        self.device = device
        self.cuda = device.type == "cuda"
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-cuda-wait")
        self.graphs = None
        self.layer_flags = None  # the transfer engine's LayerFlags, for layer-ordered restores (CUDA)
        # where sampled ids land on the host: a ring of pinned buffers and events reused round-robin
        # (at most two steps are in flight, in a decode chain); a fresh pinned tensor and event per
        # step cost ~30 us of host time
        self._out_ring: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._out_next = 0
        # beside each, where a step's logprobs land: made the first time a request asks for them
        self._lp_ring: list[tuple[torch.Tensor, torch.Tensor]] = []
        # called with each step's tokens as it is launched (a prefill's prompt tokens, one per decode row): the
        # server's vllm:iteration_tokens_total (scheduler/prom.py); None: nothing observes them
        self.observe_step_tokens: Callable[[int], None] | None = None

    def enable_graphs(self, graphs) -> None:
        """Small forwards replay captured CUDA graphs (scheduler/cuda_graphs.py): decode batches,
        batches of a few sequences adding up to TAIL_ROWS tokens each (a restore's tail), and
        short fresh one-sequence prefills (`prefill_bucket`)."""
        self.graphs = graphs

    @torch.inference_mode()
    def launch(self, batch: BatchInput, chain=None, defer_sample: bool = False) -> StepHandle | PendingSample:
        """Enqueue forward + sampling; returns a `StepHandle` for `collect`. On CUDA nothing blocks here.

        chain = (handle of a launched step, rows): this decode step's input ids are that step's
        sampled ids at `rows`, taken on the device (batch.input_ids is ignored), so the step can be
        enqueued before the previous one's tokens reach the host. defer_sample: the forward alone, its
        sampling enqueued later by `sample` (a decode step's)."""
        if self.observe_step_tokens is not None:
            self.observe_step_tokens(len(batch.input_ids))  # (a chained step's placeholders: one per row)
        if batch.verify_drafts is not None:
            return self._launch_verify(batch)
        ids_dev = None
        if chain is not None:
            prev_ids, rows = chain[0].ids, chain[1]
            ids_dev = prev_ids if rows == list(range(len(prev_ids))) else \
                prev_ids.index_select(0, torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True))
        # a graph makes the last rows' logits only: prompt logprobs need every row's (eager)
        graphs = self.graphs if batch.prompt_logprobs is None else None
        shape = graphs.shape_for(batch.new_lens, batch.page_tables) if graphs is not None else None
        if shape is not None and batch.wait_restore and not graphs.has_restore_graph(shape):
            shape = None  # no graph of this shape waits for a restore: run eagerly with the waits
        bucket = graphs.prefill_bucket(batch.prefix_lens, batch.new_lens) if graphs is not None and shape is None \
            else None
        prompt_lps = None
        if bucket is not None:  # a fresh short prefill: replay the graph of its padded length
            logits = graphs.run_prefill(bucket, batch.input_ids, batch.page_tables[0])  # [1, V]
        elif shape is not None:  # small forward (decode, or a short tail after a restore): replay a graph
            logits = graphs.run(shape, batch.input_ids, batch.prefix_lens, batch.new_lens,
                                batch.page_tables, ids_dev, wait_restore=batch.wait_restore,
                                restore_epoch=batch.restore_epoch)  # [B, V]
        else:
            attn = AttentionBatch.build(batch.prefix_lens, batch.new_lens, batch.page_tables, self.page_size,
                                        self.device, batch.is_decode)
            ids = ids_dev if ids_dev is not None else \
                torch.tensor(batch.input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            wait_layer = None
            if batch.wait_restore and self.layer_flags is not None:  # CUDA; on the CPU copies are synchronous
                self.layer_flags.expected.fill_(batch.restore_epoch)
                wait_layer = LayerWait(self.layer_flags, self.layer_flags.expected)
            if batch.prompt_logprobs is None:
                logits = self.model(ids, attn, self.kv_pool, wait_layer)  # [B, V]
            else:  # every row's hidden state: the last rows' logits sample, the asking rows' give prompt logprobs
                hidden = self.model.hidden_states(ids, attn, self.kv_pool, wait_layer)  # [T, H]
                logits = self.model.logits_of(hidden.index_select(0, attn.last_rows))  # [B, V]
                prompt_lps = self._prompt_logprobs(hidden, batch)
        if defer_sample:
            return PendingSample(logits)
        return self._sampled(logits, batch, ids_dev, prompt_lps)

    def _launch_verify(self, batch: BatchInput) -> StepHandle:
        """A verify step (scheduler/speculative.py): the tail forward of each sequence's pending token and drafts,
        every row's logits (a verify graph's, or eagerly), each row's token to the host: a greedy sequence's argmax, a
        sampled one's draw (scheduler/speculative.py: rejection sampling of its drafts), both after its penalties,
        logit_bias and min_tokens, the row's drafts before it counted as generated, and its bans' and grammar's
        masks after them; where asked, every row's logprobs (raw logits', as a plain step's)."""
        graphs = self.graphs
        shape = graphs.verify_shape_for(batch.new_lens, batch.page_tables) if graphs is not None else None
        stride = 0
        if shape is not None:
            logits = graphs.run(shape, batch.input_ids, batch.prefix_lens, batch.new_lens, batch.page_tables,
                                verify=True)  # [B * R, V]: sequence b's rows from b * R
            stride = shape[1]
        else:
            attn = AttentionBatch.build(batch.prefix_lens, batch.new_lens, batch.page_tables, self.page_size,
                                        self.device, False)
            ids = torch.tensor(batch.input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            logits = self.model.logits_of(self.model.hidden_states(ids, attn, self.kv_pool))  # [T, V]
        # each row's penalties (its drafts before it counted as generated), bans and grammar's mask after them
        drafts, lens, n = batch.verify_drafts, batch.new_lens, len(logits)
        penalties = None if batch.penalties is None else verify_penalties(batch.penalties, drafts, lens, stride, n)
        bans = None if batch.bans is None else verify_bans(batch.bans, drafts, lens, stride, n)
        masks = None if batch.token_masks is None else (graph_rows(batch.token_masks[0], lens, stride),
                                                        batch.token_masks[1])
        scored = _scored(logits, penalties, bans, masks)
        next_ids = scored.argmax(dim=-1)  # [T]: greedy sequences' tokens
        rows, seqs = sampled_rows(batch.new_lens, batch.temperatures, stride)
        if rows:  # sampled sequences: each row drawn as a plain step would be (rejection sampling of its draft)
            index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)  # [S]
            temps, top_ps, top_ks, min_ps = ([values[b] for b in seqs] if values else [] for values in (
                batch.temperatures, batch.top_ps, batch.top_ks, batch.min_ps))  # (top_ks, min_ps: [] for none)
            drawn = sample(scored.index_select(0, index), temps, top_ps, [None] * len(rows), top_ks, min_ps)  # [S]
            next_ids = next_ids.index_copy(0, index, drawn)
        out_ids = mark_nan(logits, next_ids)  # [T]
        logprobs = None
        if batch.logprobs is not None:  # some sequence asked: every row's, its token's and the k likeliest
            logprobs = token_logprobs(logits, next_ids, max(k for k in batch.logprobs if k is not None))  # [T, 1 + k]
        if not self.cuda:
            return StepHandle(out_ids, None, out_ids, logprobs, row_stride=stride)
        host, event, slot = self._out_slot(len(out_ids))
        host.copy_(out_ids, non_blocking=True)
        if logprobs is not None:
            logprobs = self._logprobs_to_host(slot, *logprobs)
        event.record(cuda_rt.current_stream(self.device))
        return StepHandle(host, event, out_ids, logprobs, row_stride=stride)

    @torch.inference_mode()
    def sample(self, pending: PendingSample, batch: BatchInput) -> StepHandle:
        """A deferred step's sampling (`launch(defer_sample=True)`), once the host has the tokens before it: its
        penalties count them from the host's state (as an unchained step's), not from the device."""
        return self._sampled(pending.logits, batch, None, None)

    def _sampled(self, logits: torch.Tensor, batch: BatchInput, ids_dev, prompt_lps) -> StepHandle:
        """Penalties, guided masks, sampling, NaN marks and logprobs of a forward's logits [B, V], and their
        copy to the host."""
        penalized = _scored(logits, batch.penalties, batch.bans, batch.token_masks, ids_dev)
        next_ids = sample(penalized, batch.temperatures, batch.top_ps, batch.generators, batch.top_ks,
                          batch.min_ps)  # [B]
        # the host's ids mark a NaN row (its request fails); a chained step reads the unmarked ones (an
        # id out of the vocabulary would fail the embedding, and every request with it)
        out_ids = mark_nan(logits, next_ids)  # [B]
        logprobs = None
        if batch.logprobs is not None:  # some row asked: one pass over [B, V] for all rows (the host drops the others)
            logprobs = token_logprobs(logits, next_ids, max(k for k in batch.logprobs if k is not None))
        if not self.cuda:
            return StepHandle(out_ids, None, next_ids, logprobs, prompt_lps)
        if batch.wait_restore and self.layer_flags is not None:
            self.layer_flags.stage_status()  # read after this step's event: restore_wait_timed_out
        host, event, slot = self._out_slot(len(next_ids))
        host.copy_(out_ids, non_blocking=True)
        if logprobs is not None:
            logprobs = self._logprobs_to_host(slot, *logprobs)
        if prompt_lps is not None:  # (rare, and up to a chunk's rows: fresh pinned buffers, not a ring)
            prompt_lps = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                               for t in prompt_lps)
        event.record(cuda_rt.current_stream(self.device))
        return StepHandle(host, event, next_ids, logprobs, prompt_lps)

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: BatchInput) -> tuple[torch.Tensor, ...]:
        """The asking sequences' prompt rows' `token_logprobs` and ranks (values [R, 1 + k], ids [R, k], ranks
        [R]; k the largest asked), in batch order: each sequence's first len(targets) rows, each for the prompt
        token after it."""
        rows, targets, row = [], [], 0
        for new, want in zip(batch.new_lens, batch.prompt_logprobs):
            if want is not None:
                rows.extend(range(row, row + len(want[1])))
                targets.extend(want[1])
            row += new
        index = torch.tensor([rows, targets], dtype=torch.int64).to(self.device, non_blocking=True)  # [2, R]
        k = max(want[0] for want in batch.prompt_logprobs if want is not None)
        return prompt_row_logprobs(self.model.logits_of, self.model.cfg.vocab_size, hidden, index[0], index[1], k)

    def _out_slot(self, n: int) -> tuple[torch.Tensor, torch.cuda.Event, int]:
        if not self._out_ring or self._out_ring[0][0].numel() < n:
            size = max(n, 256)
            self._out_ring = [(torch.empty(size, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
                              for _ in range(self.OUT_RING)]
        slot = self._out_next % self.OUT_RING
        buf, event = self._out_ring[slot]
        self._out_next += 1
        return buf[:n], event, slot

    def _logprobs_to_host(self, slot: int, values: torch.Tensor,
                          ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Enqueue the copy of a step's logprobs into the pinned buffers of its ring slot (reused as
        the ids' buffer is: `collect` reads them before the slot comes round again)."""
        rows = self._out_ring[0][0].numel()
        if not self._lp_ring or self._lp_ring[0][1].numel() < rows * MAX_LOGPROBS:
            self._lp_ring = [(torch.empty(rows * (1 + MAX_LOGPROBS), dtype=torch.float32, pin_memory=True),
                              torch.empty(rows * MAX_LOGPROBS, dtype=torch.int64, pin_memory=True))
                             for _ in range(self.OUT_RING)]
        value_buf, id_buf = self._lp_ring[slot]
        host_values = value_buf[:values.numel()].view(values.shape)
        host_ids = id_buf[:ids.numel()].view(ids.shape)
        host_values.copy_(values, non_blocking=True)
        host_ids.copy_(ids, non_blocking=True)
        return host_values, host_ids

    def restore_wait_timed_out(self) -> bool:
        """After collecting a forward that waited for a layer-ordered restore: whether a layer wait
        gave up (then that forward read KV that had not landed and must be discarded)."""
        return self.layer_flags is not None and self.layer_flags.staged_timed_out()

    async def collect(self, handle: StepHandle) -> list[int]:
        host, event = handle.host, handle.event
        if event is None:
            return host.tolist()
        if self.spin_wait:  # poll between the loop's other tasks: this thread never sleeps
            while not event.query():
                await asyncio.sleep(0)
        else:
            await asyncio.get_running_loop().run_in_executor(self._waiter, event.synchronize)
        return host.tolist()

    @staticmethod
    def logprobs_of(handle: StepHandle, wants: list[int | None] | None) -> list | None:
        """After `collect`: per row, the TokenLogprobs its request asked for (`BatchInput.logprobs`)
        or None; None when no row asked."""
        return None if handle.logprobs is None else unpack_logprobs(*handle.logprobs, wants)

    @staticmethod
    def prompt_logprobs_of(handle: StepHandle, wants: list[tuple[int, list[int]] | None] | None) -> list | None:
        """After `collect`: per row, the TokenLogprobs of its prompt rows (`BatchInput.prompt_logprobs`),
        or None; None when no row asked."""
        if handle.prompt_logprobs is None:
            return None
        values, ids, ranks = handle.prompt_logprobs
        lps = unpack_logprobs(values, ids, [w[0] for w in wants if w is not None for _ in w[1]])
        flat = (lp._replace(rank=rank) for lp, rank in zip(lps, ranks.tolist()))
        return [None if w is None else [next(flat) for _ in w[1]] for w in wants]

    def close(self) -> None:
        self._waiter.shutdown(wait=True)


class SimRunner:
    """`--simulate`: no model and no KV; the next token is a fixed function of the sequence's last
    token and position, so equal prompts still produce equal continuations."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.observe_step_tokens: Callable[[int], None] | None = None  # (as ModelRunner's)

    def launch(self, batch: BatchInput, chain=None) -> StepHandle:
        if self.observe_step_tokens is not None:
            self.observe_step_tokens(len(batch.input_ids))
        inputs = batch.input_ids if chain is None else [chain[0].ids[r] for r in chain[1]]
        ids, row = [], 0
        for prefix, new in zip(batch.prefix_lens, batch.new_lens):
            row += new
            ids.append((inputs[row - 1] * 1000003 + prefix + new) % self.vocab_size)
        return StepHandle(ids, None, ids)

    async def collect(self, handle: StepHandle) -> list[int]:
        return handle.host

    @staticmethod
    def logprobs_of(handle: StepHandle, wants) -> None:
        return None  # no logits (Engine.validate refuses logprobs with --simulate)

    prompt_logprobs_of = logprobs_of  # (and prompt logprobs)

    def restore_wait_timed_out(self) -> bool:
        return False

    def close(self) -> None:
        pass
