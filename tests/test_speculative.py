"""Speculative decoding by prompt lookup (scheduler/speculative.py, vLLM's `--speculative-config` method "ngram"):
the config's parsing (vLLM's defaults) and the server's refusal of a bad one; TokenHistory.propose against a naive
reference (ids whose bytes match across token boundaries too); accept(); then the tiny CPU engine: greedy outputs
with speculation equal those without, token for token (repeating and non-repeating prompts, batches, max_tokens
caps, a stop token inside an accepted run, a mixed batch). Abort, Prometheus and the prefix cache after
speculation: tests/test_speculative_hunt.py."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_helpers import until
from scheduler import serve
from scheduler.config import EngineConfig, config_from_args
from scheduler.engine import Engine
from scheduler.request import RequestState, SamplingParams
from scheduler.speculative import SpeculativeConfig, Speculator, TokenHistory, accept

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2, draft_policy="always")
VOCAB = 512


def make_engine(speculative: SpeculativeConfig | None = None, **kw) -> Engine:
    return Engine(EngineConfig(**{"model": "tiny", "device": "cpu", "page_size": 4, "num_pages": 512,
                                  "speculative": speculative, **kw}))


def ref_propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The spec of TokenHistory.propose, naively: the longest suffix of n tokens (n_max >= n >= n_min) that occurs
    earlier, ending before the last token; the k tokens after its latest such occurrence."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        for s in range(total - n - 1, -1, -1):
            if tokens[s:s + n] == tokens[total - n:]:
                return tokens[s + n:s + n + k]
    return []


def find_looping(prompts: list[list[int]], outputs: list[list[int]], n_min: int, n_max: int) -> list[list[int]]:
    """Prompts P + O[:m] (O: P's greedy output) whose continuation O[m:] is drafted right at its first decode step
    (the history after O[m] proposes O[m + 1]): a request that speculates, and has a draft accepted, at once."""
    found = []
    for p, o in zip(prompts, outputs):
        for m in range(2, len(o) - 6):
            h = p + o[:m]
            if ref_propose(h + [o[m]], 1, n_min, n_max) == [o[m + 1]]:
                found.append(h)
                break
    return found


def looping_prompts(seed: int, length: int, tries: int, max_tokens: int, need: int) -> list[list[int]]:
    """`find_looping`'s prompts among `tries` random ones of `length` tokens (their greedy outputs of max_tokens by
    the tiny engine), at least `need` of them."""
    rng = random.Random(seed)
    seeds = [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(tries)]
    outs = [r.output_ids for r in make_engine().generate(seeds, SamplingParams(max_tokens=max_tokens))]
    found = find_looping(seeds, outs, SPEC.prompt_lookup_min, SPEC.prompt_lookup_max)
    assert len(found) >= need, "the tiny model's greedy outputs no longer repeat: pick other seeds"
    return found


class Step(NamedTuple):
    rid: str
    max_tokens: int
    out_before: int     # the request's output length when the step was planned
    draft: list[int]
    yielded: list[int]  # accept()'s tokens
    taken: list[int]    # those the request took (fewer where it ended within them)


def record_steps(monkeypatch) -> list[Step]:
    """Every verify step's requests, drafts and tokens (Speculator.after_verify, wrapped)."""
    steps: list[Step] = []
    orig = Speculator.after_verify

    def wrapped(self, reqs, drafts, greedy, after_step):
        before = [len(r.output) for r in reqs]
        taken = orig(self, reqs, drafts, greedy, after_step)
        for r, b, d, g in zip(reqs, before, drafts, greedy):
            steps.append(Step(r.rid, r.params.max_tokens, b, list(d), accept(d, g), r.output[b:]))
        return taken
    monkeypatch.setattr(Speculator, "after_verify", wrapped)
    return steps


def spec_stats(eng: Engine) -> dict:
    return eng.status()["engine"]["speculative"]


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ("verify_steps", "drafts", "draft_tokens", "accepted_tokens")}


# -- SpeculativeConfig ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, want", [
    ({"num_speculative_tokens": 3}, (3, 5, 5)),                             # neither bound: vLLM's 5 and 5
    ({"num_speculative_tokens": 3, "prompt_lookup_max": 2}, (3, 2, 2)),     # one given: the other equals it
    ({"num_speculative_tokens": 3, "prompt_lookup_min": 7}, (3, 7, 7)),
    ({"num_speculative_tokens": 15, "prompt_lookup_max": 4, "prompt_lookup_min": 1}, (15, 4, 1)),
    ({"num_speculative_tokens": 1, "prompt_lookup_max": 3, "prompt_lookup_min": 3}, (1, 3, 3)),
])
@pytest.mark.parametrize("method", ["ngram", "[ngram]"])
@pytest.mark.parametrize("as_text", [False, True])
def test_parse_takes_vllms_defaults_and_spellings(fields, want, method, as_text):
    value = {"method": method, **fields}
    cfg = SpeculativeConfig.parse(json.dumps(value) if as_text else value)
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == want
    assert cfg.method == "ngram"


@pytest.mark.parametrize("value", [None, "", {}, "{}"])
def test_parse_of_nothing_is_off(value):
    assert SpeculativeConfig.parse(value) is None


@pytest.mark.parametrize("value, match", [
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ("5", "JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "draft_model": "x"}', r"unknown.*draft_model"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "model": "x", "zeta": 1}', r"\['model', 'zeta'\]"),
    ('{"num_speculative_tokens": 3}', "needs a method"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "not served"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": -2}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2.0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 16}', "at most 15"),
    # (the key given is named, not the min copied from it: session 52)
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}', "prompt_lookup_max must be"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 0}',
     "prompt_lookup_max must be"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": false, "prompt_lookup_max": 3}',
     "prompt_lookup_min must be"),
    # (min alone is copied to max, which is checked first: the message names max, with the value given)
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": false}', "must be an integer.*False"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 3}',
     r"prompt_lookup_min \(4\) must not exceed prompt_lookup_max \(3\)"),
])
def test_parse_refuses_bad_configs_saying_why(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(value)


def test_the_server_flag_reaches_the_engine_config():
    args = serve.build_parser().parse_args(["--model", "tiny", "--device", "cpu", "--speculative-config",
                                            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'])
    assert config_from_args(args).speculative == SpeculativeConfig(3, prompt_lookup_max=2, prompt_lookup_min=2)
    assert config_from_args(serve.build_parser().parse_args(["--model", "tiny"])).speculative is None


@pytest.mark.parametrize("value, match", [
    ("{oops", "not JSON"), ('{"method": "ngram", "num_speculative_tokens": 99}', "at most 15"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "not served"),
])
def test_the_server_refuses_a_bad_flag_with_exit_2(capsys, value, match):
    assert serve.main(["--port", "0", "--device", "cpu", "--model", "tiny", "--speculative-config", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hicache-serve: ") and len(err.strip().splitlines()) == 1
    assert re.search(match, err), err


# -- TokenHistory.propose ---------------------------------------------------------------------------------
# ids whose packed int32 bytes (little-endian) line up across token boundaries: 256 = 00 01 00 00, 65536 =
# 00 00 01 00, and [1, 256] = 01 00 00 00 00 01 00 00 holds 65536's bytes at byte 3
ODD_IDS = [0, 1, 256, 65536, 16777216, 257, 65793, 0x01010101, 0x00010001, 0x01000100, 0x7FFFFFFF, 0x7F7F7F7F]


def history_of(tokens: list[int]) -> TokenHistory:
    h = TokenHistory()
    h.sync(tokens, [])
    return h


def test_a_match_across_token_boundaries_is_skipped_for_the_aligned_one_before_it():
    tokens = [7, 65536, 9, 3, 1, 256, 5, 65536]
    data = history_of(tokens)._buf.tobytes()
    misaligned = data.rfind((65536).to_bytes(4, "little"), 0, (len(tokens) - 1) * 4)
    assert misaligned % 4 != 0  # (the case: the latest byte match straddles two tokens)
    assert history_of(tokens).propose(3, 1, 1) == [9, 3, 1] == ref_propose(tokens, 3, 1, 1)
    # no aligned occurrence at all: nothing, though the bytes match
    assert history_of([1, 256, 5, 65536]).propose(2, 1, 3) == [] == ref_propose([1, 256, 5, 65536], 2, 1, 3)


@pytest.mark.parametrize("tokens, k, n_min, n_max, want", [
    ([1, 2, 3, 1, 2], 2, 1, 3, [3, 1]),        # longest suffix [1, 2]: what followed it
    ([1, 2, 3, 9, 2, 5, 1, 2], 3, 1, 2, [3, 9, 2]),
    ([4, 4, 4, 4], 5, 1, 3, [4]),              # an occurrence overlapping the suffix: the latest, one token follows
    ([1, 2, 3], 2, 1, 2, []),                  # nothing occurs earlier
    ([5], 2, 1, 5, []), ([], 2, 1, 5, []),     # too short for any suffix
    ([1, 2, 1, 3, 1], 2, 2, 2, []),            # [3, 1] never occurs earlier; n_min 2 takes no unigram
    ([1, 2, 1, 3, 1], 2, 1, 2, [3, 1]),        # the latest of two occurrences of [1]
    ([1, 2, 3, 1, 2], 0, 1, 3, []),            # k 0
])
def test_propose_cases(tokens, k, n_min, n_max, want):
    assert history_of(tokens).propose(k, n_min, n_max) == want == ref_propose(tokens, k, n_min, n_max)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.one_of(st.sampled_from(ODD_IDS), st.integers(0, 3)), max_size=40),
       k=st.integers(0, 6), n_min=st.integers(1, 4), extra=st.integers(0, 3), split=st.integers(0, 40))
def test_propose_is_the_naive_lookup(tokens, k, n_min, extra, split):
    """Also built the way the engine builds it: the prompt, then the output synced a part at a time."""
    n_max = n_min + extra
    want = ref_propose(tokens, k, n_min, n_max)
    assert history_of(tokens).propose(k, n_min, n_max) == want
    h, prompt = TokenHistory(), tokens[:split]
    out = tokens[split:]
    for end in range(0, len(out) + 1, 3):
        h.sync(prompt, out[:end])
    h.sync(prompt, out)
    assert len(h) == len(tokens) and h._buf.tolist() == tokens
    assert h.propose(k, n_min, n_max) == want


def test_sync_appends_only_what_is_new():
    h = TokenHistory()
    h.sync([1, 2, 3], [])
    h.sync([1, 2, 3], [])
    assert h._buf.tolist() == [1, 2, 3] and len(h) == 3
    h.sync([1, 2, 3], [4])
    h.sync([1, 2, 3], [4, 5, 6])
    h.sync([1, 2, 3], [4, 5, 6])
    assert h._buf.tolist() == [1, 2, 3, 4, 5, 6] and len(h) == 6
    late = TokenHistory()  # first synced with output already there
    late.sync([1, 2, 3], [4, 5])
    assert late._buf.tolist() == [1, 2, 3, 4, 5]


# -- accept ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("drafts, greedy, want", [
    ([7, 8, 9], [7, 8, 9, 10], [7, 8, 9, 10]),  # all accepted: k + 1 tokens
    ([7, 8, 9], [6, 8, 9, 10], [6]),            # the first rejected: the greedy token alone
    ([7, 8, 9], [7, 5, 9, 10], [7, 5]),         # accepted up to the first miss, then the row after it
    ([7, 8, 9], [7, 8, 4, 10], [7, 8, 4]),
    ([], [3], [3]),                             # none drafted: the pending token's greedy one
])
def test_accept(drafts, greedy, want):
    assert accept(drafts, greedy) == want


# -- the engine: greedy outputs are those without speculation ----------------------------------------------
@pytest.fixture(scope="module")
def plain() -> Engine:
    return make_engine()


@pytest.fixture(scope="module")
def spec() -> Engine:
    return make_engine(SPEC)


@pytest.fixture(scope="module")
def prompts(plain):
    """(looping: prompts drafted and accepted from their first decode step, repeating: a random block 3-4 times,
    fresh: no repeat). (The random model does not copy a repeated block: the history's suffix, its own tokens
    included, occurs nowhere earlier, so `repeating` decodes in plain steps; `looping` repeats its own output.)"""
    rng = random.Random(5)
    seeds = [[rng.randrange(VOCAB) for _ in range(20)] for _ in range(8)]
    outs = [r.output_ids for r in plain.generate(seeds, SamplingParams(max_tokens=32))]
    looping = find_looping(seeds, outs, SPEC.prompt_lookup_min, SPEC.prompt_lookup_max)
    assert len(looping) >= 3, "the tiny model's greedy outputs no longer repeat: pick other seeds"
    blocks = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 13, 6)]
    repeating = [blocks[0] * 3, blocks[1] * 4, blocks[2] * 4 + blocks[2][:3]]
    fresh = [rng.sample(range(VOCAB), n) for n in (11, 25, 40)]
    return looping[:4], repeating, fresh


def test_greedy_outputs_equal_those_without_speculation_in_a_batch(plain, spec, prompts):
    looping, repeating, fresh = prompts
    batch = looping + repeating + fresh
    params = SamplingParams(max_tokens=24)
    want = [r.output_ids for r in plain.generate(batch, params)]
    before = spec_stats(spec)
    got = spec.generate(batch, params)
    assert [r.output_ids for r in got] == want
    assert all(r.error is None and r.finish_reason == "length" and len(r.output_ids) == 24 for r in got)
    d = delta(spec_stats(spec), before)
    assert d["drafts"] > 0 and d["accepted_tokens"] > 0 and d["draft_tokens"] >= d["accepted_tokens"]
    assert spec.stats["decode_tokens"] > 0
    spec.check_integrity()


@pytest.mark.parametrize("kind", ["looping", "repeating", "fresh"])
def test_each_prompt_alone_equals_its_plain_output(plain, spec, prompts, kind):
    group = dict(zip(("looping", "repeating", "fresh"), prompts))[kind]
    params = SamplingParams(max_tokens=16)
    for p in group:
        before = spec_stats(spec)
        [got] = spec.generate([p], params)
        [want] = plain.generate([p], params)
        assert got.output_ids == want.output_ids, p
        d = delta(spec_stats(spec), before)
        if kind == "looping":  # (drafted at its first decode step, and that draft is right)
            assert d["drafts"] > 0 and d["accepted_tokens"] > 0, d
    spec.check_integrity()


@pytest.mark.parametrize("cfg", [SpeculativeConfig(1, prompt_lookup_max=1, prompt_lookup_min=1, draft_policy="always"),
                                 SpeculativeConfig(15, prompt_lookup_max=1, prompt_lookup_min=1, draft_policy="always"),
                                 SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 7,
                                                          "draft_policy": "always"})])
def test_other_configs_give_the_same_outputs(plain, prompts, cfg):
    batch = [p for group in prompts for p in group]
    params = SamplingParams(max_tokens=20)
    eng = make_engine(cfg)
    got = eng.generate(batch, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain.generate(batch, params)]
    stats = spec_stats(eng)
    assert stats["drafts"] > 0 and len(stats["accepted_per_pos"]) == cfg.num_speculative_tokens
    assert sum(stats["accepted_per_pos"]) == stats["accepted_tokens"]
    assert all(a >= b for a, b in zip(stats["accepted_per_pos"], stats["accepted_per_pos"][1:]))
    eng.check_integrity()


# -- boundaries -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4])
def test_drafts_are_capped_by_max_tokens(plain, spec, prompts, monkeypatch, max_tokens):
    batch = [p for group in prompts for p in group]
    params = SamplingParams(max_tokens=max_tokens)
    steps = record_steps(monkeypatch)
    got = spec.generate(batch, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain.generate(batch, params)]
    assert all(len(r.output_ids) == max_tokens and r.finish_reason == "length" for r in got)
    for s in steps:  # (room: the step's own token is the last the request may have)
        assert len(s.draft) <= min(SPEC.num_speculative_tokens, s.max_tokens - s.out_before - 1), s
        assert s.taken == s.yielded  # (never more than max_tokens: nothing cut)
    if max_tokens >= 3:  # drafts of the looping prompts, capped
        assert any(s.draft for s in steps)
        assert any(len(s.yielded) == max_tokens - 1 for s in steps)  # a step filled the request at once
    else:  # no room for a draft: plain decode steps only
        assert not any(s.draft for s in steps)
    spec.check_integrity()


@pytest.mark.parametrize("how", ["stop_token_ids", "eos"])
def test_a_stop_token_inside_an_accepted_run_ends_the_output_there(plain, prompts, monkeypatch, how):
    """The stop id is a draft accepted before others in one verify step: the tokens after it are dropped."""
    looping = prompts[0]
    eng = make_engine(SPEC)
    steps = record_steps(monkeypatch)
    free = eng.generate(looping, SamplingParams(max_tokens=24))
    outs = {r.rid: r.output_ids for r in free}
    pick = None
    for s in steps:  # a token taken mid-step, before two more of that step, at its first place in the output
        out = outs[s.rid]
        for j, tok in enumerate(s.taken[:-2]):
            if out.index(tok) == s.out_before + j:
                pick = (next(i for i, r in enumerate(free) if r.rid == s.rid), tok, s.out_before + j)
                break
        if pick:
            break
    assert pick, "no accepted run to stop in"
    i, stop, at = pick
    if how == "eos":
        for e in (plain, eng):
            monkeypatch.setattr(e, "model_config", dataclasses.replace(e.model_config, eos_token_id=stop))
        params = SamplingParams(max_tokens=24)
    else:
        params = SamplingParams(max_tokens=24, stop_token_ids=(stop,))
    steps.clear()
    made = eng.stats["decode_tokens"]
    [got] = eng.generate([looping[i]], params)
    [want] = plain.generate([looping[i]], params)
    assert eng.stats["decode_tokens"] - made == len(got.output_ids) - 1  # (the tokens past the stop: not counted)
    assert got.output_ids == want.output_ids == outs[free[i].rid][:at + 1]
    assert got.finish_reason == want.finish_reason == "stop"
    assert any(stop in s.yielded[:-1] and s.taken[-1] == stop for s in steps)  # (ended inside a verify step)
    eng.check_integrity()


# -- a mixed batch ------------------------------------------------------------------------------------------
def test_greedy_sampled_and_logprobs_requests_together(plain, prompts, monkeypatch):
    looping, repeating, _ = prompts
    batch = [looping[0], looping[1], repeating[0], looping[2]]
    params = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, temperature=0.8, seed=11),
              SamplingParams(max_tokens=20, logprobs=2), SamplingParams(max_tokens=20, temperature=0.8, seed=12,
                                                                        top_p=0.9)]
    eng = make_engine(SPEC)
    steps = record_steps(monkeypatch)
    got = eng.generate(batch, params)
    want = plain.generate(batch, params)
    assert {s.rid for s in steps} <= {got[0].rid, got[2].rid}  # the greedy ones verify (logprobs or not), the
    assert got[0].rid in {s.rid for s in steps}                   # seeded sampled ones do not
    assert all(r.error is None and len(r.output_ids) == 20 for r in got)
    for g, w in zip(got, want):  # greedy, seeded-sampled (plain steps of their own) and logprobs alike
        assert g.output_ids == w.output_ids
    assert [lp.logprob for lp in got[2].logprobs] == pytest.approx([lp.logprob for lp in want[2].logprobs], abs=1e-4)
    [alone] = plain.generate([batch[2]], SamplingParams(max_tokens=20))  # (the logprobs one is greedy)
    assert got[2].output_ids == alone.output_ids
    stats = spec_stats(eng)
    assert stats["drafts"] > 0 and stats["accepted_tokens"] > 0  # (the greedy one speculated among them)
    eng.check_integrity()


def test_verify_rows_are_the_drafts_and_pending_token_rounded_up_to_a_power_of_two():
    from scheduler.speculative import verify_rows
    assert [verify_rows(k) for k in range(1, 16)] == [2, 4, 4] + [8] * 4 + [16] * 8



@pytest.mark.asyncio
async def test_requests_split_off_a_verify_step_decode_while_its_drafting_request_waits_for_room():
    """Regression (session 57's liveness hunt): a verify step holds only the requests that draft; when its drafting
    request waited for an L1 page that a write_back backup was still copying, the step came out empty and the loop
    slept until that copy ended, although a sampled request beside it had every page its next token needed. The
    backups' copies are slowed here (a busy link) so that window is wide; the loop must never sleep while a request
    in decode holds the pages of its next token."""
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1, draft_policy="always")
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=12, decode_reserve_ratio=0.0,
                              overlap_schedule=False, speculative=spec).with_hicache(
        enable=True, policy="always", host_ratio=4.0, storage_ratio=0.0, transfer_backend="torch",
        write_policy="write_back"))
    transfer = eng.cache.transfer
    wait = transfer.wait

    async def slow_wait(handle):
        if handle.direction == "d2h":
            await asyncio.sleep(0.3)
        return await wait(handle)
    transfer.wait = slow_wait
    await eng.start()
    idle_beside_ready, sleep = [], eng._wake.wait

    async def watched_sleep():  # (the loop sleeps here when a tick formed no batch)
        idle_beside_ready.extend(r.rid for r in eng.running if r.state is RequestState.DECODE
                                 and len(r.pages) * eng.page_size >= len(r.prompt) + len(r.output))
        await sleep()
    eng._wake.wait = watched_sleep
    # two answers fill the L1 the two requests below leave free, unsaved (write_back); the first is the greedy
    # prompt's earlier answer, which the greedy request drafts from
    await eng.generate_async([[5, 6, 7, 8] * 2, [100 + j for j in range(16)]],
                             [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=1)])
    greedy = eng.add_request([5, 6, 7, 8] * 2, SamplingParams(max_tokens=12, ignore_eos=True))
    sampled = eng.add_request([11, 12, 13, 14], SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                                                               ignore_eos=True))  # (never drafts)
    await until(lambda: greedy.state.done and sampled.state.done, 60)
    assert idle_beside_ready == []
    assert len(greedy.output) == len(sampled.output) == 12
    await eng.cache.drain()
    eng.cache.check_integrity()
    await eng.shutdown()
