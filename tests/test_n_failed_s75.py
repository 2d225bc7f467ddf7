"""Under `n` (or a batch of prompts), the engine failing one choice fails the whole response (a 500, or a streamed
error chunk): the choices it cut short were counted `aborted` in hicache_requests, as though their client had left,
and an operator reading the outcomes saw one failure and a client abort where the server had failed them all
(scheduler/choices.py `Choices._failed`). They count `failed` now; a choice aborted by shutdown or a client still
counts `aborted` (tests/test_n_choices.py, tests/test_stop_batch_api.py)."""
from __future__ import annotations

import json

import httpx
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from test_sampling_hunt import _poison_l1_prefix
from test_server import ServerThread, metric_samples, wait_idle

BAD = [11, 12, 13, 14, 15, 16, 17, 18, 19]


def _outcomes(url: str) -> dict[str, float]:
    samples = metric_samples(url)
    return {dict(labels)["outcome"]: v for (name, labels), v in samples.items() if name == "hicache_requests_total"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_choices_an_engine_failure_cut_short_count_as_failed_not_aborted(stream):
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256, max_new_tokens_limit=64))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": BAD, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text  # its prefix is now in L1
        s.call(_poison_l1_prefix, engine, BAD[:8])
        before = _outcomes(s.url)
        # prompt 0's two choices are healthy and long; prompt 1's read the poisoned prefix and fail at once
        body = {"prompt": [[30, 31, 32], BAD], "max_tokens": 60, "n": 2, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        if stream:
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_error", r.text
        else:
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
        wait_idle(s)
        after = _outcomes(s.url)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["aborted"] == 0, delta
    assert delta["failed"] + delta["success"] == 4 and delta["failed"] >= 3, delta
