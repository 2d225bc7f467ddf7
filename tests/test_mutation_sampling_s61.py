"""Session 61's mutation check of scheduler/sampling.py, guided.py, sampler_fields.py and responses_logprobs.py:
the rules no test pinned (each test here failed on one mutant and passes as the code is)."""
from __future__ import annotations

import torch

from scheduler.responses_logprobs import AnswerLogprobs
from scheduler.sampling import prompt_row_logprobs, sample, seeded_generator

CPU = torch.device("cpu")


def _entry(piece: str) -> dict:
    return {"token": piece, "logprob": -1.0, "bytes": list(piece.encode()), "top_logprobs": []}


# ---- sampling.py


def test_a_temperature_float32_rounds_to_0_still_draws_among_tied_likeliest_tokens():
    """A temperature that float32 rounds to 0 (1e-46) is taken as its smallest normal value: the likeliest tokens
    (here two tied) keep their equal chances; without the floor the division made them 0 / 0, NaN, and argmax
    always took the first of them."""
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0]])
    drawn = {int(sample(logits, [1e-46], [1.0], [seeded_generator(s, CPU)])[0]) for s in range(16)}
    assert drawn == {1, 2}


def test_a_prompt_tokens_rank_counts_itself_and_the_likelier_ones():
    """vLLM's rank: the tokens at least as likely as the target, itself included (a tie counts as ahead: a token
    tied with the likeliest is 2); the likeliest alone is 1."""
    hidden = torch.eye(2)
    table = torch.tensor([[4.0, 4.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    values, ids, ranks = prompt_row_logprobs(lambda h: h @ table, 5, hidden, torch.tensor([0, 0, 1]),
                                             torch.tensor([1, 3, 2]), 2)
    assert ranks.tolist() == [2, 3, 3]
    _, _, ranks = prompt_row_logprobs(lambda h: h @ table, 5, hidden, torch.tensor([1]), torch.tensor([4]), 0)
    assert ranks.tolist() == [1]
    assert torch.allclose(values[:, 0], torch.log_softmax(table, -1)[[0, 0, 1], [1, 3, 2]])


# ---- responses_logprobs.py

CALL_PIECES = ["<tool_call>", '{"name": "f"}', "</tool_call>"]


def test_a_chunk_with_text_takes_all_its_tokens_even_those_that_show_none():
    """A stream's chunk of several tokens (speculative decoding) whose delta has text takes every one of its
    tokens and those that waited, its last token's too though it shows no text."""
    shaper = AnswerLogprobs(None)
    assert shaper.feed([1, 2], [_entry("a"), _entry("token_id:2")], {"content": "a"}) == [_entry("a"),
                                                                                             _entry("token_id:2")]
    assert shaper.feed([3], [_entry("b")], {"content": "b"}) == [_entry("b")]


def test_a_token_of_no_text_before_a_call_goes_with_the_call_whole_and_streamed():
    """A token that shows no text ("token_id:N") just before a call block: a stream's chunk of it has no text, it
    waits, and the call drops it; a whole answer's text around the call, read token by token, drops it too."""
    pieces = ["O", "token_id:9", *CALL_PIECES]
    whole = AnswerLogprobs(None).feed(list(range(len(pieces))), [_entry(p) for p in pieces],
                                      {"content": "O", "tool_calls": [{"id": "c"}]}, last=True)
    assert [e["token"] for e in whole] == ["O"]
    shaper, streamed = AnswerLogprobs(None), []
    deltas = [{"content": "O"}, {}, {}, {}, {"tool_calls": [{"id": "c"}]}]
    for i, (piece, delta) in enumerate(zip(pieces, deltas)):
        streamed += shaper.feed([i], [_entry(piece)], delta, last=i == len(pieces) - 1)
    assert [e["token"] for e in streamed] == ["O"]


# ---- guided.py


def _guides():
    from scheduler.guided import Guides

    return Guides("tiny", 512, ())  # (the tiny model's byte tokenizer, no EOS: a stand-in never allowed)


def _b(char: str) -> int:
    from scheduler.tokenizer import BYTE_OFFSET

    return ord(char) + BYTE_OFFSET


def test_a_batchs_guided_rows_each_check_their_own_held_stop_ids():
    """fill_masks of several rows: each row's answer is whether its grammar allows a token besides its own held
    ids (min_tokens'); a row whose grammar allows only its held id says False (then they are not held)."""
    from scheduler.guided import GuidedSpec, fill_masks

    guides = _guides()
    rows = [guides.start(GuidedSpec("regex", "ab")), guides.start(GuidedSpec("regex", "x"))]
    masks = torch.zeros(2, guides.words, dtype=torch.int32)
    assert fill_masks(rows, masks, [(), (_b("x"),)]) == [True, False]
    assert fill_masks(rows, masks, [(_b("a"),), ()]) == [False, True]


def test_a_verify_steps_rows_say_which_masks_allow_no_token():
    """fill_verify_masks: per guide, per row, whether the row's mask allowed nothing (after_step reads the row that
    chose each token: such a token is no answer's and the request ends there)."""
    from scheduler.guided import GuidedSpec, fill_verify_masks

    guides = _guides()
    whole, ab = guides.start(GuidedSpec("regex", "")), guides.start(GuidedSpec("regex", "ab"))
    masks = torch.zeros(1 + 3, guides.words, dtype=torch.int32)
    fill_verify_masks([whole, ab], [[], [_b("a"), _b("b")]], masks)
    assert whole.rows_allow_none == [True] and ab.rows_allow_none == [False, False, True]


def test_a_vocabulary_not_a_multiple_of_32_masks_its_last_word_and_its_logits():
    """300 ids: a mask row of 10 words (the last one partly used); a grammar whose next token is id 295 (past the
    9th word) allows it alone, and apply_masks leaves that logit alone finite."""
    from scheduler.guided import Guides, GuidedSpec, apply_masks

    guides = Guides("tiny", 300, ())
    guide = guides.start(GuidedSpec("grammar", 'start: "a" <[295]>'))
    assert guide.accept(_b("a")) is None
    row = torch.zeros(guides.words, dtype=torch.int32)
    assert guide.fill_mask(row) and not guide.allows_none
    out = apply_masks(torch.zeros(2, 300), [1], row[None])
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1]).nonzero()[:, 0].tolist() == [295]


def _tokenizer_json(model_type: str, vocab, added: list[dict]) -> str:
    import json

    return json.dumps({"model": {"type": model_type, "vocab": vocab}, "decoder": {"type": "ByteLevel"},
                       "added_tokens": added})


def test_a_plain_added_token_of_blanks_is_spelled_in_gpt2s_byte_level_alphabet():
    """A non-special added token "\\n\\n x" moves into a byte-level BPE vocabulary as GPT-2 spells its bytes
    ("ĊĊĠx": a newline is U+010A, a blank U+0120); one whose spelling is another token's stays added."""
    import json

    from scheduler.guided import _plain_added_tokens

    added = [{"id": 7, "content": "\n\n x", "special": False}, {"id": 8, "content": " a", "special": False},
             {"id": 9, "content": "<s>", "special": True}]
    spec = json.loads(_plain_added_tokens(_tokenizer_json("BPE", {"Ġa": 3, "x": 4}, added)))
    assert spec["model"]["vocab"] == {"Ġa": 3, "x": 4, "ĊĊĠx": 7}
    assert [a["id"] for a in spec["added_tokens"]] == [8, 9]


def test_a_tokenizer_that_is_not_bpe_is_left_as_it_is():
    """Only a byte-level BPE's added tokens move (a Unigram vocabulary, a list, is not read as one)."""
    from scheduler.guided import _plain_added_tokens

    text = _tokenizer_json("Unigram", [["a", -1.0], ["b", -2.0]], [{"id": 2, "content": "<think>", "special": False}])
    assert _plain_added_tokens(text) == text
