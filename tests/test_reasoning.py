"""`--reasoning-parser` (scheduler/reasoning.py): a chat answer's <think> block as the message's
reasoning_content, the rest as content; a stream's deltas add up to the whole response's fields."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.reasoning import ReasoningSplitter, opens_thinking
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

START, END = 256, 257  # "<think>", "</think>"


@pytest.mark.parametrize("text, thinking, want", [
    ("<think>\nhmm</think>\n\nHi", False, ("\nhmm", "\n\nHi")),
    ("\n<think>a</think>b", False, ("a", "b")),
    ("Hi, no thinking", False, (None, "Hi, no thinking")),
    ("a<think>b</think>c", False, (None, "a<think>b</think>c")),  # a marker after text is text
    ("hmm</think>Hi", True, ("hmm", "Hi")),  # the prompt opened the block
    ("<think>cut off by max_tokens", False, ("cut off by max_tokens", "")),
    ("<thin", False, (None, "<thin")),  # a marker never finished is text
    ("<think>a</thi", False, ("a</thi", "")),
    ("", False, (None, "")),
])
def test_whole_answers(text, thinking, want):
    s = ReasoningSplitter(thinking)
    reasoning, content = s.split(text)
    assert (reasoning if s.reasoned else None, content) == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "th", "ink>", "a", " ", "\n", "x</think"]),
                max_size=12), st.booleans(), st.data())
def test_any_deltas_add_up_to_the_whole_answer(pieces, thinking, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    streamed = ReasoningSplitter(thinking)
    parts = [streamed.feed(d) for d in deltas] + [streamed.flush()]
    whole = ReasoningSplitter(thinking)
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == whole.split(text)
    assert streamed.reasoned == whole.reasoned


def test_a_prompt_that_leaves_a_think_block_open():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, enable_thinking false
    assert not opens_thinking("<|im_start|>assistant\n")


# -- over HTTP, against the same engine without the parser ------------------------------------------------
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if thinking %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), added=("<think>", "</think>"),  # (as Qwen3's)
                                config={"chat_template": TEMPLATE})
    tokenizer = HFTokenizer(str(path))
    made = []
    for parser in ("qwen3", None):  # two engines of the same seed: the same answers
        engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
        made.append(ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0, reasoning_parser=parser),
                                            tokenizer=tokenizer)).__enter__())
    yield made
    for s in made:
        s.__exit__(None, None, None)


def _chat(s, **body) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0, **body}
    r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _streamed(s, **body) -> tuple[str, str]:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0, "stream": True,
            **body}
    reasoning = content = ""
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content", "")
                content += delta.get("content", "")
    return reasoning, content


def _thinking_then_answering(s) -> dict:
    """A bias on "</think>" that ends the thinking in the middle of the answer (greedy: deterministic; the
    frequency penalty keeps the random-weight model from saying it again and again)."""
    for bias in (2.0, 2.2, 2.4, 2.6, 2.8, 3.0):
        kw = {"logit_bias": {str(END): bias, str(START): -100}, "frequency_penalty": 2,
              "chat_template_kwargs": {"thinking": True}}
        ids = _chat(s, **kw)["token_ids"]
        if END in ids[1:-1]:
            return kw
    pytest.fail("no bias put '</think>' in the middle of the answer")


def test_the_thinking_is_reasoning_content_and_the_stream_adds_up(servers):
    parsed, plain = servers
    kw = _thinking_then_answering(plain)
    text = _chat(plain, **kw)["message"]["content"]
    message = _chat(parsed, **kw)["message"]
    assert "reasoning_content" not in _chat(plain, **kw)["message"]
    assert message["reasoning_content"] and message["reasoning_content"] + "</think>" + message["content"] == text
    assert "</think>" not in message["reasoning_content"]
    assert _streamed(parsed, **kw) == (message["reasoning_content"], message["content"])


def test_an_answer_that_never_thinks_is_all_content(servers):
    parsed, plain = servers
    kw = {"logit_bias": {str(START): -100, str(END): -100}}
    message = _chat(parsed, **kw)["message"]
    assert message["reasoning_content"] is None and message["content"] == _chat(plain, **kw)["message"]["content"]
    assert _streamed(parsed, **kw) == ("", message["content"])


def test_completions_are_never_split(servers):
    body = {"prompt": "hi<think>\n", "max_tokens": 8, "temperature": 0}
    texts = [httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
             for s in servers]
    assert texts[0] == texts[1]


@pytest.mark.parametrize("argv, parser", [([], None), (["--reasoning-parser", "qwen3"], "qwen3"),
                                          (["--reasoning-parser", "deepseek_r1"], "deepseek_r1")])
def test_the_flag_reaches_the_server(monkeypatch, argv, parser):
    from scheduler import serve

    seen = []

    class NoListen:  # (the app is built as hicache-serve builds it; nothing listens)
        def __init__(self, uv_config, on_exit, on_force, **more) -> None:
            self.config = uv_config  # (serve.main reads its app's state after the run)
            seen.append(uv_config.app.state.hc.limits.reasoning_parser)

        def run(self) -> None:
            pass

    monkeypatch.setattr(serve, "_Server", NoListen)
    assert serve.main(["--port", "0", "--device", "cpu", "--model", "tiny", "--max-total-tokens", "256", *argv]) == 0
    assert seen == [parser]


def test_a_guided_answer_is_all_content(servers):
    """Its grammar holds it from the first token, so it cannot think: with a prompt that opened the think block
    (regression: the whole answer came back as reasoning_content, content "")."""
    import re

    parsed, _ = servers
    message = _chat(parsed, guided_regex="[a-z]{3,6}", chat_template_kwargs={"thinking": True})["message"]
    assert message["reasoning_content"] is None and re.fullmatch("[a-z]{3,6}", message["content"]), message
