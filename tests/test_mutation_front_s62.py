"""What a user sees at the front door, found unpinned by session 62's mutation check of scheduler/api_inputs.py,
reasoning.py, serve.py, presets.py, logs.py and hicache/config.py: a batch's bad prompt named by its position, a
prompt's think block seen open past its last tokens, the server's flag bounds. No server, no model."""
from __future__ import annotations

import pytest

from scheduler import serve
from scheduler.api_inputs import parse_prompts
from scheduler.api_models import APIError
from scheduler.generation_defaults import GenerationDefaults
from scheduler.reasoning import ReasoningTokens, opens_thinking, prompt_opens_thinking, think_markers
from scheduler.request import SEED_MAX
from scheduler.tokenizer import ByteTokenizer, HFTokenizer
from tokenizer_files import write_byte_tokenizer

TOK = ByteTokenizer(512)


def _parse(body: dict, chat: bool = False, **kw):
    args = dict(tokenizer=None, served_names={"tiny"}, model_name="tiny", vocab_size=512, prompt_limit=64,
                max_tokens_limit=16)
    return parse_prompts(body, chat, **{**args, **kw})


# -- api_inputs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,at", [([[1, 2], [600]], 1), ([[600], [1]], 0), ([[1], [2], [1000]], 2)])
def test_a_batch_s_bad_prompt_is_named_by_its_position(bad, at):
    """A completion's batch fails whole, naming the prompt by its index from 0 (a batch of two included)."""
    with pytest.raises(APIError) as err:
        _parse({"prompt": bad, "max_tokens": 1})
    assert err.value.param == f"prompt.{at}"
    assert err.value.message.startswith(f"prompt {at} of the batch: token id ")


def test_a_single_prompt_s_error_names_the_prompt_alone():
    with pytest.raises(APIError) as err:
        _parse({"prompt": [[600]], "max_tokens": 1})
    assert (err.value.param, err.value.message) == ("prompt", "token id 600 is outside the vocabulary [0, 512)")


# -- reasoning --------------------------------------------------------------------------------------------
def test_the_last_think_marker_decides_whether_the_prompt_leaves_the_block_open():
    assert opens_thinking("<think>a</think>\n<think>\n")
    assert not opens_thinking("<think>\n</think><think>a</think>")


def test_a_continued_message_s_thought_is_seen_open_past_the_prompt_s_last_tokens():
    """continue_final_message: the tail looked at is the final message's length more than the usual 16 ids, so a
    <think> the template wrote just before a long continued thought is still seen (and one further back is not)."""
    continued = "x" * 40
    prompt = TOK.encode("<user>hi<assistant><think>\n" + continued, add_special_tokens=False)
    assert prompt_opens_thinking(TOK, prompt, continued)
    assert not prompt_opens_thinking(TOK, prompt)  # (40 ids of thought: past the 16 looked at)
    far = TOK.encode("<think>\n" + "y" * 20 + continued, add_special_tokens=False)
    assert not prompt_opens_thinking(TOK, far, continued)


# -- serve ------------------------------------------------------------------------------------------------
def _args(*argv: str):
    return serve.build_parser().parse_args(["--model", "tiny", "--port", "0", *argv])


@pytest.mark.parametrize("flag", ["--max-tokens-limit", "--max-concurrent-requests", "--max-body-bytes"])
def test_the_server_s_positive_limits_refuse_0(flag):
    assert serve._check_server_args(_args(flag, "0")) == f"{flag} must be >= 1"
    assert serve._check_server_args(_args(flag, "1")) is None


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens():
    _, ids, _ = _parse({"prompt": [[1, 2, 3, 4, 5], [6, 7]], "max_tokens": 1, "truncate_prompt_tokens": 2})
    assert ids == [[4, 5], [6, 7]]


def test_an_empty_prompt_is_a_400():
    with pytest.raises(APIError) as err:
        _parse({"prompt": "", "max_tokens": 1}, tokenizer=TOK)
    assert (err.value.param, err.value.message) == ("prompt", "the prompt is empty")


def test_a_prompt_of_the_limit_is_taken_and_one_longer_refused():
    assert _parse({"prompt": list(range(64)), "max_tokens": 1})[1] == [list(range(64))]
    with pytest.raises(APIError) as err:
        _parse({"prompt": list(range(65)), "max_tokens": 1})
    assert err.value.code == "prompt_too_long"


@pytest.mark.parametrize("bad", [512, -1])
def test_a_token_id_outside_the_vocabulary_is_a_400(bad):
    assert _parse({"prompt": [0, 511], "max_tokens": 1})[1] == [[0, 511]]
    with pytest.raises(APIError) as err:
        _parse({"prompt": [1, bad], "max_tokens": 1})
    assert (err.value.param, err.value.code) == ("prompt", "invalid_token_id")


def test_a_text_prompt_without_a_tokenizer_is_a_400_naming_the_prompt():
    with pytest.raises(APIError) as err:
        _parse({"prompt": "hi", "max_tokens": 1})
    assert err.value.param == "prompt" and "no tokenizer" in err.value.message


def test_add_special_tokens_false_leaves_the_bos_out(tmp_path):
    tok = HFTokenizer(str(write_byte_tokenizer(tmp_path, special=("<s>",), bos="<s>")))
    with_bos = _parse({"prompt": "ab", "max_tokens": 1}, tokenizer=tok)[1][0]
    without = _parse({"prompt": "ab", "max_tokens": 1, "add_special_tokens": False}, tokenizer=tok)[1][0]
    assert with_bos[1:] == without and len(without) == 2


def test_a_chat_without_max_tokens_gets_what_is_left_of_the_context_and_a_completion_16(tmp_path):
    tok = HFTokenizer(str(write_byte_tokenizer(tmp_path, config={
        "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"})))
    _, ids, params = _parse({"messages": [{"role": "user", "content": "hi"}]}, chat=True, tokenizer=tok,
                            max_tokens_limit=1000, context_tokens=50)
    assert params.max_tokens == 50 + 1 - len(ids[0])
    assert _parse({"prompt": [1, 2]}, max_tokens_limit=1000, context_tokens=50)[2].max_tokens == 16
    assert _parse({"prompt": [1, 2]}, max_tokens_limit=8)[2].max_tokens == 8  # (the default within the limit)


def test_max_tokens_0_is_refused_without_echo():
    with pytest.raises(APIError) as err:
        _parse({"prompt": [1, 2], "max_tokens": 0})
    assert err.value.param == "max_tokens" and "must be >= 1" in err.value.message


def test_logprobs_ask_for_the_prompt_s_only_with_echo():
    assert _parse({"prompt": [1, 2], "max_tokens": 1, "logprobs": 2})[2].prompt_logprobs is None
    assert _parse({"prompt": [1, 2], "max_tokens": 1, "logprobs": 2, "echo": True})[2].prompt_logprobs == 2
    assert _parse({"prompt": [1, 2], "max_tokens": 0, "echo": True})[2].prompt_logprobs == 0  # (the prefill alone)


def test_max_completion_tokens_is_named_in_its_own_error(tmp_path):
    tok = HFTokenizer(str(write_byte_tokenizer(tmp_path, config={"chat_template": "{{ messages[0].content }}"})))
    with pytest.raises(APIError) as err:
        _parse({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 17}, chat=True, tokenizer=tok)
    assert err.value.param == "max_completion_tokens" and "'max_completion_tokens' of 17" in err.value.message


def test_the_largest_seed_is_taken():
    assert _parse({"prompt": [1], "max_tokens": 1, "seed": SEED_MAX})[2].seed == SEED_MAX


def test_whitespace_inside_a_think_marker_breaks_it():
    """"<th ink>" is no marker: the answer is content, no reasoning token counted (the whitespace skipped is only the
    answer's leading)."""
    counter = ReasoningTokens(think_markers(TOK))
    counter.feed(TOK.encode("<th ink>abc</think>", add_special_tokens=False))
    assert counter.total() == 0


@pytest.mark.parametrize("argv,problem", [
    (["--responses-store-max", "-1"], "--responses-store-max must be >= 0"),
    (["--responses-store-max-mib", "0"], "--responses-store-max-mib must be in [1, 2**30]"),
    (["--responses-store-max-mib", str((1 << 30) + 1)], "--responses-store-max-mib must be in [1, 2**30]"),
    (["--port", "65536"], "--port must be in [0, 65535]"),
    (["--port", "-1"], "--port must be in [0, 65535]"),
    (["--host", ""], "--host must not be empty"),
    (["--shutdown-grace-s", "nan"], "--shutdown-grace-s must be a number"),
    (["--enable-hicache", "--disable-prefix-cache"], "--enable-hicache cannot be used with --disable-prefix-cache"),
    (["--tool-call-parser", "hermes"], "--enable-auto-tool-choice and --tool-call-parser go together"),
    (["--log-json", ""], "--log-json must not be empty"),
])
def test_server_flags_out_of_bounds_are_one_line(argv, problem, monkeypatch):
    monkeypatch.setattr(serve, "_bind_problem", lambda host, port: None)
    assert serve._check_server_args(_args(*argv)).startswith(problem)


@pytest.mark.parametrize("argv", [["--responses-store-max", "0"], ["--responses-store-max-mib", "1"],
                                  ["--responses-store-max-mib", str(1 << 30)], ["--port", "65535"], ["--port", "0"]])
def test_server_flags_at_their_bounds_are_taken(argv, monkeypatch):
    monkeypatch.setattr(serve, "_bind_problem", lambda host, port: None)
    assert serve._check_server_args(_args(*argv)) is None


def test_the_l3_path_and_the_log_are_checked_before_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    on = ["--enable-hicache", "--hicache-storage-path"]
    assert serve._check_server_args(_args(*on, "l3.kv")) is None  # (a relative path in the working directory)
    assert "a directory" in serve._check_server_args(_args(*on, str(tmp_path)))
    assert serve._check_server_args(_args("--hicache-storage-path", str(tmp_path / "no" / "l3.kv"))) is None  # (off)
    assert serve._check_server_args(_args("--log-json", str(tmp_path))) == f"--log-json: cannot write {tmp_path}"
    problem = serve._check_server_args(_args("--generation-config", str(tmp_path)))
    assert problem.startswith("--generation-config must be auto, vllm or a directory holding")


def test_generation_config_vllm_ignores_the_checkpoint_s(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.25}')
    assert serve._generation_defaults(_args("--model", str(tmp_path), "--generation-config", "vllm")) == \
        GenerationDefaults()
    assert serve._generation_defaults(_args("--model", str(tmp_path))) != GenerationDefaults()


def test_disable_hicache_prefetch_without_enable_hicache_is_named():
    parser = serve.build_parser()
    args = parser.parse_args(["--disable-hicache-prefetch"])
    assert serve._idle_hicache_flags(parser, args) == ["--disable-hicache-prefetch"]


def test_the_server_s_defaults():
    args = serve.build_parser().parse_args([])
    assert (args.host, args.port, args.max_tokens_limit, args.log_level, args.generation_config) == \
        ("127.0.0.1", 8000, 4096, "info", "auto")


class _Stop(Exception):
    pass


def test_main_hands_the_flags_to_the_engine_the_app_and_uvicorn(monkeypatch):
    seen = {}
    real_engine = serve.Engine

    def engine(config):
        seen["config"] = config
        return real_engine(config)

    def app(engine, limits, tokenizer):
        seen["limits"] = limits
        raise _Stop

    monkeypatch.setattr(serve, "Engine", engine)
    monkeypatch.setattr(serve, "create_app", app)
    with pytest.raises(_Stop):
        serve.main(["--model", "tiny", "--device", "cpu", "--num-pages", "64", "--port", "0", "--max-tokens-limit", "7",
                    "--shutdown-grace-s", "-3", "--reasoning-parser", "qwen3", "--responses-store-max-mib", "5"])
    limits = seen["limits"]
    assert seen["config"].max_new_tokens_limit == 7 and limits.max_tokens_limit == 7
    assert (limits.shutdown_grace_s, limits.reasoning_parser, limits.responses_store_max_mib) == (0.0, "qwen3", 5)
    assert limits.trust_request_chat_template is False


def test_an_engine_that_cannot_start_is_one_line_and_exit_2(monkeypatch, capsys):
    def fail(config):
        raise RuntimeError("CUDA out of memory\nmore")

    monkeypatch.setattr(serve, "Engine", fail)
    assert serve.main(["--model", "tiny", "--device", "cpu", "--port", "0"]) == 2
    assert capsys.readouterr().err == "hicache-serve: cannot start the engine: CUDA out of memory\n"
    assert serve.main(["--model", "tiny", "--device", "cpu", "--port", "0", "--chat-template", "{% for %}"]) == 2
    assert capsys.readouterr().err.startswith("hicache-serve: the chat template does not compile here")
