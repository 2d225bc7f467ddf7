"""Regressions from session 52's hunt of token accounting on /v1/responses: a background response cancelled while it
thought reports the reasoning tokens it made (its usage said 0, its whole output a reasoning item)."""
from __future__ import annotations

import json
import threading
import time

import httpx

from test_responses_hunt import _idle
from test_responses_s51_hunt import _check_cut_short, srv  # noqa: F401  (its server: --reasoning-parser qwen3)

THINKING = {"model": "tiny", "input": "think", "max_output_tokens": 900, "temperature": 0,  # (TEMPLATE opens the block)
            "logit_bias": {"256": -100, "257": -100}}  # (no "<think>" / "</think>": it thinks to the end)


def test_a_background_response_cancelled_while_thinking_counts_its_reasoning_tokens(srv):  # noqa: F811
    events, ids = [], {}

    def post_stream():
        with httpx.stream("POST", srv.url + "/v1/responses", json={**THINKING, "background": True, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1]["type"] == "response.created":
                        ids["id"] = events[-1]["response"]["id"]

    reader = threading.Thread(target=post_stream)
    reader.start()
    deadline = time.monotonic() + 60
    while sum(e["type"] == "response.reasoning_text.delta" for e in events) < 3:
        assert time.monotonic() < deadline and reader.is_alive()
        time.sleep(0.01)
    httpx.post(f"{srv.url}/v1/responses/{ids['id']}/cancel", timeout=60)
    reader.join(60)
    final = _check_cut_short(events, ids["id"])
    assert [item["type"] for item in final["output"]] == ["reasoning"]
    usage = final["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == usage["output_tokens"] >= 3, usage
    assert httpx.get(f"{srv.url}/v1/responses/{ids['id']}", timeout=30).json()["usage"] == usage
    _idle(srv)
    srv.call(srv.engine.check_integrity)
