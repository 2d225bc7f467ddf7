"""What a client or an operator gets, found unpinned by session 60's mutation check of scheduler/api_auth.py,
api_admin.py, batch_api.py, api_beam_search.py and chat_answer.py: the key check's header forms and message, CORS
credentials, the reset's fields and its tier order, a refused prompt's result, beam search's parameters and its
default max_tokens, tool calls across deltas. No server: the middleware on a bare starlette app, the reset's parsing
and flushing on a fake cache."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from hicache.radix import Tier
from scheduler.api_admin import requested_tiers, reset_tiers
from scheduler.api_auth import CORSSettings, _bearer_token, install_access
from scheduler.api_models import APIError
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

KEY = "sk-s60"
ORIGIN = "http://ui.example"


def _app(**limits) -> TestClient:
    async def models(request):
        return JSONResponse({"ok": True})
    app = Starlette(routes=[Route("/v1/models", models)])
    install_access(app, SimpleNamespace(**{"api_key": None, "cors": None, **limits}))
    return TestClient(app)


# -- api_auth -------------------------------------------------------------------------------------------
def test_the_bearer_token_is_read_past_extra_spaces():
    """`Authorization: Bearer  KEY` (two spaces) carries KEY: the token is stripped after the scheme."""
    assert _bearer_token([(b"authorization", b"Bearer  " + KEY.encode())]) == KEY.encode()
    assert _bearer_token([(b"authorization", b"Basic " + KEY.encode())]) is None


def test_a_401_says_whether_the_key_was_missing_or_wrong():
    """The 401's message tells a client that sent no key from one that sent a wrong one."""
    client = _app(api_key=KEY)
    none = client.get("/v1/models")
    wrong = client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert none.status_code == wrong.status_code == 401
    assert none.json()["error"]["message"].startswith("no API key")
    assert wrong.json()["error"]["message"].startswith("a wrong API key")
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_cors_allows_credentials_only_when_asked():
    """Without --allow-credentials a CORS answer carries no Access-Control-Allow-Credentials (a page's cookies are
    not to be sent along); with it, it does."""
    def cred(allow: bool):
        client = _app(cors=CORSSettings(allowed_origins=(ORIGIN,), allow_credentials=allow))
        r = client.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        return r.headers.get("access-control-allow-credentials")
    assert cred(False) is None and cred(True) == "true"


# -- api_admin ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("query, body", [([("foo", "true")], {}), ([], {"foo": True}),
                                         ([], {"reset_external": 1})])
def test_a_reset_refuses_an_unknown_field_or_a_non_bool_flag(query, body):
    """An unknown field whose value would pass as a flag is still a 400 naming it; a body's flag is a JSON bool,
    not 1."""
    with pytest.raises(APIError) as exc:
        requested_tiers(query, body)
    assert exc.value.status == 400 and exc.value.param == (query or list(body.items()))[0][0]


def test_a_reset_reads_tiers_and_flags_as_documented():
    """Repeated `tiers` add up; tier names and query flags are read in any case, spaces around them ignored."""
    assert requested_tiers([("tiers", "l1"), ("tiers", "l3")], {}) == (Tier.L1, Tier.L3)
    assert requested_tiers([("tiers", " L2 ")], {}) == (Tier.L2,)
    assert requested_tiers([], {"tiers": ["L3"]}) == (Tier.L3,)
    assert requested_tiers([("reset_external", "True")], {}) == (Tier.L1, Tier.L2, Tier.L3)
    assert requested_tiers([("reset_external", " OFF ")], {}) == (Tier.L1, Tier.L2)


class _FakeCache:
    """What reset_tiers reads of a CacheManager: its tree's allocators and resident pages, flush_async's calls."""

    def __init__(self, tiers, resident):
        self.calls, self.resident = [], resident
        self.tree = SimpleNamespace(allocators={t: object() for t in tiers}, num_resident_pages=[0, 0, 0],
                                    num_locked_pages=[0, 0, 0])

    async def flush_async(self, tier, write_back, through_l3):
        self.calls.append((tier, write_back, through_l3))
        self.tree.num_resident_pages[tier] = self.resident[tier]
        return 10 + tier


@pytest.mark.parametrize("tiers, calls", [
    ((Tier.L1,), [(Tier.L1, True, False)]),  # L1 alone: its unsaved pages are written back to L2
    ((Tier.L3, Tier.L1), [(Tier.L1, True, True), (Tier.L3, True, True)]),  # L3 reset after: L1's writes land first
    ((Tier.L2, Tier.L1), [(Tier.L1, False, False), (Tier.L2, False, False)]),  # L2 reset too: nothing written back
])
def test_a_reset_flushes_in_tier_order_with_write_back_only_to_an_l2_that_stays(tiers, calls):
    cache = _FakeCache((Tier.L1, Tier.L2, Tier.L3), resident=[3, 2, 1])
    out = asyncio.run(reset_tiers(cache, tiers))
    assert cache.calls == calls
    assert out["pages_left"] == {t.label: [3, 2, 1][t] for t, _, _ in calls}  # (resident, locked or not)
    assert out["pages_freed"] == {t.label: 10 + t for t, _, _ in calls}


def test_without_l2_l1_is_still_written_back_where_it_can_be():
    """An engine without L2 (hicache off): the reset of l1,l2 skips l2 and flushes L1 as one of L1 alone."""
    cache = _FakeCache((Tier.L1,), resident=[0, 0, 0])
    out = asyncio.run(reset_tiers(cache, (Tier.L1, Tier.L2)))
    assert cache.calls == [(Tier.L1, True, False)] and set(out["skipped"]) == {"l2"}


# -- batch_api ------------------------------------------------------------------------------------------
def test_a_refused_prompt_s_result_counts_its_tokens_and_keeps_the_logprobs_shape():
    """A prompt the engine refuses (a token outside the vocabulary) gets a result with its error, its prompt's
    token count and, where logprobs were asked, an empty logprobs list (None where not asked), as a served one's."""
    eng = Engine(EngineConfig(model="tiny", num_pages=16, page_size=4))
    bad = [1, 2, 10 ** 6]
    asked, plain = eng.generate([bad, bad], [SamplingParams(max_tokens=2, logprobs=1), SamplingParams(max_tokens=2)])
    for r in (asked, plain):
        assert r.finish_reason == "error" and "vocabulary" in r.error and r.prompt_tokens == 3
    assert asked.logprobs == [] and plain.logprobs is None


def test_generate_inside_a_running_loop_names_generate_async():
    """Engine.generate() in a running event loop (a notebook's) is a RuntimeError pointing at generate_async."""
    eng = Engine(EngineConfig(model="tiny", num_pages=16, page_size=4))

    async def inside():
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match="generate_async"):
        asyncio.run(inside())


def test_a_tuple_of_params_is_one_per_prompt():
    """`params` as a tuple is one SamplingParams per prompt, as a list is."""
    eng = Engine(EngineConfig(model="tiny", num_pages=16, page_size=4))
    out = eng.generate([[1, 2, 3], [4, 5, 6]], (SamplingParams(max_tokens=1), SamplingParams(max_tokens=2)))
    assert [len(r.output_ids) for r in out] == [1, 2] and all(r.error is None for r in out)


# -- api_beam_search ------------------------------------------------------------------------------------
def _beams(**fields):
    from scheduler.api_beam_search import BeamSearches
    from scheduler.api_inputs import parse_prompts
    api_req, _, params = parse_prompts({"prompt": [1, 2, 3], "use_beam_search": True, **fields}, False,
                                       tokenizer=None, served_names=set(), model_name="tiny", vocab_size=512,
                                       prompt_limit=64, max_tokens_limit=32)
    return BeamSearches.of(None, api_req, params, False, 0.0)


def test_a_beam_search_takes_n_up_to_its_width_and_neutral_penalties():
    """n = MAX_BEAM_WIDTH is a search (one more is the 400); repetition_penalty 1.0 (its neutral) is fine, 1.1 not."""
    from scheduler.beam_search import MAX_BEAM_WIDTH
    assert _beams(n=MAX_BEAM_WIDTH).search_params.beam_width == MAX_BEAM_WIDTH
    with pytest.raises(APIError) as exc:
        _beams(n=MAX_BEAM_WIDTH + 1)
    assert exc.value.param == "n"
    assert _beams(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0) is not None
    with pytest.raises(APIError) as exc:
        _beams(repetition_penalty=1.1)
    assert exc.value.status == 400 and exc.value.param == "repetition_penalty"


def test_a_beam_search_s_parameters_are_the_request_s():
    """temperature left out is 0 (a deterministic search); the fields it honours reach its BeamSearchParams."""
    assert _beams().search_params.temperature == 0.0
    sp = _beams(temperature=0.5, min_tokens=2, ignore_eos=True, top_k=3, max_tokens=7).search_params
    assert (sp.temperature, sp.min_tokens, sp.ignore_eos, sp.top_k, sp.max_tokens) == (0.5, 2, True, 3, 7)


def test_a_left_out_max_tokens_fits_the_last_step_s_prompt():
    """Without max_tokens a search's is what its last step's prompt may hold: prompt + max_tokens - 1 tokens within
    max_prompt_tokens (at least 1)."""
    bs = _beams()
    bs.st = SimpleNamespace(engine=SimpleNamespace(max_prompt_tokens=10), prompt_limit=10)  # (the server's limit)
    assert bs._search_params([1] * 4).max_tokens == 7 and bs._search_params([1] * 12).max_tokens == 1
    assert bs._search_params([1] * 2).max_tokens == 9


# -- chat_answer ----------------------------------------------------------------------------------------
def _calls(answer, parts):
    deltas = [answer.feed(p) for p in parts] + [answer.flush()]
    return [(c["index"], c["function"]["name"]) for d in deltas for c in d.calls]


def test_calls_found_in_later_deltas_are_indexed_on_and_parallel_false_keeps_the_first():
    """A stream's tool_calls deltas are indexed across deltas (0, 1, ...); with parallel_tool_calls false only the
    first call is sent, also where the second comes in a later delta."""
    from scheduler.chat_answer import ChatAnswer
    parts = ['<tool_call>{"name": "f", "arguments": {}}</tool_call>', '\n<tool_call>{"name": "g", "arguments": {}}'
             '</tool_call>']
    assert _calls(ChatAnswer(None, "auto"), parts) == [(0, "f"), (1, "g")]
    assert _calls(ChatAnswer(None, "auto", single=True), parts) == [(0, "f")]


def test_a_named_call_s_first_delta_names_it_even_empty():
    """A named tool_choice's stream names its call (id, type "function", name) in its first delta, even one with
    no argument text yet; later deltas carry arguments alone, and an empty later one nothing."""
    from scheduler.chat_answer import ChatAnswer
    a = ChatAnswer(None, "named", named="f")
    first = a.feed("").calls
    assert first == [{"index": 0, "id": a._named_id, "type": "function", "function": {"name": "f", "arguments": ""}}]
    assert a.feed('{"x"').calls == [{"index": 0, "function": {"arguments": '{"x"'}}] and a.feed("").calls == []


def test_text_the_call_parser_held_at_the_end_is_content():
    """An answer ending in what might have begun a call ("<tool_ca") keeps it as content, streamed or whole."""
    from scheduler.chat_answer import ChatAnswer
    a = ChatAnswer(None, "auto")
    assert a.feed("hi <tool_ca").content + a.flush().content == "hi <tool_ca"
    assert ChatAnswer(None, "auto").whole("hi <tool_ca") == (None, "hi <tool_ca", [])


def test_with_a_reasoning_parser_an_answer_without_a_thought_has_none():
    """--reasoning-parser on, an answer with no think block: reasoning_content None (not ""), its text the content;
    the text a split held at the end (whitespace, a marker's start) goes where any text goes: a named call's
    arguments."""
    from scheduler.chat_answer import ChatAnswer
    from scheduler.reasoning import ReasoningSplitter
    assert ChatAnswer(ReasoningSplitter(), "none").whole("hello") == (None, "hello", [])
    answer = ChatAnswer(ReasoningSplitter(), "named", named="f")
    reasoning, content, calls = answer.whole(" ")
    assert (reasoning, content, [c["function"]["arguments"] for c in calls]) == (None, None, [" "])
