"""Counters and per-direction transfer statistics of the hierarchy (DESIGN.md section 9)."""
from __future__ import annotations

from dataclasses import dataclass, field

DIRECTIONS = ("d2h", "h2d", "h2s", "s2h")
# every kind `Metrics.count_failure` is given: an L3 error (StorageError.KINDS), a failed copy, a
# driver's bug, an L3 read with no L1 room for its H2D, a running request that found no page it had
# reserved (L1 promised twice), a shared store's hints that could not be refreshed, a request whose
# logits were NaN (Admission._fail_nan), a cost model that raised as it decided or learned (CostPolicy._failed).
# Listed so /metrics exports each at 0 before it first happens.
FAILURE_KINDS = ("eio", "short", "enospc", "checksum", "timeout", "closed", "missing",
                 "transfer", "driver", "no_pages", "l1_overcommit", "hint_refresh", "nan_logits", "cost_model",
                 "request_work")
# a request's, a store's or the cost model's, not an op's end
NOT_OP_FAILURES = ("l1_overcommit", "hint_refresh", "nan_logits", "cost_model", "request_work")


@dataclass
class DirectionStats:
    num_bytes: int = 0
    count: int = 0
    recurring_s: float = 0.0     # what the cost model learns (Transfer.recurring_ns; no one-time setup)
    enqueue_s: float = 0.0
    setup_s: float = 0.0         # workspace allocation
    compute_wait_s: float = 0.0  # waiting for the work before it on the caller's stream (not recurring)
    queue_wait_s: float = 0.0
    seen_wait_s: float = 0.0     # CUDA: from the device done to a thread seeing it (not recurring)
    service_s: float = 0.0
    end_to_end_s: float = 0.0
    extents: int = 0             # L3 only: I/O calls after coalescing

    def add(self, num_bytes: int, *, enqueue_s=0.0, setup_s=0.0, compute_wait_s=0.0, queue_wait_s=0.0,
            seen_wait_s=0.0, service_s=0.0, end_to_end_s=0.0, extents=0, recurring_s=None) -> None:
        """recurring_s: the sample the cost model took (default: end to end less setup and the
        compute wait)."""
        self.num_bytes += num_bytes
        self.count += 1
        self.enqueue_s += enqueue_s
        self.setup_s += setup_s
        self.compute_wait_s += compute_wait_s
        self.queue_wait_s += queue_wait_s
        self.seen_wait_s += seen_wait_s
        self.service_s += service_s
        self.end_to_end_s += end_to_end_s
        self.recurring_s += (max(0.0, end_to_end_s - setup_s - compute_wait_s) if recurring_s is None
                             else recurring_s)
        self.extents += extents

    @property
    def gib_s(self) -> float:
        return self.num_bytes / (1 << 30) / self.recurring_s if self.recurring_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"bytes": self.num_bytes, "count": self.count, "recurring_s": self.recurring_s,
                "gib_s": self.gib_s, "enqueue_s": self.enqueue_s, "setup_s": self.setup_s,
                "compute_wait_s": self.compute_wait_s, "queue_wait_s": self.queue_wait_s,
                "seen_wait_s": self.seen_wait_s, "service_s": self.service_s,
                "end_to_end_s": self.end_to_end_s, "extents": self.extents}


@dataclass
class Metrics:
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    # prompt tokens computed by prefill (not served from a tier: with hit_tokens, a finished request's
    # prompt), counted as each chunk's output is kept (Admission.after_step): a request aborted between
    # chunks counts those that ran; an overlapped forward whose output was discarded counts nothing
    # (its rerun does), so it equals the engine's prefill_tokens less such discarded forwards and less what
    # preempted requests' resumptions compute again (the engine's preempted_recomputed_tokens)
    recomputed_tokens: int = 0
    evictions_pages: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    promotions: int = 0            # L3 -> L2 publications
    backups_started: int = 0
    backups_done: int = 0
    restores_started: int = 0      # L2 and L3 restores into L1, and prefetches taken on to L1
    restores_done: int = 0
    # L3 -> L2 prefetches: started; taken on to L1 by their request once landed (each then also counted in
    # restores_started: it ends as a restore); ended published in L2 with no request taking them on. Once
    # nothing is in flight, every op started ended once: backups_started + restores_started +
    # prefetches_started == backups_done + restores_done + prefetches_taken + prefetches_done + failures +
    # cancellations (the ops' failures: `op_failures`)
    prefetches_started: int = 0
    prefetches_taken: int = 0
    prefetches_done: int = 0
    # requests admitted to compute what a restore or prefetch of their own was to bring from L2/L3,
    # because it failed or could not start (counted by the engine, once, at admission; not when the
    # request waited and was restored after all, nor when a preempted request's resumption recomputes its own K/V)
    fallbacks: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # by kind: eio, short, checksum, transfer ...
    cancellations: int = 0
    # restore: requests admitted to recompute a hit a lower tier held, by policy (once per request,
    # however many loop turns it waited, and not again as it resumes after a preemption);
    # write_l2 / write_l3: backups refused or without a free page
    policy_skips: dict[str, int] = field(default_factory=lambda: {"restore": 0, "write_l2": 0, "write_l3": 0})
    restore_s: float = 0.0
    restore_overlapped_s: float = 0.0  # wall time decode batches ran while a restore was pending
    # L3 pages dropped after a failed read: the vanished, corrupt or unreadable ones and those the drop
    # takes with them (the rest of their tree nodes, the prefixes below); with evictions_pages["l3"],
    # what left L3 (redis: stale shared-store hints are the store's own `stale_hints_dropped`)
    storage_missing_pages: int = 0
    # L3 pages adopted as the engine started, from the index an earlier engine left on the file
    # (--hicache-storage-persist, hicache/l3_index.py)
    storage_adopted_pages: int = 0
    # pages that left each tier because a request that reused them got NaN logits (hicache/suspect.py):
    # with evictions_pages and storage_missing_pages, what left the tier
    nan_dropped_pages: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    directions: dict[str, DirectionStats] = field(
        default_factory=lambda: {d: DirectionStats() for d in DIRECTIONS})

    def count_failure(self, kind: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1

    def op_failures(self) -> int:
        """Ops that ended FAILED: the failures but those of requests and of a store's hints."""
        return sum(n for kind, n in self.failures.items() if kind not in NOT_OP_FAILURES)

    def as_dict(self) -> dict:
        return {
            "hit_tokens": dict(self.hit_tokens), "recomputed_tokens": self.recomputed_tokens,
            "evictions_pages": dict(self.evictions_pages), "promotions": self.promotions,
            "backups_started": self.backups_started, "backups_done": self.backups_done,
            "restores_started": self.restores_started, "restores_done": self.restores_done,
            "prefetches_started": self.prefetches_started, "prefetches_taken": self.prefetches_taken,
            "prefetches_done": self.prefetches_done,
            "fallbacks": self.fallbacks, "failures": dict(self.failures),
            "cancellations": self.cancellations, "policy_skips": dict(self.policy_skips),
            "restore_s": self.restore_s, "restore_overlapped_s": self.restore_overlapped_s,
            "storage_missing_pages": self.storage_missing_pages, "nan_dropped_pages": dict(self.nan_dropped_pages),
            "storage_adopted_pages": self.storage_adopted_pages,
            "directions": {d: s.as_dict() for d, s in self.directions.items()},
        }
