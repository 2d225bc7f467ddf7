"""vLLM's `prompt_logprobs: k` on /v1/completions and /v1/chat/completions (scheduler/prompt_logprobs_api.py; it
was an "unknown field" 400): per prompt position null first, then a dict keyed by token id holding the prompt's
own token and the k likeliest, each {"logprob", "rank", "decoded_token"} (rank 1: the likeliest; the own token's
counted on the device, scheduler/sampling.py `prompt_row_logprobs`). A completion's every choice carries its
prompt's; a chat's sits at the response's top level. Streamed: a 400 for k > 0 or -1 (vLLM's), 0 sends nothing.
The HTTP server on the CPU (tiny preset, the byte-level tokenizer: one token per byte of ASCII text)."""
from __future__ import annotations

import math

import pytest
import torch

from scheduler.sampling import prompt_row_logprobs
from server_fixtures import byte_level_server, ok, post, sse, tiny_config

TEXT = "the quick brown fox"
HI = [{"role": "user", "content": "hi there"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=16)) as s:
        yield s


def reference(srv, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the dense forward's logits [N, V]: row i is the distribution of token i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(srv.engine.model.forward_dense(torch.tensor(prompt)).float(), dim=-1)


def check_shape_and_values(srv, prompt: list[int], plps: list, k: int) -> None:
    """vLLM's shape, and each number the dense reference's: the own token first (its rank counted over the
    vocabulary), then the k likeliest in order (ranks 1..k; the own token, when one of them, its position)."""
    ref = reference(srv, prompt)
    assert len(plps) == len(prompt) and plps[0] is None
    for i in range(1, len(prompt)):
        pos, row, own = plps[i], ref[i - 1], prompt[i]
        top = torch.topk(row, k).indices.tolist() if k else []
        assert list(pos) == list(dict.fromkeys([str(own)] + [str(t) for t in top])), i  # keys: token ids, own first
        for key, entry in pos.items():
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            assert math.isclose(entry["logprob"], float(row[int(key)]), abs_tol=1e-4), (i, key)
            assert entry["decoded_token"] == srv.tok.decode([int(key)], skip_special_tokens=False)
        assert [pos[str(t)]["rank"] for t in top] == list(range(1, k + 1)), i
        if own not in top:  # vLLM's rank: the tokens at least as likely (itself too), here within the tolerance
            rank, value = pos[str(own)]["rank"], float(row[own])
            assert int((row > value + 1e-4).sum()) + 1 <= rank <= int((row >= value - 1e-4).sum()), i
            assert rank > k


# -- completions ------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 3])
def test_a_completion_choice_carries_the_prompts_logprobs(srv, k):
    ids = srv.tok.encode(TEXT)
    body = ok(srv, "/v1/completions", {**GREEDY, "prompt": TEXT, "max_tokens": 2, "prompt_logprobs": k})
    [choice] = body["choices"]
    check_shape_and_values(srv, ids, choice["prompt_logprobs"], k)
    assert choice["logprobs"] is None and len(choice["token_ids"]) == 2
    # the generated tokens are those of the same request without prompt_logprobs
    plain = ok(srv, "/v1/completions", {**GREEDY, "prompt": TEXT, "max_tokens": 2})["choices"][0]
    assert plain["token_ids"] == choice["token_ids"] and "prompt_logprobs" not in plain


def test_token_id_prompts_and_ranks_are_consistent(srv):
    ids = [5, 300, 17, 42, 499, 8, 8, 8]  # (ids past the tokenizer's 256 decode to "")
    plps = ok(srv, "/v1/completions", {**GREEDY, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 5})[
        "choices"][0]["prompt_logprobs"]
    check_shape_and_values(srv, ids, plps, 5)
    for i, pos in enumerate(plps[1:], 1):
        by_rank = sorted(pos.values(), key=lambda e: e["rank"])
        assert by_rank[0]["rank"] == 1 and by_rank[0]["logprob"] == max(e["logprob"] for e in pos.values())
        own = pos[str(ids[i])]
        higher = sum(e["logprob"] > own["logprob"] for e in pos.values())
        assert own["rank"] == higher + 1 or own["rank"] > 5  # within the top 5: 1 + the entries above it


def test_they_equal_the_echoed_prompts_logprobs(srv):
    """Both asked (the engine computes the larger k): each shape shows its own k of the same numbers."""
    ids = srv.tok.encode(TEXT)
    for echo_k, prompt_k in ((1, 4), (4, 1)):
        choice = ok(srv, "/v1/completions", {**GREEDY, "prompt": TEXT, "max_tokens": 0, "echo": True,
                                            "logprobs": echo_k, "prompt_logprobs": prompt_k})["choices"][0]
        lps, plps = choice["logprobs"], choice["prompt_logprobs"]
        check_shape_and_values(srv, ids, plps, prompt_k)
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert lps["token_logprobs"][i] == plps[i][str(ids[i])]["logprob"]
            assert len(lps["top_logprobs"][i]) in (echo_k, echo_k + 1)  # (the echo's k, not the larger one)
            for piece, value in lps["top_logprobs"][i].items():
                assert any(e["logprob"] == value for e in plps[i].values()) or echo_k > prompt_k
        alone = ok(srv, "/v1/completions", {**GREEDY, "prompt": TEXT, "max_tokens": 0, "echo": True,
                                           "logprobs": echo_k})["choices"][0]
        assert alone["logprobs"] == lps and "prompt_logprobs" not in alone


def test_every_choice_of_a_prompt_carries_that_prompts(srv):
    prompts = [TEXT, "jumps over"]
    body = ok(srv, "/v1/completions", {"prompt": prompts, "max_tokens": 2, "n": 2, "seed": 7, "prompt_logprobs": 2})
    plps = [c["prompt_logprobs"] for c in body["choices"]]
    assert plps[0] == plps[1] and plps[2] == plps[3] and plps[0] != plps[2]
    check_shape_and_values(srv, srv.tok.encode(prompts[0]), plps[0], 2)
    check_shape_and_values(srv, srv.tok.encode(prompts[1]), plps[2], 2)


def test_a_prompt_logprobs_request_takes_nothing_from_the_cache(srv):
    prompt = "a prompt cached twice over"
    ok(srv, "/v1/completions", {**GREEDY, "prompt": prompt, "max_tokens": 1})
    again = ok(srv, "/v1/completions", {**GREEDY, "prompt": prompt, "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    asked = ok(srv, "/v1/completions", {**GREEDY, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1})
    assert asked["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# -- chat -------------------------------------------------------------------------------------------
def test_a_chats_prompt_logprobs_are_at_the_top_level(srv):
    rendered = ok(srv, "/tokenize", {"messages": HI})["tokens"]
    body = ok(srv, "/v1/chat/completions", {**GREEDY, "messages": HI, "max_tokens": 2, "n": 2, "prompt_logprobs": 2})
    assert body["usage"]["prompt_tokens"] == len(rendered)
    check_shape_and_values(srv, rendered, body["prompt_logprobs"], 2)
    assert all("prompt_logprobs" not in c for c in body["choices"]) and len(body["choices"]) == 2
    plain = ok(srv, "/v1/chat/completions", {**GREEDY, "messages": HI, "max_tokens": 2})
    assert "prompt_logprobs" not in plain and plain["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]


# -- streaming and bad values -----------------------------------------------------------------------
@pytest.mark.parametrize("path,base", [("/v1/completions", {"prompt": TEXT}), ("/v1/chat/completions", {"messages": HI})])
def test_streaming_refuses_them_as_vllm_does_and_0_sends_nothing(srv, path, base):
    for k in (1, -1):
        r = post(srv, path, {**base, "max_tokens": 2, "stream": True, "prompt_logprobs": k})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        assert "stream" in r.json()["error"]["message"]
    chunks = sse(srv, path, {**base, "max_tokens": 2, "prompt_logprobs": 0})
    assert chunks and not any("prompt_logprobs" in c or "prompt_logprobs" in str(c["choices"]) for c in chunks)


@pytest.mark.parametrize("path,base", [("/v1/completions", {"prompt": TEXT}), ("/v1/chat/completions", {"messages": HI})])
@pytest.mark.parametrize("value,says", [(21, "20"), (-1, "512"), (-2, "-1"), ("3", "integer"), (True, "integer"),
                                        (1.5, "integer")])
def test_bad_values_are_400s_naming_the_field(srv, path, base, value, says):
    r = post(srv, path, {**base, "max_tokens": 2, "prompt_logprobs": value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs" and says in err["message"], err


# -- the rank on the device -------------------------------------------------------------------------
def test_the_device_rank_counts_the_tokens_at_least_as_likely():
    """vLLM's rank (its `batched_count_greater_than`: >=): a tie counts as ahead; -inf's is the whole row."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0],
                           [1.0, 3.0, 2.0, 3.0, 0.0],
                           [5.0, 1.0, 1.0, 1.0, 1.0],
                           [0.0, float("-inf"), 1.0, 2.0, 3.0]])
    rows, targets = torch.arange(4), torch.tensor([2, 3, 0, 1])
    values, ids, ranks = prompt_row_logprobs(lambda h: h, 5, logits, rows, targets, 2)
    assert ranks.tolist() == [3, 2, 1, 5]
    assert ids[0].tolist() in ([1, 3], [3, 1]) and values.shape == (4, 3)
