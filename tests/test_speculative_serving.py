"""Speculative decoding (scheduler/speculative.py) against the rest of the engine: the HTTP server (stop strings
whose match ends inside a verify step, streaming, n choices, small max_tokens, the CLI flag), prefixes restored from
L2 / L3 (write_through and write_back) then decoded with speculation, the replay driver, shutdown and abort with
requests mid-verify, shared prefill of identical prompts, priority scheduling and one running slot. Greedy on the
CPU in float32: every output equals the same engine's without speculation, token for token."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from types import SimpleNamespace

import httpx
import pytest

from hicache.radix import Tier
from hicache_helpers import finish, read_stream
from scheduler import serve
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from scheduler.speculative import Speculator
from server_fixtures import byte_level_server, ok, sse, tiny_config
from test_speculative import SPEC, VOCAB, looping_prompts, make_engine, record_steps, spec_stats

@pytest.fixture(scope="module")
def looping() -> list[list[int]]:
    """Prompts of >= 40 tokens (shared prefill's threshold is 32) drafted, and a draft accepted, at their first
    decode step (test_speculative.find_looping)."""
    return looping_prompts(7, 40, 10, 40, need=4)[:4]


@pytest.fixture(scope="module")
def plain() -> Engine:
    return make_engine()


def want(plain: Engine, prompts, params) -> list[list[int]]:
    return [r.output_ids for r in plain.generate(prompts, params)]


def l1_back(eng: Engine) -> None:
    """No request holds an L1 page: each is free or the tree's, none private, none locked."""
    l1 = eng.status()["tiers"]["l1"]
    assert l1["private_pages"] == 0, l1
    assert l1["free_pages"] + l1["evictable_pages"] == l1["capacity_pages"], l1


# -- 1. the HTTP server ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(speculating, plain) byte-level servers of the tiny model."""
    with byte_level_server(tmp_path_factory, tiny_config(speculative=SPEC)) as s, \
            byte_level_server(tmp_path_factory, tiny_config()) as p:
        yield s, p


def completion(srv, body: dict, stream: bool) -> dict:
    """/v1/completions, streamed or not, as {"choices": [{text, token_ids, finish_reason, stop_reason}], usage} (the
    usage's token counts: cached tokens differ between servers)."""
    body = {"model": "tiny", "temperature": 0, **body}
    if not stream:
        r = ok(srv, "/v1/completions", body)
        keys = ("text", "token_ids", "finish_reason", "stop_reason")
        return {"choices": [{k: c[k] for k in keys} for c in sorted(r["choices"], key=lambda c: c["index"])],
                "usage": counts(r["usage"])}
    chunks = sse(srv, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    choices: dict[int, dict] = {}
    for c in (c for ch in chunks[:-1] for c in ch["choices"]):
        acc = choices.setdefault(c["index"], {"text": "", "token_ids": [], "finish_reason": None, "stop_reason": None})
        acc["text"] += c["text"]
        acc["token_ids"] += c.get("token_ids") or []
        if c["finish_reason"] is not None:
            acc["finish_reason"], acc["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    assert not chunks[-1]["choices"]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": counts(chunks[-1]["usage"])}


def counts(usage: dict) -> dict:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def server_spec(srv) -> dict:
    return srv.call(srv.engine.status)["engine"]["speculative"]


def settled(srv) -> None:
    """Once the server's engine ended every request (a stop string's abort lands at the loop's next tick): its
    integrity, and every L1 page back."""
    for _ in range(500):
        if srv.call(lambda: not srv.engine.requests and not srv.engine.running):
            break
        time.sleep(0.01)
    srv.call(srv.engine.check_integrity)
    srv.call(l1_back, srv.engine)


def mid_step_stops(tok, out: list[int], steps, span: int):
    """(j, stop): a stop string whose text ends with token j's, which a verify step took before its last token;
    span 1: token j's text (one character), span 2: text of two characters or more from an earlier token of that
    step on."""
    for s in steps:
        for j in range(s.out_before, s.out_before + len(s.taken) - 1):
            for a in ([j] if span == 1 else range(s.out_before, j)):
                stop = tok.decode(out[a:j + 1])
                if stop and "\ufffd" not in stop and (len(stop) == 1) == (span == 1) and tok.decode(out[j:j + 1]):
                    yield j, stop


@pytest.mark.parametrize("stream, include", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("span", [1, 2])
def test_a_stop_string_matched_inside_a_verify_step(servers, looping, monkeypatch, stream, include, span):
    """The stop string's match is completed by a token a verify step took before others: the text ends before it,
    usage and token_ids count up to and including that token (vLLM's count), as without speculation. span: the
    stop string is that token's text, or text that starts in an earlier token of the same step. include: vLLM's
    include_stop_str_in_output."""
    spec, plain = servers
    steps = record_steps(monkeypatch)
    tried = []
    for prompt in looping:
        steps.clear()
        free = completion(spec, {"prompt": prompt, "max_tokens": 40, "ignore_eos": True}, False)["choices"][0]
        out, made = free["token_ids"], list(steps)
        for j, stop in mid_step_stops(spec.tok, out, made, span):
            body = {"prompt": prompt, "max_tokens": 40, "ignore_eos": True, "stop": [stop],
                    "include_stop_str_in_output": include}
            base = completion(plain, body, stream)
            tried.append((j, stop, base["usage"]["completion_tokens"]))
            if base["usage"]["completion_tokens"] != j + 1:
                continue  # (its text occurs earlier: the match ends elsewhere)
            steps.clear()
            got = completion(spec, body, stream)
            assert got == base
            c = got["choices"][0]
            assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
            assert c["text"].endswith(stop) if include else stop not in c["text"]
            assert c["token_ids"] == out[:j + 1] and got["usage"]["completion_tokens"] == j + 1
            assert any(s.out_before <= j < s.out_before + len(s.taken) - 1 for s in steps)  # (the case: mid-step)
            settled(spec)
            return
    pytest.fail(f"no stop string ends inside a verify step: {tried}")


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 20])
def test_streamed_and_whole_n_greedy_choices_equal_the_plain_server(servers, looping, max_tokens):
    spec, plain = servers
    before = server_spec(spec)["accepted_tokens"]
    body = {"prompt": looping[1], "max_tokens": max_tokens, "n": 3, "ignore_eos": True}
    base = completion(plain, body, False)
    assert len(base["choices"]) == 3 and len(base["choices"][0]["token_ids"]) == max_tokens
    assert all(c == base["choices"][0] for c in base["choices"])  # (greedy: n equal choices)
    whole, streamed = completion(spec, body, False), completion(spec, body, True)
    assert whole == base
    assert streamed == base
    if max_tokens >= 3:
        assert server_spec(spec)["accepted_tokens"] > before  # (they speculated)
    settled(spec)


def itl_count(srv) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    fams = text_string_to_metric_families(httpx.get(srv.url + "/metrics", timeout=30).text)
    return sum(s.value for f in fams for s in f.samples if s.name == "vllm:inter_token_latency_seconds_count")


def test_inter_token_latency_is_observed_once_per_step_as_vllms(servers, looping, monkeypatch):
    """vLLM observes vllm:inter_token_latency_seconds once per engine iteration and request (v1/metrics/stats.py
    update_from_output), however many tokens the iteration made; scheduler/prom_vllm.py equates that with once
    per token because one step made one token. A verify step makes several: still one gap."""
    spec, _ = servers
    steps = record_steps(monkeypatch)
    before = itl_count(spec)
    got = completion(spec, {"prompt": looping[2], "max_tokens": 24, "ignore_eos": True}, False)
    made = [len(s.taken) for s in steps]
    assert got["usage"]["completion_tokens"] == 24 and max(made) > 1  # (a verify step made several)
    # the steps after the first token: each verify step, and each plain decode step (one token each)
    assert itl_count(spec) - before == 23 - sum(n - 1 for n in made)


def test_the_serve_cli_builds_a_speculating_engine(monkeypatch):
    built = []  # (serve.main stops where uvicorn would start)
    monkeypatch.setattr(serve, "_Server", lambda config, on_exit, on_force, **more: built.append(config.app) or SimpleNamespace(
        run=lambda: None, config=config))
    flag = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
                       "draft_policy": "always"})
    assert serve.main(["--port", "0", "--model", "tiny", "--device", "cpu", "--speculative-config", flag,
                       "--enable-hicache", "--scheduling-policy", "priority"]) == 0
    eng = built[0].state.hc.engine
    assert eng.config.speculative == SPEC and eng.speculator is not None and eng.speculator.config == SPEC
    assert eng.config.hicache.enable and eng.config.scheduling_policy == "priority"
    assert serve.main(["--port", "0", "--model", "tiny", "--device", "cpu"]) == 0
    assert built[1].state.hc.engine.speculator is None
    for app in built:  # (the L3 temp file removed)
        asyncio.run(app.state.hc.engine.shutdown())


# -- 2. hicache tiers: a prefix restored from L2 / L3, then decoded with speculation ---------------------------
async def below_l1(eng: Engine, tier: str) -> None:
    """Every tree page out of L1 (under write_back written back first), and out of L2 too for tier "l3"."""
    await eng.cache.drain()
    for t in (Tier.L1, Tier.L2)[:2 if tier == "l3" else 1]:
        await eng.cache.flush_async(t)
        await eng.cache.drain()


def tiered_engine(tier: str, write_policy: str, num_pages: int, tmp_path) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=num_pages, speculative=SPEC)
                  .with_hicache(enable=True, policy="always", write_policy=write_policy, host_ratio=2.0,
                                storage_ratio=4.0 if tier == "l3" else 0.0,
                                storage_path=str(tmp_path / "l3.bin") if tier == "l3" else None))


@pytest.mark.parametrize("tier, write_policy", [("l2", "write_through"), ("l2", "write_back"),
                                                ("l3", "write_through"), ("l3", "write_back")])
def test_a_prefix_restored_from_a_lower_tier_then_speculated(plain, looping, tmp_path, tier, write_policy):
    """The prompt's prefix comes back from L2 / L3, the request decodes with speculation; then its answer's pages
    (written by verify steps, saved to L2 / L3) come back for a follow-up, which equals a plain engine's too. The
    answer's K/V ends 3 tokens into a page: one token more claimed would publish that page (garbage K/V)."""
    eng = tiered_engine(tier, write_policy, 96, tmp_path)
    prompt = looping[0]
    params = SamplingParams(max_tokens=24 + (3 - (len(prompt) + 23)) % 4)
    kv_len = len(prompt) + params.max_tokens - 1
    assert kv_len % 4 == 3
    [first_want] = want(plain, [prompt], params)
    follow = prompt + first_want + [3]

    async def run():
        await eng.start()
        await eng.generate_async([prompt + [1]], SamplingParams(max_tokens=1))
        await below_l1(eng, tier)
        [first] = await eng.generate_async([prompt], params)
        assert first.output_ids == first_want
        assert first.cached_tokens[tier] == len(prompt) - 1 - (len(prompt) - 1) % 4  # (restored from there)
        assert spec_stats(eng)["accepted_tokens"] > 0
        await below_l1(eng, tier)
        [second] = await eng.generate_async([follow], SamplingParams(max_tokens=16))
        assert second.cached_tokens[tier] == kv_len - 3  # (the answer's full pages: verify steps wrote them)
        assert eng.metrics()["restores_done"] >= 2
        await finish(eng)
        return second.output_ids
    assert asyncio.run(run()) == want(plain, [follow], SamplingParams(max_tokens=16))[0]


def test_write_back_under_l1_pressure_drops_drafts_it_has_no_page_for(plain, looping, tmp_path, monkeypatch):
    """L1 full of the tree's unsaved pages (write_back): a verify step's pages for drafts cannot be had until their
    write-back ends; the step goes on without those drafts (Admission.decode_batch), outputs unchanged."""
    from scheduler.admission import Admission
    eng = tiered_engine("l2", "write_back", 64, tmp_path)
    dropped = []
    grow = Admission._grow

    def counted(self, req, num_tokens):
        got = grow(self, req, num_tokens)
        if not got and req.output and num_tokens > len(req.prompt) + len(req.output):  # (a draft's page)
            dropped.append(req.rid)
        return got
    monkeypatch.setattr(Admission, "_grow", counted)
    rng = random.Random(3)
    params = SamplingParams(max_tokens=40)

    async def run():
        await eng.start()
        for _ in range(6):
            await eng.generate_async([[rng.randrange(VOCAB) for _ in range(60)]], SamplingParams(max_tokens=2))
        got = await eng.generate_async(looping, params)
        await finish(eng)
        return [r.output_ids for r in got]
    assert asyncio.run(run()) == want(plain, looping, params)
    assert dropped and spec_stats(eng)["accepted_tokens"] > 0


# -- 3. the replay driver ------------------------------------------------------------------------------------------
def test_the_replay_with_speculation_equals_the_replay_without(monkeypatch, tmp_path):
    """A slice of the bundled sample with reuse (tests/test_replay.py), one request at a time, hits in every tier."""
    from scheduler.replay import run_cli
    from test_replay import reuse_slice_lines
    verified = []
    orig = Speculator.after_verify

    def counted(self, reqs, drafts, greedy, after_step):
        taken = orig(self, reqs, drafts, greedy, after_step)
        verified.append(taken - len(reqs))  # (the drafts accepted)
        return taken
    monkeypatch.setattr(Speculator, "after_verify", counted)
    trace = tmp_path / "slice.jsonl"
    trace.write_text("\n".join(reuse_slice_lines(16, 200)) + "\n")
    args = ["--trace", str(trace), "--concurrency", "1", "--time-scale", "0", "--block-tokens", "32",
            "--max-input-tokens", "128", "--max-output-tokens", "40", "--l1-tokens", "256", "--l2-tokens", "512",
            "--l3-tokens", "4096", "--hicache-policy", "always", "--no-progress"]
    lookup = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "draft_policy": "always"})
    with_spec = run_cli([*args, "--speculative-config", lookup, "--compare-no-cache"])
    assert sum(verified) > 0  # (drafts accepted)
    assert with_spec["config"]["engine"]["speculative"]["num_speculative_tokens"] == 3
    n = len(verified)
    without = run_cli(args)
    assert len(verified) == n  # (no verify step without the flag)
    assert with_spec["completed"] == without["completed"] == with_spec["requests"] and with_spec["failed"] == 0
    assert with_spec["integrity"] == without["integrity"] == "passed"
    assert with_spec["outputs_digest"] == without["outputs_digest"]
    assert with_spec["compare_no_cache"]["match"]
    assert with_spec["hit_tokens"] == without["hit_tokens"] and min(with_spec["hit_tokens"].values()) > 0
    # the summary's counters: the engine's (its JSON and its table), none without the flag
    from scheduler.replay import format_summary
    spec = with_spec["speculative"]
    # (--compare-no-cache replayed it again, speculating too: the summary counts the first replay's)
    assert 0 < spec["accepted_tokens"] < sum(verified) and 0 < spec["verify_steps"] < n
    assert without["speculative"] is None
    assert (f"{spec['accepted_tokens']:,} of {spec['draft_tokens']:,} tokens accepted in {spec['verify_steps']:,} "
            "verify steps" in format_summary(with_spec))
    assert "speculative drafts" not in format_summary(without)
    assert "decoded plainly" not in format_summary(with_spec)  # (draft_policy "always": none declined)
    # (the sample's prompts recur: drafts from the prefix cache, their earlier answers)
    assert 0 < spec["cache_accepted_tokens"] <= spec["accepted_tokens"]
    assert (f"; {spec['cache_drafts']:,} drafts from the prefix cache, {spec['cache_accepted_tokens']:,} of their "
            "tokens accepted" in format_summary(with_spec))
    declined = {**with_spec, "speculative": {**spec, "declined_steps": 7}}
    assert "verify steps (7 steps of drafts decoded plainly: the cost policy)" in format_summary(declined)


# -- 4. shutdown and abort mid-verify ------------------------------------------------------------------------------
async def until(cond, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.002)):
        if cond():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("timed out")


def record_batches(monkeypatch) -> list[tuple[str, ...]]:
    """Every verify step's request ids, in order."""
    batches: list[tuple[str, ...]] = []
    orig = Speculator.after_verify

    def wrapped(self, reqs, drafts, greedy, after_step):
        batches.append(tuple(r.rid for r in reqs))
        return orig(self, reqs, drafts, greedy, after_step)
    monkeypatch.setattr(Speculator, "after_verify", wrapped)
    return batches


@pytest.mark.parametrize("grace_s", [0.0, 30.0])
def test_shutdown_while_requests_speculate(plain, looping, monkeypatch, grace_s):
    """Shut down once the three verify together: no grace aborts them (their tokens so far those of plain
    decoding); a grace lets them finish."""
    eng = make_engine(SPEC, num_pages=256)
    batches = record_batches(monkeypatch)
    params = SamplingParams(max_tokens=60)
    ref = want(plain, looping[:3], params)

    async def run():
        await eng.start()
        reqs = [eng.add_request(p, params) for p in looping[:3]]
        reads = [asyncio.create_task(read_stream(r)) for r in reqs]
        await until(lambda: len(batches) >= 2 and len(batches[-1]) == 3 and all(len(r.output) >= 8 for r in reqs))
        assert not any(r.state.done for r in reqs)
        await eng.shutdown(grace_s)
        return await asyncio.gather(*reads)
    results = asyncio.run(run())
    for (got, reason), w in zip(results, ref):
        if grace_s:
            assert (got, reason) == (w, "length")
        else:
            assert reason == "abort" and 8 <= len(got) < 60 and got == w[:len(got)]
    assert eng.stats["aborted"] == (0 if grace_s else 3) and not eng.running and not eng.requests
    eng.check_integrity()
    l1_back(eng)


def test_aborting_one_request_of_a_verify_batch_leaves_the_others_as_they_were(plain, looping, monkeypatch):
    eng = make_engine(SPEC, num_pages=256)
    batches = record_batches(monkeypatch)
    ref = want(plain, looping[:3], SamplingParams(max_tokens=32))
    at_abort = []

    async def run():
        await eng.start()
        reqs = [eng.add_request(p, SamplingParams(max_tokens=400 if i == 1 else 32)) for i, p in enumerate(looping[:3])]
        reads = [asyncio.create_task(read_stream(r)) for r in (reqs[0], reqs[2])]
        got = []
        while True:  # the middle one, aborted from its stream once it verified beside both others
            ev = await reqs[1].queue.get()
            if ev.finished:
                break
            got.append(ev.token_id)
            if len(got) >= 10 and not at_abort and batches and set(batches[-1]) == {r.rid for r in reqs}:
                at_abort.append(len(batches))
                assert await eng.abort(reqs[1].rid)
        out = await asyncio.gather(*reads)
        await finish(eng)
        return out, (got, ev.finish_reason), reqs
    (a, c), (b, reason), reqs = asyncio.run(run())
    assert at_abort and reason == "abort" and 10 <= len(b) < 40
    assert a == (ref[0], "length") and c == (ref[2], "length")
    assert all(reqs[1].rid not in batch for batch in batches[at_abort[0] + 1:])
    assert any(len(batch) == 2 for batch in batches[at_abort[0]:])  # (the others verified on, without it)
    l1_back(eng)


# -- 5. shared prefill: identical prompts together ------------------------------------------------------------------
def test_identical_prompts_together_share_their_prefill_and_both_speculate(plain, looping, monkeypatch):
    eng = make_engine(SPEC)
    steps = record_steps(monkeypatch)
    params = SamplingParams(max_tokens=24)
    prompt = looping[1]
    got = eng.generate([prompt, prompt, looping[2]], params)
    assert [r.output_ids for r in got] == want(plain, [prompt, prompt, looping[2]], params)
    assert got[0].output_ids == got[1].output_ids
    assert eng.metrics()["recomputed_tokens"] < 2 * len(prompt) + len(looping[2])  # (one waited for the other)
    assert {s.rid for s in steps if s.draft and len(s.yielded) > 1} >= {got[0].rid, got[1].rid}  # (both verified)
    eng.check_integrity()
    l1_back(eng)


# -- 6. priority scheduling, one running slot -------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_one_running_slot_and_priorities_with_speculating_requests(plain, looping, monkeypatch, policy):
    eng = make_engine(SPEC, max_running_requests=1, scheduling_policy=policy)
    steps = record_steps(monkeypatch)
    priorities = [3, -1, 0, 2] if policy == "priority" else [0] * 4
    prompts = looping[:4]
    params = [SamplingParams(max_tokens=20, priority=p) for p in priorities]
    params[2] = SamplingParams(max_tokens=20, temperature=0.7, seed=5, priority=priorities[2])  # (one sampled)
    got = eng.generate(prompts, params)
    assert [r.output_ids for r in got] == want(plain, prompts, [dataclasses.replace(p, priority=0) for p in params])
    assert all(r.finish_reason == "length" for r in got)
    by_rid = {r.rid: i for i, r in enumerate(got)}  # the order they verified in (one running at a time): the queue's
    assert list(dict.fromkeys(by_rid[s.rid] for s in steps)) == sorted([0, 1, 3], key=lambda i: (priorities[i], i))
    eng.check_integrity()
    l1_back(eng)


def test_a_simulated_replay_says_speculation_is_ignored(capsys):
    """A --simulate replay has no model to verify drafts with: its engine makes no speculator, and says so."""
    from scheduler.replay import build_parser
    from scheduler.replay_args import config_from_replay_args, fill_defaults
    args = build_parser().parse_args(["--simulate", "--speculative-config", '{"method": "ngram", '
                                      '"num_speculative_tokens": 3}'])
    fill_defaults(args)
    cfg = config_from_replay_args(args)
    assert cfg.simulate and cfg.speculative is not None
    assert "--speculative-config: ignored under --simulate" in capsys.readouterr().err
    assert Engine(cfg).speculator is None
