"""Regressions from session 52's hunts of the HTTP API's limits: truncate_prompt_tokens -1 with a beam search keeps
the longest prompt its steps may re-send (prompt + max_tokens - 1 within --max-prompt-tokens; it kept the whole limit,
then the search refused it with a 400 naming max_tokens); vLLM's add_special_tokens on completions."""
from __future__ import annotations

import pytest

from scheduler.server import ServerLimits
from server_fixtures import byte_level_server, post, tiny_config

PROMPT = list(range(10, 310))  # (300 tokens, past the limit of 100)
BEAM = {"model": "tiny", "max_tokens": 4, "use_beam_search": True, "n": 2}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    limits = ServerLimits(shutdown_grace_s=1.0, max_prompt_tokens=100)
    with byte_level_server(tmp_path_factory, tiny_config(num_pages=64), limits=limits) as s:
        yield s


LONG_CHAT = {"messages": [{"role": "user", "content": "y" * 400}]}


@pytest.mark.parametrize("path, base", [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", LONG_CHAT)])
def test_minus_one_keeps_the_longest_prompt_a_beam_search_may_resend(srv, path, base):
    r = post(srv, path, {**base, **BEAM, "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 100 - (4 - 1)
    plain = post(srv, path, {**base, "model": "tiny", "max_tokens": 4, "truncate_prompt_tokens": -1})
    assert plain.status_code == 200 and plain.json()["usage"]["prompt_tokens"] == 100  # (no search: the whole limit)


def test_a_k_past_what_a_beam_search_may_resend_is_a_400_naming_it(srv):
    r = post(srv, "/v1/completions", {"prompt": PROMPT, **BEAM, "truncate_prompt_tokens": 98})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    assert post(srv, "/v1/completions", {"prompt": PROMPT, **BEAM, "truncate_prompt_tokens": 97}).status_code == 200


@pytest.fixture(scope="module")
def bos_srv(tmp_path_factory):
    """A tokenizer that puts its BOS (<s>, id 256) ahead of every text it encodes."""
    from scheduler.engine import Engine
    from scheduler.server import create_app
    from scheduler.tokenizer import HFTokenizer
    from test_server import ServerThread
    from tokenizer_files import write_byte_tokenizer
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), special=("<s>",), bos="<s>")
    with ServerThread(create_app(Engine(tiny_config()), ServerLimits(shutdown_grace_s=1.0),
                                 tokenizer=HFTokenizer(str(path)))) as s:
        yield s


@pytest.mark.parametrize("add", [True, False])
def test_a_completions_add_special_tokens_is_vllms(bos_srv, add):
    """vLLM's CompletionRequest.add_special_tokens (default true): false encodes a text prompt without the BOS, as
    /tokenize counts it (it was an unknown-field 400)."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "add_special_tokens": add, "echo": True,
            "logprobs": 0}
    r = post(bos_srv, "/v1/completions", body)
    assert r.status_code == 200, r.text
    counted = post(bos_srv, "/tokenize", {"prompt": "hi", "add_special_tokens": add}).json()["count"]
    assert r.json()["usage"]["prompt_tokens"] == counted == (3 if add else 2)
