"""Rules of the API's helpers that no test executed (session 72's coverage hunt, area api), each a clear error or a
fall-back someone depends on:

- a background response that already failed keeps "failed" when a cancel lands in its choices' clean-up
  (responses_background.BackgroundRun._end), with no second terminal event;
- hicache-serve's --device cuda without CUDA, hicache-replay's --model that is neither a preset nor a checkpoint
  directory: one line and exit 2 (config.resolve_device, presets.model_config_of); a config.json's rope_scaling that
  is no object: a ValueError naming it (presets._rope_theta);
- structured outputs without llguidance, chat templates without jinja2: an error saying what to install;
  a GuidedSpec of a schema that is no JSON data is refused as a RequestError (guided.GuidedSpec);
- bad_words with no tokenizer, or tokenized past the model's vocabulary: a 400 naming bad_words (ban_fields);
- allowed_token_ids past ALLOWED_TOKEN_IDS_MAX: a RequestError naming the field (request._check_bans);
- a special_tokens_map.json that cannot be read is left out, the tokenizer still loads (tokenizer.HFTokenizer);
- abort_quietly: an abort that raises (a crashed loop) is logged, not raised (generation.abort_quietly);
- a log line dropped while stderr itself is gone is still counted, nothing raised (logs.LogSink); a log that cannot
  be read (only appended to) is taken as ending its line (logs._ends_mid_line);
- StopMatcher refuses no stop strings, and a beam search's include_stop_str_in_output that is no bool;
- a beam search cancelled while its steps wait in the queue aborts them; a step aborted under it (a shutdown, an
  operator) ends it "abort", saying so (beam_search._step).
"""
from __future__ import annotations

import asyncio
import io
import sys
from types import SimpleNamespace

import pytest
import torch

from scheduler import generation, serve
from scheduler.api_models import APIError
from scheduler.api_responses import parse_request
from scheduler.ban_fields import bad_words_token_ids
from scheduler.beam_search import BeamSearchParams
from scheduler.chat_template import ChatTemplate
from scheduler.guided import GuidedSpec, Guides
from scheduler.logs import LogSink
from scheduler.presets import ModelConfig
from scheduler.request import ALLOWED_TOKEN_IDS_MAX, RequestError, SamplingParams
from scheduler.responses_background import BackgroundResponses
from scheduler.responses_output import ResponseOutput
from scheduler.responses_store import ResponsesStore
from scheduler.stop_strings import StopMatcher
from scheduler.tokenizer import ByteTokenizer, HFTokenizer
from test_responses_background import _FailingChoices
from test_responses_background_hunt import _Slot
from test_server_crash_hunt import HANG_GUARD_S, make_engine
from tokenizer_files import write_byte_tokenizer

BASE = ["--port", "0", "--device", "cpu", "--model", "tiny"]


class _FailingThenSlowToClose(_FailingChoices):
    """A chat that fails (an error chunk), whose stream then takes its time to close (Choices' aborts awaited)."""

    async def sse(self):
        try:
            async for line in super().sse():
                yield line
        finally:
            await asyncio.Event().wait()  # (until cancelled)


def test_a_cancel_in_a_failed_background_response_s_cleanup_keeps_it_failed():
    store, slot, choices = ResponsesStore(4), _Slot(), _FailingThenSlowToClose()
    req = parse_request({"input": "hi", "background": True})
    out = ResponseOutput(choices, req, store.keeper(req, None))

    async def scenario():
        background = BackgroundResponses(store)
        background.start(out, slot, stream=False)
        run = store.run(out.id)
        async with asyncio.timeout(HANG_GUARD_S):
            while run.response["status"] != "failed":
                await asyncio.sleep(0)
            assert not run.finished  # (its stream is closing)
            return run, await background.cancel(out.id)

    run, answer = asyncio.run(scenario())
    assert answer["status"] == "failed" and store.response(out.id)["status"] == "failed"
    assert [e["type"] for e in run.events].count("response.failed") == 1
    assert run.events[-1]["type"] == "response.failed" and not any("cancelled" in e["type"] for e in run.events)
    assert run.finished and slot.released == 1


def test_device_cuda_without_cuda_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert serve.main([*BASE, "--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip() == "hicache-serve: --device cuda requested but CUDA is not available"


def test_a_model_neither_preset_nor_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    """(hicache-replay's: the replay sizes its tiers from the model's shapes before any engine is built.)"""
    from scheduler.replay import run_cli
    for model in (str(tmp_path / "no-such-model"), str(tmp_path)):  # (a directory without config.json too)
        with pytest.raises(SystemExit) as exit_:
            run_cli(["--model", model])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"model {model!r} is neither a preset (" in err and err.strip().endswith("nor a checkpoint dir"), err
        assert "Traceback" not in err


def test_a_rope_scaling_that_is_no_object_is_refused_naming_it():
    cfg = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "rope_scaling": "yarn"}
    with pytest.raises(ValueError, match=r"config.json's rope_scaling must be an object, got 'yarn'"):
        ModelConfig.from_hf_config(cfg)


def test_structured_outputs_without_llguidance_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # (an import of it raises ImportError)
    guides = Guides("tiny", 512, (1,))
    guides.use(ByteTokenizer(512))
    with pytest.raises(RequestError, match=r"need the llguidance package \(pip install llguidance\)") as err:
        guides.check(GuidedSpec("regex", "[a-z]+"))
    assert err.value.param == "guided"


def test_a_chat_template_without_jinja2_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
    with pytest.raises(ValueError, match="jinja2 is not installed"):
        ChatTemplate("{{ messages }}")


def test_a_schema_dict_that_is_no_json_data_is_refused_as_a_request_error():
    spec = GuidedSpec("json_schema", {"type": "object", "enum": {1, 2}})  # (a set: json.dumps raises TypeError)
    assert isinstance(spec.value, dict)
    with pytest.raises(RequestError, match="value is text") as err:
        make_engine().validate([1, 2, 3], SamplingParams(max_tokens=2, guided=spec))
    assert err.value.param == "guided"


def test_bad_words_without_a_tokenizer_or_past_the_vocabulary_are_a_400_naming_them():
    with pytest.raises(APIError) as err:
        bad_words_token_ids(["foo"], None, 512)
    assert (err.value.status, err.value.param) == (400, "bad_words") and "no tokenizer" in err.value.message
    with pytest.raises(APIError) as err:  # (a tokenizer of more ids than the model's vocabulary)
        bad_words_token_ids(["foo"], ByteTokenizer(1024), 50)
    assert (err.value.status, err.value.param) == (400, "bad_words")
    assert "outside the vocabulary [0, 50)" in err.value.message


def test_allowed_token_ids_past_the_limit_are_refused_naming_the_field():
    params = SamplingParams(max_tokens=2, allowed_token_ids=(0,) * (ALLOWED_TOKEN_IDS_MAX + 1))
    with pytest.raises(RequestError, match=f"at most {ALLOWED_TOKEN_IDS_MAX} token ids") as err:
        params.validate(16, 512)
    assert err.value.param == "allowed_token_ids"
    SamplingParams(max_tokens=2, allowed_token_ids=(0,) * ALLOWED_TOKEN_IDS_MAX).validate(16, 512)  # (the limit: ok)


@pytest.mark.parametrize("content", ["{not json", "\xff"])
def test_an_unreadable_special_tokens_map_is_left_out_and_the_tokenizer_loads(tmp_path, content):
    write_byte_tokenizer(tmp_path, special=("<eos>",), config={"eos_token": "<eos>"})
    (tmp_path / "special_tokens_map.json").write_bytes(content.encode("latin-1"))
    tok = HFTokenizer(str(tmp_path))
    assert tok.special_tokens == {"eos_token": "<eos>"}  # (tokenizer_config.json's, the map left out)
    assert tok.decode(tok.encode("hi", add_special_tokens=False)) == "hi"


def test_an_abort_that_raises_is_logged_not_raised(monkeypatch):
    logged = []
    monkeypatch.setattr(generation.log, "exception", lambda event, **kw: logged.append((event, kw)))

    async def crashed_abort(rid, stop=False):
        raise RuntimeError("the loop is gone")
    engine = SimpleNamespace(abort=crashed_abort)
    req = SimpleNamespace(rid="r1", state=SimpleNamespace(done=False))
    asyncio.run(generation.abort_quietly(engine, req))
    assert logged == [("abort failed", {"rid": "r1"})]


def test_a_dropped_log_line_is_counted_even_where_stderr_is_gone(monkeypatch):
    gone = io.StringIO()
    gone.close()
    monkeypatch.setattr(sys, "stderr", gone)  # (its notice cannot be written either: ValueError)
    full = io.StringIO()
    full.close()
    sink = LogSink(full)
    sink.strict = False
    assert sink.write("line\n") == 0 and sink.write("line\n") == 0
    assert sink.dropped_writes == 2


def test_a_stop_matcher_needs_stop_strings():
    for stops in ([], ["ok", ""]):
        with pytest.raises(ValueError, match="non-empty stop strings"):
            StopMatcher(stops)


def test_a_beam_search_s_include_stop_str_in_output_must_be_a_bool():
    params = BeamSearchParams(beam_width=2, max_tokens=4, include_stop_str_in_output="yes")
    with pytest.raises(RequestError, match="include_stop_str_in_output must be a bool, got 'yes'") as err:
        params.validate(make_engine(), [1, 2, 3])
    assert err.value.param == "include_stop_str_in_output"


def _search_with_a_hook(at: int, then):
    """A beam search (4 beams, 12 steps) on an engine that runs one request at a time (a step's beams queue behind
    each other), `then(task, req)` called as its `at`-th step request is queued; the step requests."""
    from scheduler.beam_search import beam_search
    from test_beam_search import PROMPT
    from test_beam_search import make_engine as beam_engine
    eng = beam_engine(max_running_requests=1)
    real, reqs, task = eng.add_request, [], []

    def add(*args, **kwargs):
        req = real(*args, **kwargs)
        reqs.append(req)
        if len(reqs) == at:
            then(task[0], eng, req)
        return req
    eng.add_request = add
    task.append(asyncio.ensure_future(beam_search(eng, PROMPT, BeamSearchParams(beam_width=4, max_tokens=12))))
    return eng, reqs, task[0]


def test_a_search_cancelled_while_its_steps_wait_aborts_them():
    """The client left (the search task cancelled) while a step's beams still wait in the queue: each step request
    not yet ended is aborted, none left to run for nobody (test_beam_search's cancel test found its steps ended)."""
    from hicache_helpers import finish
    from scheduler.request import RequestState

    async def go():
        eng, reqs, task = _search_with_a_hook(5, lambda task, eng, req: task.cancel())  # (step 1's 4th beam)
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(HANG_GUARD_S):
                await asyncio.shield(task)
        states = [r.state for r in reqs[1:]]
        assert all(s.done for s in states) and RequestState.ABORTED in states, states
        assert not eng.requests
        await finish(eng)
    asyncio.run(go())


def test_a_step_aborted_under_the_search_ends_it_as_aborted():
    """A step request aborted by the engine (a shutdown's grace ended, an operator's abort) ends the search with
    finish_reason "abort" and a message saying so, not an "error" of a step that "ended with 'abort'"."""
    from hicache_helpers import finish
    from scheduler.beam_search import BeamSearchError
    aborts = []

    async def go():
        eng, _, task = _search_with_a_hook(5, lambda task, eng, req: aborts.append(
            asyncio.ensure_future(eng.abort(req.rid))))
        with pytest.raises(BeamSearchError) as err:
            async with asyncio.timeout(HANG_GUARD_S):
                await task
        assert err.value.finish_reason == "abort" and "a beam search step was aborted" in str(err.value)
        await aborts[0]
        await finish(eng)
    asyncio.run(go())


def test_a_log_this_process_may_append_to_but_not_read_is_taken_as_ending_its_line(tmp_path, monkeypatch):
    """--log-json of a write-only file (mode 0o200, not root): whether its last line is open cannot be read, so it is
    taken as closed (no newline written first), not an OSError that stops the start."""
    from scheduler import logs
    path = tmp_path / "run.jsonl"
    path.write_text('{"event": "cut short')
    assert logs._ends_mid_line(str(path))

    def write_only(file, mode="r", *args, **kwargs):
        if "r" in mode:
            raise PermissionError(13, "Permission denied", str(file))
        return open(file, mode, *args, **kwargs)
    monkeypatch.setattr(logs, "open", write_only, raising=False)
    assert logs._ends_mid_line(str(path)) is False
