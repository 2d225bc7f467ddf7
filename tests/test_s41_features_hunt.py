"""Hunt over three chat / text features: vLLM's chat-template options (scheduler/api_inputs.py `chat_ids`),
include_stop_str_in_output / skip_special_tokens (scheduler/stop_strings.py) and --reasoning-parser
(scheduler/reasoning.py, scheduler/choices.py). Regressions first, then behaviours checked correct."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.reasoning import ReasoningSplitter
from scheduler.server import ServerLimits, create_app
from scheduler.stop_strings import CompletionText
from scheduler.tokenizer import ByteTokenizer, HFTokenizer, decode_completion
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

START, END, BOS = 256, 257, 258  # "<think>", "</think>", "<s>"
HI = {"role": "user", "content": "hi"}
# a thought the client started, longer than the few prompt tokens whose text was looked at for an open block
LONG_THOUGHT = "<think>\nLet me think about this question very carefully, one step after the other"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if thinking %}<think>\n{% endif %}"
            "{% for t in tags or [] %}[{{ t }}]{% endfor %}{% endif %}")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """--reasoning-parser qwen3 over a byte-level tokenizer with Qwen3's think markers (not special) and a BOS."""
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), added=("<think>", "</think>"), special=("<s>",),
                                config={"chat_template": TEMPLATE, "bos_token": "<s>"})  # (ids START, END, BOS)
    tokenizer = HFTokenizer(str(path))
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=1024))
    limits = ServerLimits(shutdown_grace_s=1.0, reasoning_parser="qwen3")
    with ServerThread(create_app(engine, limits, tokenizer=tokenizer)) as s:
        s.tokenizer = tokenizer
        yield s


def _post(s, **body) -> httpx.Response:
    body = {"messages": [HI], "max_tokens": 12, "temperature": 0, **body}
    return httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)


def _chat(s, **body) -> dict:
    r = _post(s, **body)
    assert r.status_code == 200, r.text
    return r.json()


def _chunks(s, **body) -> list[dict]:
    body = {"messages": [HI], "max_tokens": 12, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _added_up(chunks: list[dict], n: int) -> list[dict]:
    """Each choice's stream added up, in the whole response's shape."""
    out = [{"reasoning": "", "content": "", "token_ids": [], "logprobs": [], "finish_reason": None} for _ in range(n)]
    for chunk in chunks:
        for c in chunk["choices"]:
            o = out[c["index"]]
            o["reasoning"] += c["delta"].get("reasoning_content", "")
            o["content"] += c["delta"].get("content", "")
            o["token_ids"] += c["token_ids"]
            o["logprobs"] += (c["logprobs"] or {}).get("content", [])
            o["finish_reason"] = c["finish_reason"] or o["finish_reason"]
    return out


def _ending_thought_midway(s, **body) -> tuple[dict, dict]:
    """(body, choice): a bias on "</think>" that ends the thought in the middle of the answer (greedy; the
    frequency penalty keeps the random-weight model from saying it again and again)."""
    for bias in (2.0, 2.2, 2.4, 2.6, 2.8, 3.0):
        kw = {**body, "logit_bias": {str(END): bias, str(START): -100}, "frequency_penalty": 2}
        choice = _chat(s, **kw)["choices"][0]
        if END in choice["token_ids"][1:-1]:
            return kw, choice
    pytest.fail("no bias put '</think>' in the middle of the answer")


# -- regressions -----------------------------------------------------------------------------------------
def test_a_continued_long_thought_is_reasoning(srv):
    """continue_final_message on an assistant message that opened a think block: the answer goes on thinking.
    Regression: only the prompt's last 16 tokens were looked at, so a thought longer than that was not seen
    open and the answer was all content, its "</think>" in it."""
    convo = [HI, {"role": "assistant", "content": LONG_THOUGHT}]
    body, choice = _ending_thought_midway(srv, messages=convo, add_generation_prompt=False,
                                          continue_final_message=True)
    raw = decode_completion(srv.tokenizer, [], choice["token_ids"])  # the text the parser splits
    message = choice["message"]
    assert message["reasoning_content"] is not None, message
    assert message["reasoning_content"] + "</think>" + message["content"] == raw
    [streamed] = _added_up(_chunks(srv, **body), 1)
    assert (streamed["reasoning"], streamed["content"]) == (message["reasoning_content"], message["content"])


def test_a_continued_closed_thought_answers(srv):
    """(The prompt's think block closed inside the continued message: the answer is content.)"""
    convo = [HI, {"role": "assistant", "content": LONG_THOUGHT + "</think>\n\nThe answer"}]
    message = _chat(srv, messages=convo, add_generation_prompt=False, continue_final_message=True,
                    logit_bias={str(START): -100, str(END): -100})["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"]


def test_a_template_failing_on_a_kwarg_names_chat_template_kwargs(srv):
    """A template that fails on a chat_template_kwargs value (iterating an int) is the kwargs' 400, not the
    messages'. Regression: it named 'messages', which render fine."""
    r = _post(srv, chat_template_kwargs={"tags": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    r = httpx.post(srv.url + "/tokenize", json={"messages": [HI], "chat_template_kwargs": {"tags": 5}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_any_kwarg_name_is_a_template_variable(srv):
    """Regression: a kwarg named 'self' was a 400 "Template.render() got multiple values for argument 'self'"
    (the variables were passed as Python keyword arguments)."""
    plain = _chat(srv, max_tokens=1)["usage"]["prompt_tokens"]
    assert _chat(srv, max_tokens=1, chat_template_kwargs={"self": "x"})["usage"]["prompt_tokens"] == plain


def test_an_echoed_prompt_keeps_its_special_tokens_when_asked(srv):
    """skip_special_tokens false keeps special tokens' text in the choice's text, the echoed prompt's too (as
    vLLM's, which decodes token-id prompts with them). Regression: the echo dropped the prompt's "<s>" while
    the generated ones were kept."""
    hello = srv.tokenizer.encode("hello", add_special_tokens=False)
    body = {"prompt": [BOS, *hello], "max_tokens": 2, "temperature": 0, "echo": True, "logit_bias": {str(BOS): 100}}
    texts = {skip: httpx.post(srv.url + "/v1/completions", json={**body, "skip_special_tokens": skip},
                              timeout=60).json()["choices"][0]["text"] for skip in (True, False)}
    assert texts == {True: "hello", False: "<s>hello<s><s>"}


@pytest.mark.parametrize("text, want", [
    ("<think>\nabc</think>x", ("\nabc", "x")),  # the answer opened the block the prompt had opened
    ("\n<think>abc</think>x", ("abc", "x")),
    ("abc</think>x", ("abc", "x")),
    ("<thi", ("<thi", "")),  # (a marker never finished is the thought's text)
    ("a<think>b</think>c", ("a<think>b", "c")),  # (a marker after text is text)
])
def test_a_thought_the_prompt_opened_drops_a_repeated_start_marker(text, want):
    """The markers are never reasoning_content: a model that opens the block again after a prompt that opened
    it (vLLM's parsers drop that "<think>" too). Regression: it began the reasoning_content."""
    streamed = ReasoningSplitter(thinking=True)
    parts = [streamed.feed(ch) for ch in text] + [streamed.flush()]
    assert ReasoningSplitter(thinking=True).split(text) == want
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == want


# -- checked correct -------------------------------------------------------------------------------------
def test_kwargs_null_or_empty_change_nothing(srv):
    plain = _chat(srv, max_tokens=1)["usage"]["prompt_tokens"]
    for kwargs in (None, {}):
        assert _chat(srv, max_tokens=1, chat_template_kwargs=kwargs)["usage"]["prompt_tokens"] == plain
    tags = _chat(srv, max_tokens=1, chat_template_kwargs={"tags": ["ab"]})["usage"]["prompt_tokens"]
    assert tags == plain + len("[ab]")


def test_n_streams_with_a_stop_in_the_end_marker_add_up(srv):
    """n choices thinking (the prompt opens the block), a stop string inside "</think>" kept in the text,
    logprobs and usage: each choice's deltas add up to its whole response; a stop at the marker ends the
    thought with no content."""
    body = {"n": 2, "temperature": 1, "seed": 7, "max_tokens": 16, "chat_template_kwargs": {"thinking": True},
            "logit_bias": {str(END): 3, str(START): -100}, "stop": ["think>"], "include_stop_str_in_output": True,
            "logprobs": True}
    _chat(srv, **body)  # (the prompt now in L1 for both: what they cache, and the forward of its tail, the same)
    whole = _chat(srv, **body)
    chunks = _chunks(srv, **body, stream_options={"include_usage": True})
    assert chunks[-1]["usage"] == whole["usage"]
    streamed = _added_up(chunks[:-1], 2)
    for choice, s in zip(whole["choices"], streamed):
        m = choice["message"]
        # (a whole answer that only thought has content null, as vLLM's parser returns it; a stream sends none)
        assert (s["reasoning"], s["content"] or None, s["token_ids"], s["finish_reason"]) == \
            (m["reasoning_content"], m["content"], choice["token_ids"], choice["finish_reason"])
        assert s["logprobs"] == choice["logprobs"]["content"]
        if END in choice["token_ids"]:
            assert choice["finish_reason"] == "stop" and m["content"] is None
            assert "</think>" not in m["reasoning_content"]
    assert any(END in c["token_ids"] for c in whole["choices"])


def test_the_openai_sdk_reads_reasoning_content(srv):
    body, choice = _ending_thought_midway(srv, chat_template_kwargs={"thinking": True})
    extra = {k: body[k] for k in ("logit_bias", "frequency_penalty", "chat_template_kwargs")}
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as c:
        r = c.chat.completions.create(model="tiny", messages=[HI], max_tokens=12, temperature=0, extra_body=extra)
        stream = c.chat.completions.create(model="tiny", messages=[HI], max_tokens=12, temperature=0, stream=True,
                                           extra_body=extra)
        deltas = [ch.choices[0].delta for ch in stream]
    assert r.choices[0].message.reasoning_content == choice["message"]["reasoning_content"]
    assert r.choices[0].message.content == choice["message"]["content"]
    message = r.choices[0].message
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content


@pytest.mark.parametrize("text, min_tokens, want_plain, want_kept", [
    ("abab", 2, "ab", "abab"),   # the first "ab" ends within min_tokens: only the second matches
    ("xab", 2, "x", "xab"),      # a match may start within min_tokens, completed past them
    ("ab", 2, "ab", "ab"),       # never completed past them: no match, the text is all there
])
def test_include_stop_str_with_min_tokens(text, min_tokens, want_plain, want_kept):
    tok = ByteTokenizer(512)
    for include, want in ((False, want_plain), (True, want_kept)):
        ct = CompletionText(tok, [], ["ab"], min_tokens, include_stop=include)
        out = "".join(ct.feed(t) for t in tok.encode(text))
        out += ct.flush()
        assert out == want and ct.stopped == (want_plain != text)
