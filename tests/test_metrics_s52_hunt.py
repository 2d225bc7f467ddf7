"""Regressions from session 52's hunt of the server's metrics: the prompt-token counters count each choice's prompt
(n, each beam returned: vLLM's child requests), as the per-request histogram and the prefix-cache queries do; they
counted each prompt once."""
from __future__ import annotations

import pytest

from server_fixtures import byte_level_server, ok, tiny_config
from test_server import metric_samples


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config()) as s:
        yield s


@pytest.mark.parametrize("body, engine_requests", [
    ({"prompt": "fifteen tokens!", "n": 3}, 3),
    ({"prompt": ["abc", "defgh"], "n": 2}, 4),
    ({"prompt": "eight tk", "n": 2, "use_beam_search": True}, 2),
])
def test_prompt_tokens_count_each_choice(srv, body, engine_requests):
    before = metric_samples(srv.url)
    ok(srv, "/v1/completions", {"model": "tiny", "max_tokens": 3, "temperature": 0, **body})
    after = metric_samples(srv.url)

    def delta(name):  # (over its labels: vLLM's families carry model_name)
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == name)
    prompts = [body["prompt"]] if isinstance(body["prompt"], str) else body["prompt"]
    per_choice = sum(len(p) for p in prompts) * body["n"]  # (one token per ASCII byte)
    assert delta("hicache_prompt_tokens_total") == per_choice == delta("vllm:prompt_tokens_total")
    assert delta("hicache_request_prompt_tokens_sum") == per_choice
    assert delta("hicache_request_prompt_tokens_count") == engine_requests
