"""Guards for structured-output, admission, engine-limit and server-flag rules that a mutation check (session 56)
broke without any test failing: choices given as a list in process, an empty choice refused, the server's tokenizer
replacing the grammars compiled before it, `structured_outputs` with `json_object: false` beside another key, the
prompt limit held to what the pool and positions hold, the status' parked count, and the server's EOS reaching the
grammars' matchers."""
from __future__ import annotations

import asyncio
import re

import pytest

from hicache_helpers import until
from scheduler.api_guided import GuidedFields
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.guided import GuidedSpec
from scheduler.request import RequestError, SamplingParams
from scheduler.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def eng():
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256))


def _text(eng, result) -> str:
    return ByteTokenizer(eng.vocab_size).decode(result.output_ids)


def test_choices_given_as_a_python_list_in_process_are_served(eng):
    """SamplingParams(guided=GuidedSpec("choice", ["yes", "no"])): the list is taken as its JSON text, and the answer
    is one of the choices (it was refused as a value that is not text)."""
    spec = GuidedSpec("choice", ["yes", "no"])
    assert spec.value == '["yes", "no"]'
    prompt = ByteTokenizer(eng.vocab_size).encode("Answer: ")
    for seed in range(3):
        out = eng.generate([prompt], SamplingParams(max_tokens=8, seed=seed, temperature=1.0, guided=spec))[0]
        assert _text(eng, out) in ("yes", "no") and out.finish_reason == "stop"


@pytest.mark.parametrize("choices", ['["a", ""]', '[""]', '["a", 1]'])
def test_an_empty_or_non_string_choice_is_refused_before_it_is_queued(eng, choices):
    """A guided choice among which one is the empty string (an empty answer) is that request's error, naming
    `guided`, and nothing is queued."""
    with pytest.raises(RequestError, match="non-empty list of non-empty strings") as err:
        eng.add_request([10, 11], SamplingParams(guided=GuidedSpec("choice", choices)))
    assert err.value.param == "guided" and not eng.waiting


def test_the_servers_tokenizer_replaces_grammars_compiled_before_it():
    """`Guides.use` (the server gives the engine its tokenizer): a grammar compiled before it, for the model's own
    tokenizer, is compiled again for the new one rather than reused, and llguidance's view of the tokenizer is
    rebuilt."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64))
    guides, spec = eng.guides, GuidedSpec("regex", "[ab]{2}")
    before, view = guides.check(spec), guides._tokenizer
    assert guides.check(spec) is before  # (compiled once while the tokenizer stays)
    guides.use(ByteTokenizer(eng.vocab_size))
    assert guides._tokenizer is not view and guides.check(spec) is not before
    out = eng.generate([[10, 11, 12]], SamplingParams(max_tokens=4, guided=spec))[0]
    assert re.fullmatch("[ab]{2}", _text(eng, out))


@pytest.mark.parametrize("so, kind", [({"regex": "a+", "json_object": False}, "regex"),
                                      ({"choice": ["x", "y"], "json_object": False}, "choice")])
def test_structured_outputs_json_object_false_beside_another_key_is_not_a_second_ask(so, kind):
    """vLLM's `structured_outputs` with `"json_object": false` and one other key asks for that other one only (false
    asks for nothing), where two real asks are a 400."""
    field, spec = GuidedFields(structured_outputs=so).guided()
    assert field == "structured_outputs" and spec.kind == kind
    with pytest.raises(ValueError, match="exactly one"):
        GuidedFields(structured_outputs={"json_object": False}).guided()


def test_a_prompt_limit_above_what_the_engine_holds_is_held_to_it():
    """--max-prompt-tokens above what one request can hold (the model's positions, the L1 pool) is capped there:
    a longer prompt is refused by the prompt limit's message naming that cap, not by a later check that blames
    max_tokens or the positions."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=2048, max_prompt_tokens=10 ** 6))
    cap = eng.max_kv_tokens
    assert eng.max_prompt_tokens == cap
    with pytest.raises(RequestError, match=f"prompt of {cap + 1} tokens exceeds the limit of {cap}$"):
        eng.validate([5] * (cap + 1), SamplingParams(max_tokens=1))


def test_status_counts_queued_requests_as_waiting_not_parked():
    """engine.status(): requests queued (none parked on a restore) are `waiting`; `parked` stays 0 (Prometheus'
    vllm:num_requests_waiting and hicache's parked gauge read these)."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64))
    for _ in range(2):
        eng.add_request([10, 11, 12], SamplingParams(max_tokens=2))
    st = eng.status()["engine"]
    assert (st["waiting"], st["parked"], st["running"]) == (2, 0, 0)


def test_the_servers_eos_lets_a_guided_answer_end_where_its_grammar_may():
    """An EOS id the server adds (its tokenizer's eos_token) is the grammars' EOS too: where a grammar may end
    (regex "a+" after one "a") and the model prefers that EOS, the answer stops there with "stop" (it was never
    allowed by the masks, and the answer ran on to max_tokens)."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64))
    eos = 2  # (no byte: a special id of the presets' byte tokenizer)
    eng.add_eos_token_id(eos)
    out = eng.generate([[10, 11, 12]], SamplingParams(max_tokens=8, guided=GuidedSpec("regex", "a+"),
                                                      logit_bias={eos: 100.0}))[0]
    assert out.output_ids == [ord("a") + 3, eos] and out.finish_reason == "stop"


def test_a_request_ending_early_gives_back_the_rest_of_its_reservation():
    """A request admitted for its prompt and all its max_tokens that stops early (at EOS) gives the pages it never
    used back to admission: nothing stays reserved once it ends, and a later request that needs the whole pool is
    admitted (the leftover kept it waiting for good)."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=16))
    eng.add_eos_token_id(2)
    out = eng.generate([[10, 11, 12, 13]], SamplingParams(max_tokens=40, logit_bias={2: 100.0}))[0]
    assert out.output_ids == [2] and out.finish_reason == "stop"
    assert eng.admission.reserved_pages == 0
    big = eng.generate([[10, 11, 12, 13]], SamplingParams(max_tokens=16 * 4 - 4 + 1, ignore_eos=True))[0]
    assert len(big.output_ids) == 61
    eng.check_integrity()


@pytest.mark.asyncio
async def test_a_request_aborted_while_a_prefill_pass_runs_is_not_admitted_by_it():
    """abort() of a queued request while a prefill pass is under way (it awaited a blocking restore of a request
    before it): that pass skips it, and it ends aborted without a token computed for it or sent."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64))
    admit = eng.admission._admit
    victim: list = []

    async def admit_then_abort(req, *args, **kw):  # (the first admission awaits: the client aborts the next one)
        if victim and req is not victim[0] and not victim[0].state.done:
            await eng.abort(victim[0].rid)
        return await admit(req, *args, **kw)

    eng.admission._admit = admit_then_abort
    first = eng.add_request([10, 11, 12, 13, 14], SamplingParams(max_tokens=2))
    victim.append(eng.add_request([20, 21, 22, 23, 24], SamplingParams(max_tokens=2)))
    await eng.start()
    try:
        await until(lambda: first.state.done and victim[0].state.done, 60)
        events = []
        while not victim[0].queue.empty():
            events.append(victim[0].queue.get_nowait())
        assert [ev.token_id for ev in events if ev.token_id is not None] == []
        assert victim[0].finish_reason == "abort" and victim[0].output == [] and victim[0].scheduled_s is None
        assert first.finish_reason == "length" and eng.stats["prefill_tokens"] == 5
    finally:
        await eng.shutdown()
    eng.check_integrity()


def test_requests_sharing_exactly_the_least_prefix_worth_waiting_for_compute_it_once():
    """Two prompts arriving together whose reusable prefix (the prompt less its last token) is exactly
    PREFILL_SHARE_MIN_TOKENS long: the second waits for the first's pages, so the prefix is computed once."""
    from scheduler.admission import PREFILL_SHARE_MIN_TOKENS
    prompt = [(j * 7) % 400 + 5 for j in range(PREFILL_SHARE_MIN_TOKENS + 1)]
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256))
    outs = eng.generate([prompt, prompt], SamplingParams(max_tokens=2))
    assert outs[0].output_ids == outs[1].output_ids
    assert eng.metrics()["recomputed_tokens"] == len(prompt) + 1
    eng.check_integrity()


def test_lpm_does_not_move_a_prompt_logprobs_request_ahead_for_a_prefix_it_will_not_read():
    """--scheduling-policy lpm orders the queue by the cached prompt tokens each request will read; a request asking
    for prompt logprobs computes its whole prompt (it reads none), so a plain request of the same prompt, queued
    after it, goes first."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, scheduling_policy="lpm"))
    prompt = [(j * 11) % 300 + 5 for j in range(40)]
    eng.generate([prompt], SamplingParams(max_tokens=1))
    logprobs = eng.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    plain = eng.add_request(prompt, SamplingParams(max_tokens=1))
    assert eng.admission._admission_order() == [plain, logprobs]


@pytest.mark.asyncio
async def test_a_preempted_prompt_logprobs_request_resumes_from_its_cached_kv():
    """With decode_reserve_ratio 0 a request that asked for prompt logprobs and is preempted resumes, as any other,
    from the K/V it had computed (its prompt logprobs were all made already): it recomputes no more tokens than the
    same request without prompt logprobs, and streams the same tokens."""
    async def run(prompt_logprobs):
        eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=24, decode_reserve_ratio=0.0))
        await eng.start()
        try:
            old = eng.add_request([(j * 13) % 200 + 1 for j in range(20)], SamplingParams(max_tokens=40,
                                                                                          ignore_eos=True))
            await asyncio.sleep(0)
            new = eng.add_request([(j * 7) % 200 + 3 for j in range(20)],
                                  SamplingParams(max_tokens=40, ignore_eos=True, prompt_logprobs=prompt_logprobs))
            await until(lambda: old.state.done and new.state.done, 60)
            eng.check_integrity()
            return eng.stats["preempted"], eng.stats["preempted_recomputed_tokens"], old.output, new.output
        finally:
            await eng.shutdown()

    plain, asking = await run(None), await run(1)
    assert plain[0] >= 1 and asking[0] == plain[0]
    assert asking[1] == plain[1] and asking[2:] == plain[2:]


@pytest.mark.parametrize("argv, says", [
    (["--responses-store-max", "-1"], "--responses-store-max must be >= 0"),
    (["--tool-call-parser", "hermes"], "--enable-auto-tool-choice and --tool-call-parser go together"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice and --tool-call-parser go together"),
])
def test_server_flags_that_cannot_be_used_are_one_line_and_exit_2(argv, says, capsys):
    """hicache-serve refuses, before the model loads, a negative --responses-store-max and a --tool-call-parser
    without --enable-auto-tool-choice (or the other way round: vLLM's flags go together)."""
    from scheduler import serve

    assert says in serve._check_server_args(serve.build_parser().parse_args(["--port", "0", "--model", "tiny", *argv]))
    assert serve.main(["--port", "0", "--device", "cpu", "--model", "tiny", *argv]) == 2
    assert says in capsys.readouterr().err


def test_a_negative_shutdown_grace_is_a_grace_of_zero(monkeypatch):
    """--shutdown-grace-s below 0 is served as 0 (its help says so): the engine's grace is 0 seconds and uvicorn
    waits its 2 seconds beyond it for connections, not a negative time."""
    from scheduler import serve

    seen = {}
    real_create_app = serve.create_app

    def create_app(engine, limits, **kw):
        seen["grace"] = limits.shutdown_grace_s
        return real_create_app(engine, limits, **kw)

    monkeypatch.setattr(serve, "create_app", create_app)
    monkeypatch.setattr(serve._Server, "run",
                        lambda self: seen.setdefault("uvicorn", self.config.timeout_graceful_shutdown))
    assert serve.main(["--device", "cpu", "--model", "tiny", "--port", "0", "--shutdown-grace-s", "-5"]) == 0
    assert seen == {"grace": 0.0, "uvicorn": 5.0}
