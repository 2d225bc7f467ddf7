"""Rules found unpinned by session 68's second mutation check of scheduler/stop_strings.py, tool_calls.py,
reasoning.py, chat_messages.py, chat_template.py and token_bans.py (earlier passes: test_mutation_text_s59.py,
test_mutation_tok_s61.py, test_mutation_penalties_s62.py): text a tool-call parser holds at the answer's end, a
tool message without content, continue_final_message's cut as transformers makes it, and the raw logits that
apply_bans leaves alone when asked for a copy (logprobs read them). No server, no engine."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from scheduler.chat_messages import ChatMessage
from scheduler.chat_template import ChatTemplate
from scheduler.penalty_state import PenaltyState
from scheduler.token_bans import RowBans, apply_bans
from scheduler.tool_calls import HermesToolParser


# -- tool calls -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("answer", ["a <tool", "Let me see.\n<tool_c", "x  <"])
def test_a_marker_begun_at_the_answer_s_end_is_text_after_its_whitespace(answer):
    """The held start of a "<tool_call>" that never came is content at flush, after the whitespace before it
    (which waited for it), in the answer's order: the answer comes back exactly (mutant T30: the held text
    bypassed the pending whitespace, "a<tool ")."""
    parser = HermesToolParser()
    content, calls = parser.feed(answer)
    tail, more = parser.flush()
    assert (content + tail, calls + more) == (answer, [])


# -- chat messages --------------------------------------------------------------------------------------------
def test_a_tool_message_needs_content():
    """Only an assistant's message may come without content; a tool's result is its content (mutant C4: a tool
    message without one reached the template as "")."""
    with pytest.raises(ValidationError, match="a tool message needs 'content'"):
        ChatMessage.model_validate({"role": "tool", "tool_call_id": "call_1"})
    assert ChatMessage.model_validate({"role": "tool", "tool_call_id": "call_1", "content": "42"}).content == "42"


# -- chat template --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content, want", [
    ("hi ", "hi "),    # the template kept the trailing space: kept
    (" hi ", " hi "),  # (transformers marks the content's end: a leading space changes nothing; it was " hi")
    ("hi", "hi"),
])
def test_continue_final_message_keeps_a_trailing_space_as_transformers_does(content, want):
    """transformers' continue_final_message keeps the content's trailing whitespace only where the template kept
    it (session 79: transformers marks where the content ends, CONTINUE_FINAL_MESSAGE_TAG; mutant CT5 was of the
    search for the content's text that this replaced)."""
    template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    text = template.render([{"role": "assistant", "content": content}], add_generation_prompt=False,
                           continue_final_message=True)
    assert text == "<assistant>" + want


# -- token bans -----------------------------------------------------------------------------------------------
def _row(allowed=None, words=(), output=()) -> RowBans:
    return RowBans(allowed, tuple(words), list(output), PenaltyState())


def test_a_masked_copy_leaves_the_raw_logits_alone():
    """copy=True (no penalty made a copy before): the bans are applied to a copy, the raw float32 logits, which
    logprobs read, keep their values (mutant B3: masked in place)."""
    logits = torch.arange(16, dtype=torch.float32).reshape(2, 8)
    raw = logits.clone()
    out = apply_bans(logits, [_row(allowed=(1, 2)), None], None, copy=True)
    assert torch.equal(logits, raw)
    assert out[0].isinf().tolist() == [True, False, False, True, True, True, True, True]
    assert torch.equal(out[1], raw[1])


def test_a_word_ban_copy_leaves_the_raw_logits_alone():
    """A row with bad words only (no mask): its word bans too go to a copy (mutant B4: written into the raw
    logits)."""
    logits = torch.zeros(1, 8)
    out = apply_bans(logits, [_row(words=((5, 6),), output=(5,))], None, copy=True)
    assert torch.equal(logits, torch.zeros(1, 8))
    assert out[0].isinf().nonzero().flatten().tolist() == [6]


def test_a_one_token_bad_word_is_banned_among_the_allowed_ids():
    """allowed_token_ids and one-token bad words at once: the word is banned though allowed (mutant B8: the
    allowed ids' mask left the bad word out)."""
    logits = torch.zeros(1, 8)
    out = apply_bans(logits, [_row(allowed=(1, 2, 3), words=((2,),))], None, copy=True)
    assert (~out[0].isinf()).nonzero().flatten().tolist() == [1, 3]
