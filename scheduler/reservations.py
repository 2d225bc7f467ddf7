"""What admission reserves in L1 for a request, its pages growing into that, and preemption where the
reservation was less than what the request may use (EngineConfig.decode_reserve_ratio < 1).

Admission reserves a request's prefill (its prompt; after a preemption, its output so far too) and
`decode_reserve_ratio` of the tokens it may still write K/V for. At 1 nothing runs short and nothing is
preempted. Below it more requests run at once: a request in decode that needs a page past its
reservation takes one that nobody reserved, and where L1 has none left the least urgent request in decode
(the newest; under priority scheduling the largest priority first; the requester included: vLLM V1's choice) is
preempted (`preempt`): its K/V is published to the prefix cache as a finished request's is (and backed up by the
write policy), its pages and reservation go back, and it is queued again with its output folded into its next prefill
(`Request.resumed_tokens`). Readmitted, that prefix is a cache hit (L1, or a restore from L2 or L3 where
it was evicted meanwhile) and the prefill's last row samples its next token: the client sees one stream.
SGLang retracts decode requests alike; vLLM's preempted requests are recomputed, from its prefix cache
where that still holds them. With decode_reserve_ratio "auto" (the default) the share adapts (`AutoReserveRatio`).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import structlog

from hicache.radix import Tier
from scheduler.request import Request, RequestState, enqueue

if TYPE_CHECKING:
    from scheduler.engine import Engine

log = structlog.get_logger("scheduler.engine")


class AutoReserveRatio:
    """decode_reserve_ratio "auto": SGLang's adaptive new_token_ratio, with its defaults. The share starts at
    START, falls by (START - MIN) / DECAY_STEPS each decode step to MIN (requests tend to end well before their
    max_tokens: reserving less runs more at once); a preemption raises it to what the requests in decode have used
    of their max_tokens, each given MARGIN_STEPS more (that much was needed: admit more cautiously). SGLang sets it
    to that estimate even where it is lower, as it is below MIN where max_tokens far exceed what is used (a chat
    without one); here a preemption never lowers it (regression, session 55's hunt). An idle engine (nothing
    running, queued or parked) starts again at START."""
    START, MIN, DECAY_STEPS, MARGIN_STEPS = 0.7, 0.1, 600, 20

    def __init__(self) -> None:
        self.value = self.START

    def decode_step(self) -> None:
        self.value = max(self.value - (self.START - self.MIN) / self.DECAY_STEPS, self.MIN)

    def preempted(self, decoding: list[Request]) -> None:
        """After a preemption: `decoding`, the requests still in decode (used tokens over max_tokens)."""
        if decoding:
            used = sum(len(r.output) + self.MARGIN_STEPS for r in decoding)
            self.value = min(1.0, max(self.value, used / sum(r.params.max_tokens for r in decoding)))

    def idle(self) -> None:
        self.value = self.START


class Reservations:
    """Admission's L1 reservations (mixed into it: uses engine, cache, page_size, reserved_pages, memory_blocked,
    room_waiters, `_reusable`, `_reuses`, `_l1_room_pages`, `_room_beside`, `release` and `auto_ratio`, an
    AutoReserveRatio)."""
    engine: "Engine"
    auto_ratio: AutoReserveRatio

    def reserve_ratio(self) -> float:
        """The share of its remaining max_tokens a request admitted now reserves (decode_reserve_ratio)."""
        setting = self.engine.config.decode_reserve_ratio  # (read at each admission: a bench changes it)
        return self.auto_ratio.value if setting == "auto" else setting

    def _reserve_tokens(self, req: Request) -> int:
        """Tokens whose K/V admission reserves for `req`: its prefill's, and `reserve_ratio()` of those it may
        write after (every token it may still generate but the last: `request.kv_tokens`)."""
        later = max(req.params.max_tokens - len(req.output) - 1, 0)
        return req.prefill_len + math.ceil(self.reserve_ratio() * later)

    def _pages_after(self, req: Request, cached_tokens: int) -> int:
        """Pages the request reserves once `cached_tokens` of its prefill are in L1."""
        return -(-self._reserve_tokens(req) // self.page_size) - cached_tokens // self.page_size

    def _beyond_reservation(self, req: Request, num_tokens: int) -> int:
        """Pages `req` needs to cover `num_tokens` tokens past what it holds and has reserved."""
        missing = -(-num_tokens // self.page_size) - len(req.pages)
        return max(0, missing - req.reserved_pages)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make req.pages cover `num_tokens` tokens: from its reservation, then from the L1 nobody reserved.
        False when that room is short (`_outgrew`) or the pages cannot be had yet (under write_back the LRU
        leaves to evict may wait for their backups)."""
        missing = -(-num_tokens // self.page_size) - len(req.pages)
        if missing <= 0:
            return True
        if self._outgrew(req, num_tokens):
            return False
        pages = self.cache.alloc_l1(missing, req.claim)
        if pages is None:
            return False
        reserved = min(missing, req.reserved_pages)
        req.pages.extend(pages)
        req.reserved_pages -= reserved
        self.reserved_pages -= reserved
        return True

    def _outgrew(self, req: Request, num_tokens: int) -> bool:
        """Whether `req` needs pages past its reservation that no request left unreserved."""
        beyond = self._beyond_reservation(req, num_tokens)
        return beyond > 0 and beyond > self._l1_room_pages()

    def _grow_or_preempt(self, req: Request, num_tokens: int) -> bool:
        """`_grow` for a decode step, preempting while `req` outgrew its reservation: the least urgent request in
        decode, `req` itself included (the largest (priority, arrival): vLLM V1's choice), whose pages this step may
        already have grown (the step appends its rows once every request has its pages: `decode_batch`). False: no
        page for `req` this step (it was preempted, or its pages wait for backups)."""
        while not self._grow(req, num_tokens):
            if not self._outgrew(req, num_tokens) or self.cache.l1_room_coming():
                # (pages a backup copies are evictable once copied, a preempted request's K/V among them under
                # write_through: the request waits a step for them. Regression: the first victim's pages were
                # locked by its backup as the request allocated, and one page short preempted every request)
                if self._beyond_reservation(req, num_tokens):  # room nobody reserved: the queue waits for it too
                    self.room_waiters.append(req)  # (`_queue_waits`)
                return False
            victim = max((r for r in self.engine.running if r.state is RequestState.DECODE),
                         key=lambda r: (r.params.priority, r.arrival_s))
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def _queue_waits(self) -> bool:
        """Whether a request in decode waits for L1 room nobody reserved (`room_waiters`, `_grow_or_preempt`: pages
        past its reservation, which backups are copying): then no queued request is admitted, as vLLM admits none in a
        step where a running request lacked memory. (Regression: each prefill pass admitted one on the room a backup's
        copy had freed, and a stream of short requests, each backed up as it ended, held a long request in decode for
        good.)"""
        return any(r.state is RequestState.DECODE for r in self.room_waiters)

    def preempt(self, req: Request) -> None:
        """Take a request in decode off L1: publish its K/V (as `release` does at its end), give back its pages
        and reservation, and queue it again to resume from that prefix (the module's docstring)."""
        eng = self.engine
        kv_tokens = req.cached_len
        if req.served_hits is None:
            req.served_hits = dict(req.hit_tokens)  # (what its result reports: its first admission's)
        self.release(req, publish=True)
        eng.running.remove(req)
        req.resumed_tokens = len(req.output)
        req.preemptions += 1
        req.pages, req.cached_len, req.locked_len = [], 0, 0
        req.hit_tokens = {"l1": 0, "l2": 0, "l3": 0}
        req.restore_tier, req.restore_l1_start, req.restore_op = "none", 0, None
        req.restore_failed = req.restore_declined = req.landed_offered = False
        req.promoted_tokens = 0  # (what its L3 read promoted was its first admission's hit, not its resumption's)
        req.span_plan = None  # (its next prefill is no first token to learn the cost model from)
        req.state = RequestState.WAITING
        enqueue(eng.waiting, req)
        eng.stats["preempted"] += 1
        self.auto_ratio.preempted([r for r in eng.running if r.state is RequestState.DECODE])
        eng.log_event(req, "preempted", output_tokens=len(req.output), kv_tokens=kv_tokens,
                      preemptions=req.preemptions, running=len(eng.running), waiting=len(eng.waiting),
                      reserve_ratio=round(self.reserve_ratio(), 4))
        # the queue changed: the loop plans again rather than sleep if this step comes out empty (regression: a
        # verify step's one drafted request preempted itself, the step was empty, and the loop slept with a request
        # that drafts nothing still in decode, scheduler/speculative.py `split`, until another request arrived)
        eng.wake_idle()

    def _head_still_blocked(self) -> bool:
        """Whether the queue's head is the request the last prefill pass found no L1 room for, and no room
        came since. Room comes back as requests finish (then the chain ends and the head is tried again);
        until then a tick would only try it in vain. (Regression: it ended the chain every step.) Under "lpm"
        the head is whichever request that pass stopped at, while it still waits. The room that counts is the
        head's: beside its L1 prefix (as `_admit` counts it), which another request may have locked since, so
        the room overall fell while the head's grew (regression, session 54: a chain went on past a head that
        fit, one CI run in ~12)."""
        blocked, waiting = self.memory_blocked, self.engine.waiting
        if blocked is None or self._l1_room_pages() > blocked[1]:
            return False
        if self.engine.config.scheduling_policy == "lpm":
            head = next((req for req in waiting if req.rid == blocked[0]), None)
        else:
            head = waiting[0] if waiting[0].rid == blocked[0] else None
        if head is None:
            return False
        l1_tokens, l1_node = self._head_l1_prefix(head)
        return self._pages_after(head, l1_tokens) > self._room_beside(l1_node)

    # the queue's head and the tree its L1 prefix was last found in, (its prefill's length, L1's change count) then,
    # and that prefix (tokens, its deepest node): `_head_l1_prefix`
    _head_walk: tuple | None = None

    def _head_l1_prefix(self, head: Request) -> tuple[int, object]:
        """The L1 prefix of a waiting head (tokens, its deepest node), walked again only once L1 changed: the head is
        checked at each chained decode step while it waits, and a walk copies and compares its whole prompt
        (regression, session 76's hunt: 0.6 ms of host time a decode step for a 32k-token prompt L1 holds)."""
        tree, kept = self.cache.tree, self._head_walk
        if kept is None or kept[0] is not head or kept[1] is not tree or kept[2] != self._walked_when(head):
            m = tree.match(self._reusable(head), include_storage=False, touch=False)
            # (the count read after the walk: it may split a node)
            kept = self._head_walk = head, tree, self._walked_when(head), (m.lengths[Tier.L1], m.handles[Tier.L1])
        return kept[3]

    def _l1_held(self, req: Request) -> int:
        """How many of `_reusable(req)`'s tokens L1 holds, read only and without copying them: the queue's order under
        "lpm" (admission.py `_admission_order`) at each prefill pass, walked again only once L1 changed (regression,
        session 76's hunt: 9.5 ms of the event loop a pass for 128 queued requests of an 8k-token prefix L1 holds)."""
        if req.lpm_held is None or req.lpm_held[0] != self._walked_when(req):
            held = (self.cache.tree.resident_tokens(req.cache_prefill, Tier.L1, end=req.prefill_len - 1)
                    if self._reuses(req) else 0)
            req.lpm_held = self._walked_when(req), held
        return req.lpm_held[1]

    def _walked_when(self, req: Request) -> tuple[int, int]:
        """What a walk of `req`'s prefill down L1 depends on that may change while it waits: its prefill's length
        (a preemption folds its output in) and L1's residency (`RadixTree.changes`)."""
        return req.prefill_len, self.cache.tree.changes[Tier.L1]

    def _log_overcommit(self, req: Request) -> None:
        """A running request cannot get a page it had reserved and nothing pending will free one:
        L1 was promised twice. What the promise rested on, for the post-mortem."""
        cache, running = self.cache, self.engine.running
        cache.metrics.count_failure("l1_overcommit")
        log.error("l1_overcommit", rid=req.rid, reserved_pages=self.reserved_pages,
                  reserved_by_running=sum(r.reserved_pages for r in running),
                  free_pages=cache.l1.allocator.num_free, evictable_pages=cache.tree.evictable_pages(Tier.L1),
                  running=len(running), parked=len(self.engine.parked), waiting=len(self.engine.waiting),
                  request_pages=len(req.pages), request_reserved=req.reserved_pages)
