"""Stop strings below the HTTP layer: the matcher (scheduler/stop_strings.py's StopMatcher), which
holds back text that may start a stop string and cuts at the earliest completed match, checked
against a reference that searches the whole text at each token; the completion text of byte tokens
(CompletionText), where a stop string inside a multi-byte character matches once the character is
whole and only generated text counts; the validation of `stop` (scheduler/api_models.py); and the
engine's end of a stopped request, a finish that publishes its KV. No server: the HTTP tests are in
tests/test_stop_batch_api.py."""
from __future__ import annotations

import random

import pytest

from scheduler.api_inputs import parse_prompts
from scheduler.api_models import APIError
from scheduler.stop_strings import CompletionText, StopMatcher
from scheduler.tokenizer import ByteTokenizer

TOK = ByteTokenizer(512)


# -- the matcher alone ------------------------------------------------------------------------------------------
def test_the_matcher_holds_back_what_may_start_a_stop_string_and_cuts_at_the_match():
    m = StopMatcher(["abc", "bd"])
    assert m.feed("xa") == "x"          # "a" may start "abc": held
    assert m.feed("b") == ""            # "ab" may start "abc"
    assert m.feed("z") == "abz"         # "abz" starts neither: released
    assert m.feed("ab") == ""
    assert m.feed("dq") == "a" and m.matched == "bd"  # "abdq": "bd" at 1, the text before it
    with pytest.raises(RuntimeError):
        m.feed("more")
    m = StopMatcher(["abcd", "c"])      # the earliest completed match wins, not the leftmost start
    assert m.feed("ab") == "" and m.feed("c") == "ab" and m.matched == "c"
    m = StopMatcher(["xyz"])
    assert m.feed("axy") == "a" and m.flush() == "xy" and m.matched is None


def _reference_stop(pieces: list[str], stops: list[str]) -> str:
    """The text before a stop string, the generation ending at the first piece (token) after which the
    text holds one, cut before the leftmost (no hold-back: the whole text is searched each time)."""
    for end in range(1, len(pieces) + 1):
        text = "".join(pieces[:end])
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        if hits:
            return text[:min(hits)]
    return "".join(pieces)


def test_streamed_pieces_add_up_to_the_text_before_the_stop_string_wherever_the_splits_fall():
    rng = random.Random(5)
    for _ in range(2000):
        text = "".join(rng.choice("aab\u00e9c") for _ in range(rng.randrange(0, 14)))
        stops = ["".join(rng.choice("abc\u00e9") for _ in range(rng.randrange(1, 4)))
                 for _ in range(rng.randrange(1, 4))]
        cuts = sorted({0, len(text), *(rng.randrange(len(text) + 1) for _ in range(rng.randrange(6)))})
        pieces = [text[a:b] for a, b in zip(cuts, cuts[1:])]
        m, out = StopMatcher(stops), []
        for piece in pieces:
            out.append(m.feed(piece))
            if m.matched is not None:
                break
        else:
            out.append(m.flush())
        assert "".join(out) == _reference_stop(pieces, stops), (pieces, stops, out)
        assert (m.matched is not None) == any(s in text for s in stops), (text, stops)


def test_a_stop_string_split_inside_a_character_matches_once_the_character_is_whole():
    """Byte tokens: "é" is two tokens. Nothing of it is sent early, and the match ends at its second byte."""
    ids = TOK.encode("caf\u00e9!")
    text = CompletionText(TOK, [], ["\u00e9"])
    out = [text.feed(t) for t in ids[:4]]
    assert out == ["c", "a", "f", ""] and not text.stopped  # the first byte of é: held by the decoder
    assert text.feed(ids[4]) == "" and text.stopped
    # a string over two tokens, and a prompt that ends in what would complete one: only generated text counts
    text = CompletionText(TOK, TOK.encode("say STO"), ["STOP", "yz"])
    assert [text.feed(t) for t in TOK.encode("P xy")] == ["P", " ", "x", ""] and not text.stopped
    assert text.feed(TOK.encode("z")[0]) == "" and text.stopped


def test_stop_values_that_cannot_work_are_clear_400s():
    kw = dict(tokenizer=TOK, served_names={"tiny"}, model_name="tiny", vocab_size=512, prompt_limit=100,
              max_tokens_limit=16)
    for stop, needle in (("", "empty string"), (["a", ""], "empty string"), (list("abcde"), "at most 4")):
        with pytest.raises(APIError) as e:
            parse_prompts({"prompt": "hi", "stop": stop}, False, **kw)
        assert e.value.status == 400 and e.value.param == "stop" and needle in e.value.message, e.value.body()
    req, _, params = parse_prompts({"prompt": "hi", "stop": ["a", "b", "a", "d"], "stop_token_ids": [7]}, False, **kw)
    assert req.stop_strings() == ("a", "b", "d") and params.stop_token_ids == (7,)
    req, _, params = parse_prompts({"prompt": "hi", "stop": [5, 6]}, False, **kw)  # ids stay ids
    assert req.stop_strings() == () and params.stop_token_ids == (5, 6)
    with pytest.raises(APIError) as e:  # no tokenizer: no text to match
        parse_prompts({"prompt": [1, 2], "stop": "x"}, False, **{**kw, "tokenizer": None})
    assert e.value.param == "stop" and "no tokenizer" in e.value.message


# -- the engine -------------------------------------------------------------------------------------------------
def test_a_request_a_stop_condition_ends_finishes_and_publishes_its_kv():
    """regression: a stop string's end was an abort: counted as aborted, and the KV of the answer it
    had generated never reached the prefix cache (a chat's next turn recomputed it)."""
    import asyncio

    from hicache.radix import Tier
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.request import SamplingParams

    async def main():
        eng = Engine(EngineConfig(model="tiny", page_size=4))
        await eng.start()
        prompt = list(range(10, 30))
        req = eng.add_request(prompt, SamplingParams(max_tokens=40))
        while len(req.output) < 9:
            await asyncio.sleep(0.001)
        assert await eng.abort(req.rid, stop=True)
        while not req.state.done:
            await asyncio.sleep(0.001)
        result = req.result()
        assert result.finish_reason == "stop" and result.error is None
        assert eng.stats["finished"] == 1 and eng.stats["aborted"] == 0
        # the answer's KV is in L1: prompt + answer is matched to its last full page of computed KV
        # (every output token but the last has KV; a chained step may have computed one more)
        computed = len(prompt) + len(result.output_ids) - 1
        l1_tokens = eng.cache.match(prompt + result.output_ids).length(Tier.L1)
        assert l1_tokens >= computed // 4 * 4 > len(prompt)
        eng.check_integrity()
        await eng.shutdown()

    asyncio.run(main())
