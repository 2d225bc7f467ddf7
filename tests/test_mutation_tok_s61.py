"""Text in and out of the server, found unpinned by session 61's mutation check of scheduler/tokenizer.py,
api_tools.py, chat_template.py and sse_response.py: the byte tokenizer's edges, a checkpoint's templates and
special tokens, the incremental decoder, the tool fields' schema and checks, and the template's environment.
No server, no engine."""
from __future__ import annotations

import json

import pytest

from scheduler.api_tools import ToolFieldError, ToolFields, required_calls
from scheduler.chat_template import ChatTemplate
from scheduler.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDecoder, decode_completion, load_tokenizer
from tokenizer_files import write_byte_tokenizer

TOK = ByteTokenizer(512)


# -- the byte tokenizer ---------------------------------------------------------------------------------
def test_a_vocabulary_of_exactly_the_byte_ids_is_enough():
    """ids 0-2 reserved and 256 byte ids: 259 ids fit the byte tokenizer, 258 do not."""
    assert ByteTokenizer(259).encode("\xff") == [0xC3 + 3, 0xBF + 3]
    with pytest.raises(ValueError, match=">= 259"):
        ByteTokenizer(258)


def test_the_last_byte_id_is_a_byte_not_a_placeholder():
    """id 258 is byte 0xFF: decoded as bytes (an invalid UTF-8 byte: U+FFFD), named <0xFF> alone."""
    assert TOK.decode([258]) == "\ufffd" and TOK.decode([259]) == "<id:259>"
    assert TOK.token_strs([258, 259]) == ["<0xFF>", "<id:259>"]


def test_del_is_no_printable_character():
    """Printable ASCII is 0x20-0x7E: DEL (0x7F) is named <0x7F>, space is itself."""
    assert TOK.token_strs(TOK.encode("\x7f ~")) == ["<0x7F>", " ", "~"]


def test_request_templates_are_kept_by_last_use():
    """The KEPT_REQUEST_TEMPLATES kept are the most recently used: one used again outlives those sent after it."""
    tok = ByteTokenizer(512)
    texts = [f"{{{{ messages[0].content }}}}{i}" for i in range(9)]
    first = tok.request_template(texts[0])
    for text in texts[1:8]:
        tok.request_template(text)
    assert tok.request_template(texts[0]) is first  # (used again: now the newest)
    second = tok.request_template(texts[1])
    last = tok.request_template(texts[8])  # (one past the 8 kept: the least recently used, texts[2], goes)
    assert tok.request_template(texts[8]) is last
    assert tok.request_template(texts[0]) is first and tok.request_template(texts[1]) is second


# -- a checkpoint's templates and special tokens --------------------------------------------------------
HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]


def _chat(tok, tools=None) -> str:
    return tok.decode(tok.apply_chat_template(HI, tools=tools))


def test_the_tool_use_template_file_renders_chats_with_tools(tmp_path):
    """additional_chat_templates/tool_use.jinja is the template named "tool_use": chats with tools get it; and
    --chat-template (use_chat_template) replaces both."""
    path = write_byte_tokenizer(tmp_path / "t")
    (path / "chat_template.jinja").write_text("plain {{ messages[0].content }}")
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "tool_use.jinja").write_text("tools {{ tools | length }}")
    tok = HFTokenizer(str(path))
    assert _chat(tok) == "plain hi" and _chat(tok, TOOLS) == "tools 1"
    tok.use_chat_template("flag {{ messages[0].content }}")
    assert _chat(tok) == _chat(tok, TOOLS) == "flag hi"


def test_an_empty_default_template_file_leaves_the_named_one(tmp_path):
    """An empty chat_template.jinja is no template: the checkpoint's other (named) template renders chats."""
    path = write_byte_tokenizer(tmp_path / "t")
    (path / "chat_template.jinja").write_text("")
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "chatml.jinja").write_text("named {{ messages[0].content }}")
    assert _chat(HFTokenizer(str(path))) == "named hi"


def test_an_empty_template_in_the_configs_list_is_skipped(tmp_path):
    """tokenizer_config.json's [{"name", "template"}, ...]: an entry with an empty template is none."""
    path = write_byte_tokenizer(tmp_path / "t", config={"chat_template": [
        {"name": "empty", "template": ""}, {"name": "chatml", "template": "listed {{ messages[0].content }}"}]})
    assert _chat(HFTokenizer(str(path))) == "listed hi"


def test_the_default_template_is_chosen_wherever_the_configs_list_puts_it(tmp_path):
    path = write_byte_tokenizer(tmp_path / "t", config={"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]})
    tok = HFTokenizer(str(path))
    assert _chat(tok) == "plain" and _chat(tok, TOOLS) == "tools"


def test_special_tokens_saved_as_added_token_objects_are_their_content(tmp_path):
    """tokenizer_config.json's {"content": ..., "lstrip": ...} (an AddedToken as saved) is its content."""
    added = {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    path = write_byte_tokenizer(tmp_path / "t", config={"chat_template": "{{ bos_token }}", "bos_token": added,
                                                        "additional_special_tokens": [added]})
    tok = HFTokenizer(str(path))
    assert _chat(tok) == "<s>" and tok.special_tokens == {"bos_token": "<s>", "additional_special_tokens": ["<s>"]}


def test_a_tokenizer_config_that_holds_no_object_is_an_empty_config(tmp_path):
    """A tokenizer_config.json of a JSON list (no object) is read as {}: the tokenizer loads, without a chat."""
    path = write_byte_tokenizer(tmp_path / "t")
    (path / "tokenizer_config.json").write_text("[]")
    tok = HFTokenizer(str(path))
    assert tok.template is None and tok.special_tokens == {} and tok.decode(tok.encode("a")) == "a"


def test_special_tokens_map_is_read_only_for_saves_without_added_tokens_decoder(tmp_path):
    """transformers reads special_tokens_map.json (winning over the config) only where tokenizer_config.json has
    no added_tokens_decoder; additional_special_tokens are listed once each."""
    tpl = "{{ bos_token }}|{{ additional_special_tokens | join(',') }}"
    mapped = {"bos_token": "<map>", "additional_special_tokens": ["<a>", "<b>"]}
    old = write_byte_tokenizer(tmp_path / "old", config={"chat_template": tpl, "bos_token": "<cfg>",
                                                         "additional_special_tokens": ["<a>"]})
    (old / "special_tokens_map.json").write_text(json.dumps(mapped))
    assert _chat(HFTokenizer(str(old))) == "<map>|<a>,<b>"
    new = write_byte_tokenizer(tmp_path / "new", config={"chat_template": tpl, "bos_token": "<cfg>",
                                                         "added_tokens_decoder": {}})
    (new / "special_tokens_map.json").write_text(json.dumps(mapped))
    assert _chat(HFTokenizer(str(new))) == "<cfg>|"


def test_a_tool_use_template_that_does_not_compile_refuses_only_chats_with_tools(tmp_path):
    """The checkpoint's tool_use template failing to compile: chats with tools are refused saying so (not
    rendered by the default template, which never shows the tools), the others served."""
    path = write_byte_tokenizer(tmp_path / "t", config={"chat_template": [
        {"name": "default", "template": "plain {{ messages[0].content }}"},
        {"name": "tool_use", "template": "{% if %}"}]})
    tok = HFTokenizer(str(path))
    assert _chat(tok) == "plain hi"
    with pytest.raises(ValueError, match="tool_use chat template"):
        _chat(tok, TOOLS)


# -- the incremental decoder ----------------------------------------------------------------------------
def test_a_flush_sends_held_text_once():
    """flush() sends what is held (an incomplete character as U+FFFD) and nothing again after."""
    dec = IncrementalDecoder(TOK)
    assert dec.feed(TOK.encode("\u00e9")[0]) == ""
    assert dec.flush() == "\ufffd" and dec.flush() == ""
    assert dec.feed(TOK.encode("a")[0]) == "a"


def _sentencepiece_dir(path) -> str:
    """Llama 2's shape: "▁" for a space, byte fallback, and a decoder that strips the text's leading space."""
    from tokenizers import Tokenizer, decoders, models
    vocab = {"<unk>": 0, "▁Paris": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def test_a_completion_continues_the_prompts_text_across_a_split_character(tmp_path):
    """A completion is decoded after the prompt's last ids (" Paris" after "é", not "Paris"), unless they end
    inside a character (then the completion is decoded alone: its lone continuation byte is U+FFFD, not lost)."""
    tok = HFTokenizer(_sentencepiece_dir(tmp_path / "sp"))
    e_acute, paris = [2 + 0xC3, 2 + 0xA9], 1
    assert tok.decode([paris]) == "Paris"
    assert decode_completion(tok, e_acute, [paris]) == " Paris"
    assert decode_completion(tok, e_acute[:1], [e_acute[1], paris]) == "\ufffd Paris"


def test_special_tokens_are_kept_in_the_text_when_asked(tmp_path):
    """skip_special_tokens False (vLLM's field) keeps a special token's text in the stream; true leaves it out."""
    tok = HFTokenizer(str(write_byte_tokenizer(tmp_path / "t", special=("<|end|>",))))
    ids = tok.encode("a<|end|>")
    assert tok.decode(ids, skip_special_tokens=False) == "a<|end|>" and tok.decode(ids) == "a"
    for skip, want in ((False, "a<|end|>"), (True, "a")):
        dec = IncrementalDecoder(tok, skip_special_tokens=skip)
        assert "".join(dec.feed(t) for t in ids) + dec.flush() == want


def test_a_directory_without_tokenizer_json_has_no_tokenizer(tmp_path, monkeypatch):
    """A checkpoint directory without tokenizer.json gets none (token ids only), not the byte fallback; a directory
    named like a preset without config.json is no checkpoint: the preset, with its byte tokenizer."""
    assert load_tokenizer(str(tmp_path), 512) is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    assert isinstance(load_tokenizer("tiny", 512), ByteTokenizer)


# -- tool fields ----------------------------------------------------------------------------------------
def test_a_named_tool_choice_without_tools_says_tools_are_needed():
    """A named choice with no tools at all is told it needs 'tools' (not that its function is missing from them)."""
    fields = ToolFields(tool_choice={"type": "function", "function": {"name": "f"}})
    with pytest.raises(ToolFieldError, match="needs 'tools'") as exc:
        fields.check_tools(auto_enabled=True)
    assert exc.value.param == "tool_choice"


def test_a_named_tool_without_parameters_is_held_to_an_object():
    """A named function with no parameters schema takes any object as its arguments (not any JSON value)."""
    fields = ToolFields(tools=[{"type": "function", "function": {"name": "f"}}],
                        tool_choice={"type": "function", "function": {"name": "f"}})
    assert json.loads(fields.tool_spec().value) == {"type": "object"}


def test_parallel_tool_calls_unset_allows_several_calls():
    """OpenAI's default for parallel_tool_calls is true: only an explicit false caps a required list at one call."""
    tool = {"type": "function", "function": {"name": "f"}}
    for parallel in (None, True):
        schema = json.loads(ToolFields(tools=[tool], tool_choice="required",
                                       parallel_tool_calls=parallel).tool_spec().value)
        assert "maxItems" not in schema and schema["minItems"] == 1


def test_a_reference_to_a_tools_own_root_points_at_its_parameters():
    """"$ref": "#" in a tool's parameters (a recursive schema) points at that tool's parameters in a required
    list's schema, not at the top of the whole list."""
    node = {"type": "object", "properties": {"child": {"$ref": "#"}}}
    tools = [{"type": "function", "function": {"name": "f"}},
             {"type": "function", "function": {"name": "tree", "parameters": node}}]
    schema = json.loads(ToolFields(tools=tools, tool_choice="required").tool_spec().value)
    params = schema["items"]["anyOf"][1]["properties"]["parameters"]
    assert params["properties"]["child"] == {"$ref": "#/items/anyOf/1/properties/parameters"}


# -- the chat template ----------------------------------------------------------------------------------
def _render(template: str, messages=HI, **kw) -> str:
    return ChatTemplate(template).render(messages, **kw)


def test_the_templates_variables_are_transformers():
    """documents is none (not undefined), tools as given, template_kwargs reach it, strftime_now is there."""
    tpl = "{{ documents is none }}|{{ tools | length }}|{{ enable_thinking }}|{{ strftime_now('%Y') | length }}"
    assert _render(tpl, tools=TOOLS, template_kwargs={"enable_thinking": False}) == "True|1|False|4"


def test_the_template_environment_is_transformers():
    """Blocks trimmed and left-stripped, loop controls on, a tojson that neither escapes HTML nor ASCII and takes
    indent and sort_keys."""
    assert _render("  {% if true %}\nA\n  {% endif %}\n{% for m in messages %}{% break %}x{% endfor %}") == "A\n"
    assert _render("{{ {'b': '<é>', 'a': 1} | tojson(indent=1, sort_keys=True) }}") == '{\n "a": 1,\n "b": "<é>"\n}'


def test_the_template_runs_sandboxed_and_immutable():
    """A template (a request's own, trusted) may not reach Python internals nor change its values."""
    for tpl in ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{% set l = [] %}{{ l.append(1) }}"):
        with pytest.raises(Exception, match="unsafe|not safely callable|access"):
            _render(tpl)


def test_a_template_rendering_past_the_limit_is_refused():
    with pytest.raises(ValueError, match="rendered more than"):
        _render("{% for i in range(17) %}{{ 'x' * 1048576 }}{% endfor %}")


def test_continue_final_message_cuts_after_the_last_occurrence_and_the_stripped_content():
    """The cut is after the final message's content (its last occurrence in the text), stripped where the template
    stripped it."""
    tpl = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>{% endfor %}"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi  "}]
    assert _render(tpl, msgs, add_generation_prompt=False, continue_final_message=True) == "<user>hi</s><assistant>hi"


def test_continue_final_message_that_the_template_drops_is_refused_saying_so():
    """A template that leaves the final message out: the refusal (a 400 for the request) says so, not "substring
    not found" (chat_template.py's C20)."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    with pytest.raises(ValueError, match="the final message does not appear in the chat"):
        _render("{{ messages[0].content }}", msgs, add_generation_prompt=False, continue_final_message=True)


def test_developer_messages_are_system_ones_unless_the_template_names_the_role():
    msgs = [{"role": "developer", "content": "be brief"}]
    assert _render("{{ messages[0].role }}", msgs) == "system"
    assert _render("{{ messages[0].role }}{# developer #}", msgs) == "developer"


def test_lifted_defs_point_into_their_tool_and_data_is_left_alone():
    """A tool's "$defs" lifted to the top keep their references into the tool ("#" is its parameters); a "$ref" inside
    data (const, default, enum, examples) is a value, left as written."""
    params = {"type": "object", "properties": {"n": {"$ref": "#/$defs/node"}, "k": {"const": {"$ref": "#"}}},
              "$defs": {"node": {"type": "object", "properties": {"up": {"$ref": "#"}}}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    schema = json.loads(ToolFields(tools=tools, tool_choice="required").tool_spec().value)
    assert schema["$defs"]["node"]["properties"]["up"] == {"$ref": "#/items/anyOf/0/properties/parameters"}
    props = schema["items"]["anyOf"][0]["properties"]["parameters"]["properties"]
    assert props == {"n": {"$ref": "#/$defs/node"}, "k": {"const": {"$ref": "#"}}}


def test_required_calls_read_a_held_list_and_nothing_else():
    """A required list's item without parameters is a call with {} arguments; text that is no list (a number, an
    object) is no list of calls (None), never an error."""
    (call,) = required_calls('[{"name": "f"}]')
    assert (call.name, call.arguments) == ("f", "{}")
    assert required_calls("5") is None and required_calls('{"name": "f"}') is None

