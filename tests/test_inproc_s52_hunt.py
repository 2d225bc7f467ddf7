"""Regressions from session 52's hunt of the in-process API: an engine whose event loop was closed under it says so
(it said its loop "still runs there"); a forked child is refused at once (it hung on the parent's L3 I/O threads);
EngineConfig's booleans and other fields are type-checked (simulate="false" ran a simulated engine); numpy's max_tokens
is taken; a GuidedSpec's schema may be a dict; one prompt given bare, or a text, is one clear error."""
from __future__ import annotations

import asyncio
import json
import multiprocessing

import numpy as np
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.guided import GuidedSpec
from scheduler.request import RequestError, SamplingParams

TINY = EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4)


def test_an_engine_whose_event_loop_was_closed_says_so():
    eng = Engine(TINY)
    loop = asyncio.new_event_loop()
    [r] = loop.run_until_complete(eng.generate_async([[1, 2, 3]], SamplingParams(max_tokens=2)))
    assert r.error is None
    loop.close()  # (the engine's loop task still pending on it)
    with pytest.raises(RuntimeError, match="was closed"):
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="was closed"):
        asyncio.run(eng.shutdown())


def _child_generates(eng: Engine, queue) -> None:
    try:
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        queue.put("served")
    except RuntimeError as exc:
        queue.put(str(exc))


def test_a_forked_child_is_refused_at_once():
    eng = Engine(TINY.with_hicache(enable=True))  # (an L3 of a temporary file: I/O threads of this process)
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_generates, args=(eng, queue))
    child.start()
    child.join(60)
    assert not child.is_alive()
    assert "another process" in queue.get(timeout=5)
    [r] = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # (the parent serves on)
    assert r.error is None
    asyncio.run(eng.shutdown())


@pytest.mark.parametrize("field, value, says", [
    ("simulate", "false", "simulate must be True or False"), ("enable_prefix_cache", 0, "True or False"),
    ("cuda_graphs", None, "True or False"), ("gpu_memory_fraction", "0.5", "a number"),
    ("hicache", None, "HiCacheConfig"), ("hicache", {}, "HiCacheConfig"), ("model", None, "model must be a string"),
    ("log_json", 1, "log_json must be a string"),
])
def test_engine_config_fields_of_the_wrong_type_are_named(field, value, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(**{"model": "tiny", "device": "cpu", field: value})


def test_numpy_max_tokens_and_a_dict_schema_are_taken():
    eng = Engine(TINY)
    spec = GuidedSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}})
    assert json.loads(spec.value)["type"] == "object"
    assert GuidedSpec("choice", ["yes", "no"]).value == '["yes", "no"]'
    [plain, guided] = eng.generate([[1, 2, 3], [4, 5, 6]], [SamplingParams(max_tokens=np.int64(2)),
                                                           SamplingParams(max_tokens=8, guided=spec)])
    assert plain.error is None and len(plain.output_ids) == 2, plain.error
    assert guided.error is None, guided.error
    with pytest.raises(RequestError, match="value is text"):
        eng.add_request([1, 2], SamplingParams(guided=GuidedSpec("regex", {"a": 1})))
    asyncio.run(eng.shutdown())


@pytest.mark.parametrize("prompts, says", [([1, 2, 3], "give one prompt as"), ("hello", "tokenized first")])
def test_one_prompt_given_bare_is_one_clear_error(prompts, says):
    eng = Engine(TINY)
    with pytest.raises(ValueError, match=says):
        eng.generate(prompts, SamplingParams(max_tokens=2))
    [r] = eng.generate([prompts] if says != "tokenized first" else [[1]], SamplingParams(max_tokens=2))
    assert r.error is None
    asyncio.run(eng.shutdown())
    with pytest.raises(RequestError, match="has shut down"):
        eng.add_request([1, 2], SamplingParams(max_tokens=2))


def test_a_path_as_model_or_log_json_is_its_text(tmp_path):
    """(Review) pathlib paths, served before the type checks, were refused as "must be a string"."""
    cfg = EngineConfig(model="tiny", device="cpu", log_json=tmp_path / "log.jsonl")
    assert cfg.log_json == str(tmp_path / "log.jsonl")
    import pathlib
    assert EngineConfig(model=pathlib.Path("tiny"), device="cpu").model == "tiny"


def test_a_stop_under_way_on_another_loop_is_said_so():
    """(Review) start() awaited another loop's future: asyncio's "attached to a different loop"."""
    eng = Engine(TINY)
    other = asyncio.new_event_loop()
    eng._stop_done = other.create_future()  # (a stop_loop() of another thread's loop, under way)
    with pytest.raises(RuntimeError, match="another event loop is under way"):
        asyncio.run(eng.start())
    other.close()
