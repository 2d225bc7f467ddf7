"""What a user sees of a request, found unpinned by session 65's mutation check of scheduler/request.py,
generation.py, generation_defaults.py, request_ids.py and trace.py: SamplingParams' bounds, the server's metrics
and stop rules of one generation, generation_config.json's defaults, request ids, Mooncake trace lines. No model."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from scheduler import generation
from scheduler.generation import Generation, eos_id
from scheduler.request import Request, SamplingParams, TokenEvent
from scheduler.tokenizer import ByteTokenizer

EOS = 7


# -- generation.py ----------------------------------------------------------------------------------------
class _Hist:
    def __init__(self) -> None:
        self.seen: list[float] = []

    def observe(self, value: float) -> None:
        self.seen.append(value)


class _Metrics:
    def __init__(self) -> None:
        self.ttft, self.itl, self.tpot, self.e2e, self.queue = _Hist(), _Hist(), _Hist(), _Hist(), _Hist()
        self.outcomes: list[str] = []
        self.ends: list[tuple] = []

    def outcome(self, outcome: str) -> None:
        self.outcomes.append(outcome)

    def prompt_choice(self, api_req, index: int, choice: int):
        return SimpleNamespace(ended=lambda tokens: None)

    def ended(self, *args) -> None:
        self.ends.append(args[:3])


def _generation(**params) -> Generation:
    st = SimpleNamespace(engine=SimpleNamespace(model_config=SimpleNamespace(eos_token_ids=(EOS,), eos_token_id=EOS)),
                         tokenizer=ByteTokenizer(512), metrics=_Metrics())
    api_req = SimpleNamespace(stop_strings=lambda: (), skip_special_tokens=True, return_tokens_as_token_ids=None,
                              include_stop_str_in_output=False, spaces_between_special_tokens=True)
    req = Request(prompt=[300, 301], params=SamplingParams(**params))
    req.queue = asyncio.Queue()
    return Generation(st, req, api_req, chat=False, arrival=0.0)


def _stop(rid: str = "r") -> TokenEvent:
    return TokenEvent(rid, None, 1, finished=True, finish_reason="stop")


def test_with_ignore_eos_an_eos_that_ends_a_grammar_is_text_with_no_stop_reason():
    """ignore_eos makes the EOS an ordinary token: where a request still ends "stop" on it (its grammar became
    whole there) its text shows and it is no stop_reason; a stop_token_ids' id is hidden and is the reason."""
    g = _generation(ignore_eos=True, stop_token_ids=(9,))
    assert g._shows_text(EOS, _stop()) and g._stop_token_reason(EOS) is None
    assert not g._shows_text(9, _stop()) and g._stop_token_reason(9) == 9
    plain = _generation()
    assert not plain._shows_text(EOS, _stop())


def test_time_per_output_token_is_the_decode_time_over_the_tokens_after_the_first(monkeypatch):
    """vLLM's TPOT: (end - first token) / (tokens - 1); one token observes none."""
    g = _generation(max_tokens=4)
    monkeypatch.setattr(generation.time, "perf_counter", lambda: 13.0)
    g.first_token_at, g.output_tokens = 10.0, 4
    g._finish(TokenEvent("r", None, 4, finished=True, finish_reason="length"))
    assert g.st.metrics.tpot.seen == [1.0] and g.st.metrics.e2e.seen == [13.0]
    one = _generation(max_tokens=4)
    one.first_token_at, one.output_tokens = 10.0, 1
    one._finish(TokenEvent("r", None, 1, finished=True, finish_reason="stop"))
    assert one.st.metrics.tpot.seen == [] and one.st.metrics.outcomes == ["success"]


@pytest.mark.asyncio
async def test_a_verify_steps_later_tokens_observe_no_inter_token_gap():
    """One inter-token latency per engine step: a speculative step's tokens after its first (same_step) add none."""
    g = _generation(max_tokens=8)
    for i, same in enumerate([False, False, True, True, False]):
        g.req.queue.put_nowait(TokenEvent(g.req.rid, 300 + i, i, same_step=same))
    g.req.queue.put_nowait(TokenEvent(g.req.rid, None, 5, finished=True, finish_reason="length"))
    steps = [s async for s in g.steps()]
    assert len(steps) == 5 and steps[-1][1].finished
    assert len(g.st.metrics.ttft.seen) == 1 and len(g.st.metrics.itl.seen) == 2


@pytest.mark.asyncio
async def test_a_stream_left_early_counts_the_tokens_the_engine_made():
    """The client went away (close): the request is aborted and counted "aborted" once, with the tokens its engine
    request generated, read or not (as vLLM's engine-side counts)."""
    g = _generation(max_tokens=8)
    aborted = []

    async def abort(rid, stop=False):
        aborted.append(rid)

    g.st.engine.abort = abort
    g.req.output, g.output_tokens = [300, 301, 302], 1
    await g.close()
    await g.close()
    assert g.st.metrics.outcomes == ["aborted"] and g.st.metrics.ends == [("abort", 2, 3)]
    assert aborted == [g.req.rid]


class _Tok:
    def __init__(self, eos: str, ids: list[int]) -> None:
        self.special_tokens, self.ids = {"eos_token": eos}, ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.ids)


def test_an_eos_token_that_is_not_one_id_leaves_the_models_eos():
    """vLLM's check_stop EOS: the tokenizer's eos_token where it is one id, else the model's own."""
    assert eos_id(_Tok("<|eot|>", [42]), 9) == 42
    assert eos_id(_Tok("</s>", [60, 47]), 9) == 9
    assert eos_id(_Tok("", []), 9) == 9


# -- request.py -------------------------------------------------------------------------------------------
from scheduler.request import (  # noqa: E402
    ALLOWED_TOKEN_IDS_MAX, BAD_WORDS_MAX, BAD_WORDS_MAX_TOKENS, LOGIT_BIAS_MAX_TOKENS, PRIORITY_MAX, SEED_MIN,
    RequestError,
)

VOCAB = 2048
VALID_AT_THE_BOUNDS = [
    dict(temperature=100), dict(temperature=100.0), dict(top_p=1.0), dict(min_p=1.0), dict(top_k=-1),
    dict(seed=SEED_MIN, temperature=1.0), dict(seed=-1, temperature=1.0), dict(priority=PRIORITY_MAX),
    dict(logprobs=20), dict(prompt_logprobs=20), dict(max_tokens=16, min_tokens=16),
    dict(logit_bias={i: 1.0 for i in range(LOGIT_BIAS_MAX_TOKENS)}), dict(logit_bias={VOCAB - 1: -100.0}),
    dict(allowed_token_ids=(VOCAB - 1,)), dict(allowed_token_ids=(1, 2), bad_words_token_ids=((1,), (2, 3))),
    dict(bad_words_token_ids=tuple((i,) for i in range(BAD_WORDS_MAX))),
    dict(bad_words_token_ids=((1,) * (BAD_WORDS_MAX_TOKENS // 2),) * 2),
]


@pytest.mark.parametrize("kw", VALID_AT_THE_BOUNDS, ids=lambda kw: ",".join(f"{k}" for k in kw))
def test_values_at_the_bounds_are_taken(kw):
    SamplingParams(**kw).validate(16, vocab_size=VOCAB)


REFUSED_PAST_THEM = [
    (dict(cache_salt=""), "cache_salt"), (dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
    (dict(logit_bias={1: -100.5}), "logit_bias"), (dict(allowed_token_ids=(VOCAB,)), "allowed_token_ids"),
    (dict(allowed_token_ids=()), "allowed_token_ids"),
    (dict(allowed_token_ids=[], bad_words_token_ids=((4,),)), "allowed_token_ids"),
    (dict(bad_words_token_ids=((),)), "bad_words_token_ids"),
    (dict(bad_words_token_ids=((VOCAB,),)), "bad_words_token_ids"),
    (dict(bad_words_token_ids=tuple((i,) for i in range(BAD_WORDS_MAX + 1))), "bad_words_token_ids"),
    (dict(allowed_token_ids=(1, 2), bad_words_token_ids=((1,), (2,))), "allowed_token_ids"),
    (dict(priority=PRIORITY_MAX + 1), "priority"),
]


@pytest.mark.parametrize("kw,param", REFUSED_PAST_THEM, ids=[p for _, p in REFUSED_PAST_THEM])
def test_values_past_the_bounds_are_request_errors_naming_the_field(kw, param):
    with pytest.raises(RequestError) as err:
        SamplingParams(**kw).validate(16, vocab_size=VOCAB)
    assert err.value.param == param
    if param == "allowed_token_ids" and not kw[param]:  # (empty: told so, not that its tokens are all banned)
        assert "must be None or a non-empty tuple" in str(err.value)


def test_allowed_token_ids_may_hold_the_most_and_are_kept_once_each():
    p = SamplingParams(allowed_token_ids=(3, 1, 3, 1))
    p.validate(16)
    assert p.allowed_token_ids == (3, 1)
    SamplingParams(allowed_token_ids=tuple(range(ALLOWED_TOKEN_IDS_MAX))).validate(16)


def test_the_logit_bias_checked_is_the_one_kept():
    """validate keeps a copy: the caller's dict changed after the check (an id outside the vocabulary) is not used."""
    bias = {1: 5.0}
    p = SamplingParams(logit_bias=bias)
    p.validate(16, vocab_size=VOCAB)
    bias[VOCAB + 10] = 1.0
    assert p.logit_bias == {1: 5.0}


def test_a_tiny_temperature_samples_rather_than_being_greedy():
    p = SamplingParams(temperature=0.005)
    p.validate(16)
    assert not p.greedy and SamplingParams().greedy



def test_requests_of_one_key_queue_in_the_order_they_came():
    """enqueue: lower priority first, then arrival; a request of a key already queued goes behind it (regression
    guard: one of an equal key was dropped or put ahead)."""
    from collections import deque

    from scheduler.request import enqueue
    waiting: deque = deque()
    reqs = [Request([1], SamplingParams(priority=p), rid=f"r{i}", arrival_s=t)
            for i, (p, t) in enumerate([(0, 1.0), (0, 1.0), (-1, 2.0), (0, 1.0), (-1, 2.0), (1, 0.5)])]
    for r in reqs:
        enqueue(waiting, r)
    assert [r.rid for r in waiting] == ["r2", "r4", "r0", "r1", "r3", "r5"]


def test_a_salted_prompt_s_first_token_is_no_model_token():
    from scheduler.request import salted_prompt
    for salt in ("a", "tenant-2", "ü"):
        first, *rest = salted_prompt([5, 6, 7], salt)
        assert first < 0 and rest == [6, 7]

# -- request_ids.py ---------------------------------------------------------------------------------------
from scheduler.request_ids import problem, resolve_ids  # noqa: E402


def _http(header: str | None):
    return SimpleNamespace(headers={} if header is None else {"X-Request-Id": header}, state=SimpleNamespace())


def test_a_request_id_is_printable_ascii_the_delete_character_is_not():
    assert problem("a~!z") is None
    assert problem("a\x7fb") == "must be printable ASCII without whitespace (it lands in log lines and headers), " \
                                "got '\\x7f' at 1"


def test_an_empty_header_counts_as_none_and_a_response_reads_its_body_alone():
    ids = resolve_ids(_http(""), "mine", chat=True)
    assert (ids.request_id, ids.response_id) == ("mine", "chatcmpl-mine")
    ids = resolve_ids(_http("hdr"), "mine", chat=False, read_header=False)
    assert ids.request_id == "mine" and ids.base_rid.startswith("cmpl-mine-")
    assert resolve_ids(_http("hdr"), "mine", chat=False).request_id == "hdr"


# -- trace.py ---------------------------------------------------------------------------------------------
from scheduler.trace import TraceProblem, TraceRecord, parse_line  # noqa: E402


def _line(ts=0, n_in=1000, n_out=10, ids=(1, 2)) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": list(ids)})


def test_a_whole_number_of_blocks_and_no_output_are_a_good_line():
    rec = parse_line(_line(ts=5, n_in=1024, n_out=0, ids=(3, 4)), 2)
    assert rec == TraceRecord(2, 5, 1024, 0, (3, 4))
    assert parse_line(_line(n_in=512, ids=(1,)), 1).hash_ids == (1,)


@pytest.mark.parametrize("line,says", [
    ('{"timestamp": Infinity, "input_length": 1, "output_length": 1, "hash_ids": [1]}',
     "timestamp must be a finite number, got inf"),
    ('{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": [1]}',
     "timestamp must be a finite number, got nan"),
    (_line(n_in=2**63, ids=(1,)), f"input_length must be a 64-bit integer, got {2**63}"),
    (_line(n_in=1, ids=(2**64,)), "hash_ids must be a list of non-negative 64-bit integers"),
    (_line(n_in=1024, ids=(1, 2, 3)), "3 hash_ids for input_length 1024: expected ceil(1024/512) = 2"),
])
def test_a_bad_line_is_a_problem_saying_why(line, says):
    assert parse_line(line, 4) == TraceProblem(4, says)


def test_a_strict_load_names_ten_bad_lines_and_counts_the_rest(tmp_path):
    from scheduler.trace import TraceError, load_trace
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(["[1]"] * 11 + [_line()]) + "\n")
    with pytest.raises(TraceError) as err:
        load_trace(path, strict=True)
    assert len(err.value.problems) == 11
    assert str(err.value).count("expected a JSON object") == 10
    assert str(err.value).endswith("line 10: expected a JSON object, got list; ... and 1 more")


def test_a_record_scaled_keeps_its_prompt_inside_its_blocks():
    """scale_record: at most len(hash_ids) blocks of tokens, even for a record built in code with more input."""
    from scheduler.trace import TokenSynth, scale_record
    rec = scale_record(TraceRecord(0, 0.0, 2000, 3, (1,)), 16)
    assert (rec.input_tokens, rec.output_tokens) == (16, 1)
    assert len(TokenSynth(512, 16).prompt_tokens(rec)) == 16


def test_a_block_starts_with_its_ids_digits_in_a_field_a_64_bit_id_fills():
    """The id field is as wide as a 64-bit id needs in base vocab_size: 7 digits at 1,000 ids."""
    from scheduler.trace import TokenSynth
    synth = TokenSynth(1000, 16)
    assert synth.id_width == 7
    assert synth.block(5 * 10**18 + 123)[:7].tolist() == [123, 0, 0, 0, 0, 0, 5]
