"""Session 80: truncate_prompt_tokens past a beam search's longest prompt (scheduler/prompt_truncation.py). A beam
search's steps send each beam as a prompt, so its longest prompt is --max-prompt-tokens less max_tokens - 1; the 400
named only --max-prompt-tokens and the context less max_tokens - 1, neither of which gives the number it reported
(here 1 token under a limit of 8 and a context of 160)."""
from __future__ import annotations

import pytest

from scheduler.server import ServerLimits
from server_fixtures import byte_level_server, post, tiny_config


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(num_pages=40, max_new_tokens_limit=16),
                           limits=ServerLimits(shutdown_grace_s=1.0, max_prompt_tokens=8)) as s:
        yield s


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_beam_search_s_truncation_400_says_its_limit_is_less_max_tokens(srv, field):
    path, base = ("/v1/completions", {"prompt": "hi"}) if field == "max_tokens" else \
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    r = post(srv, path, {**base, field: 8, "use_beam_search": True, "truncate_prompt_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    message = r.json()["error"]["message"]
    assert "longest prompt this request can have, 1 tokens" in message
    assert f"--max-prompt-tokens less its {field} - 1" in message, message


def test_a_search_less_truncation_400_names_the_limits_as_before(srv):
    r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 8, "truncate_prompt_tokens": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    assert "8 tokens (--max-prompt-tokens, and the 160 tokens a request can hold less its max_tokens - 1)" \
        in r.json()["error"]["message"]
