"""Grammars through a tokenizer's non-special added tokens (Qwen3's <think>, </think>, <tool_call>: "special": false,
their text kept in decoded text): llguidance takes every added token of a tokenizer.json as special, so a grammar
that writes "<think>" was forced to that one token and then refused it (the request failed with "the token sampled
broke the request's grammar"). `Guides` hands llguidance such tokens as the plain text they are
(scheduler/guided.py `_plain_added_tokens`); special ones stay special."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")

from scheduler.guided import Guides, GuidedSpec  # noqa: E402
from scheduler.tokenizer import HFTokenizer  # noqa: E402
from tokenizer_files import write_byte_tokenizer  # noqa: E402

VOCAB = 512
THINK, END_THINK, EOS, TAG = 256, 257, 258, 259  # write_byte_tokenizer's ids: the added ones, then the special


@pytest.fixture(scope="module")
def guides(tmp_path_factory):
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), added=("<think>", "</think>"),
                                special=("<|end|>", "<|tag|>"))
    g = Guides("unused", VOCAB, (EOS,))
    g.use(HFTokenizer(str(path)))
    return g


def _allowed(guide) -> list[int]:
    row = torch.zeros(guide.words, dtype=torch.int32)
    guide.fill_mask(row)
    return [t for t in range(VOCAB) if (int(row[t // 32]) >> (t % 32)) & 1]


def _drive(guide, pick) -> list[int]:
    """Take `pick(allowed)` until the grammar is whole (at most 64 tokens); every token must be accepted."""
    taken = []
    for _ in range(64):
        allowed = _allowed(guide)
        if guide.complete or allowed == [EOS]:
            return taken
        token = pick(allowed)
        assert guide.accept(token) is None, (taken, token)
        taken.append(token)
    raise AssertionError(f"the grammar never completed: {taken}")


@pytest.mark.parametrize("pick", [min, max], ids=["lowest", "highest"])
def test_a_grammar_that_writes_think_can_be_followed(guides, pick):
    """Regression: the mask allowed only the atomic <think> token, which the matcher then refused."""
    guide = guides.start(GuidedSpec("regex", "<think>[a-z]{2}</think>ok"))
    taken = _drive(guide, pick)
    text = guides.tokenizer.decode(taken, skip_special_tokens=False)
    assert text.startswith("<think>") and text.endswith("</think>ok") and len(text) == len("<think>ab</think>ok")


def test_the_atomic_added_token_is_text_where_the_grammar_allows_that_text(guides):
    guide = guides.start(GuidedSpec("regex", "[<a-z>/]{0,12}"))
    allowed = _allowed(guide)
    assert THINK in allowed and END_THINK in allowed  # (as bytes: 7 and 8 characters of the class)
    assert guide.accept(THINK) is None


def test_a_special_token_is_still_no_text(guides):
    """<|tag|> (special) is no text a grammar can write: a regex of its characters never allows it."""
    guide = guides.start(GuidedSpec("regex", "[<|a-z>]{1,8}"))
    allowed = _allowed(guide)
    assert TAG not in allowed and guides.tokenizer.encode("<")[0] in allowed


def test_a_json_string_may_hold_the_tags(guides):
    guide = guides.start(GuidedSpec("json_schema", json.dumps({"type": "string", "enum": ["<think>x</think>"]})))
    taken = _drive(guide, min)
    assert guides.tokenizer.decode(taken, skip_special_tokens=False) == '"<think>x</think>"'
