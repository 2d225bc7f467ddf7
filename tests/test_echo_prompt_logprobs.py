"""Prompt logprobs (SamplingParams.prompt_logprobs, GenerationResult.prompt_logprobs) and /v1/completions'
`echo`, as vLLM serves them: each prompt token's logprob under the model given the tokens before it (the
first has none) and the k likeliest tokens', computed over the whole prompt (such a request takes no cached
prefix from any tier), chunk by chunk under chunked prefill; `max_tokens: 0` runs the prefill alone. Over
HTTP, `echo` puts the prompt's text (and, with `logprobs`, its logprobs) ahead of each choice's own.
CPU, tiny preset; the HTTP harness is tests/test_server.py's."""
from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
import torch

from hicache.radix import Tier
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import ByteTokenizer
from test_server import ServerThread

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # 13 tokens: 3 full pages of 4 and one more


def make_engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=128, **kw))


def reference(eng: Engine, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the dense forward's logits: row i is the distribution of token i + 1 [N, V]."""
    with torch.inference_mode():
        return torch.log_softmax(eng.model.forward_dense(torch.tensor(prompt)).float(), dim=-1)


def check_prompt_logprobs(eng: Engine, prompt: list[int], got, k: int) -> None:
    ref = reference(eng, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        lp, row = got[i], ref[i - 1]
        assert math.isclose(lp.logprob, float(row[prompt[i]]), abs_tol=1e-4), i
        assert len(lp.top) == k
        want = torch.topk(row, k)
        assert [t for t, _ in lp.top] == want.indices.tolist(), i
        for (_, v), w in zip(lp.top, want.values.tolist()):
            assert math.isclose(v, w, abs_tol=1e-4)


def run(eng: Engine, prompts, params) -> list:
    return eng.generate(prompts, params)


# -- in process -----------------------------------------------------------------------------------------
def test_prompt_logprobs_equal_a_dense_forwards_log_softmax():
    eng = make_engine()
    [res] = run(eng, [PROMPT], SamplingParams(max_tokens=3, prompt_logprobs=5))
    check_prompt_logprobs(eng, PROMPT, res.prompt_logprobs, 5)
    assert res.logprobs is None and len(res.output_ids) == 3
    [plain] = run(eng, [PROMPT], SamplingParams(max_tokens=3))
    assert plain.prompt_logprobs is None
    eng.check_integrity()


def test_a_cached_prefix_in_l1_is_recomputed():
    eng = make_engine()
    [first] = run(eng, [PROMPT], SamplingParams(max_tokens=2))
    assert eng.cache.tree.match(PROMPT, touch=False).lengths[Tier.L1] == 12  # the prompt's full pages
    recomputed = eng.metrics()["recomputed_tokens"]
    [res] = run(eng, [PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=2))
    check_prompt_logprobs(eng, PROMPT, res.prompt_logprobs, 2)
    assert res.cached_tokens == {"l1": 0, "l2": 0, "l3": 0}
    assert eng.metrics()["recomputed_tokens"] - recomputed == len(PROMPT)
    assert res.output_ids == first.output_ids
    [again] = run(eng, [PROMPT], SamplingParams(max_tokens=2))  # what it computed is still a prefix hit
    assert again.cached_tokens["l1"] == 12 and again.output_ids == first.output_ids
    eng.check_integrity()


def test_a_prefix_evicted_to_l2_is_recomputed_not_restored():
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64)
                 .with_hicache(enable=True, host_ratio=2.0, policy="always"))

    async def go():
        await eng.start()
        [first] = await eng.generate_async([PROMPT], SamplingParams(max_tokens=2))
        await eng.cache.flush_async(Tier.L1)
        lengths = eng.cache.tree.match(PROMPT, touch=False).lengths
        assert lengths[Tier.L1] == 0 and lengths[Tier.L2] == 12, lengths
        before = dict(eng.metrics()["hit_tokens"]), eng.metrics()["recomputed_tokens"]
        [res] = await eng.generate_async([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=3))
        after = dict(eng.metrics()["hit_tokens"]), eng.metrics()["recomputed_tokens"]
        await eng.stop_loop()
        return first, res, before, after

    first, res, before, after = asyncio.run(go())
    check_prompt_logprobs(eng, PROMPT, res.prompt_logprobs, 3)
    assert res.cached_tokens == {"l1": 0, "l2": 0, "l3": 0} and before[0] == after[0]
    assert after[1] - before[1] == len(PROMPT) and res.output_ids == first.output_ids
    eng.check_integrity()


def test_chunked_prefill_gives_the_same_values_beside_other_requests():
    """Chunks of 4 tokens, the prompt-logprobs request batched with plain ones (their tokens unchanged)."""
    eng = make_engine(max_prefill_tokens=4)
    others = [[40, 41, 42], [100, 7, 300, 12, 13, 9]]
    alone = [r.output_ids for r in run(make_engine(), others, SamplingParams(max_tokens=4))]
    res = run(eng, [others[0], PROMPT, others[1]],
              [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, prompt_logprobs=4),
               SamplingParams(max_tokens=4, logprobs=2)])
    check_prompt_logprobs(eng, PROMPT, res[1].prompt_logprobs, 4)
    assert [res[0].output_ids, res[2].output_ids] == alone
    assert res[0].prompt_logprobs is None and res[2].prompt_logprobs is None and len(res[2].logprobs) == 4
    eng.check_integrity()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.9, "seed": 7}])
def test_generated_tokens_are_those_of_the_request_without_prompt_logprobs(sampling):
    plain = run(make_engine(), [PROMPT], SamplingParams(max_tokens=6, **sampling))[0]
    eng = make_engine(max_prefill_tokens=5)
    [res] = run(eng, [PROMPT], SamplingParams(max_tokens=6, prompt_logprobs=0, logprobs=1, **sampling))
    assert res.output_ids == plain.output_ids
    assert all(lp.top == [] for lp in res.prompt_logprobs[1:])
    eng.check_integrity()


def test_max_tokens_0_runs_the_prefill_alone():
    eng = make_engine(max_prefill_tokens=8)
    [res] = run(eng, [PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert res.output_ids == [] and res.finish_reason == "length" and res.error is None
    check_prompt_logprobs(eng, PROMPT, res.prompt_logprobs, 1)
    assert eng.cache.tree.match(PROMPT, touch=False).lengths[Tier.L1] == 12  # what it computed is published
    for params, field in [(SamplingParams(max_tokens=0), "max_tokens"),
                          (SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
                          (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
                          (SamplingParams(prompt_logprobs=True), "prompt_logprobs")]:
        with pytest.raises(RequestError, match=field) as err:
            eng.validate(PROMPT, params)
        assert err.value.param == field
    eng.check_integrity()


def test_a_simulated_engine_refuses_prompt_logprobs():
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, simulate=True))
    with pytest.raises(RequestError, match="prompt_logprobs") as err:
        eng.validate(PROMPT, SamplingParams(prompt_logprobs=0))
    assert err.value.param == "prompt_logprobs"


def test_prompt_logprobs_never_replay_a_captured_graph():
    """The CUDA graphs return the last rows' logits only: a batch with a prompt-logprobs row runs eagerly."""
    class Graphs:  # a runner's graphs that offer a prefill bucket and a tail shape for everything
        def shape_for(self, new_lens, page_tables):
            return "shape"

        def has_restore_graph(self, shape):
            return True

        def prefill_bucket(self, prefix_lens, new_lens):
            return 16

        def run(self, *args, **kw):
            raise AssertionError("a prompt-logprobs batch replayed a graph")

        run_prefill = run

    eng = make_engine()
    eng.runner.graphs = Graphs()
    [res] = run(eng, [PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert res.error is None
    check_prompt_logprobs(eng, PROMPT, res.prompt_logprobs, 2)
    eng.check_integrity()


# -- HTTP ------------------------------------------------------------------------------------------------
TEXT = "Hello, world"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv():
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256, max_new_tokens_limit=64,
                                 max_prefill_tokens=8).with_hicache(enable=True, host_ratio=2.0))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=ByteTokenizer(512))) as s:
        s.engine = engine
        yield s


def _post(srv, body: dict, status: int = 200) -> dict:
    r = httpx.post(srv.url + "/v1/completions", json={**GREEDY, **body}, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _stream(srv, body: dict) -> list[dict]:
    with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + "/v1/completions",
                                                 json={**GREEDY, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


def _check_prompt_entries(srv, prompt_ids: list[int], lps: dict, k: int) -> None:
    """The first len(prompt_ids) entries of a choice's logprobs against the dense reference."""
    tok = ByteTokenizer(512)
    n = len(prompt_ids)
    assert lps["tokens"][:n] == [tok.decode([t]) for t in prompt_ids]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert lps["text_offset"][:n] == list(range(n))  # (one character a byte token here)
    ref = reference(srv.engine, prompt_ids)
    for i in range(1, n):
        assert math.isclose(lps["token_logprobs"][i], float(ref[i - 1][prompt_ids[i]]), abs_tol=1e-4)
        top = lps["top_logprobs"][i]
        assert lps["tokens"][i] in top and len(top) in (k, k + 1)
        want = torch.topk(ref[i - 1], k).indices.tolist()
        assert all(tok.decode([t]) in top for t in want)


def test_echo_alone_puts_the_prompt_text_first(srv):
    plain = _post(srv, {"prompt": TEXT, "max_tokens": 3})["choices"][0]
    echoed = _post(srv, {"prompt": TEXT, "max_tokens": 3, "echo": True})
    choice = echoed["choices"][0]
    assert choice["text"] == TEXT + plain["text"] and choice["token_ids"] == plain["token_ids"]
    assert choice["logprobs"] is None and echoed["usage"]["completion_tokens"] == 3


def test_echo_with_logprobs_and_max_tokens_0_is_the_prompt_alone(srv):
    ids = ByteTokenizer(512).encode(TEXT)
    body = _post(srv, {"prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 2})
    choice = body["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length" and choice["token_ids"] == []
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    _check_prompt_entries(srv, ids, choice["logprobs"], 2)
    # without logprobs: the prompt's text, nothing else
    bare = _post(srv, {"prompt": ids, "max_tokens": 0, "echo": True})["choices"][0]
    assert bare["text"] == TEXT and bare["logprobs"] is None and bare["token_ids"] == []


def test_echo_with_logprobs_and_max_tokens_1_adds_the_generated_token(srv):
    ids = ByteTokenizer(512).encode(TEXT)
    plain = _post(srv, {"prompt": TEXT, "max_tokens": 1, "logprobs": 1})["choices"][0]
    choice = _post(srv, {"prompt": TEXT, "max_tokens": 1, "logprobs": 1, "echo": True})["choices"][0]
    assert choice["text"] == TEXT + plain["text"]
    lps, own = choice["logprobs"], plain["logprobs"]
    assert len(lps["tokens"]) == len(ids) + 1
    _check_prompt_entries(srv, ids, lps, 1)
    assert lps["tokens"][-1] == own["tokens"][-1] and lps["top_logprobs"][-1].keys() == own["top_logprobs"][-1].keys()
    assert lps["token_logprobs"][-1] == pytest.approx(own["token_logprobs"][-1], abs=1e-4)
    assert lps["text_offset"][-1] == len(TEXT)


def test_streaming_echo_sends_the_prompt_in_the_first_chunk(srv):
    body = {"prompt": TEXT, "max_tokens": 3, "logprobs": 1, "echo": True}
    whole = _post(srv, body)["choices"][0]
    chunks = [c for c in _stream(srv, body) if c["choices"]]
    assert chunks[0]["choices"][0]["text"].startswith(TEXT)
    assert len(chunks[0]["choices"][0]["logprobs"]["tokens"]) >= len(TEXT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "text_offset", "top_logprobs"):
        assert [v for c in chunks for v in c["choices"][0]["logprobs"][key]] == whole["logprobs"][key]
    # max_tokens 0: one chunk, the prompt, finished
    [only] = [c for c in _stream(srv, {**body, "max_tokens": 0}) if c["choices"]]
    assert only["choices"][0]["text"] == TEXT and only["choices"][0]["finish_reason"] == "length"


def test_every_choice_and_every_prompt_echoes_its_own(srv):
    body = _post(srv, {"prompt": TEXT, "max_tokens": 2, "n": 2, "echo": True, "logprobs": 0, "temperature": 1.0,
                       "seed": 3})
    assert [c["index"] for c in body["choices"]] == [0, 1]
    ids = ByteTokenizer(512).encode(TEXT)
    for c in body["choices"]:
        assert c["text"].startswith(TEXT) and len(c["logprobs"]["tokens"]) == len(ids) + 2
        _check_prompt_entries(srv, ids, c["logprobs"], 0)
    other = [72, 105, 33, 80]
    body = _post(srv, {"prompt": [TEXT, "abc"], "max_tokens": 1, "echo": True})
    assert body["choices"][0]["text"].startswith(TEXT) and body["choices"][1]["text"].startswith("abc")
    body = _post(srv, {"prompt": [ids, other], "max_tokens": 0, "echo": True, "logprobs": 1})
    assert [c["text"] for c in body["choices"]] == [TEXT, ByteTokenizer(512).decode(other)]
    _check_prompt_entries(srv, other, body["choices"][1]["logprobs"], 1)


def test_max_tokens_0_without_echo_is_a_400(srv):
    err = _post(srv, {"prompt": TEXT, "max_tokens": 0}, status=400)["error"]
    assert err["param"] == "max_tokens" and "echo" in err["message"]
    err = _post(srv, {"prompt": TEXT, "max_tokens": -1, "echo": True}, status=400)["error"]
    assert err["param"] == "max_tokens"
    srv.call(srv.engine.check_integrity)

