"""Logprobs and penalties on the GPU (skipped without CUDA), decode batches replayed from CUDA graphs
and chained on the device: logprobs, copied to pinned memory with the step's ids (scheduler/runner.py),
equal a dense forward's log_softmax; penalties count the chained step's in-flight token (only on the
device) and give the greedy tokens of a host reference; a batch's rows that did not ask are sampled as if
nobody had. The CPU checks of the same: tests/test_logprobs.py, tests/test_penalties.py."""
import asyncio
import math
from collections import Counter

import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 5, [40, 41, 42], [100, 7, 300, 12, 13] * 9, [9, 8, 7, 6, 5, 4, 3, 2, 1]]


async def _events(eng: Engine, params) -> list[list]:
    async def one(prompt, p):
        return [ev async for ev in eng.submit(prompt, p) if not ev.finished]
    await eng.start()
    out = await asyncio.gather(*(one(pr, p) for pr, p in zip(PROMPTS, params)))
    await eng.stop_loop()
    return out


@pytest.mark.parametrize("graphs", [True, False])
def test_logprobs_on_cuda_equal_a_dense_forwards_log_softmax(graphs):
    eng = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16,
                              cuda_graphs=graphs))
    assert (eng.runner.graphs is not None) == graphs
    asking = [SamplingParams(max_tokens=12, logprobs=k) for k in (5, None, 20, 0)]
    nobody = [SamplingParams(max_tokens=12) for _ in PROMPTS]
    for _ in range(2):  # the second time over cached prefixes: tails and decode graphs
        events = asyncio.run(_events(eng, asking))
        plain = asyncio.run(_events(eng, nobody))
        for prompt, evs, plain_evs, p in zip(PROMPTS, events, plain, asking):
            output = [ev.token_id for ev in evs]
            assert output == [ev.token_id for ev in plain_evs]  # asking changes no token
            assert all(ev.logprobs is None for ev in plain_evs)
            if p.logprobs is None:
                assert all(ev.logprobs is None for ev in evs)
                continue
            with torch.inference_mode():
                ref = torch.log_softmax(eng.model.forward_dense(
                    torch.tensor(prompt + output[:-1], device="cuda"))[len(prompt) - 1:].float(), dim=-1)
            for i, ev in enumerate(evs):
                lp = ev.logprobs
                assert math.isclose(lp.logprob, float(ref[i, ev.token_id]), abs_tol=1e-3)
                assert math.isclose(lp.logprob, float(ref[i].max()), abs_tol=1e-3)  # greedy: the likeliest
                assert len(lp.top) == p.logprobs
                for (tid, v), want in zip(lp.top, torch.topk(ref[i], p.logprobs).values.tolist()):
                    assert math.isclose(v, want, abs_tol=1e-3) and math.isclose(v, float(ref[i, tid]), abs_tol=1e-3)
    assert eng.stats["chained_steps"] > 0
    eng.check_integrity()


def _penalized_on_host(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's formulas on the host: repetition over prompt and output, then frequency * count and
    presence * (count > 0) over the output."""
    out = logits.double().clone()
    for t, v in (p.logit_bias or {}).items():  # (the bias first, as vLLM V1)
        out[t] += v
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, n in Counter(output).items():
        out[t] -= p.frequency_penalty * n + p.presence_penalty
    return out


def test_penalties_on_cuda_graphs_under_chained_decode_equal_a_host_reference():
    """Penalties (and a logit_bias) kept per request on the device across steps (scheduler/penalty_state.py):
    each token is the best of the host's reference over the dense forward's logits."""
    eng = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16,
                              cuda_graphs=True))
    asking = [SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=2.0),
              SamplingParams(max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=1.5, repetition_penalty=1.8),
              SamplingParams(max_tokens=40, ignore_eos=True, presence_penalty=-0.5, repetition_penalty=0.6,
                             logit_bias={7: 3.0, 100: -2.0, 255: 1.5})]
    nobody = [SamplingParams(max_tokens=16, ignore_eos=True) for _ in PROMPTS]
    for _ in range(2):
        events = asyncio.run(_events(eng, asking))
        plain = asyncio.run(_events(eng, nobody))
        assert [ev.token_id for ev in events[1]] == [ev.token_id for ev in plain[1]]  # the row that did not ask
        for prompt, evs, p in zip(PROMPTS, events, asking):
            output = [ev.token_id for ev in evs]
            assert len(output) == p.max_tokens
            with torch.inference_mode():
                logits = eng.model.forward_dense(torch.tensor(prompt + output[:-1], device="cuda"))
            for i, token in enumerate(output):
                ref = _penalized_on_host(logits[len(prompt) - 1 + i].float().cpu(), prompt, output[:i], p)
                assert float(ref[token]) >= float(ref.max()) - 1e-3, (i, token, int(ref.argmax()), output)
    assert eng.stats["chained_steps"] > 0
    eng.check_integrity()


@pytest.mark.parametrize("overlap", [True, False])
def test_min_tokens_on_cuda_graphs_holds_the_stop_id_exactly_min_tokens_steps(overlap):
    """min_tokens' mask (scheduler/penalty_state.py) on CUDA graphs, chained or not: a stop id forced by a
    +100 bias comes exactly as the (min_tokens + 1)-th token; a chained step's index counts the token
    still in flight (one off either way, the stop would come a token late or early)."""
    eng = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16,
                              cuda_graphs=True, overlap_schedule=overlap))
    stop = 77
    params = [SamplingParams(max_tokens=16, min_tokens=m, stop_token_ids=(stop,), logit_bias={stop: 100.0})
              for m in (0, 3, 7, 12)]
    for _ in range(2):
        results = eng.generate(PROMPTS, params)
        for p, res in zip(params, results):
            assert (len(res.output_ids), res.output_ids[-1], res.finish_reason) == (p.min_tokens + 1, stop, "stop"), \
                (p.min_tokens, res.output_ids)
    assert (eng.stats["chained_steps"] > 0) == overlap
    eng.check_integrity()


def test_sampled_rows_on_cuda_draw_together_follow_top_k_and_repeat_with_their_seeds():
    """A batch's sampled rows drawn together on the device (scheduler/sampling.py), chained decode on CUDA
    graphs: top_k 1 and min_p 1 give the greedy tokens; a seeded row repeats its stream whatever shares its
    batch; draws of one row on the device follow vLLM's distribution (a CUDA generator per seeded row)."""
    from scheduler.sampling import sample
    from sampling_reference import VOCAB, reference_probs

    eng = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16,
                              cuda_graphs=True))
    greedy = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in PROMPTS]
    sampled = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.5, top_k=1, seed=1),
               SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.5, seed=2, top_p=0.9, top_k=20),
               SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.5, min_p=1.0),
               SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=3, min_p=0.05)]
    plain = [r.output_ids for r in eng.generate(PROMPTS, greedy)]
    first = [r.output_ids for r in eng.generate(PROMPTS, sampled)]
    assert first[0] == plain[0] and first[2] == plain[2]
    alone = [r.output_ids for r in eng.generate(PROMPTS[1:2] + PROMPTS[3:], [sampled[1], sampled[3]])]
    assert alone == [first[1], first[3]]  # seeded rows: the same with or without the others
    assert eng.stats["chained_steps"] > 0
    eng.check_integrity()
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)).cuda() * 2
    n = 20_000
    gens = [torch.Generator(device="cuda").manual_seed(i) if i % 2 else None for i in range(n)]
    ids = sample(logits.expand(n, VOCAB), [0.9] * n, [0.85] * n, gens, [6] * n, [0.02] * n)
    freq = torch.bincount(ids.cpu(), minlength=VOCAB).double() / n
    want = reference_probs(logits.cpu(), 0.9, 0.85, 6, 0.02)
    assert (freq[want == 0] == 0).all() and (freq - want).abs().max() < 0.02, (freq, want)


def test_the_rejection_kernel_draws_vllms_distribution_over_qwens_vocabulary():
    """kernels/rejection_sampling.py, which draws top-p / top-k / min_p rows on CUDA without a sort: 20,000
    draws a setting over 151,936 tokens follow vLLM's distribution (float64 reference; top-p of the top-k
    set with both, as Qwen3's generation_config.json asks); seeded rows (CUDA and CPU generators) draw the
    same alone as in a batch."""
    from scheduler import sampling
    from scheduler.sampling import sample
    from sampling_reference import reference_probs

    vocab, n = 151_936, 20_000
    logits = (torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 3).cuda()
    for temperature, top_p, top_k, min_p in [(0.8, 0.95, 0, 0.0), (1.0, 0.5, 0, 0.0), (1.0, 1.0, 40, 0.0),
                                             (0.7, 0.9, 0, 0.01), (0.6, 0.95, 20, 0.0), (1.0, 0.8, 300, 0.0)]:
        rows = logits.expand(n, vocab)
        assert sampling._kernel_rows(rows, [top_k] * n, [top_p] * n) == list(range(n))
        gens = [None if i % 2 else torch.Generator(device="cuda").manual_seed(i) for i in range(n)]
        ids = sample(rows, [temperature] * n, [top_p] * n, gens, [top_k] * n, [min_p] * n)
        freq = torch.bincount(ids.cpu(), minlength=vocab).double() / n
        want = reference_probs(logits.cpu(), temperature, top_p, top_k, min_p)
        assert (freq[want == 0] == 0).all(), (temperature, top_p, top_k, min_p)
        assert (freq - want).abs().max() < 0.02, (temperature, top_p, top_k, min_p)
    batch = torch.randn(3, vocab, device="cuda") * 3

    def gens():
        return [torch.Generator(device="cuda").manual_seed(5), torch.Generator().manual_seed(6), None]
    together = sample(batch, [0.8, 1.0, 0.9], [0.9, 0.8, 0.95], gens())
    first, second = gens()[:2]
    assert together[0] == sample(batch[0:1], [0.8], [0.9], [first])[0]
    assert together[1] == sample(batch[1:2], [1.0], [0.8], [second])[0]


def test_the_rejection_kernel_draws_the_same_split_over_programs_or_not_on_cuda():
    """Compiled: a row of 151,936 tokens in 19 chunks (the default) or in one, its rounds split or all in
    one program, draws the same tokens (the same uniforms; sums in another order could differ only at an
    exact tie of mass and top_p)."""
    from kernels.rejection_sampling import pack_params, sample_rows, set_kth_logits

    vocab, n = 151_936, 64
    logits = torch.randn(n, vocab, device="cuda") * 3
    for temperature, top_p, top_k in [(0.8, 0.95, 0), (1.0, 0.5, 0), (1.0, 1.0, 50), (0.6, 0.95, 20)]:
        params = pack_params(list(range(n)), [temperature] * n, [top_p] * n, [-math.inf] * n, [top_k] * n,
                             [2**40 + i for i in range(n)]).cuda()
        set_kth_logits(logits, params, list(range(n)) if top_k else [], [top_k] * n)
        runs = [sample_rows(logits, params, **config) for config in
                ({}, {"CHUNK": 2048 * 75}, {"ROUNDS": 1}, {"ROUNDS": 8, "CHUNK": 4096})]
        assert all(run.equal(runs[0]) for run in runs[1:]), (temperature, top_p, top_k)


def test_the_rejection_kernels_uniforms_on_cuda_are_the_hash_they_document():
    """Compiled (not interpreted): the counter hash's constants typed as uint32, as the interpreter's
    numpy computes them (tests/test_rejection_sampling.py)."""
    from test_rejection_sampling import check_uniforms_equal_the_reference

    check_uniforms_equal_the_reference("cuda")


def _banned_on_host(p: SamplingParams, output: list[int], vocab: int = 512) -> set[int]:
    """vLLM V1's bans before the token after `output` (tests/test_token_bans.py's, which the device cannot import:
    it has no fastapi): every token outside allowed_token_ids, each one-token bad word, each longer word's last
    token where the output ends with the rest of it."""
    banned = set() if p.allowed_token_ids is None else set(range(vocab)) - set(p.allowed_token_ids)
    for word in p.bad_words_token_ids:
        if len(word) == 1 or len(output) >= len(word) - 1 and tuple(output[len(output) - len(word) + 1:]) == word[:-1]:
            banned.add(word[-1])
    return banned


@pytest.mark.parametrize("overlap", [True, False])
def test_token_bans_on_cuda_graphs_equal_a_host_reference(overlap):
    """allowed_token_ids and bad words (scheduler/token_bans.py) on CUDA graphs, chained or not: a two-token word
    taken from the row's own greedy answer is banned only where its first token came, which a chained step
    knows only on the device; each token is the best of the dense forward's logits with the host's bans."""
    eng = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16,
                              cuda_graphs=True, overlap_schedule=overlap))
    base = [r.output_ids for r in eng.generate(PROMPTS, [SamplingParams(max_tokens=16, ignore_eos=True)] * 4)]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, bad_words_token_ids=((base[0][3], base[0][4]),)),
              SamplingParams(max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=16, ignore_eos=True, allowed_token_ids=tuple(range(0, 512, 3)),
                             bad_words_token_ids=((base[2][1],), tuple(base[2][5:8]))),
              SamplingParams(max_tokens=16, ignore_eos=True, bad_words_token_ids=tuple(zip(base[3], base[3][1:]))[:5])]
    for _ in range(2):  # (the second time over cached prefixes)
        results = eng.generate(PROMPTS, params)
        assert results[1].output_ids == base[1]  # the row that did not ask
        assert results[0].output_ids[:4] == base[0][:4] and results[0].output_ids[4] != base[0][4]
        for prompt, res, p in zip(PROMPTS, results, params):
            output = res.output_ids
            with torch.inference_mode():
                logits = eng.model.forward_dense(torch.tensor(prompt + output[:-1], device="cuda"))
            for i, token in enumerate(output):
                ref = logits[len(prompt) - 1 + i].float().cpu().clone()
                banned = _banned_on_host(p, output[:i])
                ref[sorted(banned)] = float("-inf")
                assert token not in banned and float(ref[token]) >= float(ref.max()) - 1e-3, (i, token, output)
    assert (eng.stats["chained_steps"] > 0) == overlap
    eng.check_integrity()
