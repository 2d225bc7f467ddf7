"""vLLM's `stop_reason` on completion and chat choices (scheduler/generation.py `Generation.stop_reason`, rendered by
scheduler/api_models.py): the stop string that matched (str), or the id that ended the choice from `stop_token_ids`
or an integer `stop` (int); null for any other end: the model's EOS, max_tokens, a grammar that is whole. As vLLM's
check_stop: the EOS is the tokenizer's eos_token, unless ignore_eos, even where stop_token_ids names it too; the
model's other EOS ids (its generation config's) are stop token ids (vLLM adds them there), so they are the reason.
A whole response's every choice carries it; a completion stream's every chunk (null until its choice's last), a chat
stream's only the chunk that carries finish_reason (vLLM's `exclude_unset` leaves it off the others). A chat whose
finish_reason becomes "tool_calls" keeps it (vLLM's)."""
from __future__ import annotations

import dataclasses

import pytest

from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.stop_strings import StopMatcher
from scheduler.tokenizer import HFTokenizer
from server_fixtures import byte_level_server, ok, sse, tiny_config
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=64)) as s:
        yield s


def _text(choice: dict) -> str:
    if "message" in choice:
        return choice["message"]["content"] or ""
    return choice["text"] if "text" in choice else choice["delta"].get("content") or ""


def _by_choice(chunks: list[dict]) -> dict[int, list[dict]]:
    """A stream's choice chunks per choice index, in order (a usage chunk, with no choices, left out)."""
    out: dict[int, list[dict]] = {}
    for ch in chunks:
        for c in ch["choices"]:
            out.setdefault(c["index"], []).append(c)
    return out


def _streamed_reason(chunks: list[dict], chat: bool) -> list:
    """Each choice's stop_reason as its stream says it, its framing checked: only the chunk with its finish_reason
    (its last) may carry one; a completion's other chunks say null, a chat's leave the key out."""
    reasons = []
    for _, cs in sorted(_by_choice(chunks).items()):
        *rest, last = cs
        assert last["finish_reason"] is not None and "stop_reason" in last, last
        assert all(c["finish_reason"] is None for c in rest)
        if chat:
            assert all("stop_reason" not in c for c in rest), rest
        else:
            assert all("stop_reason" in c and c["stop_reason"] is None for c in rest), rest
        reasons.append(last["stop_reason"])
    return reasons


def _both(s, path: str, body: dict) -> tuple[dict, list]:
    """The whole response, and each choice's streamed stop_reason (checked against the whole's)."""
    whole = ok(s, path, body)
    streamed = _streamed_reason(sse(s, path, body), path == CHAT)
    assert streamed == [c["stop_reason"] for c in whole["choices"]]
    return whole, streamed


def _pieces(s, path: str, body: dict) -> list[tuple[list[int], list[str]]]:
    """An unconstrained request's choices: each one's token ids and the text each token added (its chunks)."""
    per = _by_choice(sse(s, path, body))
    out = []
    for i in sorted(per):
        assert all(len(c["token_ids"]) == 1 for c in per[i] if c["token_ids"])
        tokens = [c for c in per[i] if c["token_ids"]]
        out.append(([c["token_ids"][0] for c in tokens], [_text(c) for c in tokens]))
    return out


def _first_match(pieces: list[str], stop: str) -> int:
    """The token whose text completes `stop` first (len(pieces) where none does)."""
    return next((k for k in range(len(pieces)) if stop in "".join(pieces[:k + 1])), len(pieces))


def _expected(ids: list[int], pieces: list[str], stop: str, token: int) -> tuple[str, str | int | None]:
    """(finish_reason, stop_reason) of an unconstrained run once `stop` and `token` may end it (a stop token's
    text is not shown: the string must be whole before it)."""
    by_string, by_token = _first_match(pieces, stop), ids.index(token) if token in ids else len(ids)
    if by_string < by_token:
        return "stop", stop
    return ("stop", token) if by_token < len(ids) else ("length", None)


def _split_stops(runs: list[tuple[list[int], list[str]]]) -> tuple[str, int]:
    """A stop string (two printable ASCII characters: two tokens) that ends choice 0 and a stop token id that
    ends choice 1, from the two choices' unconstrained runs."""
    text0 = "".join(runs[0][1])
    for at in range(len(text0) - 1):
        stop = text0[at:at + 2]
        if not (stop.isascii() and stop.isprintable()):
            continue
        for token in dict.fromkeys(runs[1][0]):
            if [_expected(*run, stop, token) for run in runs] == [("stop", stop), ("stop", token)]:
                return stop, token
    raise AssertionError(f"no stop string of {text0!r} and stop token of {runs[1][0]} split the choices")


# -- a stop string --------------------------------------------------------------------------------------------
def test_of_strings_matched_at_one_place_the_first_given_is_the_reason():
    """Both complete in one delta at the same place: vLLM reports the first of its `stop` list (it was the
    alphabetically least, "a"); the leftmost match still ends the text first."""
    both = StopMatcher(["ab", "a"])
    assert both.feed("xab") == "x" and both.matched == "ab"
    left = StopMatcher(["b", "xa"])
    assert left.feed("xab") == "" and left.matched == "xa"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_is_the_stop_reason(srv, path, include):
    """A stop string over two tokens (one byte each): the string that matched, whole and streamed, with its
    text in the output or not; the other string given never matched."""
    body = {"prompt": "hello"} if path == COMPLETIONS else {"messages": HI}
    body |= {"temperature": 0, "max_tokens": 24}
    [(_, pieces)] = _pieces(srv, path, body)
    full = "".join(pieces)
    stop = next(s for a in range(4, len(full) - 1) if (s := full[a:a + 2]).isascii() and s.isprintable())
    absent = "\x01never\x02"
    whole, _ = _both(srv, path, {**body, "stop": [absent, stop], "include_stop_str_in_output": include})
    [choice] = whole["choices"]
    at = full.find(stop)
    assert _text(choice) == full[:at + len(stop) if include else at]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_max_tokens_has_no_stop_reason(srv, path):
    body = {"prompt": "hello"} if path == COMPLETIONS else {"messages": HI}
    whole, _ = _both(srv, path, {**body, "temperature": 0, "max_tokens": 6, "stop": ["\x01never"],
                                 "stop_token_ids": [0]})
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "length" and "stop_reason" in choice and choice["stop_reason"] is None


# -- a stop token id ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("as_stop", [False, True])
def test_a_stop_token_id_is_the_stop_reason_once_min_tokens_lets_it(srv, path, as_stop):
    """The model made to say id 70 (logit_bias): min_tokens holds it back for 3 tokens, then it is the 4th and
    ends the choice; the reason is the id, an int, given as stop_token_ids or as an integer `stop`."""
    body = {"prompt": "hello"} if path == COMPLETIONS else {"messages": HI}
    body |= {"temperature": 0, "max_tokens": 8, "logit_bias": {"70": 100}, "min_tokens": 3}
    free, _ = _both(srv, path, body)
    assert free["choices"][0]["token_ids"][3:] == [70] * 5 and free["choices"][0]["stop_reason"] is None
    stop = {"stop": 70} if as_stop else {"stop_token_ids": [5, 70]}
    whole, _ = _both(srv, path, {**body, **stop})
    [choice] = whole["choices"]
    assert len(choice["token_ids"]) == 4 and choice["token_ids"][-1] == 70 and 70 not in choice["token_ids"][:3]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == 70 and type(choice["stop_reason"]) is int


# -- each choice its own --------------------------------------------------------------------------------------
def test_a_batch_of_prompts_each_choice_its_own_reason(srv):
    """Three prompts, one stop string and one stop token id: the first prompt's choice ends at the string, the
    second's at the token, the third's as its unconstrained run says (at max_tokens where neither comes)."""
    body = {"prompt": ["hello", "world", "zz"], "temperature": 0, "max_tokens": 24}
    runs = _pieces(srv, COMPLETIONS, body)
    stop, token = _split_stops(runs[:2])
    whole, _ = _both(srv, COMPLETIONS, {**body, "stop": [stop], "stop_token_ids": [token]})
    reasons = [(c["finish_reason"], c["stop_reason"]) for c in whole["choices"]]
    assert reasons[:2] == [("stop", stop), ("stop", token)]
    assert reasons[2] == _expected(*runs[2], stop, token)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_n_choices_each_their_own_reason(srv, path):
    """n=2, sampled (seeded: choice j draws with seed + j): one choice ends at a stop string, the other at a stop
    token id."""
    body = {"prompt": "hello"} if path == COMPLETIONS else {"messages": HI}
    for seed in range(20):
        run = {**body, "n": 2, "temperature": 1.0, "seed": seed, "max_tokens": 24}
        try:
            stop, token = _split_stops(_pieces(srv, path, run))
            break
        except AssertionError:
            continue
    else:
        raise AssertionError("no seed splits the two choices")
    whole, _ = _both(srv, path, {**run, "stop": [stop], "stop_token_ids": [token]})
    reasons = [(c["finish_reason"], c["stop_reason"]) for c in whole["choices"]]
    assert reasons == [("stop", stop), ("stop", token)]


# -- the model's EOS, and a chat's tool calls -----------------------------------------------------------------
EOT, END = 257, 256  # the tokenizer's eos_token "<|eot|>"; "</s>", the model's first EOS (config.json's)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def eos_srv(tmp_path_factory):
    """Llama 3.1's shape: the model's EOS ids are (</s>, <|eot|>) in that order, the tokenizer's eos_token is
    <|eot|>; the hermes tool parser on."""
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), special=("</s>", "<|eot|>"),
                                config={"chat_template": template, "eos_token": "<|eot|>"})
    engine = Engine(tiny_config())
    engine.model_config = dataclasses.replace(engine.model_config, eos_token_id=END, extra_eos_token_ids=(EOT,))
    limits = ServerLimits(shutdown_grace_s=1.0, tool_call_parser="hermes")
    with ServerThread(create_app(engine, limits, tokenizer=HFTokenizer(str(path)))) as s:
        yield s


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_the_eos_has_no_stop_reason_unless_ignored_and_asked_for(eos_srv, path):
    body = {"prompt": "hello"} if path == COMPLETIONS else {"messages": HI}
    body |= {"temperature": 0, "max_tokens": 4, "logit_bias": {str(EOT): 100}}
    for extra, want in [({}, ("stop", None)),
                        ({"stop_token_ids": [EOT]}, ("stop", None)),  # (the EOS first, as vLLM's check_stop)
                        ({"stop_token_ids": [EOT], "ignore_eos": True}, ("stop", EOT)),
                        ({"ignore_eos": True}, ("length", None))]:
        whole, _ = _both(eos_srv, path, {**body, **extra})
        [choice] = whole["choices"]
        assert (choice["finish_reason"], choice["stop_reason"]) == want, extra


def test_the_models_other_eos_ids_are_stop_token_ids(eos_srv):
    """vLLM puts a model's EOS ids but the tokenizer's into stop_token_ids: </s> ends it as a stop token would."""
    body = {"prompt": "hello", "temperature": 0, "max_tokens": 4, "logit_bias": {str(END): 100}}
    whole, _ = _both(eos_srv, COMPLETIONS, body)
    [choice] = whole["choices"]
    assert (choice["token_ids"], choice["finish_reason"], choice["stop_reason"]) == ([END], "stop", END)
    whole, _ = _both(eos_srv, COMPLETIONS, {**body, "ignore_eos": True})
    assert (whole["choices"][0]["finish_reason"], whole["choices"][0]["stop_reason"]) == ("length", None)


def test_tool_calls_keep_the_stop_reason(eos_srv):
    """An answer held (guided_regex) to a hermes call: "tool_calls", no reason where its grammar ended it; ended
    by a stop string after the call, the string (vLLM keeps stop_reason when finish_reason becomes tool_calls)."""
    regex = "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else "\\n" if ch == "\n" else ch for ch in CALL + "\nEND")
    body = {"messages": HI, "tools": [WEATHER], "guided_regex": regex, "temperature": 0, "max_tokens": 200}
    for extra, want in [({}, None), ({"stop": ["END"]}, "END")]:
        whole, _ = _both(eos_srv, CHAT, {**body, **extra})
        [choice] = whole["choices"]
        assert choice["message"]["tool_calls"] and choice["finish_reason"] == "tool_calls"
        assert choice["stop_reason"] == want, extra


@pytest.fixture(scope="module")
def tokenizer_eos_srv(tmp_path_factory):
    """A fine-tune's shape: config.json names no EOS (the preset's none), the tokenizer's eos_token is <|eot|>."""
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), special=("</s>", "<|eot|>"),
                                config={"eos_token": "<|eot|>"})
    with ServerThread(create_app(Engine(tiny_config()), ServerLimits(shutdown_grace_s=1.0),
                                 tokenizer=HFTokenizer(str(path)))) as s:
        yield s


def test_the_tokenizers_eos_token_ends_an_answer_as_vllms(tokenizer_eos_srv):
    """vLLM's check_stop ends at the tokenizer's eos_token whatever config.json names (regression: the model's EOS
    ids alone ended answers, so a fine-tune whose tokenizer says <|im_end|> ran to max_tokens); ignore_eos runs on,
    min_tokens holds it."""
    body = {"prompt": "hello", "temperature": 0, "max_tokens": 6, "logit_bias": {str(EOT): 100}}
    [choice] = ok(tokenizer_eos_srv, COMPLETIONS, body)["choices"]
    assert (choice["finish_reason"], choice["stop_reason"], choice["token_ids"]) == ("stop", None, [EOT])
    [choice] = ok(tokenizer_eos_srv, COMPLETIONS, {**body, "ignore_eos": True})["choices"]
    assert choice["finish_reason"] == "length" and choice["token_ids"] == [EOT] * 6
    [choice] = ok(tokenizer_eos_srv, COMPLETIONS, {**body, "min_tokens": 3})["choices"]
    assert choice["finish_reason"] == "stop" and len(choice["token_ids"]) == 4 and choice["token_ids"][-1] == EOT
