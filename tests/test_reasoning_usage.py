"""Reasoning tokens in usage (--reasoning-parser, scheduler/reasoning.py's `ReasoningTokens`): a Response's
`output_tokens_details.reasoning_tokens` and a chat's `completion_tokens_details.reasoning_tokens` (vLLM's, with a
parser only) are the answer's token ids inside its think block: after "<think>" (or from the first token where the
prompt opened the block) up to "</think>", the markers not counted. They were always 0. A stream's final usage
carries the whole response's count; n choices' counts add up."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.reasoning import ReasoningSplitter, ReasoningTokens, think_markers
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
import test_reasoning
from test_reasoning import END, START, _thinking_then_answering
from test_responses_api import TEMPLATE as RESPONSES_TEMPLATE
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

servers = test_reasoning.servers  # (the fixture: a qwen3-parsing server and a plain one, the same answers)
A, B, C, NL = "a", "b", "c", "\n"  # (one token each; the markers: START, END)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Markers of one token each (as Qwen3's), and markers spelled in bytes (7 and 8 tokens)."""
    root = tmp_path_factory.mktemp("toks")
    return {"added": HFTokenizer(str(write_byte_tokenizer(root / "added", added=("<think>", "</think>")))),
            "bytes": HFTokenizer(str(write_byte_tokenizer(root / "bytes")))}


def _count(tokenizer, ids: list[int], thinking: bool, cuts: tuple[int, ...] = ()) -> int:
    counter = ReasoningTokens(think_markers(tokenizer), thinking)
    for a, b in zip((0, *cuts), (*cuts, len(ids))):
        counter.feed(ids[a:b])
    return counter.total()


@pytest.mark.parametrize("ids, thinking, want", [
    ([START, A, B, END, C], False, 2),
    ([NL, START, A, END, C], False, 1),  # (whitespace before the marker: neither thought nor counted)
    ([A, B], False, 0),
    ([A, START, B, END, C], False, 0),  # a marker after text is text
    ([A, B, END, C], True, 2),  # the prompt opened the block: thought from the first token
    ([START, A, END, B], True, 1),  # ... and a "<think>" the answer opens it with all the same is dropped
    ([NL, A, END], True, 2),
    ([START, A, B], False, 2),  # cut off (max_tokens) inside the thought
    ([END, A], False, 0),
    ([NL], True, 1),
    ([], False, 0),
])
def test_the_ids_inside_the_think_block_are_counted(tokenizers, ids, thinking, want):
    tok = tokenizers["added"]
    ids = [t if isinstance(t, int) else tok.encode(t, add_special_tokens=False)[0] for t in ids]
    assert _count(tok, ids, thinking) == want
    assert [_count(tok, ids, thinking, (cut,)) for cut in range(len(ids) + 1)] == [want] * (len(ids) + 1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "a", " ", "\n", "<", "</", ">", "th", "ink>", "</th"]),
                max_size=14), st.booleans(), st.sampled_from(["added", "bytes"]), st.data())
def test_the_count_is_the_split_s_reasoning_in_tokens(tokenizers, pieces, thinking, kind, data):
    """The counter agrees with the text split (scheduler/reasoning.py's ReasoningSplitter) whatever the answer:
    its count is the reasoning_content's tokens (none where the answer did not think), fed whole or in parts."""
    tok = tokenizers[kind]
    ids = tok.encode("".join(pieces), add_special_tokens=False)
    splitter = ReasoningSplitter(thinking)
    reasoning, _ = splitter.split(tok.decode(ids, skip_special_tokens=False))
    want = len(tok.encode(reasoning, add_special_tokens=False)) if splitter.reasoned else 0
    cuts = tuple(sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=5))))
    assert _count(tok, ids, thinking) == want == _count(tok, ids, thinking, cuts)


def test_a_tokenizer_s_markers_are_looked_up_once(tokenizers):
    tok = tokenizers["added"]
    markers = think_markers(tok)
    assert (markers.start, markers.end) == ((START,), (END,)) and think_markers(tok) is markers
    assert len(think_markers(tokenizers["bytes"]).end) == len("</think>")


# -- chat completions: vLLM's completion_tokens_details.reasoning_tokens, with a parser only --------------------
def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(s, **body) -> dict:
    return _post(s.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                                                 "temperature": 0, **body})


def _chat_stream_usage(s, **body) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    usage = None
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


def _counts(usage: dict) -> tuple:
    """A usage's token counts but the cached ones (a repeat finds its prompt in the prefix cache)."""
    return tuple(usage.get(k) for k in ("prompt_tokens", "completion_tokens", "completion_tokens_details",
                                        "input_tokens", "output_tokens", "output_tokens_details"))


def _thought(ids: list[int]) -> int:
    """The ids a prompt-opened think block holds (the answer writes no "<think>": it is banned)."""
    return ids.index(END) if END in ids else len(ids)


def test_a_chat_s_usage_counts_its_thought_whole_and_streamed(servers):
    parsed, plain = servers
    kw = _thinking_then_answering(plain)
    ids = _chat(plain, **kw)["choices"][0]["token_ids"]
    assert 0 < ids.index(END) < len(ids) - 1
    usage = _chat(parsed, **kw)["usage"]
    assert usage["completion_tokens"] == len(ids)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": ids.index(END)}
    assert _counts(_chat_stream_usage(parsed, **kw)) == _counts(usage)
    assert "completion_tokens_details" not in _chat(plain, **kw)["usage"]  # (vLLM's: only with a parser)
    assert "completion_tokens_details" not in _chat_stream_usage(plain, **kw)


def test_an_answer_that_does_not_think_counts_none(servers):
    parsed, _ = servers
    kw = {"logit_bias": {str(START): -100, str(END): -100}}
    assert _chat(parsed, **kw)["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert _chat_stream_usage(parsed, **kw)["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_n_choices_thoughts_add_up(servers):
    parsed, _ = servers
    kw = {"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 16, "chat_template_kwargs": {"thinking": True},
          "logit_bias": {str(END): 3.0, str(START): -100}}
    body = _chat(parsed, **kw)
    counts = [_thought(c["token_ids"]) for c in body["choices"]]
    assert len(set(counts)) > 1  # (the choices differ: a sum, not one choice's count)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": sum(counts)}
    assert _chat_stream_usage(parsed, **kw)["completion_tokens_details"] == {"reasoning_tokens": sum(counts)}


# -- /v1/responses: output_tokens_details.reasoning_tokens ---------------------------------------------------------
@pytest.fixture(scope="module")
def responders(tmp_path_factory):
    """Two servers of the same engine seed (the same answers), with and without a parser; their template opens a
    think block when the first message says "think" (tests/test_responses_api.py's)."""
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), added=("<think>", "</think>"),
                                config={"chat_template": RESPONSES_TEMPLATE})
    made = []
    for parser in ("qwen3", None):
        engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
        made.append(ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0, reasoning_parser=parser),
                                            tokenizer=HFTokenizer(str(path)))).__enter__())
    yield made
    for s in made:
        s.__exit__(None, None, None)


def _respond(s, **body) -> dict:
    return _post(s.url, "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 16, **body})


def _respond_streamed(s, **body) -> dict:
    """The final event's Response (response.completed / .incomplete)."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 16, "stream": True, **body}
    last = None
    with httpx.stream("POST", s.url + "/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
    assert last["type"] in ("response.completed", "response.incomplete"), last
    return last["response"]


def _sampled_thought_then_answer(s) -> tuple[dict, list[int]]:
    """Sampling settings (a seed: a repeat repeats the answer) whose thought ends in the middle of the answer,
    and the answer's ids (its chat's, the same messages)."""
    messages = [{"role": "system", "content": "think"}, {"role": "user", "content": "hi"}]
    for seed in range(200):
        kw = {"temperature": 1.0, "seed": seed}
        ids = _post(s.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 16, **kw}
                    )["choices"][0]["token_ids"]
        if END in ids[1:-1]:
            return kw, ids
    pytest.fail("no seed ended the thought in the middle of the answer")


def test_a_response_s_thought_is_its_reasoning_tokens_whole_and_streamed(responders):
    parsed, _ = responders
    kw, ids = _sampled_thought_then_answer(parsed)
    whole = _respond(parsed, instructions="think", **kw)
    assert [item["type"] for item in whole["output"]][:2] == ["reasoning", "message"]
    usage = whole["usage"]
    assert usage["output_tokens"] == len(ids)
    assert usage["output_tokens_details"]["reasoning_tokens"] == ids.index(END)
    assert _counts(_respond_streamed(parsed, instructions="think", **kw)["usage"]) == _counts(usage)


def test_a_thought_cut_off_is_all_reasoning(responders):
    parsed, _ = responders
    kw = {"instructions": "think", "temperature": 0, "max_output_tokens": 6}
    usage = _respond(parsed, **kw)["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == _thought(
        _post(parsed.url, "/v1/chat/completions", {"messages": [{"role": "system", "content": "think"},
                                                                {"role": "user", "content": "hi"}],
                                                   "max_tokens": 6, "temperature": 0})["choices"][0]["token_ids"])
    assert usage["output_tokens_details"]["reasoning_tokens"] > 0
    assert _counts(_respond_streamed(parsed, **kw)["usage"]) == _counts(usage)


def test_a_response_without_a_thought_or_a_parser_counts_none(responders):
    parsed, plain = responders
    for s, kw in ((parsed, {}), (plain, {"instructions": "think"})):
        usage = _respond(s, temperature=0, **kw)["usage"]
        assert usage["output_tokens"] > 0 and usage["output_tokens_details"]["reasoning_tokens"] == 0
        assert _counts(_respond_streamed(s, temperature=0, **kw)["usage"]) == _counts(usage)
