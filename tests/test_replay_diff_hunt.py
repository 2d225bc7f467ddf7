"""The replay's accounting against an independent model (differential bug hunt, session 27): what a
Mooncake trace's hash ids say each request must hit, and in which tier, compared with a `--simulate`
replay and a real one (tiny model, CPU), request by request (each request's `prefill_start` event of
`--log-json`) and in total (the summary, its JSON and its printed lines).

The models know nothing of the tree or the allocators:
  - unbounded tiers: a request hits, in whole pages, the longest run of pages some earlier prompt
    held in full (a page is known by its index and the hash ids it covers), at most its prompt
    less its last token;
  - a small L1 (or L1 and L2) above a tier that holds everything: the same total, split over tiers;
  - prompts that never share a page, each a whole number of pages plus one token, under
    write-through: every tier is an LRU of whole prompts, so a request is served by the first tier
    whose capacity (in prompts) exceeds the number of other prompts used since its last use.
Policy `always`, one request at a time: a simulated run's hits equal a real one's (scheduler/replay.py).
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import structlog

from scheduler.replay import format_summary, run_cli
from scheduler.replay_args import SAMPLE_TRACE

PAGE = 16  # the replay's page (tokens)
TRACE_BLOCK = 512  # tokens per hash id in a Mooncake trace
SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
TIERS = ("l1", "l2", "l3")


# -- the trace and the replay ----------------------------------------------------------------------
def write_trace(path: Path, records: list[tuple]) -> Path:
    """records: (timestamp_ms, input_length, output_length, hash_ids), in file order."""
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": n, "output_length": o, "hash_ids": list(ids)})
                            + "\n" for ts, n, o, ids in records))
    return path


def replay(trace: Path, tmp: Path, *flags: str) -> tuple[dict, dict[int, tuple[int, int, int]]]:
    """One deterministic replay (policy always, one request at a time): its summary and, per request
    index, the (l1, l2, l3) hit tokens of its last `prefill_start` event (a restore overlapped with
    its forward and discarded is admitted again)."""
    log = tmp / f"events-{len(list(tmp.glob('events-*')))}.jsonl"
    saved = structlog.get_config()
    try:
        summary = run_cli(["--trace", str(trace), "--time-scale", "0", "--concurrency", "1", "--no-progress",
                           "--hicache-policy", "always", "--log-json", str(log), *flags])
    finally:
        structlog.configure(**saved)
    per_request = {}
    for line in log.read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "request" and e.get("state") == "prefill_start":
            index = int(e["rid"][1:].split("-")[0])  # "r{index}-line{line}"
            per_request[index] = (e["hit_l1"], e["hit_l2"], e["hit_l3"])
    return summary, per_request


def scaled_input(input_length: int, num_blocks: int, block_tokens: int) -> int:
    """The prompt's tokens at `block_tokens` a hash id (the README: lengths scale by block_tokens/512,
    rounded half up, and stay inside the request's blocks)."""
    n = max(1, math.floor(input_length * block_tokens / TRACE_BLOCK + 0.5))
    return min(max(n, (num_blocks - 1) * block_tokens + 1), num_blocks * block_tokens)


def prefix_model(records: list[tuple], block_tokens: int, max_input_tokens: int | None = None) -> list[int]:
    """Hit tokens per request, in arrival order, of a cache that forgets nothing."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    hits = []
    for _, n_in, _, ids in sorted(records, key=lambda r: r[0]):
        n = scaled_input(n_in, len(ids), block_tokens)
        if max_input_tokens is not None:
            n = min(n, max_input_tokens)
        # page j, whole in this prompt, is known by its index and the hash ids it covers
        pages = [(j, tuple(ids[: ((j + 1) * PAGE - 1) // block_tokens + 1])) for j in range(n // PAGE)]
        reusable_pages = (n - 1) // PAGE  # the last token is always computed
        k = 0
        while k < reusable_pages and pages[k] in seen:
            k += 1
        hits.append(k * PAGE)
        seen.update(pages)
    return hits


def random_records(seed: int, num: int) -> list[tuple]:
    """Conversations: most requests extend a prefix of an earlier one's hash ids, some repeat an id,
    some are one token; timestamps out of file order."""
    rng = random.Random(seed)
    records, prompts, next_id = [], [], 1
    for _ in range(num):
        ids = list(rng.choice(prompts)[: rng.randrange(0, 4)]) if prompts and rng.random() < 0.75 else []
        for _ in range(rng.randrange(0 if ids else 1, 4)):
            ids.append(ids[-1] if ids and rng.random() < 0.1 else next_id)
            next_id += 1
        n_in = rng.randrange((len(ids) - 1) * TRACE_BLOCK + 1, len(ids) * TRACE_BLOCK + 1)
        if rng.random() < 0.05:
            ids, n_in = ids[:1], 1
        prompts.append(tuple(ids))
        records.append((rng.randrange(0, 100_000), n_in, rng.randrange(0, 400), ids))
    return records


def check_summary(s: dict, hits: list[int], prompts: list[int]) -> None:
    assert (s["requests"], s["completed"], s["failed"]) == (len(prompts), len(prompts), 0)
    assert s["integrity"] == "passed" and s["engine_crash"] is None
    assert s["prompt_tokens"] == sum(prompts)
    assert sum(s["hit_tokens"].values()) == sum(hits)
    assert s["recomputed_tokens"] == sum(prompts) - sum(hits)
    lines = dict(line.split("  ", 1) for line in format_summary(s).splitlines())
    for tier in TIERS:
        pct = 100 * s["hit_tokens"][tier] / sum(prompts)
        assert lines[f"hit tokens {tier.upper()}"].strip() == f"{s['hit_tokens'][tier]:,} ({pct:.1f}%)"


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> tuple[Path, list[tuple]]:
    records = random_records(seed=7, num=30)
    return write_trace(tmp_path_factory.mktemp("conv") / "conv.jsonl", records), records


# -- unbounded and half-bounded tiers --------------------------------------------------------------
@pytest.mark.parametrize("capacities, tiers_hit", [
    (["--l1-tokens", "100000"], {"l1"}),
    (["--l1-tokens", "512", "--l2-tokens", "100000", "--l3-tokens", "0"], {"l1", "l2"}),
    (["--l1-tokens", "512", "--l2-tokens", "512", "--l3-tokens", "100000"], {"l1", "l2", "l3"}),
])
@pytest.mark.parametrize("simulate", [True, False], ids=["simulate", "real"])
def test_every_request_hits_the_longest_prefix_seen(conversations, tmp_path, capacities, tiers_hit, simulate):
    # 24-token blocks on 16-token pages: pages straddle blocks, prompts end inside pages
    trace, records = conversations
    s, per_request = replay(trace, tmp_path, "--block-tokens", "24", *capacities,
                            *(["--simulate"] if simulate else []))
    expected = prefix_model(records, 24)
    got = [sum(per_request[i]) for i in range(len(records))]
    assert got == expected
    assert {t for t in TIERS if s["hit_tokens"][t]} == tiers_hit  # (L2 of 512 tokens keeps a little)
    prompts = [scaled_input(n, len(ids), 24) for _, n, _, ids in sorted(records, key=lambda r: r[0])]
    check_summary(s, expected, prompts)
    assert s["output_tokens"] == sum(max(1, math.floor(o * 24 / TRACE_BLOCK + 0.5)) for *_, o, _ in records)


@pytest.mark.parametrize("block_tokens, max_input_tokens", [(8, None), (64, None), (16, 40)])
def test_simulated_hits_follow_the_prefix_model_at_other_block_sizes(conversations, tmp_path, block_tokens,
                                                                       max_input_tokens):
    trace, records = conversations
    clip = ["--max-input-tokens", str(max_input_tokens)] if max_input_tokens else []
    s, per_request = replay(trace, tmp_path, "--simulate", "--block-tokens", str(block_tokens), *clip,
                            "--l1-tokens", "512", "--l2-tokens", "512", "--l3-tokens", "100000")
    expected = prefix_model(records, block_tokens, max_input_tokens)
    assert [sum(per_request[i]) for i in range(len(records))] == expected
    assert sum(expected) > 0


# -- LRU tiers of whole prompts --------------------------------------------------------------------
def stack_model(sequence: list[int], capacities: tuple[int, int, int]) -> list[str | None]:
    """The tier each use of a prompt is served from, when each tier keeps the `capacities` most
    recently used prompts (inclusive LRU tiers: write-through writes every prompt to all of them)."""
    order: list[int] = []
    out: list[str | None] = []
    for unit in sequence:
        distance = len(order) - 1 - order.index(unit) if unit in order else None
        out.append(next((t for t, k in zip(TIERS, capacities) if distance is not None and distance < k), None))
        if unit in order:
            order.remove(unit)
        order.append(unit)
    return out


@pytest.mark.parametrize("capacities", [(1, 3, 5), (2, 3, 6), (1, 1, 3)])
def test_lru_tiers_serve_each_prompt_from_the_tier_its_reuse_distance_picks(tmp_path, capacities):
    pages = 2
    rng = random.Random(sum(capacities))
    sequence = [rng.randrange(7) for _ in range(36)]
    # each prompt: `pages` whole pages plus one token of a block of its own, so prompts never share a
    # page, the whole prompt but its last token is reusable, and nothing splits a prompt's node
    records = [(t, pages * TRACE_BLOCK + 16, 16, [1000 * u + k for k in range(pages + 1)])
               for t, u in enumerate(sequence)]
    trace = write_trace(tmp_path / "units.jsonl", records)
    k1, k2, k3 = capacities
    # L1: k1 prompts plus the page a running request's last token takes
    flags = ["--block-tokens", "16", "--l1-tokens", str((k1 * pages + 1) * PAGE),
             "--l2-tokens", str(k2 * pages * PAGE), "--l3-tokens", str(k3 * pages * PAGE)]
    expected = stack_model(sequence, capacities)
    runs = [replay(trace, tmp_path, *flags, *extra) for extra in (["--simulate"], [])]
    for s, per_request in runs:
        got = [next((t for t, n in zip(TIERS, per_request[i]) if n), None) for i in range(len(sequence))]
        assert got == expected
        assert all(sum(per_request[i]) == (pages * PAGE if tier else 0) for i, tier in enumerate(expected))
        hits = [pages * PAGE if tier else 0 for tier in expected]
        check_summary(s, hits, [pages * PAGE + 1] * len(sequence))
        for tier in TIERS:
            assert s["hit_tokens"][tier] == pages * PAGE * expected.count(tier)
    assert runs[0][1] == runs[1][1]


def test_a_prefix_split_over_three_tiers_counts_each_part_in_its_own_tier(tmp_path):
    a = [1, 2, 3, 4, 5, 6]

    def rec(t: int, ids: list[int]) -> tuple:  # (len(ids) - 1) whole pages and one token
        return (t, (len(ids) - 1) * TRACE_BLOCK + 16, 16, ids)

    records = [rec(0, a + [100]), rec(1, [20, 21, 22, 23, 24, 25, 101]), rec(2, [30, 31, 32, 33, 34, 35, 102]),
               rec(3, a[:2] + [103]), rec(4, a[:4] + [104]), rec(5, a + [105])]
    trace = write_trace(tmp_path / "split.jsonl", records)
    flags = ["--block-tokens", "16", "--l1-tokens", str(8 * PAGE), "--l2-tokens", str(7 * PAGE), "--l3-tokens", "100000"]
    # a leaves L1 and L2 (one prompt each) but not L3; its first 2 pages come back from L3, then 4
    # pages hit 2 in L1 and 2 in L3, then 6 pages 4 in L1 and 2 in L3
    want = [(0, 0, 0)] * 3 + [(0, 0, 32), (32, 0, 32), (64, 0, 32)]
    for extra in (["--simulate"], []):
        s, per_request = replay(trace, tmp_path, *flags, *extra)
        assert [per_request[i] for i in range(6)] == want
        assert s["hit_tokens"] == {"l1": 96, "l2": 0, "l3": 96}


# -- a real trace ----------------------------------------------------------------------------------
def test_a_real_trace_prefix_replays_alike_simulated_and_real(tmp_path):
    trace = SHARED_TRACE if SHARED_TRACE.exists() else SAMPLE_TRACE
    flags = ["--block-tokens", "16", "--max-requests", "60", "--max-input-tokens", "256", "--max-output-tokens", "4",
             "--l1-tokens", "512", "--l2-tokens", "1024", "--l3-tokens", "4096"]
    (sim, sim_hits), (real, real_hits) = (replay(trace, tmp_path, *flags, *extra) for extra in (["--simulate"], []))
    assert sim_hits == real_hits and len(sim_hits) == 60
    for key in ("requests", "completed", "prompt_tokens", "output_tokens", "hit_tokens", "recomputed_tokens"):
        assert sim[key] == real[key], key
    lines = [json.loads(line) for line in trace.read_text().splitlines()[:60]]
    records = [(d["timestamp"], d["input_length"], d["output_length"], d["hash_ids"]) for d in lines]
    unbounded = prefix_model(records, 16, 256)
    assert sum(unbounded) > 0
    assert all(sum(sim_hits[i]) <= unbounded[i] for i in range(60))  # a bounded cache hits no more
    check_summary(real, [sum(real_hits[i]) for i in range(60)],
                  [min(256, scaled_input(n, len(ids), 16)) for _, n, _, ids in sorted(records, key=lambda r: r[0])])


# -- the parser's edge cases -----------------------------------------------------------------------
def test_trace_edge_cases_keep_the_numbers(tmp_path):
    records = [
        (50, 3 * TRACE_BLOCK, 32, [7, 7, 7]),    # one id three times: three equal blocks
        (10, 2 * TRACE_BLOCK, 32, [7, 7]),       # earlier timestamp, later line: replayed first
        (60, 1, 0, [7]),                         # one token, no output asked: 1 generated, nothing reusable
        (70, 3 * TRACE_BLOCK + 16, 32, [7, 7, 7, 8]),
        (80, 2 * TRACE_BLOCK, 32, [7, 9]),
    ]
    trace = write_trace(tmp_path / "edges.jsonl", records)
    with trace.open("a") as f:
        f.write(json.dumps({"timestamp": 5, "input_length": 0, "output_length": 4, "hash_ids": []}) + "\n")
        f.write(json.dumps({"timestamp": 6, "input_length": 700, "output_length": 4, "hash_ids": [1]}) + "\n")
        f.write(json.dumps({"timestamp": 7, "input_length": 700, "output_length": 4, "hash_ids": [1, 2, 3]}) + "\n")
    out = tmp_path / "out.json"
    for extra in (["--simulate"], []):
        s, per_request = replay(trace, tmp_path, "--block-tokens", "16", "--json-out", str(out), *extra)
        # [7,7] 32 tokens: nothing before; [7,7,7]: 2 pages seen, 2 reusable; [7]: 1 token; [7,7,7,8]:
        # 3 pages; [7,9]: page 0 only
        assert [sum(per_request[i]) for i in range(5)] == [0, 32, 0, 48, 16] == prefix_model(records, 16)
        assert [p["line"] for p in s["problems"]] == [6, 7, 8]
        assert s["output_tokens"] == 4 * 1 + 1
        check_summary(s, [0, 32, 0, 48, 16], [32, 48, 1, 49, 32])
        written = json.loads(out.read_text())
        for key in ("requests", "completed", "prompt_tokens", "hit_tokens", "recomputed_tokens", "problems"):
            assert written[key] == s[key], key
