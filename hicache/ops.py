"""Backup / restore operations as state machines written as data (the brief's DESIGN.md section 6,
../shared/DESIGN.md; docs/design.md here).

The legal transitions are one table, `TRANSITIONS[kind][state][event] -> next state`, with the
driver's step beside it in `ACTIONS[kind][state][event] -> Action`. `apply()` is the only place
that changes an op's state: it validates against the table (one error, `IllegalTransition`), records
history, emits exactly one structlog event "op" (with the Action) and returns the Action. It does no
other I/O; a thin async driver (hicache/backups.py, restores.py) awaits CUDA events / file futures
and feeds the results back as events. The Action names the step the driver takes inline around
that `apply()` call (it is logged and drawn by `mermaid_diagram`; no driver dispatches on the
returned value). An op that gets no pages is discarded before its first event, unregistered.

Kinds:
  BACKUP       L1_PRIVATE -START-> D2H_PENDING -D2H_DONE-> L1_L2 -START-> H2S_PENDING -H2S_DONE-> L1_L2_L3
               L1_L2 -SKIP_L3-> L1_L2_ONLY (L3 off, or admission said no)
  RESTORE_L2   L2 -START-> H2D_PENDING -H2D_DONE-> L1_L2
  RESTORE_L3   L3 -START-> S2H_PENDING -S2H_DONE-> L2_L3 -START-> H2D_PENDING -H2D_DONE-> L1_L2_L3
  PREFETCH_L3  L3 -START-> S2H_PENDING -S2H_DONE-> L2_L3   (a promotion, started when a request queues)
               S2H_PENDING -S2H_LANDED-> S2H_LANDED -S2H_DONE-> L2_L3   (a verified read: bytes landed first)
               S2H_LANDED -START-> H2D_VERIFYING -S2H_DONE-> H2D_PENDING -H2D_DONE-> L1_L2_L3
                 (taken on to L1 by the request that queued it while the read's checksums still run:
                 the H2D and the request's forward start at once; nothing is published before the
                 checksums passed, and a failed checksum fails the op, which discards that forward)
FAIL and CANCEL are legal from every non-terminal state and lead to FAILED / CANCELLED.
A state is terminal *for a kind* when the kind's table has no way out of it (`TERMINAL[kind]`):
L1_L2 ends a RESTORE_L2 but is a midpoint of a BACKUP, which is why a backup that skips L3 ends in
its own state, L1_L2_ONLY (same residency as L1_L2, but finished).

Ownership rule (what the driver does for each Action):
  * START_x: lock the step's source handle in its tier (it cannot be evicted or reused) and reserve
    private destination pages (owned by the op, by no tree node and by no free list), then launch.
  * PUBLISH_x: only after the step's event/future succeeded: hand the private destination pages to
    the tree (they stop being the op's), then unlock the step's source. Publication precedes any
    request's cached_len update, except an overlapped admission's (scheduler/restoring.py
    `_admit_overlapped`): there the request's pages [locked_len, cached_len) are the op's still
    private L1 pages, and its forward's output counts only after `adopt_restored`.
  * RELEASE (after FAIL / CANCEL): return only the still-private pages and unlock held sources;
    published pages are never freed. A copy already enqueued cannot be recalled: wait for it to
    settle before reusing its pages (shielded from cancellation).
  * In RESTORE_L3, PUBLISH_L2 after S2H hands the promoted L2 pages to the tree and clears the op's
    private claim on them *before* H2D starts, so a later H2D failure cannot free published pages.
    A prefetch taken on to L1 publishes its L2 pages while its H2D may still read them: it locks
    them in L2 at once, and keeps any duplicate (another op published the same tokens first) in
    its claim until the H2D settled.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import structlog

from hicache.log_gate import info_enabled, log_anyway


class OpKind(enum.Enum):
    BACKUP = "backup"            # L1 -> L2 (-> L3), write-through or write-back
    RESTORE_L2 = "restore_l2"    # L2 -> L1
    RESTORE_L3 = "restore_l3"    # L3 -> L2 -> L1
    PREFETCH_L3 = "prefetch_l3"  # L3 -> L2, or on to L1 when its request takes it on (take_to_l1)


class OpState(enum.Enum):
    L1_PRIVATE = "l1_private"    # data only in L1, not yet backed up
    D2H_PENDING = "d2h_pending"
    L1_L2 = "l1_l2"
    L1_L2_ONLY = "l1_l2_only"    # backup finished without L3
    H2S_PENDING = "h2s_pending"
    L1_L2_L3 = "l1_l2_l3"
    L2 = "l2"
    H2D_PENDING = "h2d_pending"
    L3 = "l3"
    S2H_PENDING = "s2h_pending"
    S2H_LANDED = "s2h_landed"    # the read's bytes are in L2 (private), its checksums still running
    H2D_VERIFYING = "h2d_verifying"  # taken on to L1: H2D in flight while those checksums finish
    L2_L3 = "l2_l3"
    FAILED = "failed"
    CANCELLED = "cancelled"


class OpEvent(enum.Enum):
    START = "start"
    D2H_DONE = "d2h_done"
    H2S_DONE = "h2s_done"
    S2H_LANDED = "s2h_landed"
    S2H_DONE = "s2h_done"
    H2D_DONE = "h2d_done"
    SKIP_L3 = "skip_l3"
    FAIL = "fail"
    CANCEL = "cancel"


class Action(enum.Enum):
    START_D2H = "start_d2h"
    START_H2S = "start_h2s"
    START_S2H = "start_s2h"
    START_H2D = "start_h2d"
    PUBLISH_L2 = "publish_l2"
    PUBLISH_L3 = "publish_l3"
    PUBLISH_L1 = "publish_l1"
    RELEASE = "release"  # free still-private pages, unlock sources
    NONE = "none"


S, E, A = OpState, OpEvent, Action
# (from, event, to, action) per kind; FAIL / CANCEL rows are added for every non-terminal state.
_STEPS: dict[OpKind, tuple[tuple[OpState, OpEvent, OpState, Action], ...]] = {
    OpKind.BACKUP: (
        (S.L1_PRIVATE, E.START, S.D2H_PENDING, A.START_D2H),
        (S.D2H_PENDING, E.D2H_DONE, S.L1_L2, A.PUBLISH_L2),
        (S.L1_L2, E.START, S.H2S_PENDING, A.START_H2S),
        (S.L1_L2, E.SKIP_L3, S.L1_L2_ONLY, A.NONE),
        (S.H2S_PENDING, E.H2S_DONE, S.L1_L2_L3, A.PUBLISH_L3),
    ),
    OpKind.RESTORE_L2: (
        (S.L2, E.START, S.H2D_PENDING, A.START_H2D),
        (S.H2D_PENDING, E.H2D_DONE, S.L1_L2, A.PUBLISH_L1),
    ),
    OpKind.RESTORE_L3: (
        (S.L3, E.START, S.S2H_PENDING, A.START_S2H),
        (S.S2H_PENDING, E.S2H_DONE, S.L2_L3, A.PUBLISH_L2),
        (S.L2_L3, E.START, S.H2D_PENDING, A.START_H2D),
        (S.H2D_PENDING, E.H2D_DONE, S.L1_L2_L3, A.PUBLISH_L1),
    ),
    OpKind.PREFETCH_L3: (
        (S.L3, E.START, S.S2H_PENDING, A.START_S2H),
        (S.S2H_PENDING, E.S2H_DONE, S.L2_L3, A.PUBLISH_L2),
        (S.S2H_PENDING, E.S2H_LANDED, S.S2H_LANDED, A.NONE),
        (S.S2H_LANDED, E.S2H_DONE, S.L2_L3, A.PUBLISH_L2),
        (S.S2H_LANDED, E.START, S.H2D_VERIFYING, A.START_H2D),
        (S.H2D_VERIFYING, E.S2H_DONE, S.H2D_PENDING, A.PUBLISH_L2),
        (S.H2D_PENDING, E.H2D_DONE, S.L1_L2_L3, A.PUBLISH_L1),
    ),
}
del S, E, A

INITIAL: Mapping[OpKind, OpState] = MappingProxyType({
    OpKind.BACKUP: OpState.L1_PRIVATE, OpKind.RESTORE_L2: OpState.L2,
    OpKind.RESTORE_L3: OpState.L3, OpKind.PREFETCH_L3: OpState.L3,
})
# Which tiers a pending state copies between: (locked source, private destination). Documentation
# (and tests); the drivers do not read it.
PENDING_STEPS: Mapping[OpState, tuple[str, str]] = MappingProxyType({
    OpState.D2H_PENDING: ("l1", "l2"), OpState.H2S_PENDING: ("l2", "l3"),
    OpState.S2H_PENDING: ("l3", "l2"), OpState.S2H_LANDED: ("l3", "l2"),
    OpState.H2D_VERIFYING: ("l2", "l1"), OpState.H2D_PENDING: ("l2", "l1"),
})


def _build_tables():
    transitions, actions, terminal = {}, {}, {}
    for kind, steps in _STEPS.items():
        table: dict[OpState, dict[OpEvent, OpState]] = {}
        todo: dict[OpState, dict[OpEvent, Action]] = {}
        for src, event, dst, action in steps:
            table.setdefault(src, {})[event] = dst
            todo.setdefault(src, {})[event] = action
        for src in list(table):
            table[src].update({OpEvent.FAIL: OpState.FAILED, OpEvent.CANCEL: OpState.CANCELLED})
            todo[src].update({OpEvent.FAIL: Action.RELEASE, OpEvent.CANCEL: Action.RELEASE})
        reached = {dst for src, _, dst, _ in steps} | {OpState.FAILED, OpState.CANCELLED}
        transitions[kind] = MappingProxyType({s: MappingProxyType(ev) for s, ev in table.items()})
        actions[kind] = MappingProxyType({s: MappingProxyType(ev) for s, ev in todo.items()})
        terminal[kind] = frozenset(s for s in reached if s not in table)
    return MappingProxyType(transitions), MappingProxyType(actions), MappingProxyType(terminal)


TRANSITIONS: Mapping[OpKind, Mapping[OpState, Mapping[OpEvent, OpState]]]
ACTIONS: Mapping[OpKind, Mapping[OpState, Mapping[OpEvent, Action]]]
TERMINAL: Mapping[OpKind, frozenset[OpState]]
TRANSITIONS, ACTIONS, TERMINAL = _build_tables()


def states_of(kind: OpKind) -> frozenset[OpState]:
    """Every state an op of `kind` can be in."""
    return frozenset(TRANSITIONS[kind]) | TERMINAL[kind]


class IllegalTransition(Exception):
    def __init__(self, kind: OpKind, state: OpState, event: OpEvent, op_id: int | None = None) -> None:
        self.kind, self.state, self.event, self.op_id = kind, state, event, op_id
        legal = sorted(e.name for e in TRANSITIONS[kind].get(state, {}))
        super().__init__(f"op {op_id}: {kind.name} cannot take {event.name} in state {state.name} "
                         f"(legal: {', '.join(legal) or 'none, terminal'})")


@dataclass
class Op:
    """One backup / restore / prefetch. Its state changes only through `apply()`."""

    op_id: int
    kind: OpKind
    state: OpState
    request_id: str | None
    # the op's copy, in pages and bytes: a backup's D2H, then its L3 write's (the pages L3 lacks), an L2
    # restore's H2D; for the L3 kinds the pages of l3 - min(l1, l2) tokens (its read or its H2D,
    # whichever is longer)
    num_pages: int
    num_bytes: int
    state_entered_ns: int
    history: list[tuple[OpState, int]] = field(default_factory=list)
    error: str | None = None
    payload: dict[str, Any] = field(default_factory=dict)  # the driver's own data (handles, pages)

    def __post_init__(self) -> None:
        if self.state not in states_of(self.kind):
            raise ValueError(f"{self.state.name} is not a state of {self.kind.name}")
        if self.num_pages < 0 or self.num_bytes < 0:
            raise ValueError("num_pages and num_bytes must be >= 0")
        if not self.history:
            self.history.append((self.state, self.state_entered_ns))

    @property
    def done(self) -> bool:
        return self.state in TERMINAL[self.kind]

    @property
    def succeeded(self) -> bool:
        return self.done and self.state not in (OpState.FAILED, OpState.CANCELLED)


def new_op(op_id: int, kind: OpKind, *, num_pages: int, num_bytes: int,
           request_id: str | None = None, now_ns: int | None = None) -> Op:
    """An op in its kind's initial state."""
    now_ns = time.monotonic_ns() if now_ns is None else now_ns
    return Op(op_id=op_id, kind=kind, state=INITIAL[kind], request_id=request_id, num_pages=num_pages,
              num_bytes=num_bytes, state_entered_ns=now_ns)


def apply(op: Op, event: OpEvent, *, now_ns: int | None = None, error: str | None = None,
          logger: Any = None) -> Action:
    """Move `op` by `event` per the table, log one "op" event, return what the driver does next.

    Raises IllegalTransition (op unchanged, nothing logged) when the table has no such edge.
    """
    next_state = TRANSITIONS[op.kind].get(op.state, {}).get(event)
    if next_state is None:
        raise IllegalTransition(op.kind, op.state, event, op.op_id)
    action = ACTIONS[op.kind][op.state][event]
    now_ns = time.monotonic_ns() if now_ns is None else now_ns
    from_state = op.state
    op.state = next_state
    op.state_entered_ns = now_ns
    op.history.append((next_state, now_ns))
    if event is OpEvent.FAIL:
        op.error = error or "failed"
    elif error is not None:
        op.error = error
    if logger is None and event is not OpEvent.FAIL and not info_enabled():
        return action  # nothing would receive the event (hicache/log_gate.py)
    fields: dict[str, Any] = dict(
        op_id=op.op_id, kind=op.kind.value, op_event=event.name, from_state=from_state.name,
        to_state=next_state.name, action=action.name, bytes=op.num_bytes, pages=op.num_pages,
        request_id=op.request_id, ts_ns=now_ns)
    if op.error is not None and next_state in (OpState.FAILED, OpState.CANCELLED):
        fields["error"] = op.error
    if logger is None:  # a fresh lazy proxy per call: works under capture_logs with caching on
        logger = structlog.get_logger("hicache.ops")
    # (after the op moved: its driver's bookkeeping must follow whatever the log does)
    log_anyway(logger.warning if event is OpEvent.FAIL else logger.info, "op", **fields)
    return action


def mermaid_diagram(kind: OpKind) -> str:
    """A Mermaid flowchart of `kind`, drawn from TRANSITIONS / ACTIONS (edges: EVENT / ACTION)."""
    lines = ["flowchart TD", f"    begin_((begin)) --> {INITIAL[kind].name}"]
    for state in sorted(states_of(kind), key=lambda s: list(OpState).index(s)):
        shape = f"{state.name}((({state.name})))" if state in TERMINAL[kind] else f"{state.name}[{state.name}]"
        lines.append(f"    {shape}")
    for state, events in TRANSITIONS[kind].items():
        for event, next_state in events.items():
            action = ACTIONS[kind][state][event]
            label = event.name if action is Action.NONE else f"{event.name} / {action.name}"
            lines.append(f"    {state.name} -->|{label}| {next_state.name}")
    return "\n".join(lines) + "\n"
