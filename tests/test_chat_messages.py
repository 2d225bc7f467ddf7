"""A chat's messages as the template sees them: an assistant's thinking sent back under vLLM's newer name
`reasoning` as well as `reasoning_content` (an agent replaying vLLM's messages sends `reasoning`; it was an
"unknown field" 400)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from scheduler.api_inputs import chat_ids
from scheduler.api_models import ChatCompletionRequest
from scheduler.chat_messages import ChatMessage
from scheduler.tokenizer import ByteTokenizer

# reads the name Qwen3's template reads
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.reasoning_content or '' }}|{{ m.content }}\n{% endfor %}"


def _rendered(*messages: dict) -> str:
    tok = ByteTokenizer(vocab_size=512)
    tok.use_chat_template(TEMPLATE)
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": list(messages),
                                                "add_generation_prompt": False})
    return tok.decode(chat_ids(req, tok))


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_thinking_sent_back_under_either_name_reaches_the_template(field):
    text = _rendered({"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "hello", field: "they greet"},
                     {"role": "user", "content": "again"})
    assert text == "<user>|hi\n<assistant>they greet|hello\n<user>|again\n"


def test_the_template_gets_both_names_as_vllm_passes_them():
    got = ChatMessage.model_validate({"role": "assistant", "content": "a", "reasoning": "r"}).as_template_dict()
    assert got == {"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r"}
    plain = ChatMessage.model_validate({"role": "assistant", "content": "a"}).as_template_dict()
    assert "reasoning" not in plain and "reasoning_content" not in plain


def test_both_names_agreeing_are_taken_and_differing_are_a_400():
    same = {"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r"}
    assert ChatMessage.model_validate(same).as_template_dict()["reasoning"] == "r"
    with pytest.raises(ValidationError, match="name one thing"):
        ChatMessage.model_validate({**same, "reasoning_content": "other"})
    with pytest.raises(ValidationError):  # a string, as reasoning_content
        ChatMessage.model_validate({"role": "assistant", "content": "a", "reasoning": 5})
