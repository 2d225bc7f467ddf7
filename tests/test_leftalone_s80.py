"""Session 80: what sessions 78-80 noticed and left alone, the real bugs among them (regressions).

* A server whose ServerLimits.max_prompt_tokens is below its engine's (the Python API; hicache-serve gives both
  --max-prompt-tokens): truncate_prompt_tokens bounded a beam search's prompt by the server's limit, the search's
  steps by the engine's. -1 cut a prompt that fit to 1 token and served it; a search the CLI refuses was served.
* A hermes call whose "arguments" is null was content text (its tool call lost); the request side reads null
  arguments as {}, and vLLM makes a call.
* ServerLimits took any string as reasoning_parser / tool_call_parser: a typo ran the one parser there is.
* `--max-num-seqs 0` / `--max-num-batched-tokens 0` were refused naming only the flag the user did not type.
"""
from __future__ import annotations

import pytest

from scheduler import serve
from scheduler.server import ServerLimits
from server_fixtures import byte_level_server, ok, post, tiny_config

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
PROMPT_LIMIT = 48


# -- the server's prompt limit bounds a beam search's steps, as the engine's does -----------------------------
@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """ServerLimits.max_prompt_tokens 48 over an engine of no prompt limit (1,024 tokens of context)."""
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=64),
                           limits=ServerLimits(shutdown_grace_s=1.0, max_prompt_tokens=PROMPT_LIMIT)) as s:
        yield s


def test_truncation_to_the_longest_prompt_never_cuts_a_beam_search_s_prompt_to_one_token(limited):
    """-1 with a max_tokens whose steps cannot fit the limit: the prompt (10 tokens, within the limit) was cut to
    its last token and searched; now a 400 naming max_tokens, as the engine's limit gives."""
    r = post(limited, CMPL, {"prompt": list(range(40, 50)), "max_tokens": 60, "n": 2, "use_beam_search": True,
                             "truncate_prompt_tokens": -1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens", r.text


def test_a_search_whose_last_step_passes_the_server_s_limit_is_refused_as_under_the_engine_s(limited):
    """40 tokens + 20 - 1 > 48: served (its steps' prompts past the limit), while a truncation to 35 tokens, within
    what it reported, was refused; hicache-serve's --max-prompt-tokens refuses it."""
    r = post(limited, CMPL, {"prompt": list(range(40, 80)), "max_tokens": 20, "n": 2, "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "exceeds the prompt limit of 48" in r.json()["error"]["message"]


def test_a_chat_without_max_tokens_searches_what_the_server_s_limit_holds(limited):
    prompt = ok(limited, "/tokenize", {"messages": HI})["tokens"]
    assert len(prompt) < PROMPT_LIMIT
    r = ok(limited, CHAT, {"messages": HI, "n": 2, "use_beam_search": True})
    longest = max(len(c["token_ids"]) for c in r["choices"])
    assert 0 < longest <= PROMPT_LIMIT + 1 - len(prompt), longest
    assert not limited.engine.requests


# -- a hermes call of null arguments is a call ----------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_time"}}]
NULL_CALL = 'start: "<tool_call>{\\"name\\": \\"get_time\\", \\"arguments\\": null}</tool_call>"'


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=128),
                           limits=ServerLimits(shutdown_grace_s=1.0, tool_call_parser="hermes")) as s:
        yield s


def test_a_call_of_null_arguments_is_a_call_of_none(hermes):
    r = ok(hermes, CHAT, {"messages": HI, "tools": TOOLS, "guided_grammar": NULL_CALL, "max_tokens": 100,
                          "temperature": 0})
    [choice] = r["choices"]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": "{}"}
    assert choice["message"]["content"] is None


@pytest.mark.parametrize("arguments", ["null", '"null"'])
def test_the_parser_reads_null_arguments_as_none(arguments):
    from scheduler.tool_calls import HermesToolParser
    parser = HermesToolParser()
    content, calls = parser.feed(f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>')
    more, rest = parser.flush()
    assert content + more == "" and [(c.name, c.arguments) for c in calls + rest] == [("f", "{}")]


# -- ServerLimits' parser names -------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("reasoning_parser", "qwen"), ("reasoning_parser", ""),
                                          ("tool_call_parser", "mistral"), ("tool_call_parser", "Hermes")])
def test_server_limits_refuse_a_parser_they_do_not_have(field, value):
    with pytest.raises(ValueError, match=f"ServerLimits.{field} must be"):
        ServerLimits(**{field: value})


def test_server_limits_take_the_parsers_they_have():
    limits = ServerLimits(reasoning_parser="deepseek_r1", tool_call_parser="hermes")
    assert (limits.reasoning_parser, limits.tool_call_parser) == ("deepseek_r1", "hermes")


# -- a refused flag named as the user typed it ----------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--max-num-seqs", "--max-num-batched-tokens", "--chunked-prefill-size",
                                  "--gpu-memory-utilization"])
def test_a_refused_alias_is_named_in_the_error(flag, capsys):
    assert serve.main(["--model", "tiny", "--device", "cpu", flag, "0"]) == 2
    err = capsys.readouterr().err
    assert flag in err, err
