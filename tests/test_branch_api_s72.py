"""The API's partial branches whose other side no test took (session 72's branch-coverage hunt, area api), each pinned
as the rule it is:

- a streamed response aborts its requests on the client's disconnect only: another ASGI message (an empty
  http.request, as a server may deliver before the disconnect) neither aborts it nor ends the disconnect watch, under
  Starlette's own listener (ASGI < 2.4) and under ours (2.4) (sse_response.py);
- a verify step whose guided rows have no drafts fills their masks without llguidance's draft call, which refuses an
  empty list (guided.fill_verify_masks); a mask row's ids outside the row (negative, past the vocabulary) are left
  alone by `_clear`, not wrapped onto another token's bit nor an IndexError;
- a token-ban row whose step built no index banned nothing: its token is not failed (token_bans.sampled_banned);
- a --max-concurrent-requests place released twice is given back once (server._Slot: "released exactly once");
- the app over an engine with no loop task (shut down before the app starts) starts, and refuses a completion 503
  shutting_down (server.py's lifespan); an engine shut down under a running app fails /health and /ping the same
  way (regression: they said ok while every completion was refused);
- --log-json into a directory that does not exist yet is no problem: the directory is made (serve.py).
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from scheduler import serve
from scheduler.guided import Guides, GuidedSpec, _clear, fill_verify_masks
from scheduler.penalty_state import PenaltyState
from scheduler.server import ServerLimits, _Slot, create_app
from scheduler.token_bans import RowBans
from scheduler.tokenizer import ByteTokenizer
from test_cover_api_s72 import _call, _status_and_json
from test_mutation_s61 import _Ends, _sse
from test_server_crash_hunt import make_engine


# -- sse_response.py --------------------------------------------------------------------------------------
class _EndsOnAbort(_Ends):
    """Choices whose abort ends their stream, as a real one's does (its requests end, their events stop)."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted = asyncio.Event()

    async def abort(self) -> None:
        await super().abort()
        self.aborted.set()

    async def body(self):
        try:
            yield "data: a\n\n"
            await self.aborted.wait()
        finally:
            self.events.append("generator closed")


@pytest.mark.parametrize("spec", [None, "2.4"])
def test_only_a_disconnect_aborts_a_stream_not_another_message(spec):
    """Once the stream's first event went out, the client's receive channel says something else (an empty
    http.request), then disconnects: the stream is aborted once, after the disconnect, and ends (the watch went on
    past the first message)."""
    ends, live = _EndsOnAbort(), asyncio.Event()
    messages = [{"type": "http.request", "body": b"", "more_body": False}, {"type": "http.disconnect"}]

    async def receive():
        await live.wait()
        if not messages:
            await asyncio.Event().wait()  # (nothing more to say: cancelled when the response is done)
        message = messages.pop(0)
        ends.events.append(f"client: {message['type']}")
        return message

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            live.set()  # (the first event: the stream now waits for its next, which only the abort ends)
    _sse(ends, spec, receive, send)
    assert "TimeoutError" not in ends.events and ends.events.count("abort") == 1, ends.events
    assert ends.events.index("client: http.request") < ends.events.index("client: http.disconnect") \
        < ends.events.index("abort"), ends.events
    assert {"close", "release", "generator closed"} <= set(ends.events) and ends.events[-1] == "returned"


# -- guided.py --------------------------------------------------------------------------------------------
def test_a_verify_step_whose_guided_rows_have_no_drafts_fills_each_mask_as_alone():
    """Every guided row of the verify step has no draft (llguidance's draft call takes no empty list: it raises
    "No interpreters"): each row's mask is the one `Guide.fill_mask` gives it alone."""
    guides = Guides("tiny", 512, ())
    rows = [guides.start(GuidedSpec("regex", "[a-z]{2}[0-9]+")), guides.start(GuidedSpec("regex", "[0-9]{3}"))]
    masks = torch.zeros(len(rows), guides.words, dtype=torch.int32)
    assert fill_verify_masks(rows, [[], []], masks, []) == [[True], [True]]
    for guide, got in zip(rows, masks):
        alone = torch.zeros(guides.words, dtype=torch.int32)
        assert guide.fill_mask(alone) and torch.equal(alone, got)
    assert not torch.equal(masks[0], masks[1]) and [g.rows_allow_none for g in rows] == [[False], [False]]


def test_clearing_ids_outside_a_mask_row_leaves_it_alone():
    """Held stop ids or a stand-in EOS past the row's tokens (or negative) clear no other token's bit."""
    row = torch.full((2,), -1, dtype=torch.int32)  # 64 tokens, all allowed
    _clear(row, (-1, 64, 100, -33))
    assert row.tolist() == [-1, -1]
    _clear(row, (0, 63))
    assert row.tolist() == [-2, 0x7FFFFFFF]


# -- token_bans.py ----------------------------------------------------------------------------------------
def test_a_ban_row_whose_step_built_no_index_bans_nothing():
    """`sampled_banned` before any step applied the row's bans (no index): no token is taken for a banned one (the
    row was never masked); once the index is built, the same token is."""
    row = RowBans((5, 7), ((7,), (1, 2)), [1], PenaltyState())
    assert not row.sampled_banned(7) and not row.sampled_banned(3)
    row.index("cpu")
    assert row.sampled_banned(7) and row.sampled_banned(3) and row.sampled_banned(2) and not row.sampled_banned(5)


# -- server.py --------------------------------------------------------------------------------------------
def test_a_place_released_twice_is_given_back_once():
    gauge = SimpleNamespace(value=0, inc=lambda n: setattr(gauge, "value", gauge.value + n),
                            dec=lambda n: setattr(gauge, "value", gauge.value - n))
    st = SimpleNamespace(in_flight=0, limits=SimpleNamespace(max_concurrent_requests=8),
                         metrics=SimpleNamespace(in_flight=gauge))
    slot = _Slot(st)
    slot.add(2)
    assert st.in_flight == 3 and gauge.value == 3
    slot.release()
    slot.release()
    assert st.in_flight == 0 and gauge.value == 0


@pytest.mark.asyncio
async def test_an_app_over_an_engine_already_shut_down_starts_and_refuses_503():
    """The engine was shut down before the app's lifespan (no loop task to watch): the app starts, and a completion
    is a 503 shutting_down naming the engine's state, not a crash of the lifespan nor a 400."""
    eng = make_engine()
    await eng.start()
    await eng.shutdown()
    assert eng._loop_task is None
    app = create_app(eng, ServerLimits(shutdown_grace_s=0.0), tokenizer=ByteTokenizer(eng.vocab_size))
    async with app.router.lifespan_context(app):
        body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}).encode()
        sent = await _call(app, "/v1/completions", [{"type": "http.request", "body": body, "more_body": False}])
        status, answer = _status_and_json(sent)
        assert status == 503 and answer["error"]["code"] == "shutting_down", answer
        assert "shut down" in answer["error"]["message"] and app.state.hc.in_flight == 0


# -- serve.py ---------------------------------------------------------------------------------------------
def test_a_log_json_in_a_directory_not_there_yet_is_no_problem_and_the_directory_is_made(tmp_path):
    log = tmp_path / "new" / "deeper" / "run.jsonl"
    args = serve.build_parser().parse_args(["--device", "cpu", "--model", "tiny", "--port", "0",
                                            "--log-json", str(log)])
    assert serve._check_server_args(args) is None
    assert log.parent.is_dir() and not log.exists()


@pytest.mark.asyncio
async def test_health_fails_over_an_engine_shut_down_under_the_app():
    """A library user shuts the engine down under a running app: /health and /ping are a 503 shutting_down, as every
    completion is (regression: they said ok over an engine that refused everything)."""
    eng = make_engine()
    app = create_app(eng, ServerLimits(shutdown_grace_s=0.0), tokenizer=ByteTokenizer(eng.vocab_size))
    async with app.router.lifespan_context(app):
        ask = [{"type": "http.request", "body": b"", "more_body": False}]
        assert _status_and_json(await _call(app, "/health", ask, method="GET"))[0] == 200
        await eng.shutdown()
        for path in ("/health", "/ping"):
            status, answer = _status_and_json(await _call(app, path, ask, method="GET"))
            assert status == 503 and answer["error"]["code"] == "shutting_down", answer
