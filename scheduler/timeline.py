"""A timeline of requests, batches and cache transfers, rebuilt from the engine's JSON-lines event log.

Every log line is a JSON object with "event" and "ts_ns" (time.monotonic_ns()). Events read here:
  request    rid, state in REQUEST_STATES; prefill_start adds prompt_tokens, hit_l1/hit_l2/hit_l3
             (tokens), restore_tier ("none"|"l2"|"l3"), restore_tokens; parked adds restore_tier and room_pages;
             prefill_waits (queued behind a request in prefill computing its prefix) adds behind (its rid),
             shared_tokens and published_tokens;
             restore_overlap_discarded drops the last admission's hits (its forward's output was
             discarded, or the request ended before taking over its restore);
             finished / aborted / failed add output_tokens (and the engine's reason, error);
             preempted (its K/V out of L1, back in the queue) and resumed (decoding again) mark a preemption.
  batch      batch_id, kind ("prefill"|"decode"|"verify"), num_seqs, num_tokens, start_ns, end_ns (once, at end).
  op         op_id, kind in OP_KINDS, from_state, to_state, bytes, pages, request_id, error: one per
             state transition (hicache.ops.apply); the first carries the op's initial state (L1_PRIVATE,
             L2, L3) as from_state. An op has ended when its last to_state is terminal for its kind
             (OP_END_STATES[kind], from hicache.ops.TERMINAL: L1_L2 ends a restore_l2, not a backup).
  occupancy  tier ("l1"|"l2"|"l3"), used_pages, capacity_pages.
  run_start  logged each time a log is opened (scheduler.logs: each engine with --log-json appends).
Other events, lines that are not JSON and known events with missing fields are skipped and counted.

A log may hold several runs, and request and op ids restart with each engine. The log is cut into
runs at each run_start line (in file order), and within a run a request or op whose id shows up
again after it ended starts a new span. A span is keyed by its id the first time the id is seen and
by "ID#N" for the N-th span of that id after (`RequestSpan.key`, `OpSpan.key`). A span its run left
open (a crashed or stopped run) ends at that run's last event (`Timeline.open_end_ns`), not in a
later run.

Outputs (scheduler/timeline_views.py): plain / rich tables, Chrome trace-event JSON (Perfetto,
chrome://tracing) and a Gantt PNG.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hicache.ops import TERMINAL, OpKind
from scheduler.logs import RUN_START_EVENT

REQUEST_STATES = ("queued", "parked", "prefill_waits", "prefill_start", "prefill_end", "first_token", "finished",
                  "aborted", "failed", "restore_overlap_discarded", "preempted", "resumed")
REQUEST_END_STATES = frozenset({"finished", "aborted", "failed"})
OP_KINDS = tuple(k.value for k in OpKind)  # backup, restore_l2, restore_l3, prefetch_l3
OP_END_STATES: dict[str, frozenset[str]] = {k.value: frozenset(s.name for s in TERMINAL[k]) for k in OpKind}
TIERS = ("l1", "l2", "l3")
# Name of the phase a request is in after each state.
REQUEST_PHASES = {"queued": "queued", "parked": "parked (restore)",
                  "prefill_waits": "queued (its prefix computed by another)", "prefill_start": "prefill",
                  "prefill_end": "prefilled", "first_token": "decode", "restore_overlap_discarded": "queued",
                  "preempted": "queued (preempted)", "resumed": "decode"}


@dataclass
class RequestSpan:
    rid: str
    states: list[tuple[str, int]] = field(default_factory=list)  # (state, ts_ns) in log order
    prompt_tokens: int | None = None
    hit_tokens: dict[str, int] = field(default_factory=dict)  # tier -> tokens, from prefill_start
    restore_tier: str | None = None
    restore_tokens: int | None = None
    output_tokens: int | None = None
    end_reason: str | None = None  # the engine's reason / error on finished, aborted, failed
    key: str | None = None  # unique in the timeline: rid, or "rid#N" for the N-th span of a reused rid
    run: int = 0  # index of the run (run_start segment of the log) it belongs to

    def __post_init__(self) -> None:
        self.key = self.rid if self.key is None else self.key

    def first_ns(self, state: str, after_ns: int | None = None) -> int | None:
        return next((t for s, t in self.states if s == state and (after_ns is None or t >= after_ns)), None)

    @property
    def arrival_ns(self) -> int:
        return self.states[0][1]

    @property
    def end_ns(self) -> int | None:
        return self.states[-1][1] if self.states[-1][0] in REQUEST_END_STATES else None

    def close_ns(self, open_end_ns: int) -> int:
        """Where the request's span ends: its end state, or `open_end_ns` if it never ended."""
        return self.end_ns if self.end_ns is not None else max(open_end_ns, self.states[-1][1])

    def phase_spans(self, open_end_ns: int) -> list[tuple[str, int, int]]:
        """(phase, start_ns, end_ns): each state in REQUEST_PHASES lasts until the next state."""
        ends = [t for _, t in self.states[1:]] + [self.close_ns(open_end_ns)]
        return [(REQUEST_PHASES[s], t, e) for (s, t), e in zip(self.states, ends) if s in REQUEST_PHASES]

    @property
    def final_state(self) -> str:
        return self.states[-1][0] if self.end_ns is not None else "running"

    def _between_ns(self, a: int | None, b: int | None) -> int | None:
        return None if a is None or b is None else b - a

    @property
    def queue_wait_ns(self) -> int | None:
        return self._between_ns(self.first_ns("queued"), self.first_ns("prefill_start"))

    @property
    def restore_wait_ns(self) -> int | None:  # the first admission's, as the hits and restore tier shown beside it
        # (regression: a resumption's park after a preemption was shown as the first admission's restore wait)
        parked_ns, preempted_ns = self.first_ns("parked"), self.first_ns("preempted")
        if parked_ns is None or (preempted_ns is not None and parked_ns > preempted_ns):
            return None
        return self._between_ns(parked_ns, self.first_ns("prefill_start", parked_ns))

    @property
    def prefill_ns(self) -> int | None:  # first prefill_start to its first token's prefill_end (logged with the
        # first token: the last before it), not a preempted request's resumption's
        first = self.first_ns("first_token")
        ends = [t for s, t in self.states if s == "prefill_end" and (first is None or t <= first)]
        return self._between_ns(self.first_ns("prefill_start"), ends[-1] if ends else None)

    @property
    def preemptions(self) -> int:
        return sum(s == "preempted" for s, _ in self.states)

    def preempted_ns(self, open_end_ns: int) -> int | None:
        """Time spent preempted: from each preemption to the request's next resumption (to its end, or to
        `open_end_ns`, if it never resumed). None if it was never preempted."""
        if not self.preemptions:
            return None
        total_ns, since_ns = 0, None
        for s, t in self.states:
            if s == "preempted" and since_ns is None:
                since_ns = t
            elif s in ("resumed", *REQUEST_END_STATES) and since_ns is not None:
                total_ns, since_ns = total_ns + t - since_ns, None
        return total_ns if since_ns is None else total_ns + self.close_ns(open_end_ns) - since_ns

    @property
    def first_token_ns(self) -> int | None:  # from arrival
        return self._between_ns(self.arrival_ns, self.first_ns("first_token"))

    @property
    def finish_ns(self) -> int | None:  # from arrival
        return self._between_ns(self.arrival_ns, self.end_ns)


@dataclass
class OpSpan:
    op_id: int
    kind: str
    initial_state: str
    request_id: str | None = None
    transitions: list[tuple[str, int]] = field(default_factory=list)  # (to_state, ts_ns)
    num_bytes: int | None = None
    num_pages: int | None = None
    error: str | None = None
    key: int | str | None = None  # unique in the timeline: op_id, or "op_id#N" for the N-th span of a reused id
    run: int = 0  # index of the run (run_start segment of the log) it belongs to

    def __post_init__(self) -> None:
        self.key = self.op_id if self.key is None else self.key

    @property
    def start_ns(self) -> int:
        return self.transitions[0][1]

    @property
    def ended(self) -> bool:
        return self.transitions[-1][0] in OP_END_STATES[self.kind]

    @property
    def outcome(self) -> str:
        last = self.transitions[-1][0]
        return {"FAILED": "failed", "CANCELLED": "cancelled"}.get(last, "ok" if self.ended else "incomplete")

    def state_spans(self, open_end_ns: int) -> list[tuple[str, int, int]]:
        """(state, start_ns, end_ns) for each state the op sat in; the end state has no span, and the
        last state of an op that never ended runs to `open_end_ns`."""
        spans = [(s, t, self.transitions[i + 1][1]) for i, (s, t) in enumerate(self.transitions[:-1])]
        if not self.ended:
            s, t = self.transitions[-1]
            spans.append((s, t, max(t, open_end_ns)))
        return spans

    def end_ns(self, open_end_ns: int) -> int:
        return self.transitions[-1][1] if self.ended else max(self.transitions[-1][1], open_end_ns)


@dataclass(frozen=True)
class BatchSpan:
    batch_id: int
    kind: str
    num_seqs: int
    num_tokens: int
    start_ns: int
    end_ns: int
    run: int = 0  # index of the run it belongs to


@dataclass(frozen=True)
class OccupancySample:
    ts_ns: int
    used_pages: int
    capacity_pages: int
    run: int = 0  # index of the run it belongs to: a level holds to that run's end only


@dataclass
class Timeline:
    requests: dict[str, RequestSpan] = field(default_factory=dict)  # by RequestSpan.key, by run, then arrival
    ops: dict[int | str, OpSpan] = field(default_factory=dict)  # by OpSpan.key, by run, then start
    batches: list[BatchSpan] = field(default_factory=list)  # by start_ns
    occupancy: dict[str, list[OccupancySample]] = field(default_factory=dict)  # tier -> samples in time order
    base_ns: int = 0  # earliest timestamp seen: time zero of every output
    last_ns: int = 0  # latest timestamp seen
    run_first_ns: list[int | None] = field(default_factory=list)  # earliest timestamp of each run (None: no event)
    run_last_ns: list[int | None] = field(default_factory=list)  # latest of each run: where its open spans end
    num_runs: int = 0  # runs with at least one event (a log without run_start lines is one)
    num_unknown_events: int = 0
    num_malformed_events: int = 0
    num_bad_lines: int = 0

    def rel_ms(self, ts_ns: int) -> float:
        return (ts_ns - self.base_ns) / 1e6

    def open_end_ns(self, run: int) -> int:
        """Where a span that `run` left open ends: the run's last event. (Regression: the log's last
        event, so a crashed run's request or op ran on through every later run in the tables, the
        Chrome trace and the PNG, an hour long if the next run came an hour later.)"""
        last = self.run_last_ns[run] if 0 <= run < len(self.run_last_ns) else None
        return self.last_ns if last is None else last


def read_events(path: str | Path, *, bad_lines: list[int] | None = None) -> list[dict]:
    """The JSON objects of a log, in file order. Lines that are not JSON objects are skipped; their
    1-based numbers are appended to `bad_lines` when given."""
    events: list[dict] = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, UnicodeDecodeError, RecursionError):  # (also valid JSON Python will not read: a
                obj = None  # huge int, or nested past its decoder: regression, a traceback out of scripts/timeline.py)
            if isinstance(obj, dict):
                events.append(obj)
            elif bad_lines is not None:
                bad_lines.append(line_no)
    return events


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _opt_int(x: object) -> int | None:
    return x if _int(x) else None


def _span_key(span_id: int | str, nth: int) -> int | str:
    return span_id if nth == 1 else f"{span_id}#{nth}"


@dataclass
class _Builder:
    """The timeline being built and the spans still open in the current run, by id."""
    tl: Timeline
    run: int = 0
    open_requests: dict[str, RequestSpan] = field(default_factory=dict)
    open_ops: dict[int, OpSpan] = field(default_factory=dict)
    spans_per_id: dict[tuple[str, int | str], int] = field(default_factory=dict)  # ("request"|"op", id) -> spans

    def start_run(self, run: int) -> None:
        self.run = run
        self.open_requests.clear()
        self.open_ops.clear()

    def _next_key(self, family: str, span_id: int | str, taken: dict) -> int | str:
        nth = self.spans_per_id.get((family, span_id), 0) + 1
        while _span_key(span_id, nth) in taken:  # an id that looks like "x#2" itself
            nth += 1
        self.spans_per_id[(family, span_id)] = nth
        return _span_key(span_id, nth)

    def request_span(self, rid: str) -> RequestSpan:
        """The open span of `rid`, or a new one if it has none in this run or its last one ended."""
        req = self.open_requests.get(rid)
        if req is None or req.end_ns is not None:
            req = RequestSpan(rid, key=self._next_key("request", rid, self.tl.requests), run=self.run)
            self.open_requests[rid] = self.tl.requests[req.key] = req
        return req

    def op_span(self, op_id: int, kind: str, initial_state: str) -> OpSpan:
        """The open span of `op_id`, or a new one if it has none in this run, ended or is of another kind."""
        op = self.open_ops.get(op_id)
        if op is None or op.ended or op.kind != kind:
            op = OpSpan(op_id, kind, initial_state, key=self._next_key("op", op_id, self.tl.ops), run=self.run)
            self.open_ops[op_id] = self.tl.ops[op.key] = op
        return op


def _add_request(b: _Builder, e: dict) -> bool:
    rid, state = e.get("rid"), e.get("state")
    if not isinstance(rid, str) or state not in REQUEST_STATES:
        return False
    req = b.request_span(rid)
    req.states.append((state, e["ts_ns"]))
    req.prompt_tokens = req.prompt_tokens if req.prompt_tokens is not None else _opt_int(e.get("prompt_tokens"))
    tier = e.get("restore_tier") if isinstance(e.get("restore_tier"), str) else None
    if state == "prefill_start" and req.first_ns("preempted") is None:  # hits and the tier actually restored:
        # the last admission's (after a discarded overlapped restore the request is admitted again, restoring
        # nothing; regression: the first one's restore was shown); a preempted request's resumption hits its own
        # K/V, and reports its first admission's (scheduler/reservations.py)
        req.hit_tokens = {t: e[f"hit_{t}"] for t in TIERS if _int(e.get(f"hit_{t}"))}
        req.restore_tier, req.restore_tokens = tier or req.restore_tier, _opt_int(e.get("restore_tokens"))
    elif state == "parked" and req.first_ns("prefill_start") is None:
        req.restore_tier = tier or req.restore_tier
    elif state == "restore_overlap_discarded" and req.first_ns("preempted") is None:  # as the engine does
        # (Restoring._rewind): that admission counted no hit, restored nothing (regression: kept when the request
        # ended before the next); a resumption's: its first admission's hits and restore stand (regression: its
        # restore was shown as none beside those hits)
        req.restore_tier, req.restore_tokens = "none", 0
        req.hit_tokens = {t: 0 for t in TIERS}
    elif state in REQUEST_END_STATES:
        req.output_tokens = _opt_int(e.get("output_tokens"))
        why = [str(e[k]) for k in ("reason", "error") if e.get(k) not in (None, "")]
        req.end_reason = ": ".join(why) or None
    return True


def _add_op(b: _Builder, e: dict) -> bool:
    op_id, kind, frm, to = e.get("op_id"), e.get("kind"), e.get("from_state"), e.get("to_state")
    if not _int(op_id) or kind not in OP_KINDS or not isinstance(frm, str) or not isinstance(to, str):
        return False
    op = b.op_span(op_id, kind, initial_state=frm)
    op.transitions.append((to, e["ts_ns"]))
    op.request_id = op.request_id or (e.get("request_id") if isinstance(e.get("request_id"), str) else None)
    op.num_bytes = _opt_int(e.get("bytes")) if _int(e.get("bytes")) else op.num_bytes
    op.num_pages = _opt_int(e.get("pages")) if _int(e.get("pages")) else op.num_pages
    op.error = str(e["error"]) if e.get("error") is not None else op.error
    return True


def _add_batch(b: _Builder, e: dict) -> bool:
    vals = [e.get(k) for k in ("batch_id", "num_seqs", "num_tokens", "start_ns", "end_ns")]
    if not all(_int(v) for v in vals) or not isinstance(e.get("kind"), str) or vals[4] < vals[3]:
        return False
    b.tl.batches.append(BatchSpan(vals[0], e["kind"], vals[1], vals[2], vals[3], vals[4], b.run))
    return True


def _add_occupancy(b: _Builder, e: dict) -> bool:
    tier, used, cap = e.get("tier"), e.get("used_pages"), e.get("capacity_pages")
    if not isinstance(tier, str) or not _int(used) or not _int(cap):
        return False
    b.tl.occupancy.setdefault(tier, []).append(OccupancySample(e["ts_ns"], used, cap, b.run))
    return True


_HANDLERS = {"request": _add_request, "op": _add_op, "batch": _add_batch, "occupancy": _add_occupancy}


def split_runs(events: list[dict]) -> list[list[dict]]:
    """The events of each run, in file order: a run_start line starts a new run; runs without any
    other event are left out."""
    runs: list[list[dict]] = [[]]
    for e in events:
        if e.get("event") == RUN_START_EVENT:
            runs.append([])
        else:
            runs[-1].append(e)
    return [run for run in runs if run]


def _known_events(tl: Timeline, events: list[dict]) -> list[tuple]:
    """(handler, event) of the events read here, in ts_ns order (stable); others counted in `tl`."""
    known = []
    for e in events:
        name = e.get("event")
        handler = _HANDLERS.get(name) if isinstance(name, str) else None
        if handler is None:
            tl.num_unknown_events += 1
        elif not _int(e.get("ts_ns")):
            tl.num_malformed_events += 1
        else:
            known.append((handler, e))
    known.sort(key=lambda he: he[1]["ts_ns"])
    return known


def build_timeline(events: list[dict], *, num_bad_lines: int = 0) -> Timeline:
    """Groups events by request, op, batch and tier, run by run (`split_runs`). Within a run events are
    taken in ts_ns order (stable)."""
    tl = Timeline(num_bad_lines=num_bad_lines)
    builder = _Builder(tl)
    stamps = []  # of accepted events only
    runs = split_runs(events)
    for run, run_events in enumerate(runs):
        builder.start_run(run)
        run_stamps = []
        for handler, e in _known_events(tl, run_events):
            if handler(builder, e):
                run_stamps.append(e["ts_ns"])
                if handler is _add_batch:
                    run_stamps += (e["start_ns"], e["end_ns"])
            else:
                tl.num_malformed_events += 1
        tl.run_first_ns.append(min(run_stamps, default=None))  # (None: a run of malformed events only)
        tl.run_last_ns.append(max(run_stamps, default=None))
        stamps += run_stamps
    tl.num_runs = len(runs)
    tl.batches.sort(key=lambda b: (b.start_ns, b.batch_id))
    if stamps:
        tl.base_ns, tl.last_ns = min(stamps), max(stamps)
    # run by run (in file order: a run whose clock restarted, after a reboot, still comes after the others)
    tl.requests = dict(sorted(tl.requests.items(), key=lambda kv: (kv[1].run, kv[1].arrival_ns)))
    tl.ops = dict(sorted(tl.ops.items(), key=lambda kv: (kv[1].run, kv[1].start_ns, kv[1].op_id, str(kv[0]))))
    return tl
