"""Requests that arrive together with a shared prefix compute it once (Admission._computes_prefix_of): a waiting
request whose prefix a request in prefill is computing waits for those pages, published chunk by chunk, instead of
computing them again in the same batch (n choices of one prompt, prompts of one system prompt, a batch of them).
Regression: 4 identical 400-token prompts in one generate() computed 1,600 prompt tokens."""
from __future__ import annotations

import asyncio
import random

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

PAGE = 4
GREEDY = SamplingParams(max_tokens=4)


def make_engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE, num_pages=2048, **kw))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def computed(eng: Engine) -> int:
    return eng.metrics()["recomputed_tokens"]


def test_identical_prompts_together_compute_their_prompt_once():
    prompt = tokens(400, 0)
    alone = make_engine().generate([prompt], GREEDY)[0].output_ids
    eng = make_engine()
    results = eng.generate([prompt] * 4, GREEDY)
    # the first computes all 400; the others read 396 (the prompt less its last token, page aligned) from L1
    assert computed(eng) == 400 + 3 * 4
    assert [r.output_ids for r in results] == [alone] * 4
    assert eng.metrics()["hit_tokens"]["l1"] == 3 * 396
    eng.check_integrity()


def test_prompts_of_one_system_prompt_compute_it_once():
    system = tokens(200, 1)
    prompts = [system + tokens(50, 10 + i) for i in range(3)]
    alone = [make_engine().generate([p], GREEDY)[0].output_ids for p in prompts]
    eng = make_engine()
    assert [r.output_ids for r in eng.generate(prompts, GREEDY)] == alone
    assert computed(eng) == 250 + 2 * 50
    eng.check_integrity()


def test_a_short_shared_prefix_is_computed_alongside():
    """Below PREFILL_SHARE_MIN_TOKENS of shared prefix the requests prefill together (waiting would cost the
    follower more than it saves)."""
    from scheduler.admission import PREFILL_SHARE_MIN_TOKENS
    shared = tokens(PREFILL_SHARE_MIN_TOKENS - PAGE, 2)
    prompts = [shared + tokens(40, 20 + i) for i in range(2)]
    eng = make_engine()
    eng.generate(prompts, GREEDY)
    assert computed(eng) == sum(map(len, prompts))
    eng.check_integrity()


def test_a_shared_prefix_of_the_threshold_is_waited_for():
    from scheduler.admission import PREFILL_SHARE_MIN_TOKENS
    shared = tokens(PREFILL_SHARE_MIN_TOKENS, 8)
    prompts = [shared + tokens(40, 30 + i) for i in range(2)]
    eng = make_engine()
    eng.generate(prompts, GREEDY)
    assert computed(eng) == sum(map(len, prompts)) - PREFILL_SHARE_MIN_TOKENS
    eng.check_integrity()


def test_another_salts_prefix_is_not_waited_for():
    prompt = tokens(300, 3)
    eng = make_engine()

    async def both():
        async def one(salt):
            async for ev in eng.submit(prompt, SamplingParams(max_tokens=2, cache_salt=salt)):
                if ev.finished:
                    return
        await asyncio.gather(one("a"), one("b"))
        await eng.stop_loop()
    asyncio.run(both())
    assert computed(eng) == 600
    eng.check_integrity()


def test_a_chunked_prefill_is_waited_for_to_its_end():
    """The leader's prompt takes several prefill chunks (max_prefill_tokens 128); the follower waits for all of
    them, then reads the whole shared prefix from L1."""
    prompt = tokens(500, 4)
    eng = make_engine(max_prefill_tokens=128)
    results = eng.generate([prompt, prompt + tokens(20, 40)], GREEDY)
    assert computed(eng) == 500 + (520 - 500 + 500 % PAGE)  # (the follower: its own tail, from the last full page)
    assert results[0].output_ids == make_engine(max_prefill_tokens=128).generate([prompt], GREEDY)[0].output_ids
    eng.check_integrity()


def test_the_follower_computes_itself_when_its_leader_is_aborted():
    prompt = tokens(600, 5)
    eng = make_engine(max_prefill_tokens=64)

    async def run():
        leader = eng.add_request(prompt, SamplingParams(max_tokens=2), "leader")
        follower = eng.add_request(prompt, SamplingParams(max_tokens=2), "follower")
        await eng.start()
        while leader.cached_len < 128:  # (a few of its chunks ran; the follower waits)
            await asyncio.sleep(0)
        assert follower.cached_len == 0 and follower in eng.waiting
        await eng.abort("leader")
        while not (ev := await follower.queue.get()).finished:
            pass
        await eng.stop_loop()
        return ev
    ev = asyncio.run(run())
    assert ev.finish_reason == "length"
    assert not eng.requests
    eng.check_integrity()


def test_prompt_logprobs_and_no_prefix_cache_never_wait():
    prompt = tokens(200, 6)
    eng = make_engine()
    eng.generate([prompt, prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert computed(eng) == 400  # (a prompt-logprobs request computes every row either way)
    eng = make_engine(enable_prefix_cache=False)
    eng.generate([prompt, prompt], GREEDY)
    assert computed(eng) == 400
    eng.check_integrity()


def test_the_wait_is_one_line_of_the_timeline(tmp_path):
    """The waiting request logs `prefill_waits` once (whom it waits for, the tokens shared and already published),
    and the timeline shows it as a queued phase of its own before its prefill."""
    import structlog

    from scheduler.timeline import build_timeline, read_events
    saved = structlog.get_config()
    try:
        log = tmp_path / "run.jsonl"
        prompt = tokens(300, 7)
        eng = make_engine(log_json=str(log))
        eng.add_request(prompt, GREEDY, "leader")
        eng.add_request(prompt, GREEDY, "follower")
        asyncio.run(_drain(eng))
    finally:
        structlog.configure(**saved)
    events = read_events(log)
    waits = [e for e in events if e.get("event") == "request" and e.get("state") == "prefill_waits"]
    assert [(e["rid"], e["behind"], e["shared_tokens"], e["published_tokens"]) for e in waits] == \
        [("follower", "leader", 296, 0)]
    phases = [p for p, _, _ in build_timeline(events).requests["follower"].phase_spans(0)]
    assert phases[:3] == ["queued", "queued (its prefix computed by another)", "prefill"]


async def _drain(eng: Engine) -> None:
    await eng.start()
    while eng.requests:
        await asyncio.sleep(0.001)
    await eng.stop_loop()
