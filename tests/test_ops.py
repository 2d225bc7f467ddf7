"""The backup / restore state machines, driven directly through apply()."""
from __future__ import annotations

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from hicache.ops import (
    ACTIONS, INITIAL, PENDING_STEPS, TERMINAL, TRANSITIONS, Action, IllegalTransition, Op, OpEvent, OpKind,
    OpState, apply, mermaid_diagram, new_op, states_of,
)

K, S, E, A = OpKind, OpState, OpEvent, Action

# every successful path: (kind, [(event, expected state, expected action), ...])
HAPPY_PATHS = [
    (K.BACKUP, [(E.START, S.D2H_PENDING, A.START_D2H), (E.D2H_DONE, S.L1_L2, A.PUBLISH_L2),
                (E.START, S.H2S_PENDING, A.START_H2S), (E.H2S_DONE, S.L1_L2_L3, A.PUBLISH_L3)]),
    (K.BACKUP, [(E.START, S.D2H_PENDING, A.START_D2H), (E.D2H_DONE, S.L1_L2, A.PUBLISH_L2),
                (E.SKIP_L3, S.L1_L2_ONLY, A.NONE)]),
    (K.RESTORE_L2, [(E.START, S.H2D_PENDING, A.START_H2D), (E.H2D_DONE, S.L1_L2, A.PUBLISH_L1)]),
    (K.RESTORE_L3, [(E.START, S.S2H_PENDING, A.START_S2H), (E.S2H_DONE, S.L2_L3, A.PUBLISH_L2),
                    (E.START, S.H2D_PENDING, A.START_H2D), (E.H2D_DONE, S.L1_L2_L3, A.PUBLISH_L1)]),
    (K.PREFETCH_L3, [(E.START, S.S2H_PENDING, A.START_S2H), (E.S2H_DONE, S.L2_L3, A.PUBLISH_L2)]),
    # a verified read: its bytes land before its checksums pass
    (K.PREFETCH_L3, [(E.START, S.S2H_PENDING, A.START_S2H), (E.S2H_LANDED, S.S2H_LANDED, A.NONE),
                     (E.S2H_DONE, S.L2_L3, A.PUBLISH_L2)]),
    # taken on to L1 by its request while the checksums run
    (K.PREFETCH_L3, [(E.START, S.S2H_PENDING, A.START_S2H), (E.S2H_LANDED, S.S2H_LANDED, A.NONE),
                     (E.START, S.H2D_VERIFYING, A.START_H2D), (E.S2H_DONE, S.H2D_PENDING, A.PUBLISH_L2),
                     (E.H2D_DONE, S.L1_L2_L3, A.PUBLISH_L1)]),
]


def make(kind: OpKind, state: OpState | None = None) -> Op:
    op = new_op(7, kind, num_pages=4, num_bytes=4096, request_id="req-1", now_ns=100)
    if state is not None:
        op.state = state
    return op


def non_terminal(kind: OpKind) -> list[OpState]:
    return [s for s in states_of(kind) if s not in TERMINAL[kind]]


def test_initial_states() -> None:
    assert INITIAL == {K.BACKUP: S.L1_PRIVATE, K.RESTORE_L2: S.L2, K.RESTORE_L3: S.L3, K.PREFETCH_L3: S.L3}
    op = make(K.BACKUP)
    assert op.state is S.L1_PRIVATE and op.history == [(S.L1_PRIVATE, 100)] and not op.done


def test_terminal_sets() -> None:
    fail = {S.FAILED, S.CANCELLED}
    assert TERMINAL[K.BACKUP] == {S.L1_L2_L3, S.L1_L2_ONLY} | fail
    assert TERMINAL[K.RESTORE_L2] == {S.L1_L2} | fail
    assert TERMINAL[K.RESTORE_L3] == {S.L1_L2_L3} | fail
    assert TERMINAL[K.PREFETCH_L3] == {S.L2_L3, S.L1_L2_L3} | fail


def test_pending_steps_name_the_copy_each_state_waits_for() -> None:
    """PENDING_STEPS (documentation the drivers do not read) matches the tables: a state entered by a
    START_<copy> action waits for that copy, and one entered from it with no action (S2H_LANDED) still does."""
    tiers = {"D2H": ("l1", "l2"), "H2S": ("l2", "l3"), "S2H": ("l3", "l2"), "H2D": ("l2", "l1")}
    derived: dict[OpState, tuple[str, str]] = {}
    for kind in OpKind:
        for src, events in TRANSITIONS[kind].items():
            for event, dst in events.items():
                action = ACTIONS[kind][src][event]
                if action.name.startswith("START_"):
                    derived[dst] = tiers[action.name.removeprefix("START_")]
                elif action is Action.NONE and src in derived and dst not in TERMINAL[kind]:
                    derived[dst] = derived[src]
    assert derived == dict(PENDING_STEPS)


@pytest.mark.parametrize("kind,path", HAPPY_PATHS)
def test_happy_paths(kind: OpKind, path: list) -> None:
    op = make(kind)
    for step, (event, state, action) in enumerate(path, start=1):
        assert not op.done
        assert apply(op, event, now_ns=1000 + step, logger=structlog.get_logger("test")) is action
        assert op.state is state and op.state_entered_ns == 1000 + step
    assert op.done and op.succeeded and op.error is None
    assert [s for s, _ in op.history] == [INITIAL[kind]] + [s for _, s, _ in path]


def test_every_table_edge_is_on_a_happy_path_or_fail_cancel() -> None:
    covered = set()
    for kind, path in HAPPY_PATHS:
        state = INITIAL[kind]
        for ev, to, _ in path:
            covered.add((kind, state, ev))
            state = to
    for kind, table in TRANSITIONS.items():
        for state, events in table.items():
            assert set(events) == set(ACTIONS[kind][state])
            for event in events:
                assert event in (E.FAIL, E.CANCEL) or (kind, state, event) in covered, (kind, state, event)


@pytest.mark.parametrize("event,final", [(E.FAIL, S.FAILED), (E.CANCEL, S.CANCELLED)])
@pytest.mark.parametrize("kind", list(OpKind))
def test_fail_and_cancel_from_every_non_terminal_state(kind: OpKind, event: OpEvent, final: OpState) -> None:
    states = non_terminal(kind)
    assert INITIAL[kind] in states and len(states) >= 2
    for state in states:
        op = make(kind, state)
        with capture_logs() as logs:
            action = apply(op, event, error="disk on fire" if event is E.FAIL else None)
        assert action is A.RELEASE and op.state is final and op.done and not op.succeeded
        assert len(logs) == 1 and logs[0]["to_state"] == final.name
        if event is E.FAIL:
            assert op.error == "disk on fire" and logs[0]["error"] == "disk on fire"
            assert logs[0]["log_level"] == "warning"
        else:
            assert op.error is None and "error" not in logs[0]


def test_fail_without_message_still_records_an_error() -> None:
    op = make(K.RESTORE_L2, S.H2D_PENDING)
    apply(op, E.FAIL, logger=structlog.get_logger("test"))
    assert op.error


@pytest.mark.parametrize("kind", list(OpKind))
def test_terminal_states_accept_nothing(kind: OpKind) -> None:
    for state in TERMINAL[kind]:
        for event in OpEvent:
            op = make(kind, state)
            with capture_logs() as logs, pytest.raises(IllegalTransition) as info:
                apply(op, event)
            assert op.state is state and logs == []
            message = str(info.value)
            assert kind.name in message and state.name in message and event.name in message


@pytest.mark.parametrize("kind,state,event", [
    (K.BACKUP, S.L1_PRIVATE, E.D2H_DONE),
    (K.BACKUP, S.D2H_PENDING, E.START),
    (K.BACKUP, S.D2H_PENDING, E.H2D_DONE),
    (K.BACKUP, S.H2S_PENDING, E.SKIP_L3),
    (K.RESTORE_L2, S.L2, E.S2H_DONE),
    (K.RESTORE_L2, S.H2D_PENDING, E.SKIP_L3),
    (K.RESTORE_L3, S.L3, E.H2D_DONE),
    (K.RESTORE_L3, S.S2H_PENDING, E.H2D_DONE),
    (K.RESTORE_L3, S.L2_L3, E.SKIP_L3),
    (K.PREFETCH_L3, S.L3, E.S2H_DONE),
])
def test_illegal_events_raise(kind: OpKind, state: OpState, event: OpEvent) -> None:
    op = make(kind, state)
    history = list(op.history)
    with pytest.raises(IllegalTransition) as info:
        apply(op, event, logger=structlog.get_logger("test"))
    assert op.state is state and op.history == history
    assert (info.value.kind, info.value.state, info.value.event, info.value.op_id) == (kind, state, event, 7)


def test_op_rejects_foreign_state() -> None:
    with pytest.raises(ValueError):
        Op(op_id=1, kind=K.RESTORE_L2, state=S.L1_PRIVATE, request_id=None, num_pages=1, num_bytes=1,
           state_entered_ns=0)


def _transitions(logs: list[dict]) -> list[tuple[str, str]]:
    return [(entry["from_state"], entry["to_state"]) for entry in logs]


def test_log_sequence_of_full_backup() -> None:
    op = make(K.BACKUP)
    events = [E.START, E.D2H_DONE, E.START, E.H2S_DONE]
    with capture_logs() as logs:
        actions = [apply(op, event) for event in events]
    assert actions == [A.START_D2H, A.PUBLISH_L2, A.START_H2S, A.PUBLISH_L3]
    assert [entry["event"] for entry in logs] == ["op"] * 4
    assert [entry["op_event"] for entry in logs] == ["START", "D2H_DONE", "START", "H2S_DONE"]
    assert _transitions(logs) == [("L1_PRIVATE", "D2H_PENDING"), ("D2H_PENDING", "L1_L2"),
                                  ("L1_L2", "H2S_PENDING"), ("H2S_PENDING", "L1_L2_L3")]
    first = logs[0]
    assert first["op_id"] == 7 and first["kind"] == "backup" and first["bytes"] == 4096
    assert first["pages"] == 4 and first["request_id"] == "req-1" and first["log_level"] == "info"
    ts = [entry["ts_ns"] for entry in logs]
    assert ts == sorted(ts) and all(isinstance(t, int) and t > 0 for t in ts)
    assert [t for _, t in op.history[1:]] == ts


def test_log_sequence_of_full_l3_restore() -> None:
    op = make(K.RESTORE_L3)
    with capture_logs() as logs:
        actions = [apply(op, event) for event in (E.START, E.S2H_DONE, E.START, E.H2D_DONE)]
    assert actions == [A.START_S2H, A.PUBLISH_L2, A.START_H2D, A.PUBLISH_L1]
    assert _transitions(logs) == [("L3", "S2H_PENDING"), ("S2H_PENDING", "L2_L3"),
                                  ("L2_L3", "H2D_PENDING"), ("H2D_PENDING", "L1_L2_L3")]
    assert len(logs) == 4 and all("error" not in entry for entry in logs)


@given(kind=st.sampled_from(list(OpKind)), events=st.lists(st.sampled_from(list(OpEvent)), max_size=12))
def test_random_event_sequences_follow_the_table(kind: OpKind, events: list[OpEvent]) -> None:
    op = make(kind)
    for event in events:
        before = (op.state, list(op.history), op.error)
        expected = TRANSITIONS[kind].get(op.state, {}).get(event)
        with capture_logs() as logs:
            if expected is None:
                with pytest.raises(IllegalTransition):
                    apply(op, event)
                assert (op.state, op.history, op.error) == before and logs == []
                continue
            action = apply(op, event)
        assert op.state is expected and action is ACTIONS[kind][before[0]][event]
        assert len(logs) == 1 and _transitions(logs) == [(before[0].name, expected.name)]
        assert op.history[:-1] == before[1] and op.history[-1][0] is expected
        assert op.state in states_of(kind)
        assert op.done == (op.state not in TRANSITIONS[kind])


@pytest.mark.parametrize("kind", list(OpKind))
def test_mermaid_mentions_every_state_and_edge(kind: OpKind) -> None:
    diagram = mermaid_diagram(kind)
    assert diagram.startswith("flowchart")
    for state in states_of(kind):
        assert state.name in diagram
    for state, events in TRANSITIONS[kind].items():
        for event, next_state in events.items():
            assert f"{state.name} -->|{event.name}" in diagram
    nodes = {line.split("[")[0].split("(")[0].strip() for line in diagram.splitlines()[2:] if "-->" not in line}
    assert nodes == {s.name for s in states_of(kind)}


def test_transitions_build_no_event_when_nothing_receives_it(monkeypatch) -> None:
    """Under the quiet configuration (tests/conftest.py) a transition builds no info event; a
    failure still logs its warning, and under capture_logs every transition is seen."""
    called = []
    monkeypatch.setattr(structlog, "get_logger", lambda *a: called.append(a) or structlog.PrintLogger())
    op = make(K.RESTORE_L2)
    apply(op, E.START)
    assert called == [] and op.state is S.H2D_PENDING  # the state machine moved all the same
    monkeypatch.undo()
    with capture_logs() as logs:
        apply(op, E.FAIL, error="boom")
    assert [(e["event"], e["log_level"], e.get("error")) for e in logs] == [("op", "warning", "boom")]
