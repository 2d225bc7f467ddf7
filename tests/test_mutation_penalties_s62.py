"""Mutation check of session 62 (penalties, penalty_state, token_bans, logprobs, prompt_logprobs_api): rules that
no test pinned before, each a fast unit-level test."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from scheduler.penalties import PenaltyFields


# -- scheduler/penalties.py: the API fields ------------------------------------------------------------------
def test_the_api_takes_penalties_at_their_bounds():
    """[-2, 2] and (0, 10] are closed where the docs say: -2 and 10 are served (mutants P1, P4)."""
    got = PenaltyFields.model_validate({"presence_penalty": -2.0, "frequency_penalty": -2,
                                        "repetition_penalty": 10}).penalty_params(16)
    assert (got["presence_penalty"], got["frequency_penalty"], got["repetition_penalty"]) == (-2.0, -2.0, 10.0)


@pytest.mark.parametrize("context", [None, {"vocab_size": 48}])
def test_a_logit_bias_key_that_is_not_an_integer_is_an_int_parsing_error(context):
    """'invalid_type' (api_models maps int_parsing), with or without the vocabulary's size (mutant P7: without
    the check "abc" passed or failed as a plain ValueError)."""
    with pytest.raises(ValidationError) as err:
        PenaltyFields.model_validate({"logit_bias": {"abc": 1}}, context=context)
    assert err.value.errors()[0]["type"] == "int_parsing" and "integer string" in str(err.value)


@pytest.mark.parametrize("body", [{"repetition_penalty": "1.5"}, {"repetition_penalty": True},
                                  {"presence_penalty": "1"}, {"min_tokens": True}, {"logit_bias": {"5": "1"}}])
def test_a_penalty_field_as_a_string_or_bool_is_an_invalid_type_error(body):
    """Strict fields, as the docs say (mutant P17: repetition_penalty "1.5" was served)."""
    with pytest.raises(ValidationError) as err:
        PenaltyFields.model_validate(body, context={"vocab_size": 48})
    assert not err.value.errors()[0]["type"].startswith(("less_than", "greater_than"))


@pytest.mark.parametrize("key,context", [("9" * 13, None), ("1" * 5000, {"vocab_size": 48})])
def test_a_long_logit_bias_key_is_not_a_token_id(key, context):
    """Refused as out of range before int() reads it: without the vocabulary's size too, and a key past Python's
    4,300 digits is no ValueError of int() (mutant P23)."""
    with pytest.raises(ValidationError) as err:
        PenaltyFields.model_validate({"logit_bias": {key: 1}}, context=context)
    assert err.value.errors()[0]["type"] == "less_than", err.value.errors()


def test_the_api_field_refuses_a_logit_bias_past_its_most_tokens():
    """1,024 ids are taken, 1,025 refused by the field itself (mutant P6: the engine's check alone caught it)."""
    from scheduler.request import LOGIT_BIAS_MAX_TOKENS
    most = {str(i): 1 for i in range(LOGIT_BIAS_MAX_TOKENS)}
    assert len(PenaltyFields.model_validate({"logit_bias": most}).penalty_params(16)["logit_bias"]) == 1024
    with pytest.raises(ValidationError) as err:
        PenaltyFields.model_validate({"logit_bias": {**most, "1024": 1}})
    assert err.value.errors()[0]["type"] == "less_than_equal" and "at most 1024" in str(err.value)


# -- scheduler/penalty_state.py --------------------------------------------------------------------------------
def test_min_tokens_leaves_out_stop_ids_outside_the_vocabulary():
    """A stop id past the vocabulary or negative is never sampled: not held (mutant Q7: -1 put the last token at
    -inf; Q8: the vocabulary's size an index error)."""
    import torch

    from scheduler.penalty_state import PenaltyState, RowPenalties, apply_penalties
    logits = torch.zeros(2, 8)
    row = RowPenalties(0.0, 0.0, 1.0, [1, 2], [3], PenaltyState(), None, min_tokens=3, stop_ids=(-1, 8, 2))
    out = apply_penalties(logits, [None, row])
    assert out[1, 2] == float("-inf") and torch.isfinite(out[1, [0, 1, 3, 4, 5, 6, 7]]).all()
    assert torch.equal(out[0], logits[0])


# -- scheduler/token_bans.py ---------------------------------------------------------------------------------------
def test_a_token_sampled_from_a_row_with_nothing_left_is_banned_by_each_kind_of_ban():
    """sampled_banned: a one-token word, an id outside the allowed ones, a word whose prefix is the whole output
    (mutants B3, B5, B17)."""
    from scheduler.penalty_state import PenaltyState
    from scheduler.token_bans import RowBans
    row = RowBans((2, 3, 4, 6), ((4,), (2, 3, 6)), [2, 3], PenaltyState())
    row.index("cpu")
    assert [t for t in range(8) if row.sampled_banned(t)] == [0, 1, 4, 5, 6, 7]
    free = RowBans(None, ((4,), (9, 6)), [9], PenaltyState())
    free.index("cpu")
    assert [t for t in range(8) if free.sampled_banned(t)] == [4, 6]


@pytest.mark.parametrize("out,chained,want", [([2], True, ([3], [6])), ([2, 3], False, ([-1], [6])),
                                              ([3], False, ([], [])), ([], True, ([], [])),
                                              ([7, 9], False, ([-1], [5]))])
def test_the_host_bans_of_longer_words_chained_or_not(out, chained, want):
    """A chained step's in-flight token is the prefix's last: a 3-token word is a candidate once its first token is
    the host's newest (mutants B7-B10); a two-token word is the host's lookup only unchained."""
    from scheduler.penalty_state import PenaltyState
    from scheduler.token_bans import RowBans
    row = RowBans(None, ((2, 3, 6), (9, 5)), out, PenaltyState())
    assert row.host_bans(row.index("cpu"), chained) == want


class _Tok:
    """decode() of a tokenizer whose token 1 is special, 28 decoding as 2 does."""
    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if t == 1 and skip_special_tokens else "<s>" if t == 1 else chr(97 + (t - 1) % 26)
                       for t in ids)


# -- scheduler/logprobs.py -----------------------------------------------------------------------------------------
def test_completion_entries_offsets_and_top():
    """Text offsets run on the pieces (an echo's prompt from 0, its tokens after the prompt's); the sampled token's
    entry joins the k likeliest; pieces that decode alike keep the likelier's; -inf and NaN are -9999.0; an empty
    piece is "token_id:N" (mutants L7-L13, L17, L23)."""
    from scheduler.logprobs import LogprobsShaper, finite
    from scheduler.request import TokenLogprobs
    shaper = LogprobsShaper(_Tok(), chat=False)
    assert shaper.prompt_entries([2, 3], [None, TokenLogprobs(-1.0, [(4, -0.5)])]) == [
        ("b", None, None, 0), ("c", -1.0, {"d": -0.5, "c": -1.0}, 1)]
    shaper.follow_prompt([2, 3, 1])  # "b" "c" and the special token's "token_id:1"
    assert shaper.entry(5, TokenLogprobs(float("-inf"), [(1, -0.2), (6, float("nan"))])) == (
        "e", -9999.0, {"token_id:1": -0.2, "f": -9999.0, "e": -9999.0}, 12)
    assert shaper.entry(2, TokenLogprobs(-0.1, [(2, -0.1)]))[3] == 13
    assert LogprobsShaper(_Tok(), chat=False).entry(28, TokenLogprobs(-0.7, [(2, -0.5)]))[2] == {"b": -0.5}
    assert LogprobsShaper(None, chat=False).entry(7, TokenLogprobs(-3.0, [])) == ("token_id:7", -3.0,
                                                                                  {"token_id:7": -3.0}, 0)
    assert finite(float("nan")) == -9999.0 and finite(-1e6) == -9999.0 and finite(-2.5) == -2.5


def test_chat_entries_keep_the_engines_order_and_bytes():
    """The k likeliest in the engine's order, each logprob clamped; bytes the piece's UTF-8; with
    return_tokens_as_token_ids the token's bytes are its decoded text's, special tokens kept (mutants L14-L16,
    L19-L22, L24)."""
    from scheduler.logprobs import LogprobsShaper
    from scheduler.request import TokenLogprobs
    lp = TokenLogprobs(-2.0, [(5, -0.1), (2, -1.0), (9, float("-inf"))])
    got = LogprobsShaper(_Tok(), chat=True).entry(3, lp)
    assert (got["token"], got["logprob"], got["bytes"]) == ("c", -2.0, [99])
    assert [(t["token"], t["logprob"], t["bytes"]) for t in got["top_logprobs"]] == [
        ("e", -0.1, [101]), ("b", -1.0, [98]), ("i", -9999.0, [105])]
    ids = LogprobsShaper(_Tok(), chat=True, as_token_ids=True).entry(1, lp)
    assert (ids["token"], ids["bytes"]) == ("token_id:1", list(b"<s>"))
    assert ids["top_logprobs"][0] == {"token": "token_id:5", "logprob": -0.1, "bytes": list(b"token_id:5")}
    assert LogprobsShaper(None, chat=True, as_token_ids=True).entry(1, lp)["bytes"] is None


def test_logprob_counts_of_the_request_fields():
    """completions: 0 is the sampled tokens' alone, false none; chat: logprobs true alone is 0, top_logprobs 0
    without it changes nothing (mutants L3, L5, L6)."""
    from scheduler.logprobs import ChatLogprobsFields, CompletionLogprobsField
    assert CompletionLogprobsField(logprobs=0).logprob_count() == 0
    assert CompletionLogprobsField(logprobs=False).logprob_count() is None
    assert ChatLogprobsFields(logprobs=True).logprob_count() == 0
    assert ChatLogprobsFields(top_logprobs=0).logprob_count() is None
    with pytest.raises(ValidationError):
        ChatLogprobsFields(top_logprobs=1)
    for bad in ({"logprobs": 21}, {"logprobs": -1}, {"logprobs": True}, {"logprobs": "1"}):
        with pytest.raises(ValidationError):
            CompletionLogprobsField(**bad)
    assert CompletionLogprobsField(logprobs=20).logprob_count() == 20
    with pytest.raises(ValidationError):
        ChatLogprobsFields(logprobs="true")


# -- scheduler/prompt_logprobs_api.py ----------------------------------------------------------------------------
def _req(prompt_logprobs=None, stream=False, n=None, echo=False, logprobs=None):
    from types import SimpleNamespace
    return SimpleNamespace(prompt_logprobs=prompt_logprobs, stream=stream, n=n, echo=echo,
                           logprob_count=lambda: logprobs)


@pytest.mark.parametrize("kw,tokens,param", [
    ({"prompt_logprobs": 20}, 99865, "prompt_logprobs"),  # 21 entries a token (its own and 20): 2,097,165
    ({"prompt_logprobs": 20, "n": 2}, 49933, "prompt_logprobs"),  # every choice carries them
    ({"echo": True, "logprobs": 5}, 349526, "logprobs"),  # an echo's 6 entries a token alone
    ({"prompt_logprobs": 0, "echo": True, "logprobs": 0}, 1048577, "prompt_logprobs")])
def test_a_response_past_the_prompt_logprob_entries_limit_is_a_400(kw, tokens, param):
    """check_fan_out had no test (mutants R6-R10, R22): one token less than the limit is served."""
    from scheduler.api_models import APIError
    from scheduler.prompt_logprobs_api import MAX_RESPONSE_ENTRIES, check_fan_out
    assert MAX_RESPONSE_ENTRIES == 1 << 21
    with pytest.raises(APIError) as err:
        check_fan_out(_req(**kw), [tokens - 1, 1], 48)
    assert err.value.status == 400 and err.value.param == param and "past the 2,097,152" in err.value.message
    # (regression: it said "one response carries", which a chat's, showing its prompt's once, does not)
    assert "one request may ask for" in err.value.message and "response" not in err.value.message
    check_fan_out(_req(**kw), [tokens - 2, 1], 48)


def test_logprobs_without_echo_add_no_prompt_entries():
    """A completion's logprobs count against the limit only with its echo (mutant R11)."""
    from scheduler.prompt_logprobs_api import check_fan_out
    check_fan_out(_req(prompt_logprobs=0, logprobs=20), [1 << 20], 48)


def test_asked_and_shown_counts():
    """A stream asks and shows nothing (0 too, and -1 is refused); -1 is the whole vocabulary (mutants R2-R5,
    R12, R21)."""
    from scheduler.prompt_logprobs_api import asked_count, shown_count
    assert asked_count(_req(20), 48) == 20 and shown_count(_req(20), 48) == 20
    assert asked_count(_req(0, stream=True), 48) is None and shown_count(_req(0, stream=True), 48) is None
    assert asked_count(_req(-1), 16) == 16 and shown_count(_req(-1), 16) == 16
    for k in (-1, 1):
        with pytest.raises(ValueError, match="stream"):
            asked_count(_req(k, stream=True), 16)
    with pytest.raises(ValueError, match="whole vocabulary of 48 tokens"):
        asked_count(_req(-1), 48)
    with pytest.raises(ValueError, match="must be >= 0"):
        asked_count(_req(-2), 48)
    with pytest.raises(ValueError, match="exceeds"):
        asked_count(_req(21), 48)


def test_render_in_vllms_shape():
    """The first position None; the own token first with its rank, then the k likeliest ranked by position (the
    own token, one of them, keeps its position's rank even where a tie put its counted rank lower); special
    tokens decoded as they are (mutants R17-R20)."""
    from scheduler.prompt_logprobs_api import render
    from scheduler.request import TokenLogprobs
    lps = [None, TokenLogprobs(-0.5, [(3, -0.5), (1, -0.5), (4, -2.0)], rank=2),
           TokenLogprobs(float("-inf"), [(1, -0.1), (2, -3.0)], rank=6)]
    got = render([1, 3, 5], lps, 2, _Tok())
    assert got[0] is None
    assert list(got[1]) == ["3", "1"] and got[1]["3"] == {"logprob": -0.5, "rank": 1, "decoded_token": "c"}
    assert got[1]["1"] == {"logprob": -0.5, "rank": 2, "decoded_token": "<s>"}
    assert list(got[2]) == ["5", "1", "2"] and got[2]["5"] == {"logprob": -9999.0, "rank": 6, "decoded_token": "e"}
    assert [got[2][t]["rank"] for t in ("1", "2")] == [1, 2]
    assert render([1, 2], [None, TokenLogprobs(-1.0, [(2, -1.0)], rank=1)], 1, None)[1]["2"]["decoded_token"] is None


def test_shorter_keeps_the_k_likeliest():
    from scheduler.prompt_logprobs_api import shorter
    from scheduler.request import TokenLogprobs
    lps = [None, TokenLogprobs(-1.0, [(2, -0.5), (3, -1.0), (4, -2.0)], rank=2)]
    assert shorter(lps, 1) == [None, TokenLogprobs(-1.0, [(2, -0.5)], rank=2)] and shorter(lps, 3) == lps
