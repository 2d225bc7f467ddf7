"""The numbers and defaults the docs state that tests/test_docs_truth.py does not read: the README's "Server only"
flags' defaults and choices (against scheduler/serve.py's parser), and the limits, thresholds and constants
README.md, docs/design.md and docs/reliability.md quote (each read out of the text by a pattern and compared with
the code's constant). A doc edited away from a pattern fails loudly (the claim is no longer found). No engine runs
but a tiny CPU one for the README's "2 on the CPU's default server"."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def doc(name: str) -> str:
    """The doc's prose with its line breaks and runs of spaces folded to one space (claims wrap lines)."""
    return " ".join((REPO / name).read_text().split())


def stated(name: str, pattern: str) -> list[str]:
    m = re.search(pattern, doc(name))
    assert m, f"{name} no longer states {pattern!r}"
    return [g.replace(",", "") for g in m.groups()]


# -- the README's "Server only" flags ------------------------------------------------------------
def test_server_only_flags_defaults_and_choices():
    from scheduler.serve import build_parser
    actions = {s: a for a in build_parser()._actions for s in a.option_strings}
    text = doc("README.md").split("Server only:", 1)[1].split("## What it measures", 1)[0]
    checked = 0
    for m in re.finditer(r"`(--[a-z][a-z0-9-]*)((?: [^`]*)?)` \(", text):
        flag, metavar = m.group(1), m.group(2).strip()
        action = actions[flag]
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        description = text[m.end():i - 1]
        choices = re.fullmatch(r"\{([^}]*)\}", metavar)
        if choices and action.choices is not None:
            assert sorted(choices.group(1).split(",")) == sorted(action.choices), flag
        if choices and action.choices is None:  # free-form besides named values (--generation-config DIR)
            assert {c for c in choices.group(1).split(",") if c.isupper()}, flag
        default = re.search(r"(?:^|[;,] )default (\w+)(?=[;,)]|$)", description)
        if default:
            want = default.group(1)
            assert str(action.default) == want or (want.isdigit() and action.default == int(want)), \
                f"{flag}: README says default {want}, the parser's is {action.default!r}"
            checked += 1
    assert checked >= 3  # --responses-store-max, --responses-store-max-mib, --generation-config


def test_server_limits_dataclass_matches_the_parser_defaults():
    """The in-process ServerLimits and hicache-serve agree on what the README states as defaults."""
    from scheduler.serve import build_parser
    from scheduler.server import ServerLimits
    args = build_parser().parse_args([])
    limits = ServerLimits()
    for name in ("max_concurrent_requests", "max_body_bytes", "shutdown_grace_s", "responses_store_max",
                 "responses_store_max_mib"):
        assert getattr(args, name) == getattr(limits, name), name


# -- request limits the README states ------------------------------------------------------------
def test_request_limits_the_readme_states():
    from scheduler.api_models import N_MAX
    from scheduler.beam_search import MAX_BEAM_WIDTH
    from scheduler.openai_fields import METADATA_KEY_CHARS, METADATA_PAIRS, METADATA_VALUE_CHARS
    from scheduler.request import MAX_LOGPROBS, MIN_TEMPERATURE
    from scheduler.request_ids import MAX_CHARS
    from scheduler.stop_strings import MAX_STOP_STRINGS
    readme = "README.md"
    assert int(stated(readme, r"`n` choices \(1\.\.(\d+),")[0]) == N_MAX
    assert int(stated(readme, r"`n` the beam width, 1\.\.(\d+),")[0]) == MAX_BEAM_WIDTH
    assert int(stated(readme, r"`stop` as token ids or as up to (\d+) strings")[0]) == MAX_STOP_STRINGS
    lp, top = stated(readme, r"a completion's `logprobs` \(0\.\.(\d+)\), a chat's `logprobs` with `top_logprobs` "
                             r"\(0\.\.(\d+)\)")
    assert int(lp) == int(top) == MAX_LOGPROBS
    assert int(stated(readme, r"`top_logprobs` \(0\.\.(\d+)\) puts the chat's token logprobs")[0]) == MAX_LOGPROBS
    pairs, key, value = stated(readme, r"at most (\d+) pairs, keys up to (\d+) and values up to (\d+) characters")
    assert (int(pairs), int(key), int(value)) == (METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS)
    assert int(stated(readme, r"`request_id` \(completions, chat, responses; 1 to (\d+) printable ASCII")[0]) \
        == MAX_CHARS
    assert float(stated(readme, r"below (0\.\d+) samples at (0\.\d+), as vLLM's")[0]) == MIN_TEMPERATURE


def test_speculative_limits_the_readme_states():
    from scheduler.cuda_graphs import TAIL_SIZES
    from scheduler.speculative import TAIL_ROWS, SpeculativeConfig
    lo, hi = stated("README.md", r"drafts taken from its own tokens, (\d+) to (\d+), after the longest suffix")
    assert (int(lo), int(hi)) == (1, TAIL_ROWS - 1)
    SpeculativeConfig(num_speculative_tokens=TAIL_ROWS - 1)
    with pytest.raises(ValueError):
        SpeculativeConfig(num_speculative_tokens=TAIL_ROWS)
    both = int(stated("README.md", r"tokens \(both (\d+) when neither is given\)")[0])
    config = SpeculativeConfig(num_speculative_tokens=3)
    assert config.prompt_lookup_min == config.prompt_lookup_max == both
    least, most, cpu = stated("README.md", r"verify graph takes \((\d+) to (\d+), as the tail graphs; "
                                           r"(\d+) on the CPU\)")
    assert int(least) == 4 and int(most) == TAIL_SIZES[-1] == int(cpu)


# -- scheduling: lpm, the auto reserve ratio, shared prefill --------------------------------------
def test_scheduling_numbers_the_docs_state():
    from scheduler.admission import LPM_MAX_WAITING, PREFILL_SHARE_MIN_TOKENS
    from scheduler.reservations import AutoReserveRatio as A
    assert int(stated("README.md", r"a queue of more than (\d+) in arrival order")[0]) == LPM_MAX_WAITING
    assert int(stated("docs/design.md", r"a queue longer than (\d+) goes in arrival order")[0]) == LPM_MAX_WAITING
    start, low, steps, margin = stated("README.md", r"SGLang's adaptive share, ([\d.]+) falling to ([\d.]+) over "
                                                    r"(\d+) decode steps .*?\((\d+) tokens more each\)")
    assert (float(start), float(low), int(steps), int(margin)) == (A.START, A.MIN, A.DECAY_STEPS, A.MARGIN_STEPS)
    step, floor, more = stated("docs/design.md", r"falling by ([\d.]+) per decode step to ([\d.]+) .*?"
                                                 r"the requests still in decode have used, (\d+) tokens more each")
    assert float(step) == pytest.approx((A.START - A.MIN) / A.DECAY_STEPS) and float(floor) == A.MIN
    assert int(more) == A.MARGIN_STEPS
    assert int(stated("docs/design.md", r"`PREFILL_SHARE_MIN_TOKENS` \((\d+),")[0]) == PREFILL_SHARE_MIN_TOKENS


def test_full_reservation_runs_two_default_chats_on_the_cpu_server():
    """README: with --decode-reserve-ratio 1 "as many such chats run at once as L1 holds, 2 on the CPU's default
    server" (a chat without max_tokens reserves the rest of its context: prompt + max_tokens - 1 tokens)."""
    from scheduler.config import config_from_args
    from scheduler.engine import Engine
    from scheduler.serve import build_parser
    claim = r"as many such chats run at once as L1 holds, (\d+) on the CPU's default server"
    assert int(stated("README.md", claim)[0]) == 2
    args = build_parser().parse_args(["--device", "cpu", "--decode-reserve-ratio", "1"])
    engine = Engine(config_from_args(args))
    limit = args.max_tokens_limit
    prompt = 20
    max_tokens = min(limit, engine.max_kv_tokens + 1 - prompt)  # (api_inputs: a chat's default)
    pages = -(-(prompt + max_tokens - 1) // engine.page_size)
    assert engine.usable_l1_pages // pages == 2


# -- hicache thresholds design.md and reliability.md quote ----------------------------------------
def test_hicache_thresholds_the_design_notes_state():
    from hicache import linear_cost, transfer_plan
    from hicache.config import HiCacheConfig
    from hicache.cost_model import EXPLORE_WRITES
    from hicache.layer_copy import MIN_DMA_ROW_BYTES
    from hicache.outcomes import OUTCOME_WINDOW
    from hicache.redis_limits import LIMITS_RECHECK_S
    from hicache.restores import HOLD_CHECKS_MAX_BYTES, HOLD_CHECKS_MAX_S, VERIFY_AFTER_LANDING_MAX_BYTES
    from hicache.reuse import TierReuse
    from hicache.storage import VERIFY_CHUNK_BYTES
    design, MiB = "docs/design.md", 1 << 20
    timeout_s, times = stated(design, r"\(`io_timeout_s`, default (\d+) s, or (\d+)× its")
    assert (float(timeout_s), int(times)) == (HiCacheConfig().io_timeout_s, 4)
    assert int(stated(design, r"Not beyond (\d+) MiB")[0]) * MiB == VERIFY_AFTER_LANDING_MAX_BYTES
    assert int(stated(design, r"A taken-on read of at most (\d+) MiB")[0]) * MiB == HOLD_CHECKS_MAX_BYTES
    assert float(stated(design, r"The op driver starts them (\d+) ms after the landing")[0]) / 1000 == HOLD_CHECKS_MAX_S
    assert int(stated(design, r"`MIN_DMA_ROW_BYTES` \((\d+) KiB\)")[0]) << 10 == MIN_DMA_ROW_BYTES
    assert int(stated(design, r'"fragmented" is more than (\d+) runs')[0]) == transfer_plan.MAX_DMA_RUNS
    assert int(stated(design, r"an (\d+) MiB first chunk")[0]) * MiB == transfer_plan.RAMP_FIRST_BYTES
    assert int(stated(design, r"`direct_pages` pages \((\d+) MiB")[0]) * MiB == transfer_plan.DIRECT_FIRST_BYTES
    assert int(stated(design, r"reads its extents in ~(\d+) MiB pieces")[0]) * MiB == VERIFY_CHUNK_BYTES
    assert int(stated(design, r"The median of the last (\d+) per source")[0]) == OUTCOME_WINDOW
    assert int(stated(design, r"tier's first (\d+) asks while its reads are untimed")[0]) == EXPLORE_WRITES
    assert float(stated(design, r"at most every (\d+) s \(`redis_limits\.Refusals`")[0]) == LIMITS_RECHECK_S
    held, factor, within = stated(design, r"Once (\w+) samples were learned, a sample more than (\d+) x slower than "
                                          r"predicted .*? within the next (\d+) samples")
    assert ({"four": 4}.get(held, held), int(factor), int(within)) == (
        linear_cost.HOLD_AFTER_SAMPLES, linear_cost.OUTLIER_FACTOR, linear_cost.CONFIRM_WITHIN)
    assert stated(design, r"sizes span a (\w+) of the largest")[0] == "third"
    assert linear_cost.MIN_SPREAD_FRACTION == 1 / 3
    evicted, every = stated(design, r"after (\d+) evicted pages with too little read back, the cost policy writes only "
                                    r"every (\d+)th backup")
    tracker = TierReuse()
    assert (int(evicted), int(every)) == (tracker.min_evicted_pages, tracker.probe_every)


def test_reliability_numbers():
    import inspect

    from hicache.storage import FileStore
    lo, hi = stated("docs/reliability.md", r"L3 writes are refused for (\d+) s doubling to (\d+) s")
    assert (float(lo), float(hi)) == inspect.signature(FileStore).parameters["enospc_backoff_s"].default
    assert stated("docs/reliability.md", r"max\(`io_timeout_s`, (\d+) × the predicted read\)")[0] == "4"
    source = (REPO / "hicache/operations.py").read_text()
    assert "min(4 * timeout_s, max(timeout_s, 4 * self.mgr.cost.directions[direction].predict(num_bytes)))" in source


def test_small_forward_shapes_the_design_notes_state():
    from kernels import decode_attention, rejection_sampling, skinny_gemm
    from scheduler.cuda_graphs import DECODE_SIZES, PREFILL_BUCKETS, TAIL_SIZES
    design = "docs/design.md"
    listed = stated(design, r"B in ([\d, ]+), up to the first that holds `--max-running-requests`")[0]
    assert tuple(int(b) for b in listed.split()) == DECODE_SIZES
    listed = stated(design, r"B in ([\d, ]+) up to the first that holds max\(4,")[0]
    assert tuple(int(b) for b in listed.split()) == TAIL_SIZES
    lo, hi, bucket = stated(design, r"of (\d+)–(\d+) tokens replays a graph padded to a (\d+)-token bucket")
    assert (int(hi), int(bucket)) == (PREFILL_BUCKETS[-1], PREFILL_BUCKETS[0]) and int(lo) == 17
    assert int(stated(design, r"forwards of at most (\d+) rows on CUDA since session 50")[0]) == skinny_gemm.MAX_ROWS
    eight, four = stated(design, r"With more than (\d+) \(sequence, KV head\) pairs the keys are split 8 ways, with "
                                 r"more than (\d+) 4 ways")
    splits = decode_attention.default_splits
    assert splits(int(eight), 1) == decode_attention.NUM_SPLITS and splits(int(eight) + 1, 1) == 8
    assert splits(int(four), 1) == 8 and splits(int(four) + 1, 1) == 4
    assert int(stated(design, r"cut into chunks of ([\d,]+) tokens, a program each")[0]) == rejection_sampling.CHUNK
    assert int(stated(design, r"torch\.topk above k = (\d+)")[0]) == rejection_sampling.K_LIMIT


def test_engine_rids_are_as_the_readme_spells_them():
    """README: a request_id names its engine requests' rids in the structured log (regression: the README said
    "the id, 8 random hex digits, a choice's index", leaving out the cmpl- / chatcmpl- prefix a log search needs)."""
    from types import SimpleNamespace

    from scheduler.request_ids import resolve_ids
    stated("README.md", r"rids in the structured log \(`cmpl-\{id\}-` or `chatcmpl-\{id\}-`, a Response's too, then 8 "
                        r"random hex digits and, where there are several, `-` and a choice's index")
    request = SimpleNamespace(headers={}, state=SimpleNamespace())
    for chat, prefix in ((False, "cmpl"), (True, "chatcmpl")):
        ids = resolve_ids(request, "abc", chat)
        assert re.fullmatch(rf"{prefix}-abc-[0-9a-f]{{8}}", ids.engine_rid(0, 1))
        assert re.fullmatch(rf"{prefix}-abc-[0-9a-f]{{8}}-3", ids.engine_rid(3, 4))
