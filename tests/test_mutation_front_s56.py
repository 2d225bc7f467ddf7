"""Session 56's mutation check of the front-end modules (tool calls, chat templates and messages, the Responses
store and output, the trace, the timeline and the replay's sizing lines): guards that no test held."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from scheduler.api_tools import ToolFieldError, ToolFields, required_calls
from scheduler.chat_messages import ChatMessage
from scheduler.chat_template import ChatTemplate, read_chat_template
from scheduler.responses_output import OutputItems
from scheduler.responses_store import MAX_PAGE_ITEMS, ResponsesStore, StoredResponse
from scheduler.timeline import build_timeline
from scheduler.timeline_views import to_chrome
from scheduler.trace import TraceRecord, scale_record
from test_timeline import batch, occ, op


# ---------------------------------------------------------------- tools

def test_a_tool_with_an_empty_function_name_is_refused():
    """A tool whose function name is "" is a 400 naming 'tools' (a call to it could never be told apart), whatever
    the tool_choice."""
    fields = ToolFields.model_validate({"tools": [{"type": "function", "function": {"name": ""}}],
                                        "tool_choice": "none"})
    with pytest.raises(ToolFieldError, match="may not be empty"):
        fields.check_tools(auto_enabled=True)


@pytest.mark.parametrize("text", ['[{"parameters": {"a": 1}}]', '[{"name": 5, "parameters": {}}]',
                                  '[{"name": "f", "parameters": {}}, {"parameters": {}}]'])
def test_a_required_answer_whose_items_have_no_string_name_is_no_list_of_calls(text):
    """A "required" answer is a list of calls only where every item names its function with a string: an item
    without one makes the answer no calls (None), not a crash or a call of no name."""
    assert required_calls(text) is None
    assert [c.name for c in required_calls('[{"name": "f", "parameters": {}}]')] == ["f"]


# ---------------------------------------------------------------- chat templates and messages

def test_continue_final_message_keeps_the_trailing_space_the_template_kept():
    """continue_final_message cuts the prompt where the final message's content ends: where the template wrote the
    content's trailing space, the model goes on after that space (transformers' behaviour)."""
    tpl = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is "}]
    assert tpl.render(messages, add_generation_prompt=False, continue_final_message=True) == \
        "<user>hi</s><assistant>The answer is "


def test_an_inline_template_of_several_lines_without_braces_is_taken_as_a_template():
    """--chat-template given inline: text with a line break is a template even without any "{" (not refused as a
    path to no file)."""
    text = "<|system|>\nYou are terse."
    assert read_chat_template(text) == text


def test_bos_and_eos_are_empty_strings_for_a_tokenizer_without_them():
    """A template that joins bos_token / eos_token to text renders, with "" for them, where the tokenizer defines
    none (as transformers passes them), rather than failing on an undefined value."""
    tpl = ChatTemplate("{{ bos_token + messages[0]['content'] + eos_token }}")
    assert tpl.render([{"role": "user", "content": "hi"}]) == "hi"


def test_an_sdk_built_assistant_message_with_empty_annotations_is_accepted():
    """An assistant message the openai SDK built (annotations: [] as its model_dump writes it) sent back in a
    conversation is taken, the field dropped; annotations that say something are a 400."""
    msg = ChatMessage.model_validate({"role": "assistant", "content": "hi", "annotations": [], "refusal": None})
    assert msg.as_template_dict() == {"role": "assistant", "content": "hi"}
    with pytest.raises(ValidationError, match="annotations"):
        ChatMessage.model_validate({"role": "assistant", "content": "hi", "annotations": [{"type": "url"}]})


# ---------------------------------------------------------------- Responses

def _store_with_items(n: int) -> ResponsesStore:
    store = ResponsesStore(max_responses=4)
    items = tuple({"id": f"msg_{i}", "type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": str(i)}]} for i in range(n))
    store.put(StoredResponse({"id": "resp_1", "status": "completed", "output": []}, (), items))
    return store


def test_input_items_take_a_limit_of_up_to_100():
    """GET input_items' `limit` is 1 to 100, as OpenAI's: 100 itself is served (a page of 100), 101 is a 400."""
    store = _store_with_items(MAX_PAGE_ITEMS + 5)
    page = store.input_items("resp_1", limit=MAX_PAGE_ITEMS)
    assert len(page["data"]) == MAX_PAGE_ITEMS and page["has_more"] is True
    with pytest.raises(Exception, match="'limit' must be 1 to 100"):
        store.input_items("resp_1", limit=MAX_PAGE_ITEMS + 1)


def test_input_items_before_a_cursor_are_the_ones_just_before_it():
    """A page `before` an item (no `after`) is the `limit` items just before that item, in the order asked, with
    has_more saying earlier ones are left."""
    store = _store_with_items(10)
    page = store.input_items("resp_1", order="asc", limit=3, before="msg_7")
    assert [i["id"] for i in page["data"]] == ["msg_4", "msg_5", "msg_6"] and page["has_more"] is True
    page = store.input_items("resp_1", order="desc", limit=2, before="msg_2")
    assert [i["id"] for i in page["data"]] == ["msg_4", "msg_3"] and page["has_more"] is True
    page = store.input_items("resp_1", order="asc", limit=2, after="msg_2", before="msg_7")
    assert [i["id"] for i in page["data"]] == ["msg_3", "msg_4"]


def test_an_empty_answer_is_one_empty_message():
    """An answer with no text at all is still one (empty) assistant message in the Response's output, finished,
    since clients read the answer's text from a message."""
    items = OutputItems()
    events = items.close("completed")
    [item] = items.items
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"][0]["text"] == ""
    assert events[-1]["type"] == "response.output_item.done"


# ---------------------------------------------------------------- trace, timeline, replay sizing lines

def test_scaled_lengths_round_half_up():
    """Scaling a trace record to fewer tokens a hash id rounds its lengths half up: 3 output tokens at half the
    block size are 2, not 1."""
    rec = TraceRecord(1, 0.0, input_tokens=512, output_tokens=3, hash_ids=(7,))
    assert scale_record(rec, 256).output_tokens == 2
    assert scale_record(TraceRecord(1, 0.0, 512, 5, (7,)), 256).output_tokens == 3


def test_a_batch_that_took_no_measurable_time_is_kept():
    """A batch whose end equals its start (a clock too coarse to see it) is a batch of the timeline, not a
    malformed event."""
    tl = build_timeline([batch(1.0, 1, "decode", 1.0)])
    assert len(tl.batches) == 1 and tl.num_malformed_events == 0


def test_an_op_id_reused_by_another_kind_while_open_is_a_new_span():
    """An op id that shows up again with another kind before its op ended (two engines' logs interleaved) starts a
    span of its own, not transitions of the open one."""
    tl = build_timeline([op(0.0, 1, "backup", "L1_PRIVATE", "D2H_PENDING"),
                         op(1.0, 1, "restore_l2", "L2", "H2D_PENDING")])
    assert sorted((o.kind, o.initial_state) for o in tl.ops.values()) == [("backup", "L1_PRIVATE"),
                                                                         ("restore_l2", "L2")]


def test_the_chrome_trace_never_shows_negative_free_pages():
    """An occupancy sample of more pages used than its capacity (as logged) shows 0 free pages in the Chrome
    trace's counter, not a negative count."""
    trace = to_chrome(build_timeline([occ(0.0, "l1", 12, 10)]))
    [counter] = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert counter["args"] == {"used_pages": 12, "free_pages": 0}


def test_the_flag_named_as_sizing_a_tier_is_the_one_given_as_it_was_given():
    """The replay's lines name the option that sized a tier: not --num-pages at its default 0 (which means "from
    --max-total-tokens"), and a whole number of GiB without ".0"."""
    from scheduler.replay_args import build_parser
    from scheduler.replay_memory import sizing_flag

    args = build_parser().parse_args(["--max-total-tokens", "4096", "--l2-gib", "2"])
    assert args.num_pages == 0
    assert sizing_flag(args, "L1") == "--max-total-tokens 4096"
    assert sizing_flag(args, "L2") == "--l2-gib 2"


def test_the_replay_warns_of_no_failure_for_a_prompt_exactly_at_max_prompt_tokens(capsys):
    """The line before a replay counts the requests that will fail: a prompt of exactly --max-prompt-tokens is
    served (the engine refuses only longer ones), so it is not counted; one token more is."""
    from types import SimpleNamespace

    from scheduler.config import EngineConfig
    from scheduler.replay_args import build_parser
    from scheduler.replay_memory import warn_will_fail as _warn_will_fail

    parser = build_parser()
    args = parser.parse_args(["--max-total-tokens", "4096", "--block-tokens", "16"])
    config = EngineConfig(model="tiny", device="cpu", max_total_tokens=4096, max_prompt_tokens=100)
    _warn_will_fail(parser, args, [SimpleNamespace(prompt_tokens=100, output_tokens=1)], config, 4096)
    assert "will fail" not in capsys.readouterr().err
    _warn_will_fail(parser, args, [SimpleNamespace(prompt_tokens=101, output_tokens=1)], config, 4096)
    assert "1 of 1 requests need more than" in capsys.readouterr().err
