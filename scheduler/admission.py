"""Admission and batch formation: which requests run next, where their prefix comes from (L1 hit,
restore from L2/L3, or recompute), and the page bookkeeping of each request.

Page rules for a request (page aligned throughout):
  pages[: locked_len / S]  tree-owned prefix, protected by an L1 lock on `locked_node`;
  pages[locked_len / S :]  private to the request's claim until published by `insert_l1`;
  except while an overlapped restore lands (`overlap_op`, scheduler/restoring.py): then the pages
  [locked_len, cached_len) are the op's, private to it until it publishes them, then locked by it
  for the request (`hold_published`) until `adopt_restored`.
Admission reserves a request's prefill and a share of the pages it may still need
(scheduler/reservations.py: by default an adaptive share, decode_reserve_ratio "auto"; a request that outgrows
L1 preempts the newest request in decode, itself included). At decode_reserve_ratio 1 it reserves every page
(`kv_tokens`: prompt + max_tokens - 1; a prefill alone, max_tokens 0: prompt), so nothing is preempted and a
running request never waits for memory, except under write_back: there a reserved page may have to wait a tick for
the backups of the LRU leaves it must evict.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog
import torch

from hicache.radix import Tier
from hicache.suspect import drop_suspect_prefix, zero_l1_pages
from scheduler import load, logs, step_extras
from scheduler.request import Request, RequestState, TokenEvent
from scheduler.reservations import AutoReserveRatio, Reservations
from scheduler.restoring import Restoring
from scheduler.runner import Batch, BatchInput
from scheduler.sampling import NAN_TOKEN

if TYPE_CHECKING:
    from scheduler.engine import Engine

log = structlog.get_logger("scheduler.engine")

# A waiting request whose prefix a request in prefill is computing waits for those pages when at least this many
# of its tokens would otherwise be computed twice (`_computes_prefix_of`; SGLang's in-batch prefix caching uses
# the same 32): below it, waiting a step costs the request more than computing them alongside.
# EngineConfig.share_prefill (--disable-shared-prefill) turns the waiting off: each then computes its own prefix
PREFILL_SHARE_MIN_TOKENS = 32
# scheduling_policy "lpm" orders a queue of at most this many requests by the prompt tokens L1 holds (one read-only
# tree walk each, at a prefill pass after L1 changed); a longer queue goes in arrival order (SGLang's threshold, 128)
LPM_MAX_WAITING = 128


class Admission(Reservations, Restoring):
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.cache = engine.cache
        self.page_size = engine.page_size
        self.reserved_pages = 0
        # rid -> the end (tokens) of what a restore or prefetch of its own was to bring before it
        # failed or could not start: a fallback once it is admitted computing part of that
        self.fallback_end_tokens: dict[str, int] = {}
        # (rid, L1 room in pages) of the request the last prefill pass found no room for (`chain_decode_batch`)
        self.memory_blocked: tuple[str, int] | None = None
        self.room_waiters: list[Request] = []  # in decode, waiting for L1 room at the last decode step (`_queue_waits`)
        self.auto_ratio = AutoReserveRatio()  # (decode_reserve_ratio "auto": scheduler/reservations.py)

    # -- prefixes ------------------------------------------------------------------------------
    def _reusable(self, req: Request) -> list[int]:
        """Tokens whose KV may come from the cache: the prompt minus its last token (which must be
        computed to produce the first output), page aligned by the tree; none for a request asking for
        prompt logprobs, whose every row's logits are computed (as vLLM V1: it still publishes its pages)."""
        return req.cache_prefill[:-1] if self._reuses(req) else []

    def _reuses(self, req: Request) -> bool:
        """(A preempted request's prompt logprobs were all computed: its resumption reuses its prefix.)"""
        return self.engine.config.enable_prefix_cache and (req.params.prompt_logprobs is None or req.resumed_tokens > 0)

    # -- prefill -------------------------------------------------------------------------------
    async def prefill_batch(self) -> Batch | None:
        eng = self.engine
        budget = eng.config.max_prefill_tokens
        self.note_load()
        if not (eng.running or eng.waiting or eng.parked):
            self.auto_ratio.idle()  # (not while requests queue behind a full batch: regression, session 55's hunt)
        reqs, chunks = [], []
        self.memory_blocked = None
        binput = BatchInput(is_decode=False)
        for req in [r for r in eng.running if r.state is RequestState.PREFILL]:
            if budget <= 0:
                break
            if req.overlap_op is not None:  # restore still landing (settle_overlaps takes it from there)
                continue
            chunk = self._add_chunk(req, budget, binput)
            if chunk:
                reqs.append(req), chunks.append(chunk)
                budget -= chunk
        if not eng.stopping:  # (else they stay queued, as they are, for the next start())
            self.start_deferred_hints()
        for req in [] if self._queue_waits() else self._admission_order():
            if budget <= 0 or len(eng.running) >= eng.config.max_running_requests:
                break
            if eng.stopping and not req.resumed_tokens:
                continue  # (a request preempted while the loop stops was running: it finishes, as they do)
            if req.rid in eng.aborting:
                # aborted while this pass waited for a blocking restore (the list was taken before):
                # the next tick ends it (regression: admitted, prefilled, sent a token after abort())
                continue
            if req.hint_task is not None and not req.hint_task.done():
                continue  # its shared-L3 hints are still being fetched
            if (eng.config.share_prefill and req.prefetch_op is None  # (--disable-shared-prefill: never waits)
                    and self._computes_prefix_of(req) is not None):
                continue  # another request is computing its prefix: it reads those pages once published
            if req.prefetch_op is not None and req.prefetch_op.done:
                self.prefetch_ended(req)  # (it ended before the request was ever parked on it)
            if req.prefetch_op is not None and not req.prefetch_op.done:
                if not self._take_landed(req, alone=not reqs, budget=budget):
                    op = req.prefetch_op
                    self._park(req, self._read_room_pages(req, op.payload["l3_end"]))
                    continue
            else:
                admitted = await self._admit(req, alone=not reqs, budget=budget)
                if admitted is None:
                    continue  # parked on a restore
                if not admitted:
                    break  # not enough memory: keep the queue's order
            chunk = self._add_chunk(req, budget, binput)
            if chunk:  # else no page yet (e.g. write_back evictions wait for backups): next tick
                reqs.append(req), chunks.append(chunk)
                budget -= chunk
            if req.overlap_op is not None:  # runs alone, right now, waiting on the copy layer by layer
                binput.wait_restore = bool(chunk)
                binput.restore_epoch = req.overlap_op.payload["transfer"].epoch
                break
        if not reqs:
            return None
        return Batch(reqs, chunks, binput)

    def note_load(self) -> None:
        """The load that the backups started now are admitted by (`load.write_busy_s`): each pass's, prefill's or a
        decode turn's (regression: a decode turn kept the pass before's, whose load was a request's own prompt, and
        its backup was written to L3 for nothing)."""
        self.cache.busy_s = load.write_busy_s(self.engine)

    def _admission_order(self) -> list[Request]:
        """The queue in the order a prefill pass tries it: as queued (arrival; priority, then arrival), or with
        scheduling_policy "lpm" the requests whose prompts L1 holds most of first, arrival among equals: those
        prefixes are used before the requests admitted ahead of them evict them (SGLang's longest prefix match).
        A queue longer than LPM_MAX_WAITING goes as queued. Read-only walks: no LRU stamp, lock or split."""
        eng = self.engine
        waiting = list(eng.waiting)
        if (eng.config.scheduling_policy != "lpm" or not 1 < len(waiting) <= LPM_MAX_WAITING
                or len(eng.running) >= eng.config.max_running_requests):  # (none is admitted this pass: no walks)
            return waiting
        return sorted(waiting, key=lambda req: -self._l1_held(req))  # (stable: as queued among equals)

    def _computes_prefix_of(self, req: Request) -> Request | None:
        """The request in prefill that is computing at least PREFILL_SHARE_MIN_TOKENS of `req`'s reusable prefix
        beyond what it has published, if any: `req` then waits (stays queued) for those pages, which that request
        publishes chunk by chunk (`after_step`), instead of computing them again beside it. So requests that
        arrive together with one prefix compute it once: n choices of a prompt, prompts of one system prompt
        (regression: 4 identical prompts in one batch computed it 4 times). It cannot wait forever: the other
        request is in prefill, so it runs in the next prefill pass or ends."""
        if not self._reuses(req) or req.prefill_len - 1 < PREFILL_SHARE_MIN_TOKENS:  # (`_reusable`'s length)
            return None
        tokens = req.cache_prefill  # `_reusable`'s and its last token, not copied (a preempted one's is a copy)
        for other in self.engine.running:
            if other.state is not RequestState.PREFILL:
                continue
            # it would publish PREFILL_SHARE_MIN_TOKENS more of this prefix (in full pages) where the two agree on
            # their first `need` tokens; most pairs that do not are told by their length or one token, since this
            # runs for every queued request against every one in prefill on each pass (a beam search's steps)
            need = other.cached_len + PREFILL_SHARE_MIN_TOKENS
            need += -need % self.page_size
            theirs = other.cache_prompt
            if (need > min(len(tokens) - 1, len(theirs)) or tokens[need - 1] != theirs[need - 1]
                    or not _agree(req, other, tokens, theirs, need)):
                continue
            if req.waits_for != other.rid:
                req.waits_for = other.rid
                if logs.info_enabled():  # (measuring what they share reads it whole: only for a line written)
                    shared = min(_common_prefix_tokens(tokens, theirs), len(tokens) - 1)
                    self.engine.log_event(req, "prefill_waits", behind=other.rid, published_tokens=other.cached_len,
                                          shared_tokens=shared - shared % self.page_size)
            return other
        return None

    async def _admit(self, req: Request, alone: bool = False, budget: int = 0) -> bool | None:
        eng, cache = self.engine, self.cache
        tokens = self._reusable(req)
        m = cache.match(tokens)
        if req.restore_tier == "none":  # (else its restore ended and published: back from parking, use L1)
            started = await self._try_restore(req, m, alone, budget)
            if started == "ended":  # (blocking) as if back from parking, before anyone evicts what it restored
                return await self._admit(req, alone, budget)
            if started == "parked":
                return None
            if started == "overlapped":
                return True
            if started == "wait":
                return False
            req.hit_tokens["l1"] = m.lengths[Tier.L1]
            self._plan(req, "l1", None, req.prefill_len - m.lengths[Tier.L1])
        else:
            # what the restore brought that L1 still holds (pages evicted since are recomputed:
            # deepest first, so L3's part, which lies above L2's, goes first)
            kept = max(0, m.lengths[Tier.L1] - req.restore_l1_start)
            lost = max(0, req.hit_tokens["l2"] + req.hit_tokens["l3"] - kept)
            from_l3 = min(lost, req.hit_tokens["l3"])
            req.hit_tokens.update(l3=req.hit_tokens["l3"] - from_l3, l2=req.hit_tokens["l2"] - (lost - from_l3))
            req.hit_tokens["l1"] = max(0, m.lengths[Tier.L1] - req.hit_tokens["l2"] - req.hit_tokens["l3"])
        l1_len, l1_node = m.lengths[Tier.L1], m.handles[Tier.L1]
        need = self._pages_after(req, l1_len)
        if need > self._room_beside(l1_node):
            self.memory_blocked = (req.rid, self._l1_room_pages())
            return False
        cache.note_hit(tokens, m)
        eng.waiting.remove(req)
        req.claim = cache.new_claim(req.rid)
        # locked with its claim, as `release` unlocks it (regression: locked before the calls above, one raising
        # crashed the loop and left the prefix locked by no request, its L1 pages never evictable again)
        cache.lock(l1_node)
        req.locked_node = l1_node
        req.pages = list(m.pages[Tier.L1])
        req.cached_len = req.locked_len = l1_len
        req.reserved_pages = need
        self.reserved_pages += need
        req.state = RequestState.PREFILL
        eng.running.append(req)
        fell_back = self.fallback_end_tokens.pop(req.rid, 0) > l1_len  # (Restoring._fell_back)
        if not req.resumed_tokens:  # (a preempted request's resumption reads its own K/V: no prompt's hit, no second
            # fallback or policy skip; regression, session 58's hunt: one recomputing its K/V from L2 counted again)
            for tier in ("l1", "l2", "l3"):
                cache.metrics.hit_tokens[tier] += req.hit_tokens[tier]
            cache.metrics.fallbacks += fell_back
            cache.metrics.policy_skips["restore"] += req.restore_tier == "none" and req.restore_declined  # (_try_restore)
        req.scheduled_s = req.scheduled_s or time.perf_counter()
        eng.log_event(req, "prefill_start", prompt_tokens=req.prefill_len, hit_l1=req.hit_tokens["l1"],
                   hit_l2=req.hit_tokens["l2"], hit_l3=req.hit_tokens["l3"], restore_tier=req.restore_tier,
                   restore_tokens=req.hit_tokens["l2"] + req.hit_tokens["l3"])
        return True

    def _add_chunk(self, req: Request, budget: int, binput: BatchInput) -> int:
        chunk = min(req.prefill_len - req.cached_len, budget)
        if chunk <= 0 or not self._grow(req, req.cached_len + chunk):
            return 0
        last = req.cached_len + chunk == req.prefill_len  # an earlier chunk's token is thrown away
        self._append(binput, req, req.prefill_ids[req.cached_len: req.cached_len + chunk], req.cached_len, sampled=last)
        return chunk

    @staticmethod
    def _append(binput: BatchInput, req: Request, new_tokens: list[int], prefix_len: int,
                sampled: bool = True) -> None:
        """sampled=False: the row's token is thrown away (a prompt chunk before the last), so it is
        taken greedily and draws nothing from a seeded request's generator, whose stream then does
        not depend on how the prompt was chunked or how much of it was cached."""
        binput.input_ids.extend(new_tokens)
        binput.prefix_lens.append(prefix_len)
        binput.new_lens.append(len(new_tokens))
        binput.page_tables.append(req.pages)
        binput.temperatures.append(float(req.params.temperature) if sampled else 0.0)
        binput.top_ps.append(float(req.params.top_p))
        binput.top_ks.append(int(req.params.top_k))
        binput.min_ps.append(float(req.params.min_p))
        binput.generators.append(req.generator if sampled else None)

    # -- decode --------------------------------------------------------------------------------
    def decode_batch(self) -> Batch | None:
        eng = self.engine
        reqs, self.room_waiters = [r for r in eng.running if r.state is RequestState.DECODE], []
        if not reqs:
            return None
        self.auto_ratio.decode_step()
        if eng.speculator is None:
            return self._decode_step(reqs, None)
        step, drafted = eng.speculator.split(reqs)  # a verify step's requests and drafts, or a plain step's requests
        batch = self._decode_step(step, drafted)
        if batch is None:  # none of that step's requests has its page now (they wait for backups, or were preempted):
            # the requests split off it decode instead (regression: the loop slept until a backup ended)
            taken = {id(r) for r in step} | {id(r) for r, _ in drafted or ()}
            batch = self._decode_step([r for r in reqs if id(r) not in taken], None)
        return batch

    def _decode_step(self, reqs: list[Request], drafted: list | None) -> Batch | None:
        """A plain decode step of `reqs` (drafted None), or a verify step of `drafted` (requests with their drafts),
        each request's page for its next token grown first (preempting where it outgrew L1); None when no row
        has one."""
        eng = self.engine
        binput = BatchInput(is_decode=drafted is None, verify_drafts=None if drafted is None else [])
        grown = []  # every request's pages first, then the rows of those still in decode (a preemption may take any)
        for req, draft in drafted or [(r, []) for r in reqs]:
            if req.state is not RequestState.DECODE:
                continue  # preempted for an earlier row's page
            pos = len(req.prompt) + len(req.output) - 1
            if draft and not self._grow(req, pos + 1 + len(draft)):
                draft = []  # (no page for its drafts now: its own token alone)
            if not self._grow_or_preempt(req, pos + 1):
                if req.state is not RequestState.DECODE:
                    continue  # (itself preempted: the least urgent)
                # reserved pages exist but cannot be had yet: write_back is backing up the LRU
                # leaves it must evict; their completion wakes the loop. Without pending
                # operations nothing would ever free them: fail this request, not the loop.
                if self.cache.pending_ops() == 0:
                    self._log_overcommit(req)
                    eng.finish(req, RequestState.FAILED, "error", "no KV page available (accounting)")
                continue
            grown.append((req, draft, pos))
        ready = []
        for req, draft, pos in grown:
            if req.state is not RequestState.DECODE:
                continue  # preempted for a later row's page
            self._append(binput, req, [req.output[-1]] + draft, pos)
            if binput.verify_drafts is not None:
                binput.verify_drafts.append(draft)
            ready.append(req)
        if not ready:
            return None
        return Batch(ready, [1] * len(ready), binput)

    def chain_decode_batch(self, reqs: list[Request]) -> Batch | None:
        """The decode step after the one in flight for `reqs` (whose tokens are not back yet): the
        requests that will surely still run then (not finished, not at their last token by length),
        each one position further. Input ids are left to the runner (taken on the device). None when
        nothing can be chained."""
        eng = self.engine
        if eng.waiting and len(eng.running) < eng.config.max_running_requests and not self._head_still_blocked():
            return None  # prefill first: go back to the loop (a request waiting for a running slot gets one
            # only when another finishes, so it does not end the chain: regression, it unchained every step)
        if eng.speculator is not None and eng.speculator.ends_chain(eng.running, reqs):
            return None  # (a verify step's drafts need the tokens of the step before on the host)
        nxt = [r for r in reqs if r.state is RequestState.DECODE and len(r.output) + 2 <= r.params.max_tokens]
        if not nxt:
            return None
        binput = BatchInput(is_decode=True)
        for req in nxt:
            pos = len(req.prompt) + len(req.output)  # the in-flight step's token goes here
            if not self._grow(req, pos + 1):
                return None
            self._append(binput, req, [0], pos)  # placeholder id: the runner takes the real one on the device
        self.auto_ratio.decode_step()
        return Batch(nxt, [1] * len(nxt), binput)

    # -- after a step --------------------------------------------------------------------------
    def after_step(self, req: Request, chunk: int, token: int, same_step: bool = False) -> None:
        """One token of a step for `req` (chunk: the tokens it computed; same_step: not the step's first token
        for it, as a verify step's accepted drafts after the first)."""
        eng = self.engine
        if req.state.done:
            return
        if token == NAN_TOKEN:  # (ModelRunner.launch) nothing of this forward is kept or published
            self._fail_nan(req)
            return
        if req.state is RequestState.PREFILL:
            req.cached_len += chunk
            # recomputed_tokens: prompt tokens prefill computed, each counted once, as its chunk is
            # kept (not at admission: a request aborted between chunks computed only those that ran;
            # an overlapped forward's output dropped by `Restoring` counts nothing, its rerun counts)
            if req.resumed_tokens:  # (a preempted request's again: no prompt's, as its hits are none: vLLM's
                eng.stats["preempted_recomputed_tokens"] += chunk  # preempted queries, apart)
            else:
                self.cache.metrics.recomputed_tokens += chunk
                req.recomputed_tokens += chunk  # (the replay's per-request records)
            # (or aborted since its batch was made, e.g. as its pass waited for another's blocking restore: it ends
            # at the next tick as between chunks; regression, its client got its first token after abort())
            if req.cached_len < req.prefill_len or req.rid in eng.aborting:
                # more chunks to go; the sampled token is meaningless. The full pages computed so far
                # are published now (regression: only once the whole prompt was, so a request sharing
                # the prefix admitted meanwhile computed all of it again); backed up with the prompt
                self._publish(req, req.cache_prefill, backup=False)
                return
            eng.log_event(req, "prefill_end")
            self._publish(req, req.cache_prefill)
            req.state = RequestState.DECODE
            if req.resumed_tokens:  # (a preempted request's: its token is the next of its stream, not a first)
                req.resumed_tokens, req.hit_tokens = 0, dict(req.served_hits)
                eng.log_event(req, "resumed")
            else:
                req.first_token_s = time.perf_counter()
                eng.log_event(req, "first_token")
                if req.params.prompt_logprobs is None:  # (else its prefill also made every prompt row's logits)
                    self.score_outcome(req)
            if req.params.max_tokens == 0:  # the prefill alone (prompt logprobs): its token is thrown away
                eng.finish(req, RequestState.FINISHED, "length")
                return
        else:
            req.cached_len += 1
        complete = False  # (its grammar's answer is whole with this token)
        if req.guide is not None and (complete := step_extras.guide_takes(eng, req, int(token))) is None:
            return
        req.output.append(int(token))
        req.emit(TokenEvent(req.rid, int(token), len(req.output) - 1, same_step=same_step))
        p = req.params
        if int(token) in p.stop_token_ids or (not p.ignore_eos and int(token) in eng.model_config.eos_token_ids):
            eng.finish(req, RequestState.FINISHED, "stop")
        elif complete:  # (only EOS could follow: the answer is whole)
            eng.finish(req, RequestState.FINISHED, "stop")
        elif len(req.output) >= p.max_tokens:
            eng.finish(req, RequestState.FINISHED, "length")

    def _fail_nan(self, req: Request) -> None:
        """Its logits were NaN: fail it, and zero its private pages first (its forward wrote NaN K/V
        there). The pool must hold finite values (scheduler/attention.py: the unwritten tail of a
        page is read and masked, and NaN * 0 is NaN): the next request given one of them failed too.
        On the device the zeroing is enqueued after any step still writing them (`finish`).
        A prompt that reused cached pages: that prefix is the likely culprit, and leaves every tier
        but where others lock it (hicache/suspect.py; regression: it stayed, and every later request
        that hit it failed too)."""
        self.cache.metrics.count_failure("nan_logits")
        log.error("nan_logits", rid=req.rid, state=req.state.value, output_tokens=len(req.output))
        private = req.pages[req.locked_len // self.page_size:]
        if private:
            kv = self.cache.l1.kv
            kv[:, :, torch.tensor(private, dtype=torch.int64, device=kv.device)] = 0
        # (read before finish: a preempted request's resumption reused its own context, `cache_prefill`)
        reused, tokens = sum(req.hit_tokens.values()), req.cache_prefill
        self.engine.finish(req, RequestState.FAILED, "error", "the model's logits for this request were NaN "
                           "(a non-finite forward): its prefix's KV or the model is broken")
        if reused:  # (after finish: its own lock is gone)
            dropped, kept_tokens = drop_suspect_prefix(self.cache, tokens[:reused])
            log.warning("nan_prefix_dropped", rid=req.rid, reused_tokens=reused, dropped_tokens=reused - kept_tokens,
                        kept_locked_tokens=kept_tokens, dropped_pages=dropped)

    def _publish(self, req: Request, tokens: list[int], backup: bool = True) -> None:
        """Insert the request's full pages of `tokens` into the tree and move its lock down
        (backup=False: a prompt chunk's, which the write policy backs up with the whole prompt).

        Pages the tree already held (an identical prompt computed alongside, or a page-aligned
        prompt whose last page was recomputed) come back as duplicates: the request switches to the
        tree's copies, which its lock now pins, and frees its own, so it holds no more L1 than it
        was admitted with (holding both overcommitted L1 and failed a running request)."""
        if not self.engine.config.enable_prefix_cache:
            return
        ps = self.page_size
        aligned = min(len(tokens), req.cached_len)
        aligned -= aligned % ps
        cache = self.cache
        if aligned <= req.locked_len:
            if backup and req.chunks_unbacked:  # (its chunks published every full page of `tokens`)
                req.chunks_unbacked = False
                cache.back_up_l1(tokens[:req.locked_len])
            return
        first, end = req.locked_len // ps, aligned // ps
        duplicates = cache.insert_l1(tokens[:aligned], req.pages[first:end], req.claim, start_tokens=req.locked_len,
                                     backup=backup)
        req.chunks_unbacked = not backup
        m = cache.tree.match(tokens[:aligned], include_storage=False)
        cache.lock(m.handles[Tier.L1])
        cache.unlock(req.locked_node)
        req.locked_node, req.locked_len = m.handles[Tier.L1], m.lengths[Tier.L1]
        if duplicates:
            req.pages[first:end] = m.pages[Tier.L1][first:end]  # the same tokens' K/V, in the tree's pages
            cache.free_pages(Tier.L1, duplicates, req.claim)

    def release(self, req: Request, publish: bool, zero: bool = False) -> None:
        """End of a request: publish its computed pages (when it finished; its prompt chunks' are
        already), free the rest, give back its reservation (a parked request's too: the room its
        read's H2D was to take). zero: its private pages may hold NaN K/V: they go back zeroed."""
        self.fallback_end_tokens.pop(req.rid, None)
        self.reserved_pages -= req.reserved_pages
        req.reserved_pages = 0
        if req.overlap_op is not None:  # it ends before taking over the restore its forward ran behind: the pages
            # past its L1 prefix are the op's, which publishes them (regression: a resumed request finished by its
            # stop string there published them from its own claim, AllocatorError, and the loop crashed)
            self.cache.runner.release_held(req.overlap_op)
            publish, zero = False, True  # (and its forward's K/V came of the copy's bytes, unverified: NaN if garbage)
        if req.claim is None:
            return
        if publish:
            # KV exists for every token but the last generated one
            self._publish(req, (req.cache_prompt + req.output)[: req.cached_len])
            if self.engine.speculator is not None:  # (its tokens past the pages, for drafts: speculative.py)
                self.engine.speculator.remember_tail(req)
        elif req.chunks_unbacked:  # it ends between prompt chunks: back up those it published
            self.cache.back_up_l1(req.cache_prefill[: req.locked_len])
        self.cache.unlock(req.locked_node)
        req.locked_node = None
        if zero:
            zero_l1_pages(self.cache, self.cache.l1.allocator.pages_of(req.claim))
        self.cache.release_claim(req.claim)
        req.claim = None


def _agree(req: Request, other: Request, tokens: list[int], theirs: list[int], need: int) -> bool:
    """Whether req's `tokens` and other's `theirs` agree on their first `need`, comparing only what its last check
    of `other` left unknown (each pass checks again as other's chunks grow `need`: regression, whole prefixes)."""
    known = req.prefix_checked  # (other, tokens known to agree, an end before which they differ or None)
    agreed, differs = known[1:] if known is not None and known[0] is other else (0, None)
    if need <= agreed or (differs is not None and need >= differs):
        return need <= agreed
    same = tokens[agreed:need] == theirs[agreed:need]
    req.prefix_checked = (other, need, differs) if same else (other, agreed, need)
    return same


def _common_prefix_tokens(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists (slice comparisons: C loops, a binary search)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
