"""The serving engine: one asyncio loop that admits requests, restores or recomputes their prefixes,
and runs prefill and decode batches over the paged L1 pool.

    tick:  settle aborts and parked restores  ->  form a batch (prefill first, else decode; turn about while
           requests decode: scheduler/engine_loop.py)
           ->  launch it on the device  ->  await its tokens (restores and I/O progress meanwhile)
           ->  post-process: stream tokens, publish prefixes, finish requests

In-process API: `await engine.start()`, `async for ev in engine.submit(prompt, params)`, `await engine.abort(rid)`,
`engine.status()`, `await engine.shutdown()`; and the synchronous `Engine(...).generate(prompts, params)` for
batches (scheduler/batch_api.py). Only from the thread whose loop ran `start()`: nothing here is thread-safe.

This module builds the engine's parts (model, pools, runner, graphs, admission) and states its limits
(`validate`: what one request may ask of them); the rest is mixed in, one concern a module:
    scheduler/engine_lifecycle.py  starting and stopping the loop; a request queued, aborted, finished
    scheduler/engine_loop.py       the loop itself: the tick above, chained decode, its wake-ups
    scheduler/batch_api.py         generate() / generate_async() over add_request
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
from collections import deque
from collections.abc import Sequence

import structlog
import torch

from hicache.faults import FaultInjector
from hicache.manager import CacheManager
from hicache.radix import Tier
from scheduler import step_extras
from scheduler.admission import Admission
from scheduler.batch_api import BatchAPI
from scheduler.config import EngineConfig, resolve_device
from scheduler.cuda_graphs import TAIL_SIZES, capture_graphs
from scheduler.engine_lifecycle import EngineLifecycle
from scheduler.engine_loop import EngineLoop
from scheduler.logs import OccupancyLog, configure_logging, info_enabled, logging_state, restore_logging
from scheduler.memory_plan import plan_pools
from scheduler.model import load_model
from scheduler.guided import Guides
from scheduler.presets import model_config_of
from scheduler.request import Request, RequestError, SamplingParams, kv_tokens
from scheduler.runner import ModelRunner, SimRunner
from scheduler.speculative import Speculator

log = structlog.get_logger("scheduler.engine")


class Engine(EngineLifecycle, EngineLoop, BatchAPI):
    def __init__(self, config: EngineConfig | None = None, faults: FaultInjector | None = None) -> None:
        self.config = config = config or EngineConfig()
        logging_before, threads = logging_state(), torch.get_num_threads()
        try:
            # (--log-json: its file, whose lines are dropped, not raised, once the disk is full)
            configures = config.log_json or not structlog.is_configured()
            self.log_sink = configure_logging(config.log_json) if configures else None
            # what shutdown() puts back, its log let go, while the logging is still this engine's (`release_logging`)
            self._logging = (logging_before, structlog.get_config()["logger_factory"],
                             list(structlog.get_config()["processors"])) if config.log_json else None
            self.device, self.dtype = resolve_device(config)
            if self.device.type == "cpu" and config.cpu_threads > 0:
                torch.set_num_threads(config.cpu_threads)
            self._load(config, faults)
        except BaseException:  # (an engine refused leaves torch's threads as it found them: regression, a mistyped
            torch.set_num_threads(threads)  # model path left the caller's CPU work on cpu_threads' one thread)
            restore_logging(logging_before)  # (and the logging: its log's file let go)
            # nor holds its weights and pools until the cyclic gc finds them (its admission, speculator and cache's
            # wakeup refer back to it: regression, a retry in the same process found that much less GPU memory)
            vars(self).clear()
            raise

    def _load(self, config: EngineConfig, faults: FaultInjector | None) -> None:
        """The model, its pools and cache, then what the engine holds beside them (`_build`)."""
        if config.simulate:
            self.model, self.model_config = None, model_config_of(config.model)
            self.model_id = f"{config.model}:simulated"
        else:
            self.model, self.model_config, self.model_id = load_model(config.model, self.device, self.dtype,
                                                                      config.seed)
            self.model.skinny = self.model.fused and config.small_gemm == "triton"
            self.model.fp32_lm_head = config.fp32_lm_head
        page_size = config.page_size_on(self.device.type)
        geometry = self.model_config.kv_geometry(page_size, self.dtype)
        num_pages, hc = plan_pools(config, self.device, self.model_config, geometry, self.model_id)
        self.cache = CacheManager(geometry, num_pages, self.device, hc, faults=faults, simulate=config.simulate)
        try:
            self._build(config, page_size)
        except BaseException:  # (its L3 file locked, its streams open, until this half-built engine is collected)
            self.cache.abandon_all()
            raise

    def _build(self, config: EngineConfig, page_size: int) -> None:
        """What an engine holds beside its cache: the runner, graphs, speculator, admission, queues and counters."""
        self.cache.wakeup = self.wake_soon
        self.cache.defer_backups = True  # a step's tokens reach their clients before its backups start
        self.cache.wakeup_idle = self.wake_idle
        self.page_size = page_size
        self.held_l1_pages = 0  # L1 pages taken for good at start (usable_l1_pages)
        self.runner = (SimRunner(self.model_config.vocab_size) if config.simulate
                       else ModelRunner(self.model, self.cache.l1.kv, page_size, self.device,
                                        spin_wait=config.gpu_wait == "spin"))
        transfer = self.cache.transfer
        if config.restore_overlap and not config.simulate and transfer is not None and transfer.layerwise:
            self.runner.layer_flags = transfer.layer_flags  # None on the CPU: copies are synchronous
        if self.device.type == "cuda" and config.cuda_graphs and not config.simulate:
            capture_graphs(self)
        self.speculator = None  # speculative decoding (scheduler/speculative.py), when configured
        if config.speculative is not None and not config.simulate:
            graphs = self.runner.graphs
            self.speculator = Speculator(self, config.speculative,
                                         graphs.verify_max_seqs if graphs is not None else TAIL_SIZES[-1])
        self.admission = Admission(self)
        self.guides = Guides(config.model, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.parked: list[Request] = []
        self.running: list[Request] = []      # admitted: PREFILL (chunked) or DECODE
        self.requests: dict[str, Request] = {}
        self.aborting: set[str] = set()  # rids aborted, ended at the next tick (admission and pricing skip them)
        self._stops: set[str] = set()  # of those, the ones a caller's stop condition ended (`abort`)
        self._wake: asyncio.Event | None = None
        self._end_chain = False  # set by wake_soon, not by wake_idle: a decode chain stops for it
        self._prefill_turn = True  # the loop's next tick tries prefill first (it alternates while requests decode)
        self._loop_task: asyncio.Task | None = None
        self.stopping = False  # the loop is asked to stop: nothing more is admitted (a restart clears it)
        self._closing = False  # shutdown() began: no new requests ever; queued ones run within its grace
        self._stop_done: asyncio.Future | None = None  # a stop_loop() under way: done as it returns (start() waits)
        self._shut_down = False  # shutdown() ended: the tiers are closed
        self._grace_cut = False  # end_grace(): a shutdown's grace ends now (hicache-serve's forced exit)
        self._pid = os.getpid()  # the process that built it (start() refuses to run in a forked child)
        # clients whose work is several requests in turn (a beam search's steps: scheduler/beam_search.py) under
        # way: shutdown's grace waits for them too, and takes their next requests (add_request(continuing=True))
        self.continuing = 0
        self._batch_id = 0
        self._overlap_counted_ns = 0  # restore_overlapped_s counts decode time up to here (chained spans overlap)
        self._step_end_ns = 0  # when the last step's tokens were back (a chained step's time counts from there)
        self.last_batch_seqs = 0  # sequences in the last batch that ended (Restoring.score_outcome)
        self._log_occupancy = OccupancyLog(self.cache.tree.allocators)  # after batches, at stops
        self.stats = {"batches": 0, "prefill_tokens": 0, "decode_tokens": 0, "finished": 0, "aborted": 0,
                      "failed": 0, "chained_steps": 0, "restore_overlaps": 0, "restore_waits_timed_out": 0,
                      "preempted": 0, "preempted_recomputed_tokens": 0}

    def hold_l1_page(self, label: str) -> int:
        """Take one L1 page for good (before any request): requests are sized without it. Refuses the last one
        (regression: a one-page L1 with CUDA graphs started, then refused every request for want of a page)."""
        if self.usable_l1_pages <= 1:
            raise ValueError(f"an L1 pool of {self.cache.l1.num_pages} page(s) leaves none for requests once "
                             f"{label!r} holds one: give --num-pages >= {self.held_l1_pages + 2}"
                             + (" or --disable-cuda-graphs" if label == "cuda-graph-scratch" else ""))
        alloc = self.cache.l1.allocator
        page = alloc.alloc(1, alloc.new_claim(label))[0]
        self.held_l1_pages += 1
        return page

    # -- limits: what one request may ask ----------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def usable_l1_pages(self) -> int:
        """L1 pages requests can have: the pool less pages held for good (the CUDA graphs' scratch)."""
        return self.cache.l1.num_pages - self.held_l1_pages

    @property
    def max_kv_tokens(self) -> int:
        """Tokens of K/V one request may hold (`validate`): its L1 pages, within the model's positions."""
        return min(self.usable_l1_pages * self.page_size, self.model_config.max_position_embeddings)

    @property
    def max_prompt_tokens(self) -> int:
        """--max-prompt-tokens within `max_kv_tokens` (regression: the L1 pool alone; a prompt past the
        model's positions but within the pool was refused by a second check with another message)."""
        return min(self.config.max_prompt_tokens or self.max_kv_tokens, self.max_kv_tokens)

    def validate(self, prompt: Sequence[int], params: SamplingParams) -> None:
        if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
            kind = "" if isinstance(prompt, (list, tuple)) else f", got a {type(prompt).__name__}"
            hint = " (convert it with .tolist())" if hasattr(prompt, "tolist") else ""
            raise RequestError(f"prompt must be a non-empty list of token ids{kind}{hint}")
        vocab = self.vocab_size
        if set(map(type, prompt)) != {int} or min(prompt) < 0 or max(prompt) >= vocab:  # C-speed scans
            bad = next(t for t in prompt if type(t) is not int or not 0 <= t < vocab)
            if type(bad) is not int:  # (regression: np.int64(1) was said to be outside the vocabulary)
                raise RequestError(f"token id {bad!r} is a {type(bad).__name__}, not an int: a prompt is a list "
                                   "of Python ints (convert an array with .tolist())")
            raise RequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        params.validate(self.config.max_new_tokens_limit, vocab)
        if params.priority and self.config.scheduling_policy != "priority":  # (vLLM's refusal)
            raise RequestError(f"priority {params.priority} needs --scheduling-policy priority", "priority")
        if self.config.simulate:
            step_extras.refuse_without_logits(params)
        if params.guided is not None:
            self.guides.check(params.guided)  # (its grammar compiles, once per spec)
        if len(prompt) > self.max_prompt_tokens:
            raise RequestError(f"prompt of {len(prompt)} tokens exceeds the limit of {self.max_prompt_tokens}")
        kv = kv_tokens(len(prompt), params.max_tokens)
        positions = self.model_config.max_position_embeddings
        # the field to lower: max_tokens (the prompt alone fits, within `max_prompt_tokens` <= `max_kv_tokens`)
        param = "max_tokens"
        if kv > positions:  # past the positions it was trained for
            raise RequestError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) - 1 exceeds the model's "
                               f"{positions} positions (max_position_embeddings)", param)
        need_pages = -(-kv // self.page_size)
        if need_pages > self.usable_l1_pages:
            raise RequestError(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) - 1 needs {need_pages} pages; the L1 "
                f"pool has {self.usable_l1_pages} pages of {self.page_size} tokens for requests", param)

    def add_eos_token_id(self, token_id: int) -> None:
        """One more id that ends a request (unless ignore_eos) and that min_tokens holds: the server's tokenizer's
        eos_token, at which vLLM's check_stop ends where config.json and generation_config.json name others (a
        fine-tune's <|im_end|>: it ran to max_tokens). Before the first request."""
        if token_id not in self.model_config.eos_token_ids:
            extra = self.model_config.extra_eos_token_ids + (token_id,)
            self.model_config = dataclasses.replace(self.model_config, extra_eos_token_ids=extra)
            self.guides.eos_ids = self.model_config.eos_token_ids

    # -- status --------------------------------------------------------------------------------
    def status(self) -> dict:
        s = self.cache.status()
        s["engine"] = {"model": self.config.model, "model_id": self.model_id, "device": str(self.device),
                       "dtype": str(self.dtype).removeprefix("torch."), "page_size": self.page_size,
                       "waiting": len(self.waiting), "parked": len(self.parked), "running": len(self.running),
                       "decode_reserve_ratio": self.admission.reserve_ratio(), **self.stats}
        if self.speculator is not None:
            s["engine"]["speculative"] = {**self.speculator.stats,
                                          "accepted_per_pos": list(self.speculator.stats["accepted_per_pos"])}
        return s

    def metrics(self) -> dict:
        return self.cache.metrics.as_dict()

    def check_integrity(self) -> None:
        """The cache's checks, and every lock on its tree held by a live request (its shared prefix, in L1) or an
        operation (hicache/operations.py `lock_holds`): a lock no one releases is caught (regression watch)."""
        self.cache.check_integrity()
        live = list(self.requests.values())
        holds = self.cache.runner.lock_holds(op for req in live
                                             for op in (req.overlap_op, req.restore_op, req.prefetch_op)
                                             if op is not None)
        holds.update((req.locked_node, Tier.L1) for req in live if req.locked_node is not None)
        self.cache.tree.check_lock_holders(holds)

    def log_event(self, req: Request, state: str, **fields) -> None:
        """One line of a request's timeline (scheduler/timeline.py reads them back)."""
        if info_enabled():
            log.info("request", rid=req.rid, state=state, **fields)
