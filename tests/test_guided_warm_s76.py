"""Session 76: the server's start builds structured outputs' tokenizer off the loop (`Guides.warm`, in an executor whose
future no one awaits). A failure other than the RequestError it expects (here a tokenizer object of the caller's own,
which llguidance's form cannot be built from) stayed in that future: asyncio reported "Future exception was never
retrieved", with its traceback, as an error when the future was collected. It is now logged as a warning; the first
guided request still says why (a 500, as before: the server's tokenizer)."""
from __future__ import annotations

import gc

import httpx

from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import ByteTokenizer
from server_fixtures import tiny_config
from test_server import ServerThread


class OwnTokenizer:
    """A caller's tokenizer: the byte-level one's text and ids, but none of the classes structured outputs know."""

    def __init__(self, vocab_size: int) -> None:
        self._bytes = ByteTokenizer(vocab_size)
        self.vocab_size = vocab_size

    def __getattr__(self, name):
        return getattr(self._bytes, name)


def test_a_warm_up_that_fails_otherwise_leaves_no_future_exception_never_retrieved():
    engine = Engine(tiny_config(max_new_tokens_limit=8))
    reported: list[str] = []
    srv = ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=OwnTokenizer(512)))
    srv.loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    with srv:
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text
        guided = httpx.post(srv.url + "/v1/completions", timeout=60,
                            json={"prompt": "hi", "max_tokens": 2, "guided_regex": "a+"})
        assert guided.status_code == 500, guided.text  # (the first guided request says why, as before)
    gc.collect()  # (a done future that held an exception no one read is reported as it is collected)
    assert not [m for m in reported if "never retrieved" in m], reported
