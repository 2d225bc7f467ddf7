"""The metric names README.md, docs/design.md and docs/reliability.md cite against what a scrape shows, which
tests/test_docs_truth.py does not read (it finds a name anywhere in the code, a comment or a family's source name):
every `hicache_...` and `vllm:...` name is a family or a sample of the server's /metrics exposition (a counter's
samples end in _total there: regression, the README named `vllm:num_preemptions`, which no scrape carries), and every
`policy_skips.X` / `failures.X` the docs cite is a key the engine's metrics() reports. A tiny CPU engine, never
started, renders the exposition."""
from __future__ import annotations

import asyncio
import re
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/design.md", "docs/reliability.md")
METRIC = re.compile(r"(?<![\w:])(hicache_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def doc(name: str) -> str:
    return (REPO / name).read_text()


@lru_cache(maxsize=None)
def exposition() -> tuple[frozenset[str], dict]:
    """(every family and sample name a scrape of /metrics shows, the engine's metrics()) of a tiny CPU engine with
    every tier."""
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.prom import ServerMetrics
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=32).with_hicache(enable=True))
    try:
        text = ServerMetrics(engine).render().decode()
        # as a scrape shows them: "# TYPE" lines' names (a counter's with _total) and the samples' names
        names = re.findall(r"^# TYPE (\S+)", text, flags=re.M) + re.findall(r"^([^#\s{]+)", text, flags=re.M)
        return frozenset(names), engine.metrics()
    finally:
        asyncio.run(engine.cache.close())  # (its temporary L3 file goes)


@pytest.mark.parametrize("name", DOCS)
def test_metric_names_the_docs_cite_are_exported(name):
    exported, _ = exposition()
    cited = set(METRIC.findall(doc(name)))
    assert sorted(cited - exported) == []


def test_readme_cites_the_metrics_it_promises():
    """The README's pointers to /metrics stay found (a doc edited away from them fails here, not silently)."""
    cited = set(METRIC.findall(doc("README.md")))
    assert {"vllm:num_requests_waiting", "hicache_engine_decode_reserve_ratio"} <= cited
    assert any(n.startswith("vllm:num_preemptions") for n in cited)


@pytest.mark.parametrize("name", DOCS)
def test_counter_keys_the_docs_cite_are_reported(name):
    """`policy_skips.write_l3`, `failures.eio` and the like name keys of the engine's metrics()."""
    from hicache.metrics import FAILURE_KINDS
    _, metrics = exposition()
    wrong = []
    for group, key in re.findall(r"`(policy_skips|failures)\.(\w+)`", doc(name)):
        known = FAILURE_KINDS if group == "failures" else metrics[group]
        if key not in known:
            wrong.append(f"{group}.{key}")
    assert wrong == []
