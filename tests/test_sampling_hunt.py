"""Sampling and its determinism, end to end (a bug hunt): a seeded request's tokens whatever shares its
batches and wherever its prefix came from; what temperature, top_p, stop ids, EOS and max_tokens mean;
invalid values; non-finite logits. CPU, tiny preset (tests/test_sampling.py and
tests/test_generation_hunt.py hold the earlier cases)."""
from __future__ import annotations

import asyncio
import dataclasses
import math
import random

import pytest
import torch

from hicache.radix import Tier
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from scheduler.sampling import sample
from test_faults import make_engine

VOCAB = 512
_rng = random.Random(11)
PROMPT = [_rng.randrange(VOCAB) for _ in range(25)]  # 24 reusable tokens: 6 pages of 4
OTHERS = [[_rng.randrange(VOCAB) for _ in range(_rng.randrange(3, 30))] for _ in range(5)]
SEEDED = SamplingParams(max_tokens=10, temperature=1.2, top_p=0.95, seed=4242, ignore_eos=True)
UNSEEDED = SamplingParams(max_tokens=14, temperature=1.0, ignore_eos=True)


def _engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256, **kw))


def assert_whole(engine: Engine) -> None:
    engine.check_integrity()
    alloc = engine.cache.l1.allocator
    assert alloc.num_private() == 0 and alloc.num_free + alloc.num_tree() == alloc.num_pages


# -- seeds ---------------------------------------------------------------------------------------------------
def test_seeds_that_differ_only_above_32_bits_give_different_streams():
    """Seeds are 64-bit (SamplingParams.validate), but the CPU generator (mt19937) keeps only a seed's
    low 32 bits: seed 7 and seed 7 + 2**32 (or 2**63 + 7) sampled the very same tokens."""
    eng = _engine()
    seeds = [7, 7 + (1 << 32), 7 + (1 << 63), 7 - (1 << 32)]
    params = [dataclasses.replace(SEEDED, seed=s) for s in seeds]
    outs = [r.output_ids for r in eng.generate([PROMPT] * len(seeds), params)]
    assert all(len(o) == SEEDED.max_tokens for o in outs)
    assert len({tuple(o) for o in outs}) == len(seeds), outs
    from scheduler.sampling import seeded_generator  # a seed below 2**32 keeps torch's own stream
    assert torch.equal(torch.rand(8, generator=seeded_generator(7, torch.device("cpu"))),
                       torch.rand(8, generator=torch.Generator().manual_seed(7)))


# -- non-finite logits --------------------------------------------------------------------------------------
def _poison_l1_prefix(eng: Engine, tokens: list[int]) -> None:
    """Overwrite the K/V of `tokens`' cached L1 pages with NaN (a corrupted prefix: the forward of a
    request that reads them gives NaN logits, and only that request's)."""
    m = eng.cache.tree.match(tokens, include_storage=False, touch=False)
    assert m.lengths[Tier.L1] >= 4
    pages = torch.tensor(m.pages[Tier.L1], dtype=torch.int64)
    eng.cache.l1.kv[:, :, pages] = float("nan")


def test_mark_nan_marks_exactly_the_rows_whose_chosen_token_is_nan():
    """A greedy row with any NaN (argmax takes it) and a sampled row of nothing but NaN are marked; a
    sampled row whose other logits are NaN draws a finite token and is not; finite rows keep their ids."""
    from scheduler.sampling import NAN_TOKEN, mark_nan

    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    logits[1, 9] = logits[3, 9] = float("nan")
    logits[4] = float("nan")
    temps = [0.0, 0.0, 1.0, 1.0, 1.0]
    ids = sample(logits, temps, [1.0] * 5, [torch.Generator().manual_seed(i) for i in range(5)])
    marked = mark_nan(logits, ids)
    assert marked.tolist() == [ids[0], NAN_TOKEN, ids[2], ids[3], NAN_TOKEN]
    assert ids[3] != 9 and ((0 <= ids) & (ids < 64)).all()  # the unmarked ids stay in the vocabulary


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_nan_logits_fail_that_request_only(temperature):
    """A forward that gives one request NaN logits streamed it garbage: greedy took the NaN token
    (argmax picks a NaN), sampling drew uniformly from an all-NaN row; either way the request ended
    "length" with no error. It now fails with a clear error; the batch's other requests are untouched."""
    eng = _engine()
    params = SamplingParams(max_tokens=5, temperature=temperature, seed=3, ignore_eos=True)
    ref = eng.generate(OTHERS[:2], params)
    eng.generate([PROMPT], params)  # caches PROMPT's prefix in L1
    _poison_l1_prefix(eng, PROMPT[:-1])
    bad, *good = eng.generate([PROMPT] + OTHERS[:2], params)
    assert bad.cached_tokens["l1"] == 24
    assert bad.finish_reason == "error" and "NaN" in (bad.error or ""), (bad.finish_reason, bad.error)
    assert bad.output_ids == []
    assert [(g.finish_reason, g.output_ids) for g in good] == [(r.finish_reason, r.output_ids) for r in ref]
    assert eng.stats["failed"] == 1
    assert_whole(eng)


@pytest.mark.asyncio
async def test_nan_logits_in_decode_fail_that_request_and_spread_to_no_other():
    """A request whose forward goes NaN mid-generation (here: its K/V, all in its private pages,
    page 0 among them, turned NaN after its first token). Its tokens before stay the reference's, then
    it fails with the NaN error. Regressions: a decode batch pads every shorter page table with page 0,
    read and masked, and NaN * 0 is NaN, so the other request of its batch went NaN in the same step;
    and its pages went back to the pool full of NaN, whose unwritten tails the next requests given them
    read, so they failed too (before the NaN check: all of them streamed garbage)."""
    eng = _engine(enable_prefix_cache=False)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = await eng.generate_async([PROMPT, OTHERS[0]], params)
    victim = eng.add_request(PROMPT, params)
    bystander = eng.add_request(OTHERS[0], params)
    first = await victim.queue.get()
    assert first.token_id == ref[0].output_ids[0] and 0 in victim.pages
    assert len(victim.pages) > len(bystander.pages)  # the bystander's table is the padded one
    eng.cache.l1.kv[:, :, torch.tensor(victim.pages)] = float("nan")
    events = [first]
    while not events[-1].finished:
        events.append(await victim.queue.get())
    tokens = [e.token_id for e in events if e.token_id is not None]
    assert events[-1].finish_reason == "error" and "NaN" in events[-1].error
    assert 1 <= len(tokens) < params.max_tokens and tokens == ref[0].output_ids[:len(tokens)]
    while not bystander.state.done:
        await bystander.queue.get()
    assert (bystander.finish_reason, bystander.error) == ("length", None)
    assert bystander.result().output_ids == ref[1].output_ids
    assert eng.cache.metrics.failures.get("nan_logits") == 1
    # the pages it held serve the next requests (many, to take them all)
    again = await eng.generate_async([PROMPT, OTHERS[0]] * 4, params)
    assert [(r.finish_reason, r.output_ids) for r in again] == [(r.finish_reason, r.output_ids) for r in ref] * 4
    assert not torch.isnan(eng.cache.l1.kv).any()
    await eng.stop_loop()
    assert_whole(eng)
    await eng.shutdown()


# -- determinism ---------------------------------------------------------------------------------------------
def test_a_seeded_request_repeats_whatever_shares_its_batches_and_wherever_its_prefix_lives():
    """The same seeded request: alone with no cache, amid unseeded sampled requests (sync generate)
    with chunked prefills, an L1 hit amid others, an L2 hit amid others, an L3 hit, and through
    submit() arriving while others decode."""
    others = [UNSEEDED] * len(OTHERS)
    alone = _engine(enable_prefix_cache=False).generate([PROMPT], SEEDED)[0].output_ids
    assert len(alone) == SEEDED.max_tokens
    runs = {}
    eng = _engine(max_prefill_tokens=8)
    runs["amid others, chunked"] = eng.generate(OTHERS + [PROMPT], others + [SEEDED])[-1]
    runs["l1 hit amid others"] = eng.generate(OTHERS[:2] + [PROMPT] + OTHERS[2:],
                                              others[:2] + [SEEDED] + others[2:])[2]
    assert runs["l1 hit amid others"].cached_tokens["l1"] == 24

    async def tiers() -> list[int]:
        eng = make_engine(num_pages=256)
        await eng.start()
        await eng.generate_async([PROMPT], SEEDED)
        await eng.cache.drain()
        eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
        runs["l2 hit amid others"] = (await eng.generate_async([PROMPT] + OTHERS, [SEEDED] + others))[0]
        assert runs["l2 hit amid others"].cached_tokens["l2"] == 24
        await eng.cache.drain()
        eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
        eng.cache.tree.evict(Tier.L2, eng.cache.l2.num_pages)
        runs["l3 hit"] = (await eng.generate_async([PROMPT], [SEEDED]))[0]
        assert runs["l3 hit"].cached_tokens["l3"] == 24

        async def stream(prompt, params):
            return [ev.token_id async for ev in eng.submit(prompt, params) if ev.token_id is not None]
        tasks = [asyncio.ensure_future(stream(p, UNSEEDED)) for p in OTHERS]
        while eng.stats["decode_tokens"] == 0:  # the others are decoding when it arrives
            await asyncio.sleep(0.001)
        submitted = await stream(PROMPT, SEEDED)
        await asyncio.gather(*tasks)
        await eng.shutdown()
        return submitted
    submitted = asyncio.run(tiers())
    assert {k: r.output_ids for k, r in runs.items()} == {k: alone for k in runs}
    assert submitted == alone


def test_temperature_0_is_greedy_whatever_the_seed_and_top_p():
    eng = _engine()
    greedy = eng.generate([PROMPT, OTHERS[0]], SamplingParams(max_tokens=6, ignore_eos=True))
    for seed, top_p in [(1, 1.0), (2, 0.1), (None, 0.5)]:
        p = SamplingParams(max_tokens=6, temperature=0.0, top_p=top_p, seed=seed, ignore_eos=True)
        out = eng.generate([PROMPT, OTHERS[0]], [p, SamplingParams(max_tokens=6, temperature=1.0, seed=9)])
        assert out[0].output_ids == greedy[0].output_ids
    sampled = eng.generate([PROMPT], dataclasses.replace(SEEDED, seed=5))[0].output_ids
    assert sampled != greedy[0].output_ids[:len(sampled)]  # (sampling really samples at this temperature)


# -- the filtered distribution ---------------------------------------------------------------------------
def _frequencies(logits: torch.Tensor, temperature: float, top_p: float, n: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[-1])
    for _ in range(n):
        counts[int(sample(logits, [temperature], [top_p], [gen])[0])] += 1
    return (counts / n).tolist()


@pytest.mark.parametrize("temperature,top_p,expected", [
    # p = (1/2, 1/4, 1/8, 1/16, 1/16): mass before token 2 is 0.75 < 0.8 -> tokens 0..2, renormalised
    (1.0, 0.8, [4 / 7, 2 / 7, 1 / 7, 0.0, 0.0]),
    # temperature first: p ~ sqrt -> (.343, .243, .172, .121, .121); mass before token 3 is .758 < .8
    (2.0, 0.8, [w / 0.8787 for w in (0.3431, 0.2426, 0.1716, 0.1213)] + [0.0]),
    (1.0, 0.5, [1.0, 0.0, 0.0, 0.0, 0.0]),  # the likeliest alone covers 0.5
    (1.0, 1.0, [0.5, 0.25, 0.125, 0.0625, 0.0625]),
])
def test_top_p_keeps_exactly_the_nucleus_after_temperature(temperature, top_p, expected):
    logits = torch.tensor([[math.log(w) for w in (0.5, 0.25, 0.125, 0.0625, 0.0625)]])
    n = 3000
    freq = _frequencies(logits, temperature, top_p, n, seed=17)
    for f, e in zip(freq, expected):
        if e == 0.0:
            assert f == 0.0, freq  # outside the nucleus: never drawn
        else:
            assert abs(f - e) < 5 * math.sqrt(e * (1 - e) / n) + 1e-9, (freq, expected)


# -- stops, EOS, lengths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10, ignore_eos=True), SEEDED],
                         ids=["greedy", "seeded"])
def test_stop_ids_eos_and_max_tokens_end_exactly_there(params):
    """A stop id or EOS ends the request at its first occurrence, that token included, in a batch with
    others and through decode chains; ignore_eos goes past EOS (a stop id still stops);
    max_tokens=1 is the first token."""
    eng = _engine()
    ref = eng.generate([PROMPT], params)[0].output_ids
    k = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i])  # its first occurrence is at k
    others = [UNSEEDED] * 2

    def run(**kw):
        return eng.generate([OTHERS[0], PROMPT, OTHERS[1]], others[:1] + [dataclasses.replace(params, **kw)]
                            + others[1:])[1]
    r = run(stop_token_ids=(ref[k],))
    assert (r.output_ids, r.finish_reason) == (ref[:k + 1], "stop")
    r = run(stop_token_ids=(VOCAB - 1 if ref[0] != VOCAB - 1 else 0, ref[0]))
    assert (r.output_ids, r.finish_reason) == (ref[:1], "stop")
    r = run(max_tokens=1)
    assert (r.output_ids, r.finish_reason) == (ref[:1], "length")

    eng.model_config = dataclasses.replace(eng.model_config, eos_token_id=ref[k])  # a model with an EOS
    r = run(ignore_eos=False)
    assert (r.output_ids, r.finish_reason) == (ref[:k + 1], "stop")
    r = run(ignore_eos=True)
    assert (r.output_ids, r.finish_reason) == (ref, "length")
    r = run(ignore_eos=True, stop_token_ids=(ref[k],))
    assert (r.output_ids, r.finish_reason) == (ref[:k + 1], "stop")
    assert_whole(eng)


# -- invalid values ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    dict(temperature=-0.5), dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature=100.5),
    dict(top_p=0.0), dict(top_p=-0.1), dict(top_p=1.5), dict(top_p=math.nan), dict(max_tokens=0),
    dict(max_tokens=-3), dict(seed=1 << 64, temperature=1.0), dict(seed=-(1 << 63) - 1, temperature=1.0),
], ids=lambda d: ",".join(f"{k}={v!r}" for k, v in d.items()))
def test_an_invalid_value_is_that_requests_error_naming_it(bad):
    eng = _engine()
    [ref] = eng.generate([OTHERS[0]], SEEDED)
    good, broken = eng.generate([OTHERS[0], PROMPT], [SEEDED, dataclasses.replace(SEEDED, **bad)])
    assert good.error is None and good.output_ids == ref.output_ids
    assert broken.finish_reason == "error" and next(iter(bad)) in broken.error, broken.error
    assert eng.stats["failed"] == 0
    assert_whole(eng)
