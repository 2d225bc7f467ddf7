"""--disable-shared-prefill (EngineConfig.share_prefill=False) turns off shared prefill: a queued request no
longer waits for the pages of the request in prefill computing its prefix (Admission._computes_prefix_of is
never consulted), so requests arriving together with one prompt each compute it, as before session 45 — for
operators comparing the two, or who value each request's latency over the total work. tests/test_shared_prefill.py
pins the feature itself (on by default)."""
from __future__ import annotations

import argparse
import random

import pytest

from scheduler.admission import Admission
from scheduler.config import EngineConfig, add_engine_args, config_from_args
from scheduler.engine import Engine
from scheduler.request import SamplingParams

PAGE = 4
REQUESTS = 3
PROMPT_TOKENS = 200
GREEDY = SamplingParams(max_tokens=3)


def make_engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE, num_pages=512, **kw))


def parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(argv))


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(1, 500) for _ in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def shared_outputs(prompt) -> list[list[int]]:
    """The outputs with shared prefill on (the default): the reference the flag must not change."""
    eng = make_engine()
    outputs = [r.output_ids for r in eng.generate([prompt] * REQUESTS, GREEDY)]
    assert eng.metrics()["recomputed_tokens"] < REQUESTS * PROMPT_TOKENS  # (the scenario does share when on)
    return outputs


def test_the_flag_parses_into_the_config():
    assert EngineConfig().share_prefill is True
    assert parse([]).share_prefill is True
    assert parse(["--disable-shared-prefill"]).share_prefill is False


def test_off_each_request_arriving_together_computes_its_whole_prompt(prompt, shared_outputs, monkeypatch):
    consulted = []
    original = Admission._computes_prefix_of
    monkeypatch.setattr(Admission, "_computes_prefix_of",
                        lambda self, req: consulted.append(req.rid) or original(self, req))
    eng = make_engine(share_prefill=False)
    results = eng.generate([prompt] * REQUESTS, GREEDY)
    assert consulted == []
    assert eng.metrics()["recomputed_tokens"] == REQUESTS * PROMPT_TOKENS
    assert eng.metrics()["hit_tokens"]["l1"] == 0
    assert [r.output_ids for r in results] == shared_outputs
    eng.check_integrity()


def test_off_no_request_logs_a_prefill_wait(prompt, tmp_path):
    """No `prefill_waits` line (the timeline's "queued (its prefix computed by another)" phase) with it off."""
    import structlog

    from scheduler.timeline import read_events
    saved = structlog.get_config()
    try:
        log = tmp_path / "run.jsonl"
        eng = make_engine(share_prefill=False, log_json=str(log))
        eng.generate([prompt] * 2, SamplingParams(max_tokens=1))
    finally:
        structlog.configure(**saved)
    states = [e.get("state") for e in read_events(log) if e.get("event") == "request"]
    assert "prefill_end" in states or "first_token" in states  # (the log has the requests' lines)
    assert "prefill_waits" not in states
    eng.check_integrity()


def test_a_later_request_still_reuses_a_published_prefix_with_it_off(prompt):
    """The flag turns off the waiting only, not the prefix cache: a request arriving after the prompt was
    published reads it from L1."""
    eng = make_engine(share_prefill=False)
    eng.generate([prompt], GREEDY)
    eng.generate([prompt], GREEDY)
    assert eng.metrics()["hit_tokens"]["l1"] == PROMPT_TOKENS - PAGE  # (the prompt less its last token, paged)
    eng.check_integrity()
