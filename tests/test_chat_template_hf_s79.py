"""Chat templates rendered as transformers' apply_chat_template renders them (scheduler/chat_template.py), which
vLLM's chat path calls: continue_final_message cut where the final message's content ends, marked before the
render (transformers' CONTINUE_FINAL_MESSAGE_TAG), and the `{% generation %}` tag of templates written for TRL's
assistant-only loss."""
from __future__ import annotations

import httpx
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

SPECIAL = ("<|im_start|>", "<|im_end|>")
# Qwen2.5's shape without tools: each message's content closed by <|im_end|>
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 3's: contents trimmed
TRIMMED = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n\n' + message['content'] | trim"
           " + '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n\n' }}{% endif %}")
# a template TRL's assistant_only_loss asks for (a fine-tune ships it): the assistant's turn in {% generation %}
GENERATION = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
              "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
              "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
USER = {"role": "user", "content": "Write JSON"}


def _tokenizer(path, template: str) -> HFTokenizer:
    return HFTokenizer(str(write_byte_tokenizer(path, special=SPECIAL, config={"chat_template": template})))


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tokenizer = _tokenizer(tmp_path_factory.mktemp("tok"), CHATML)
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=tokenizer)) as s:
        s.tokenizer = tokenizer
        yield s


def _continued_text(s, content: str) -> str:
    """The prompt /tokenize makes of a chat whose assistant message `content` is continued, as text."""
    r = httpx.post(s.url + "/tokenize", json={"messages": [USER, {"role": "assistant", "content": content}],
                                              "add_generation_prompt": False, "continue_final_message": True},
                   timeout=30)
    assert r.status_code == 200, r.text
    return s.tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)


OPEN_TURN = "<|im_start|>user\nWrite JSON<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("content", ["", "<", "end", "d", "Sure"])
def test_continue_final_message_ends_where_the_content_ends(srv, content):
    # (regression: the text was cut after the last occurrence of the content anywhere in the render, so an empty
    # content left the turn closed, "<|im_end|>\n" and all, and a "<" or an "end" was found inside <|im_end|>:
    # the prompt ended "<<" or "end<|im_end")
    assert _continued_text(srv, content) == OPEN_TURN + content


def test_continue_final_message_with_a_trailing_space(srv):
    assert _continued_text(srv, "The answer is ") == OPEN_TURN + "The answer is "


def test_continue_final_message_where_the_template_trims(tmp_path):
    tokenizer = _tokenizer(tmp_path, TRIMMED)
    messages = [USER, {"role": "assistant", "content": " end "}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == \
        "<|im_start|>user\n\nWrite JSON<|im_end|><|im_start|>assistant\n\nend"


def test_a_content_the_template_drops_still_cannot_be_continued(tmp_path):
    tokenizer = _tokenizer(tmp_path, "{% for m in messages %}{{ m['role'] }}{% endfor %}")
    with pytest.raises(ValueError, match="does not appear"):
        tokenizer.apply_chat_template([USER, {"role": "assistant", "content": "x"}], add_generation_prompt=False,
                                      continue_final_message=True)


def test_a_template_with_the_generation_tag_serves_chats(tmp_path):
    # (regression: "Encountered unknown tag 'generation'": the checkpoint's chat was refused altogether, where
    # transformers and vLLM render the tag's body as it is)
    tokenizer = _tokenizer(tmp_path, GENERATION)
    assert tokenizer.chat_template == GENERATION, tokenizer.no_chat_reason
    messages = [USER, {"role": "assistant", "content": "{}"}, {"role": "user", "content": "again"}]
    ids = tokenizer.apply_chat_template(messages)
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>user\nWrite JSON<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>\n"
        "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == OPEN_TURN + "{}"


def test_an_inline_chat_template_flag_has_its_escapes_read_as_vllm_reads_them(tmp_path):
    # (regression: `--chat-template '...\n...'` from a shell, a backslash and an "n", wrote them into every prompt,
    # where vLLM's load_chat_template decodes an inline template's escapes; its non-ASCII text is kept, and a file's
    # text is taken as it is)
    from scheduler.chat_template import ChatTemplate, read_chat_template

    inline = r"{% for m in messages %}«{{ m.role }}»\n{{ m.content }}\t{% endfor %}"
    text = read_chat_template(inline)
    assert text == "{% for m in messages %}«{{ m.role }}»\n{{ m.content }}\t{% endfor %}"
    assert ChatTemplate(text).render([USER], add_generation_prompt=False) == "«user»\nWrite JSON\t"
    path = tmp_path / "t.jinja"
    path.write_text(inline, encoding="utf-8")
    assert read_chat_template(str(path)) == inline
