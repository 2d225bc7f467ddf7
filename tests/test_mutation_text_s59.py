"""What a client reads, found unpinned by session 59's mutation check of scheduler/stop_strings.py, tool_calls.py,
reasoning.py, logprobs.py, penalties.py, penalty_state.py, token_bans.py, chat_messages.py and
prompt_truncation.py: min_tokens' reach over held and flushed text, tool-call blocks that are no call, the prompt's
think block under special markers, the bounds the API takes, and stop ids outside the vocabulary. No server."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from scheduler.chat_messages import ChatMessage
from scheduler.logprobs import ChatLogprobsFields, LogprobsShaper, finite
from scheduler.penalties import PenaltyFields
from scheduler.penalty_state import PenaltyState, RowPenalties, step_upload
from scheduler.prompt_truncation import kept_tokens
from scheduler.request import TokenLogprobs
from scheduler.reasoning import prompt_opens_thinking
from scheduler.token_bans import RowBans, held_by_min_tokens, nothing_left
from scheduler.stop_strings import CompletionText, StopMatcher
from scheduler.tokenizer import ByteTokenizer, HFTokenizer
from scheduler.tool_calls import HermesToolParser
from tokenizer_files import write_byte_tokenizer

TOK = ByteTokenizer(512)
CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


def _parse(text: str) -> tuple[str, list[str]]:
    parser = HermesToolParser()
    content, calls = parser.feed(text)
    tail, more = parser.flush()
    return content + tail, [c.name for c in calls + more]


# -- stop strings ---------------------------------------------------------------------------------------
def test_a_whole_stop_string_inside_min_tokens_is_sent_at_once():
    """Text that can never match (a whole stop string fed with can_match=False: min_tokens) is not held back
    for the next token: only a proper prefix of a stop string may still become a match."""
    m = StopMatcher(["ab"])
    assert m.feed("xab", can_match=False) == "xab" and m.matched is None
    assert m.feed("a", can_match=False) == ""  # (a proper prefix: held)


def test_the_text_flushed_at_the_end_keeps_min_tokens():
    """The last token's held text (an incomplete character: U+FFFD) is that token's: with the generation ending
    at its min_tokens-th token, it may not complete a stop string."""
    first_byte = TOK.encode("\u00e9")[0]
    text = CompletionText(TOK, [], ["\ufffd"], min_tokens=1)
    assert text.feed(first_byte) == ""  # (held by the decoder)
    assert text.flush() == "\ufffd" and not text.stopped
    text = CompletionText(TOK, [], ["\ufffd"], min_tokens=0)  # (past min_tokens it matches)
    assert text.feed(first_byte) == "" and text.flush() == "" and text.stopped


# -- tool calls -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("broken", [
    "<tool_call>C:\\</tool_call>",  # a backslash outside a JSON string escapes nothing, the end marker included
    '<tool_call>a "b</tool_call> <tool_call>c "d</tool_call>',  # quotes in a body that is no JSON open no string
])
def test_a_block_that_is_no_json_ends_at_its_marker_and_the_call_after_it_is_a_call(broken):
    assert _parse(broken + "\n" + CALL) == (broken, ["f"])


# -- reasoning ------------------------------------------------------------------------------------------
def test_a_prompt_opens_thinking_whatever_the_markers_specialness(tmp_path):
    """The prompt's tail is decoded with its special tokens: a tokenizer whose <think> is special still opens it."""
    tok = HFTokenizer(str(write_byte_tokenizer(tmp_path, special=("<think>", "</think>"))))
    prompt = tok.encode("<assistant><think>\n", add_special_tokens=False)
    assert prompt_opens_thinking(tok, prompt)
    assert not prompt_opens_thinking(tok, prompt + tok.encode("</think>", add_special_tokens=False))


# -- logprobs -------------------------------------------------------------------------------------------
def test_top_logprobs_0_without_logprobs_changes_nothing():
    assert ChatLogprobsFields(top_logprobs=0).logprob_count() is None
    with pytest.raises(ValueError, match="without 'logprobs'"):
        ChatLogprobsFields(top_logprobs=1)


def test_a_nan_logprob_is_the_lowest_json_can_carry():
    assert finite(float("nan")) == -9999.0 and finite(float("-inf")) == -9999.0 and finite(-1.5) == -1.5
    assert not math.isnan(finite(float("nan")))
    inf = float("-inf")  # (a chat entry's logprobs too, the sampled token's and its alternatives')
    entry = LogprobsShaper(None, chat=True).entry(7, TokenLogprobs(inf, [(7, inf)]))
    assert entry["logprob"] == -9999.0 and entry["top_logprobs"][0]["logprob"] == -9999.0


# -- penalties: the bounds are the API's --------------------------------------------------------------
def test_the_penalty_and_bias_bounds_are_taken():
    fields = PenaltyFields.model_validate({"presence_penalty": -2.0, "frequency_penalty": -2.0,
                                          "logit_bias": {str(i): 1 for i in range(1024)}},
                                         context={"vocab_size": 2048})
    assert fields.penalty_params(16)["presence_penalty"] == -2.0 and len(fields.logit_bias) == 1024
    assert PenaltyFields.model_validate({"logit_bias": {"0": -100}}, context={"vocab_size": 8}).logit_bias == \
        {"0": -100}  # (token 0: a key of "0" is no leading zero)


def test_stop_ids_outside_the_vocabulary_are_never_held():
    """min_tokens' held stop ids go to an index_put: a negative one would count from the vocabulary's end, and
    one past it would be out of range (an in-process SamplingParams takes any integer)."""
    row = RowPenalties(0.0, 0.0, 1.0, [], [], PenaltyState(), min_tokens=2, stop_ids=(-1, 511, 512))
    up = step_upload([row], vocab_size=512)
    assert up.held_stops == 1 and up.index.tolist()[-1] == 511


# -- token bans: the host's side -------------------------------------------------------------------------
def _bans(words, output, allowed=None) -> RowBans:
    row = RowBans(allowed, words, output, PenaltyState())
    row.index("cpu")
    return row


@pytest.mark.parametrize("output, chained, want", [
    ([5], False, ([-1], [6])),          # one output token: the two-token word it begins
    ([5], True, ([6], [7])),            # its second token in flight: the device compares it (and two-token words)
    ([9, 5, 6], False, ([-1], [7])),    # the output ends with a whole prefix
    ([], False, ([], [])),
])
def test_the_host_bans_a_word_s_last_token_once_its_prefix_is_generated(output, chained, want):
    """A word's prefix that is all of the output so far (or all of it and the token in flight) counts."""
    row = _bans(((5, 6), (5, 6, 7)), output)
    ids, bans = row.host_bans(row.state.words, chained)
    assert (sorted(ids), sorted(bans)) == want


def test_a_token_sampled_from_a_row_with_nothing_left_is_banned_by_a_word_as_long_as_the_output():
    row = _bans(((5, 6), (1, 2, 3)), [5])
    assert row.sampled_banned(6) and not row.sampled_banned(7)
    assert _bans(((1, 2, 3),), [1, 2]).sampled_banned(3)


def test_min_tokens_never_holds_the_stops_that_allowed_ids_less_one_token_bad_words_leave():
    assert held_by_min_tokens((1, 2), ((2,),), (1,))  # 2 is banned: 1, the held stop, is all that is left
    assert not held_by_min_tokens((1, 2, 3), ((2,),), (1,))
    assert not held_by_min_tokens((1, 2), ((2, 4),), (1,))  # (a longer word bans 2 only after 4... never here)


def test_no_token_left_names_min_tokens_only_while_it_holds_stops_back():
    def req(output: int):
        return SimpleNamespace(guide=None, output=[7] * output, params=SimpleNamespace(min_tokens=2))
    assert "min_tokens" in nothing_left(req(1)) and "min_tokens" not in nothing_left(req(2))


# -- chat messages as the template gets them --------------------------------------------------------------
def test_a_message_reaches_the_template_as_vllm_passes_it():
    parts = ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert parts.as_template_dict() == {"role": "user", "content": "a\nb"}  # (vLLM's "string" content format)
    tool = ChatMessage(role="tool", content="12C", tool_call_id="call_1")
    assert tool.as_template_dict() == {"role": "tool", "content": "12C", "tool_call_id": "call_1"}
    calls = ChatMessage.model_validate({"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}).as_template_dict()
    assert calls["content"] == "" and calls["tool_calls"][0]["function"]["name"] == "f"  # (not None: "None")


# -- truncate_prompt_tokens ------------------------------------------------------------------------------
def _kept(k, chat=False, max_tokens=None, max_completion_tokens=None, context=100):
    req = SimpleNamespace(truncate_prompt_tokens=k, max_tokens=max_tokens, max_completion_tokens=max_completion_tokens)
    return kept_tokens(req, chat, prompt_limit=1000, context_tokens=context, default_max_tokens=16,
                       max_tokens_limit=200)


def test_the_longest_prompt_reads_the_request_s_max_tokens():
    assert _kept(-1, max_tokens=11) == 90                              # the context less max_tokens - 1
    assert _kept(-1, max_tokens=51, max_completion_tokens=11) == 90    # max_completion_tokens first
    assert _kept(-1) == 85 and _kept(-1, chat=True) == 100             # left out: a completion's default; a chat none
    # max_tokens alone fills the context: its own 400 (naming it) follows; the prompt is kept as it is checked
    assert _kept(5, max_tokens=101) == 5 and _kept(-1, max_tokens=101) == 1
