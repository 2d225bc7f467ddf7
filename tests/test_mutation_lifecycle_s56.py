"""Guards for lifecycle and request rules that session 56's mutation check of the engine's loop, its lifecycle and
the request-side modules (engine_loop, engine_lifecycle, loop_task, request, generation, generation_defaults,
prompt_truncation, request_ids, responses_background, config, tokenizer) broke without a failing test."""
from __future__ import annotations

import httpx
import pytest
import test_request_ids

from hicache_helpers import until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestState, SamplingParams
from scheduler.tokenizer import BYTE_OFFSET, ByteTokenizer, decode_completion
from test_sched_s53_hunt import record_launches

echo_srv = test_request_ids.echo_srv  # (the fixture: a server started with --enable-request-id-headers)


@pytest.mark.asyncio
async def test_a_chunked_prompt_waits_at_most_one_decode_step_between_its_chunks():
    """While requests decode (decode steps chained on the device), a long prompt prefilled in chunks gets its next
    chunk after one decode step: a decode chain does not run on and hold the prompt's chunks off until the
    decoding requests finish."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=2048, max_prefill_tokens=64))
    launches = record_launches(eng)
    await eng.start()
    decoding = [eng.add_request([3, 4, 5, i + 1], SamplingParams(max_tokens=300, ignore_eos=True)) for i in range(2)]
    await until(lambda: all(len(r.output) > 2 for r in decoding))
    start = len(launches)
    long = eng.add_request([(i * 7) % 200 + 1 for i in range(640)], SamplingParams(max_tokens=2))
    await until(lambda: long.first_token_s is not None, 60)
    kinds = "".join(k for k, _ in launches[start:])
    chunks = kinds[:kinds.rindex("P") + 1]  # (from the prompt's arrival to its last chunk)
    assert chunks.count("P") >= 640 // 64 and "DD" not in chunks, kinds
    for r in decoding:
        await eng.abort(r.rid)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_stop_abort_of_a_request_that_generated_nothing_ends_it_aborted():
    """Engine.abort(rid, stop=True) (the caller's own stop condition) finishes a request with "stop" only where it has
    generated tokens for the stop to end; one still queued, with nothing generated, ends "abort" and is counted as
    aborted, not reported as a successful stop."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64))
    req = eng.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=4))  # (the loop not started: it stays queued)
    assert await eng.abort(req.rid, stop=True)
    ev = await req.queue.get()
    assert ev.finished and ev.finish_reason == "abort"
    assert req.state is RequestState.ABORTED and eng.stats["aborted"] == 1 and eng.stats["finished"] == 0
    eng.check_integrity()
    await eng.shutdown()


def test_the_echoed_request_id_header_is_the_clients_own_on_a_responses_request(echo_srv):
    """With --enable-request-id-headers a response carries the X-Request-Id its request sent (vLLM's middleware),
    also on /v1/responses, which names its Response by the body's request_id and not by that header."""
    body = {"input": "hi", "max_output_tokens": 2, "request_id": "resp_from_body"}
    r = httpx.post(echo_srv.url + "/v1/responses", json=body, headers={"X-Request-Id": "hdr-7"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "resp_from_body" and r.headers["x-request-id"] == "hdr-7"


def test_a_completion_that_finishes_the_prompts_last_character_keeps_that_byte_in_its_text():
    """A prompt (token ids) that ends part-way through a UTF-8 character: the completion's text is decoded without
    the prompt's context, so its first byte, which would finish that character, still shows (as U+FFFD) rather than
    vanishing into the prompt's text; every generated token is in the completion's text."""
    tok = ByteTokenizer(512)
    first, second = "\u00e9".encode()  # (é: two bytes)
    prompt = tok.encode("caf") + [first + BYTE_OFFSET]
    assert decode_completion(tok, prompt, [second + BYTE_OFFSET] + tok.encode("x")) == "\ufffdx"
