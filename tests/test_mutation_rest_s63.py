"""Mutation check (session 63) of hicache/backups.py, scheduler/api_inputs.py, reasoning.py and serve.py:
rules no test pinned, each test named after what a user would notice."""
from __future__ import annotations

import asyncio

import pytest

from hicache.radix import Tier
from scheduler import serve
from scheduler.api_inputs import check_unicode, choice_params, echo_text, parse_prompts
from scheduler.api_models import APIError, ChatCompletionRequest
from scheduler.reasoning import prompt_opens_thinking
from scheduler.request import SEED_MAX, SamplingParams
from scheduler.tokenizer import ByteTokenizer, HFTokenizer
from hicache_helpers import EachWriteGate, WriteGate, assert_whole, hold_copies, make_manager, toks, until, write_prefix
from tokenizer_files import write_byte_tokenizer


def lengths(mgr, *prefixes) -> list[list[int]]:
    return [mgr.tree.match(p, include_storage=True, touch=False).lengths for p in prefixes]


@pytest.mark.asyncio
async def test_an_extension_finding_l2_locked_by_its_prefixs_l3_write_waits_for_that_write():
    """An extension asked for while its prefix's L3 write runs finds L2 full of locked pages (that
    write's, and another's private ones): it waits for the write's end, which unlocks some, and is
    then backed up; not skipped as a refused L2 write, its new page never reaching L2."""
    mgr = make_manager(l1_pages=16, host_pages=3, storage_pages=16)
    writes = WriteGate(mgr.store)
    a = toks((0, 8))
    write_prefix(mgr, a)
    await until(lambda: mgr.runner._l3_writing, 10)
    other = mgr.new_claim("other", Tier.L2)
    assert len(mgr.alloc_pages(Tier.L2, 1, other)) == 1  # L2: a's 2 pages (locked by the write) + 1 private
    write_prefix(mgr, a + toks((100, 104)), 8)
    skips = mgr.metrics.policy_skips["write_l2"]
    mgr.release_claim(other, Tier.L2)
    writes.release()
    await mgr.drain()
    assert skips == 0, "the extension was skipped instead of waiting for the L3 write"
    assert lengths(mgr, a + toks((100, 104))) == [[12, 12, 12]]
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_a_sibling_waiting_for_a_backup_whose_l3_write_locks_l2_full_waits_on_for_its_end():
    """Two prompts share a page L2 lacks: the second waits for the first's backup. Once that one's L3
    write starts it starts too, but L2 is full of pages that write locks: it waits on for the write's
    end (not only an extension of it does), then copies its own page; not skipped for good."""
    mgr = make_manager(l1_pages=16, host_pages=2, storage_pages=16)
    x, y = toks((0, 4), (10, 14)), toks((0, 4), (20, 24))
    write_prefix(mgr, x)
    write_prefix(mgr, y, 4)  # deferred behind x's backup (the shared page)
    await mgr.drain()
    assert mgr.metrics.policy_skips["write_l2"] == 0, "the sibling was skipped while L2 was locked"
    assert lengths(mgr, x, y) == [[8, 4, 8], [8, 8, 8]]
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_a_newer_backup_of_the_same_tokens_is_not_duplicated_when_the_older_one_ends():
    """A backup's L3 write wrote less than it copied (L2 lost its tail while it waited for a sibling's
    write), so a newer backup of the same tokens copies that tail again. When the older one ends it
    must not forget the newer one's key: asked again meanwhile, the tail is not copied a third time."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=64, write_policy="write_back")
    x, y = toks((0, 4), (10, 14)), toks((0, 4), (20, 28))
    write_prefix(mgr, x)
    write_prefix(mgr, y[:8], 4)
    write_prefix(mgr, y, 8)  # y's last page a node of its own
    writes = EachWriteGate(mgr.store)
    runner = mgr.runner
    assert runner.start_backup(x) is not None
    await until(lambda: len(writes.events) == 1, 10)
    old = runner.start_backup(y)  # copies y's 2 pages, then waits for x's L3 write (the shared page)
    await until(lambda: lengths(mgr, y)[0][1] == 12, 10)
    for _ in range(5):
        await asyncio.sleep(0)
    assert mgr.tree.evict(Tier.L2, 1) == 1  # y's last page leaves L2 before y's write locks it
    writes.events[0].set()
    await until(lambda: len(writes.events) == 2, 10)  # y's L3 write: its first 2 pages
    gate = hold_copies(mgr)
    assert runner.start_backup(y) is not None  # copies the lost page again
    writes.events[1].set()
    await until(lambda: old.done, 10)
    again = runner.start_backup(y)
    gate.set()
    await until(lambda: len(writes.events) == 3, 10)
    writes.events[2].set()
    await mgr.drain()
    assert again is None, "a third backup copied what the newer one copies"
    assert lengths(mgr, y) == [[12, 12, 12]]
    assert_whole(mgr)


# -- scheduler/api_inputs.py ------------------------------------------------------------------------------
HI = [{"role": "user", "content": "hi"}]
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def _parse(body: dict, chat: bool = False, **kw):
    args = dict(tokenizer=None, served_names={"tiny", "alias"}, model_name="tiny", vocab_size=512, prompt_limit=64,
                max_tokens_limit=16)
    return parse_prompts(body, chat, **{**args, **kw})


def _tok(path, template: str = PLAIN, **kw):
    return HFTokenizer(str(write_byte_tokenizer(path, config={"chat_template": template}, **kw)))


def _refused(body: dict, chat: bool = True, **kw):
    with pytest.raises(APIError) as err:
        _parse(body, chat, **kw)
    return err.value


def test_sampling_fields_left_out_are_openais_and_given_ones_are_kept():
    """No temperature: OpenAI's 1 (not greedy); a given top_p is used; echo's logprobs and prompt_logprobs ask the
    engine for the larger k of the two."""
    params = _parse({"prompt": [1], "max_tokens": 1})[2]
    assert (params.temperature, params.top_p) == (1.0, 1.0)
    assert _parse({"prompt": [1], "max_tokens": 1, "top_p": 0.5})[2].top_p == 0.5
    for logprobs, asked in ((2, 4), (4, 2)):
        body = {"prompt": [1, 2], "max_tokens": 1, "echo": True, "logprobs": logprobs, "prompt_logprobs": asked}
        assert _parse(body)[2].prompt_logprobs == 4


def test_choice_seeds_are_seed_plus_j_wrapped_within_64_bits():
    params = SamplingParams(seed=5)
    assert [choice_params(params, j).seed for j in range(3)] == [5, 6, 7]
    assert choice_params(SamplingParams(seed=SEED_MAX), 1).seed == 0  # (2**64 wraps to the same 64 bits)


def test_an_empty_model_is_the_served_one_and_a_wrong_one_names_every_served_name():
    assert _parse({"prompt": [1], "max_tokens": 1, "model": ""})[1] == [[1]]
    err = _refused({"prompt": [1], "max_tokens": 1, "model": "gpt"}, chat=False)
    assert err.status == 404 and "this server serves 'tiny' (also named 'alias')" in err.message


def test_a_truncation_the_request_cannot_take_is_a_400_naming_truncate_prompt_tokens():
    err = _refused({"prompt": [1, 2], "max_tokens": 1, "truncate_prompt_tokens": 0}, chat=False)
    assert err.param == "truncate_prompt_tokens"


def test_continue_final_message_with_add_generation_prompt_is_a_400_naming_it(tmp_path):
    err = _refused({"messages": HI, "continue_final_message": True}, tokenizer=_tok(tmp_path))
    assert err.param == "continue_final_message" and "cannot both be true" in err.message


def test_chat_template_kwargs_may_not_set_continue_final_message(tmp_path):
    err = _refused({"messages": HI, "chat_template_kwargs": {"continue_final_message": True}},
                   tokenizer=_tok(tmp_path))
    assert err.param == "chat_template_kwargs" and "may not set 'continue_final_message'" in err.message


def test_a_template_failure_is_blamed_on_reasoning_effort_or_on_the_messages_as_it_is(tmp_path):
    """A template that refuses reasoning_effort: the 400 names 'reasoning_effort'; one that refuses every
    conversation: 'messages', though chat_template_kwargs were given (they are not what it failed on)."""
    effort = _tok(tmp_path / "effort", "{% if reasoning_effort %}{{ raise_exception('no effort') }}{% endif %}" + PLAIN)
    err = _refused({"messages": HI, "reasoning_effort": "high"}, tokenizer=effort)
    assert err.param == "reasoning_effort", err.message
    never = _tok(tmp_path / "never", "{{ raise_exception('never') }}")
    err = _refused({"messages": HI, "chat_template_kwargs": {"x": 1}}, tokenizer=never)
    assert (err.param, err.code) == ("messages", "invalid_messages"), err.message


def test_a_requests_own_template_needs_trust_and_its_two_spellings_must_agree(tmp_path):
    tok = _tok(tmp_path)
    err = _refused({"messages": HI, "chat_template": PLAIN}, tokenizer=tok)
    assert (err.param, err.code) == ("chat_template", "untrusted_chat_template")
    body = {"messages": HI, "chat_template": PLAIN, "chat_template_kwargs": {"chat_template": PLAIN + "!"}}
    err = _refused(body, tokenizer=tok, trust_templates=True)
    assert err.param == "chat_template_kwargs" and "the same as 'chat_template'" in err.message


def test_a_template_given_in_chat_template_kwargs_is_not_also_a_variable_of_itself(tmp_path):
    """chat_template_kwargs.chat_template is the template (transformers' key), not one of its variables."""
    own = "{% if chat_template is defined %}LEAK{% endif %}" + PLAIN
    tok = _tok(tmp_path)
    ids = _parse({"messages": HI, "chat_template_kwargs": {"chat_template": own}}, chat=True, tokenizer=tok,
                 trust_templates=True)[1][0]
    assert tok.decode(ids, skip_special_tokens=False) == "<user>hi"


def test_a_tools_lone_surrogate_is_a_400_naming_tools():
    tool = {"type": "function", "function": {"name": "f", "description": "\ud800", "parameters": {"type": "object"}}}
    req = ChatCompletionRequest.model_validate({"messages": HI, "tools": [tool]}, context={"vocab_size": 512})
    with pytest.raises(APIError) as err:
        check_unicode(req, "messages")
    assert err.value.param == "tools"


def test_an_echo_of_a_cut_text_prompt_is_its_kept_ids_special_tokens_included(tmp_path):
    """echo with truncate_prompt_tokens: a text prompt cut is echoed as its kept ids decoded, with the special
    tokens the client wrote in it; one kept whole as given."""
    tok = _tok(tmp_path, special=("<s>",))
    for prompt, keep, want in (("a<s>b", 2, "<s>b"), ("abcd", 4, "abcd"), ("abcd", 3, "bcd")):
        req, ids, _ = _parse({"prompt": prompt, "max_tokens": 1, "echo": True, "truncate_prompt_tokens": keep},
                             tokenizer=tok)
        assert echo_text(req, 0, ids[0], tok) == want, (prompt, keep)


# -- scheduler/reasoning.py, scheduler/serve.py ------------------------------------------------------------
def test_a_think_block_opened_16_ids_before_the_prompts_end_is_seen_open():
    """The prompt's last 16 ids are looked at: "<think>" then 8 bytes of thought (byte ids) still opens the block."""
    tok = ByteTokenizer(512)
    prompt = tok.encode("<|im_start|>assistant\n<think>\nabcdefgh", add_special_tokens=False)
    assert prompt_opens_thinking(tok, prompt)
    assert not prompt_opens_thinking(tok, prompt + tok.encode("i", add_special_tokens=False))


class _Stop(Exception):
    pass


def _serve_until_the_app(monkeypatch, *argv) -> object:
    seen = {}

    def app(engine, limits, tokenizer):
        seen["limits"] = limits
        raise _Stop
    monkeypatch.setattr(serve, "create_app", app)
    with pytest.raises(_Stop):
        serve.main(["--model", "tiny", "--device", "cpu", "--num-pages", "64", "--port", "0", *argv])
    return seen["limits"]


@pytest.mark.parametrize("flag,named", [(("--api-key", "k1"), "--api-key"), ((), "HICACHE_API_KEY")])
def test_the_server_says_where_its_api_key_came_from_and_never_the_key(flag, named, monkeypatch, capsys):
    monkeypatch.setenv("HICACHE_API_KEY", "k2")
    limits = _serve_until_the_app(monkeypatch, *flag, "--trust-request-chat-template")
    err = capsys.readouterr().err
    assert f"the /v1/ routes ask for the API key of {named}" in err and "k1" not in err and "k2" not in err
    assert limits.trust_request_chat_template is True
    monkeypatch.delenv("HICACHE_API_KEY")
    assert _serve_until_the_app(monkeypatch).trust_request_chat_template is False
    assert "API key" not in capsys.readouterr().err


def test_a_checkpoint_directorys_tokenizer_is_the_servers(tmp_path):
    tok = serve._tokenizer(str(write_byte_tokenizer(tmp_path / "ckpt")))
    assert tok is not None and tok.decode(tok.encode("ab", add_special_tokens=False)) == "ab"
    assert serve._tokenizer(str(tmp_path / "missing")) is None
