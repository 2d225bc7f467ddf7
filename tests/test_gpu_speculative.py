"""Speculative decoding on CUDA (skipped without it): the verify graphs (every row's logits) give the greedy
tokens plain decode gives, for one sequence and for several, and the verify steps ran through the graphs."""
import random

import pytest

from scheduler.config import EngineConfig
from scheduler.request import SamplingParams
from scheduler.speculative import SpeculativeConfig

pytestmark = pytest.mark.gpu


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        block = [rng.randrange(512) for _ in range(24)]
        out.append(block * 3 + [rng.randrange(512) for _ in range(i)] if i % 2 == 0
                   else [rng.randrange(512) for _ in range(70)])
    return out


@pytest.mark.parametrize("graphs,k,rows", [(True, 5, 8), (True, 15, 16), (False, 5, 0)])
@pytest.mark.parametrize("n", [1, 5])
def test_speculative_greedy_on_cuda_equals_plain_decode(graphs, k, rows, n, monkeypatch):
    from scheduler.engine import Engine
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=1024, page_size=16,
                        cuda_graphs=graphs, max_running_requests=8)
    params = SamplingParams(max_tokens=48)
    plain = Engine(base)
    want = [r.output_ids for r in plain.generate(_prompts(n), params)]
    spec = Engine(EngineConfig(**{**base.__dict__, "speculative": SpeculativeConfig(k, 4, 1, draft_policy="always")}))
    if graphs:  # (verify graphs of k + 1 rows a sequence, rounded up to a power of two)
        assert spec.runner.graphs.verify_max_seqs == 8 and spec.runner.graphs.verify_rows == rows
        used = []
        run = spec.runner.graphs.run
        monkeypatch.setattr(spec.runner.graphs, "run", lambda *a, **k: used.append(k.get("verify")) or run(*a, **k))
    got = [r.output_ids for r in spec.generate(_prompts(n), params)]
    assert got == want
    stats = spec.status()["engine"]["speculative"]
    assert stats["accepted_tokens"] > 0 and stats["verify_steps"] > 0
    if graphs:
        assert used.count(True) == stats["verify_steps"]  # every verify step replayed a verify graph
    spec.check_integrity()


@pytest.mark.parametrize("graphs", [True, False])
def test_speculative_sampled_on_cuda(graphs):
    """Unseeded sampled requests verify through the verify graphs (rows at b * R, the sampler's kernels): top_k 1
    gives the greedy tokens, and greedy requests sharing the step with a sampled one keep theirs."""
    from scheduler.engine import Engine
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=1024, page_size=16,
                        cuda_graphs=graphs, max_running_requests=8)
    prompts = _prompts(5)
    plain = Engine(base)
    want = [r.output_ids for r in plain.generate(prompts, SamplingParams(max_tokens=48))]
    spec = Engine(EngineConfig(**{**base.__dict__, "speculative": SpeculativeConfig(5, 4, 1, draft_policy="always")}))
    got = spec.generate(prompts, SamplingParams(max_tokens=48, temperature=0.7, top_k=1))
    assert [r.output_ids for r in got] == want
    stats = spec.status()["engine"]["speculative"]
    assert stats["accepted_tokens"] > 0 and stats["verify_steps"] > 0
    mixed = [SamplingParams(max_tokens=48, temperature=1.0, top_p=0.9) if i % 2 else SamplingParams(max_tokens=48)
             for i in range(5)]
    got = spec.generate(prompts, mixed)
    assert [got[i].output_ids for i in (0, 2, 4)] == [want[i] for i in (0, 2, 4)]
    assert all(r.error is None and len(r.output_ids) == 48 for r in got)
    spec.check_integrity()


def test_speculative_logprobs_on_cuda_equal_plain_decodes():
    """Logprobs requests verify through the verify graphs (every row's logprobs to the host, rows at b * R): each
    token's equal plain decoding's (float32)."""
    from scheduler.engine import Engine
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=1024, page_size=16,
                        max_running_requests=8)
    prompts = _prompts(4)
    params = [SamplingParams(max_tokens=40, logprobs=k) for k in (2, None, 0, 5)]
    want = Engine(base).generate(prompts, params)
    spec = Engine(EngineConfig(**{**base.__dict__, "speculative": SpeculativeConfig(5, 4, 1, draft_policy="always")}))
    got = spec.generate(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    for g, w in zip(got, want):
        assert (g.logprobs is None) == (w.logprobs is None)
        for a, b in zip(g.logprobs or [], w.logprobs or []):
            assert abs(a.logprob - b.logprob) < 1e-3 and [t for t, _ in a.top] == [t for t, _ in b.top]
    assert spec.status()["engine"]["speculative"]["accepted_tokens"] > 0
    spec.check_integrity()


@pytest.mark.parametrize("graphs", [True, False])
def test_speculative_penalized_on_cuda_equals_plain_decode(graphs):
    """Penalties, logit_bias, min_tokens and token bans in verify rows through the verify graphs' layout (rows at
    b * R, padding rows scored by none): each row's drafts before it counted; a greedy and a top_k 1 batch, served
    once (prompt lookup) and again (the cache's drafts), give plain decoding's tokens."""
    from scheduler.engine import Engine
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=1024, page_size=16,
                        cuda_graphs=graphs, max_running_requests=8)
    prompts = _prompts(7)
    plain = Engine(base)
    free = [r.output_ids for r in plain.generate(prompts, SamplingParams(max_tokens=48))]
    fields = [{"presence_penalty": 0.8}, {"frequency_penalty": 0.5, "repetition_penalty": 1.2},
              {"logit_bias": {7: 4.0, 9: -100.0}}, {"min_tokens": 6, "stop_token_ids": [prompts[3][0]]}, {},
              {"allowed_token_ids": sorted(set(free[5]) - {free[5][3]})},
              {"bad_words_token_ids": [[free[6][1], free[6][2]], [free[6][4]]]}]
    want = [r.output_ids for r in plain.generate(prompts, [SamplingParams(max_tokens=48, **f) for f in fields])]
    spec = Engine(EngineConfig(**{**base.__dict__, "speculative": SpeculativeConfig(5, 4, 1, draft_policy="always")}))
    for extra in ({}, {"temperature": 0.7, "top_k": 1}):
        params = [SamplingParams(max_tokens=48, **f, **extra) for f in fields]
        for _ in range(2):
            assert [r.output_ids for r in spec.generate(prompts, params)] == want
    stats = spec.status()["engine"]["speculative"]
    assert stats["accepted_tokens"] > 0 and stats["cache_accepted_tokens"] > 0
    spec.check_integrity()


@pytest.mark.parametrize("graphs", [True, False])
def test_speculative_guided_on_cuda_equals_plain_decode(graphs):
    """Structured outputs in verify rows through the verify graphs' layout (each guided sequence's masks placed at
    b * R: `graph_rows`): greedy answers beside an unguided one, served once and again, give plain decoding's."""
    import json

    from scheduler.engine import Engine
    from scheduler.guided import GuidedSpec
    from scheduler.tokenizer import ByteTokenizer
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=1024, page_size=16,
                        cuda_graphs=graphs, max_running_requests=8)
    plain = Engine(base)
    tok = ByteTokenizer(plain.vocab_size)
    prompts = [tok.encode(t) for t in ("Answer: ", "abc abc abc abc ", "1x2x3x4x5x6x7x8x9x0x", "The cat ")]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = [SamplingParams(max_tokens=40, guided=GuidedSpec("regex", "[a-z ]{5,40}")), SamplingParams(max_tokens=40),
              SamplingParams(max_tokens=40, guided=GuidedSpec("regex", "[0-9]{8,30}")),
              SamplingParams(max_tokens=40, guided=GuidedSpec("json_schema", json.dumps(schema)))]
    want = [r.output_ids for r in plain.generate(prompts, params)]
    spec = Engine(EngineConfig(**{**base.__dict__, "speculative": SpeculativeConfig(5, 3, 1, draft_policy="always")}))
    for _ in range(2):
        got = spec.generate(prompts, params)
        assert [r.output_ids for r in got] == want and all(r.error is None for r in got)
    stats = spec.status()["engine"]["speculative"]
    assert stats["accepted_tokens"] > 0 and stats["cache_accepted_tokens"] > 0
    spec.check_integrity()
