"""Hunt (session 44's three features), black-box over HTTP plus a few unit checks:
* vLLM's `prompt_logprobs` (scheduler/prompt_logprobs_api.py): over a chunked prefill, batches of prompts of
  different lengths with n, the echo's k beside it, the own token among the k likeliest, special tokens'
  decoded_token, raw logits whatever the request's bias / bans / grammar (tests/test_prompt_logprobs_hunt.py
  has the engine's side: slices, several ks in a batch, penalties);
* reasoning tokens in usage (scheduler/reasoning.py ReasoningTokens): an answer cut by a stop string or a stop
  token inside its thought counts the ids it returns (vLLM's count of its output ids), a stream's per-choice
  continuous usage grows to the whole response's count, Qwen3's enable_thinking false counts none;
* vLLM's per-step / per-prompt metrics (scheduler/prom.py, prom_vllm.py): two servers on one engine, a batch
  refused after some choices were queued, n choices whose client left, --simulate.
Bug found: a second ServerMetrics on an engine took the step hook over, so the first server's
vllm:iteration_tokens_total stopped counting, and the second's missed every step before it (neither agreed with
hicache_engine_batches, the engine's count it is documented to equal)."""
from __future__ import annotations

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.prom import ServerMetrics
from scheduler.request import RequestError
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from server_fixtures import ok, post, sse
from test_prom_vllm import MODEL, parse, scrape
from test_prom_vllm_iteration import run_steps, steps_observed
from test_prom_vllm_phases import _raw_stream, deltas, until
from test_prompt_logprobs_api import check_shape_and_values
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

START, END, SPECIAL = 256, 257, 258  # "<think>", "</think>" (added, as Qwen3's), "<|end|>" (special)
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if thinking %}<think>\n{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
GREEDY = {"temperature": 0, "ignore_eos": True}
HI = [{"role": "user", "content": "hi"}]
THINKING = {"chat_template_kwargs": {"thinking": True}, "logit_bias": {str(START): -100}}  # (the prompt opened it)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """The tiny engine in prefill chunks of 8 tokens, behind a byte-level tokenizer with think markers and a
    special token, --reasoning-parser qwen3, serving MODEL (the metrics helpers' label)."""
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), added=("<think>", "</think>"), special=("<|end|>",),
                                config={"chat_template": TEMPLATE})
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256, max_prefill_tokens=8,
                                 max_new_tokens_limit=400))
    limits = ServerLimits(shutdown_grace_s=1.0, reasoning_parser="qwen3", served_model_names=(MODEL,),
                          max_concurrent_requests=64)
    with ServerThread(create_app(engine, limits, tokenizer=HFTokenizer(str(path)))) as s:
        s.engine, s.tok = engine, HFTokenizer(str(path))
        yield s


def _prompt_logprobs(srv, prompt, k: int, **body) -> list:
    return ok(srv, "/v1/completions", {**GREEDY, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": k,
                                       **body})["choices"][0]["prompt_logprobs"]


# -- prompt_logprobs ----------------------------------------------------------------------------------------------
def test_a_prompt_over_three_prefill_chunks_has_every_positions_logprobs_and_rank(srv):
    ids = list(range(30, 50))  # 20 tokens: chunks of 8, 8 and 4 (each chunk's rows, then the next's)
    check_shape_and_values(srv, ids, _prompt_logprobs(srv, ids, 3), 3)


def test_a_batch_of_prompts_of_different_lengths_with_n_each_carry_their_own(srv):
    """Lengths 20, 2, 13 and 1 (a lone token: [None]) with n = 2 sampled: each choice its prompt's, chunked."""
    prompts = [list(range(30, 50)), [7, 8], list(range(100, 113)), [9]]
    body = ok(srv, "/v1/completions", {"prompt": prompts, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 3,
                                       "prompt_logprobs": 4})
    assert [c["index"] for c in body["choices"]] == list(range(8))
    for c in body["choices"]:
        check_shape_and_values(srv, prompts[c["index"] // 2], c["prompt_logprobs"], 4)
    assert body["choices"][6]["prompt_logprobs"] == [None]


def test_the_own_token_among_the_k_likeliest_is_one_key_with_its_place(srv):
    """A prompt continued by its greedy tokens: each of those is its position's likeliest, so its entry is the top
    one (rank 1, first key) and the position has k entries, not k + 1."""
    head = [5, 6, 7]
    made = ok(srv, "/v1/completions", {**GREEDY, "prompt": head, "max_tokens": 5})["choices"][0]["token_ids"]
    prompt = head + made
    plps = _prompt_logprobs(srv, prompt, 3)
    check_shape_and_values(srv, prompt, plps, 3)
    for i in range(len(head), len(prompt)):
        assert len(plps[i]) == 3 and next(iter(plps[i])) == str(prompt[i]) and plps[i][str(prompt[i])]["rank"] == 1


@pytest.mark.parametrize("extra", [{"logit_bias": {"17": 100, "8": -100}}, {"allowed_token_ids": [1, 2, 3]},
                                   {"bad_words": ["a"]}, {"guided_regex": "[a-z]+"}])
def test_prompt_logprobs_are_of_the_raw_logits_whatever_the_request_adjusts(srv, extra):
    """vLLM's are the model's own distribution: a request's bias, bans and grammar leave them as they are (its
    sampling only; penalties and min_tokens: tests/test_prompt_logprobs_hunt.py, on the engine)."""
    ids = [5, 300, 17, 42, 499, 8, 8, 8]
    assert _prompt_logprobs(srv, ids, 2, **extra) == _prompt_logprobs(srv, ids, 2)


@pytest.mark.parametrize("echo_k, prompt_k", [(0, 3), (3, 0), (2, 7), (5, 5)])
def test_an_echo_shows_its_own_k_beside_prompt_logprobs(srv, echo_k, prompt_k):
    text = "the quick brown fox"
    body = {**GREEDY, "prompt": text, "max_tokens": 2, "echo": True, "logprobs": echo_k}
    both = ok(srv, "/v1/completions", {**body, "prompt_logprobs": prompt_k})["choices"][0]
    alone = ok(srv, "/v1/completions", body)["choices"][0]
    assert both["logprobs"] == alone["logprobs"] and both["text"] == alone["text"]
    check_shape_and_values(srv, srv.tok.encode(text), both["prompt_logprobs"], prompt_k)


def test_max_tokens_0_is_the_prefill_alone_with_echo_only(srv):
    """With echo: the prompt, its prompt_logprobs, no completion tokens; without: vLLM's 400 (max_tokens >= 1),
    though the engine takes 0 for a request that asks prompt logprobs."""
    text = "jumps over"
    body = ok(srv, "/v1/completions", {**GREEDY, "prompt": text, "max_tokens": 0, "echo": True, "prompt_logprobs": 2})
    [choice] = body["choices"]
    assert choice["text"] == text and choice["logprobs"] is None and body["usage"]["completion_tokens"] == 0
    check_shape_and_values(srv, srv.tok.encode(text), choice["prompt_logprobs"], 2)
    r = post(srv, "/v1/completions", {"prompt": text, "max_tokens": 0, "prompt_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_a_truncated_salted_prompts_are_its_kept_tokens(srv):
    text = "hello world, again"
    kept = srv.tok.encode(text)[-5:]
    plps = _prompt_logprobs(srv, text, 2, truncate_prompt_tokens=5, cache_salt="s")
    check_shape_and_values(srv, kept, plps, 2)


def test_special_and_added_tokens_are_decoded_as_they_are(srv):
    """decoded_token of a special token is its text (vLLM decodes each id alone, special tokens kept)."""
    ids = [65, START, SPECIAL, END, 66]
    plps = _prompt_logprobs(srv, ids, 0)
    assert [p[str(t)]["decoded_token"] for p, t in zip(plps[1:], ids[1:])] == ["<think>", "<|end|>", "</think>",
                                                                              srv.tok.decode([66])]


def test_the_responses_api_refuses_prompt_logprobs_as_an_unknown_field(srv):
    """vLLM's Responses API has no prompt_logprobs: a 400 naming it, not a field silently dropped."""
    r = post(srv, "/v1/responses", {"input": "hi", "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


# -- reasoning tokens ---------------------------------------------------------------------------------------------
def _chat(srv, **body) -> dict:
    return ok(srv, "/v1/chat/completions", {"messages": HI, "max_tokens": 16, "temperature": 0, **body})


def _stop_inside(srv) -> tuple[str, int]:
    """A stop string one token of the greedy thought spells (an ASCII character it has not written before), and
    that token's place."""
    ids = _chat(srv, **THINKING)["choices"][0]["token_ids"]
    assert END not in ids  # (all thought: the prompt opened the block, the answer never closes it)
    for k in range(2, len(ids)):
        piece = srv.tok.decode([ids[k]])
        if len(piece) == 1 and piece.isalnum() and piece not in srv.tok.decode(ids[:k]):
            return piece, k
    pytest.fail(f"no stop string in {ids}")


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_inside_the_thought_counts_the_ids_returned(srv, include):
    """The thought cut by a stop string: usage counts the ids the answer returns (through the one that completed
    the match, vLLM's), all reasoning; the stream's final usage says the same."""
    stop, k = _stop_inside(srv)
    body = {**THINKING, "stop": [stop], "include_stop_str_in_output": include}
    whole = _chat(srv, **body)
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "stop" and len(choice["token_ids"]) == k + 1
    assert choice["message"]["reasoning_content"].endswith(stop) == include
    usage = whole["usage"]
    assert usage["completion_tokens"] == k + 1 and usage["completion_tokens_details"] == {"reasoning_tokens": k + 1}
    chunks = sse(srv, "/v1/chat/completions", {"messages": HI, "max_tokens": 16, "temperature": 0, **body,
                                               "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens_details"] == usage["completion_tokens_details"]


def test_a_stop_token_inside_the_thought_is_counted_as_returned(srv):
    ids = _chat(srv, **THINKING)["choices"][0]["token_ids"]
    body = _chat(srv, **THINKING, stop_token_ids=[ids[6]])
    returned = body["choices"][0]["token_ids"]
    assert returned == ids[:ids.index(ids[6]) + 1]
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(returned)}


def test_n_streamed_choices_continuous_usage_grows_to_each_ones_count(srv):
    """n = 3 with continuous_usage_stats: each chunk's usage is its choice's so far (vLLM's), its reasoning tokens
    never shrinking nor past its completion tokens, ending at that choice's count; the last chunk's usage is the
    whole response's (their sum)."""
    body = {"messages": HI, "n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 16,
            "chat_template_kwargs": {"thinking": True}, "logit_bias": {str(END): 3.0, str(START): -100}}
    whole = ok(srv, "/v1/chat/completions", body)
    thoughts = [ids.index(END) if END in ids else len(ids) for ids in (c["token_ids"] for c in whole["choices"])]
    assert len(set(thoughts)) > 1
    chunks = sse(srv, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True,
                                                                           "continuous_usage_stats": True}})
    seen: dict[int, list[tuple[int, int]]] = {}
    for chunk in chunks[:-1]:
        [c] = chunk["choices"]
        u = chunk["usage"]
        seen.setdefault(c["index"], []).append((u["completion_tokens"], u["completion_tokens_details"]["reasoning_tokens"]))
    for i, counts in seen.items():
        assert all(r <= t for t, r in counts) and [r for _, r in counts] == sorted(r for _, r in counts), counts
        assert counts[-1][1] == thoughts[i]
    assert chunks[-1]["usage"]["completion_tokens_details"] == whole["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": sum(thoughts)}


def test_enable_thinking_false_counts_no_reasoning(srv):
    """Qwen3's template closes an empty think block in the prompt: the answer is content, none of it counted."""
    body = _chat(srv, chat_template_kwargs={"enable_thinking": False}, logit_bias={str(START): -100})
    assert body["choices"][0]["message"].get("reasoning_content") is None
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


# -- metrics ------------------------------------------------------------------------------------------------------
def test_two_servers_on_one_engine_both_count_every_step():
    """Each server's vllm:iteration_tokens_total is the engine's steps (as hicache_engine_batches, which both
    render from the engine): a second ServerMetrics used to take the runner's hook over, so the first stopped
    counting and the second missed the steps before it."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=48))
    first = ServerMetrics(engine, MODEL)
    samples, eng = run_steps(engine, [list(range(40, 49))], max_tokens=3)  # (made a second one, the steps' hook)
    late = ServerMetrics(engine, MODEL)  # (and one made after the steps)
    for metrics in (first, late):
        count, total, _ = steps_observed(parse(metrics.render().decode())[0])
        assert (count, total) == (eng["batches"], eng["prefill_tokens"] + eng["decode_tokens"]) == (3, 9 + 2)
    assert steps_observed(samples)[:2] == (3, 11)


def test_simulated_steps_are_observed_as_the_engine_counts_them():
    """--simulate (SimRunner): chunked prefills and chained decode steps, one observation each."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, max_prefill_tokens=8,
                                 simulate=True))
    samples, eng = run_steps(engine, [list(range(100, 120)), [1, 2, 3]], max_tokens=5)
    count, total, _ = steps_observed(samples)
    assert (count, total) == (eng["batches"], eng["prefill_tokens"] + eng["decode_tokens"]) == (7, 23 + 8)


def test_a_batch_refused_after_some_choices_were_queued_observes_nothing(srv, monkeypatch):
    """The engine refuses prompt 1's first choice after prompt 0's two were queued: a 400; those two are aborted
    and no prompt's n, most tokens or finished request is observed; the next request's tally is its own."""
    real, calls = srv.engine.add_request, []

    def add_request(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RequestError("refused for the test", "prompt")
        return real(*args, **kw)

    monkeypatch.setattr(srv.engine, "add_request", add_request)
    until(srv, lambda st: not st["engine"]["running"] and not st["server"]["in_flight"])
    before, _ = scrape(srv)
    r = post(srv, "/v1/completions", {"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 300, "ignore_eos": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert len(calls) == 3  # (prompt 0's two choices were queued before)
    until(srv, lambda st: not st["engine"]["running"] and not st["engine"]["waiting"])
    monkeypatch.undo()
    after, _ = scrape(srv)
    delta = deltas(before, after)
    assert delta("vllm:request_params_n_count") == delta("vllm:request_max_num_generation_tokens_count") == 0
    assert sum(delta("vllm:request_success_total", finished_reason=f) for f in ("stop", "length", "abort", "error")) == 0
    rejected = ("hicache_requests_total", (("outcome", "rejected"),))
    assert after[rejected] - before[rejected] == 1
    ok(srv, "/v1/completions", {"prompt": [5, 6], "n": 3, "max_tokens": 2, "ignore_eos": True})
    delta = deltas(before, scrape(srv)[0])
    assert delta("vllm:request_params_n_count") == 1 and delta("vllm:request_params_n_sum") == 3


def test_n_choices_whose_client_left_observe_their_prompt_once(srv):
    """A stream of n = 3 whose client leaves mid-answer: three aborted engine requests, one observation of the
    prompt's n and most tokens (hicache's rule: whatever its end; vLLM records none for a client's abort)."""
    until(srv, lambda st: not st["engine"]["running"] and not st["server"]["in_flight"])
    before, _ = scrape(srv)
    sock = _raw_stream(srv, {"prompt": [11, 12, 13], "n": 3, "max_tokens": 400, "ignore_eos": True})
    try:
        seen = b""
        while seen.count(b"data: ") < 6:
            seen += sock.recv(65536)
    finally:
        sock.close()
    until(srv, lambda st: not st["engine"]["running"] and not st["server"]["in_flight"])
    delta = deltas(before, scrape(srv)[0])
    assert delta("vllm:request_success_total", finished_reason="abort") == 3
    assert delta("vllm:request_params_n_count") == 1 and delta("vllm:request_params_n_sum") == 3
    assert delta("vllm:request_max_num_generation_tokens_count") == 1
    assert 0 < delta("vllm:request_max_num_generation_tokens_sum") < 400
