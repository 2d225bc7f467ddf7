"""What a client or an operator gets, found unpinned by session 60's mutation check (second part) of
scheduler/api_beam_search.py, api_admin.py, choices.py, replay_args.py and replay_memory.py: a beam choice without
a beam, a search's time to first token, its choices' request ids, a reset refused once a shutdown began while its
body was read, the replay's memory flags and their checks, and how a response's choices end, count and fail. No
server: a beam choice over a fake search, the reset's handler over a fake server state, `Choices` over fake choices."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from hicache.radix import Tier
from scheduler.api_models import APIError
from scheduler.beam_search import Beam, BeamSearchResult
from scheduler.request_ids import RequestIds

PROMPT = [1, 2, 3]


# -- api_beam_search ------------------------------------------------------------------------------------
class _Observed:
    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)


def _state() -> SimpleNamespace:
    """What a BeamChoice reads of the server's state: its and the engine's limits, EOS ids, the metrics' TTFT."""
    engine = SimpleNamespace(max_prompt_tokens=64, model_config=SimpleNamespace(eos_token_ids=[0]))
    metrics = SimpleNamespace(ttft=_Observed(), prompt_choice=lambda *a: None)
    return SimpleNamespace(engine=engine, tokenizer=None, metrics=metrics, prompt_limit=64)


def _searches(n: int):
    from scheduler.api_beam_search import BeamSearches
    from scheduler.api_inputs import parse_prompts
    api_req, _, params = parse_prompts({"prompt": PROMPT, "use_beam_search": True, "n": n, "max_tokens": 4}, False,
                                       tokenizer=None, served_names=set(), model_name="tiny", vocab_size=512,
                                       prompt_limit=64, max_tokens_limit=32)
    return BeamSearches.of(_state(), api_req, params, False, 0.0)


def _steps(choice, beams: list[Beam]) -> list:
    """(token event, finishing event) pairs of `choice` read over a search that found `beams`."""
    async def result():
        return BeamSearchResult(beams=beams, hit_tokens={})
    choice.search = SimpleNamespace(result=result)

    async def read():
        return [pair async for pair in choice.steps()]
    return asyncio.run(read())


def test_a_choice_the_search_found_no_beam_for_ends_length_with_no_tokens():
    """Fewer beams than n (end tokens crowded the rest out): the choice without one is empty and ends "length"
    (not "stop": no stop token or string ended it), and counts no time to first token; one with a beam gets its
    tokens, its beam's finish reason and one TTFT observation."""
    searches = _searches(n=2)
    first, second = searches.choices(PROMPT, RequestIds("r", "cmpl-r", "r"), index=0, batch_size=1)
    st = searches.st
    beam = Beam(tokens=PROMPT + [7, 8], cum_logprob=-1.0, prompt_tokens=len(PROMPT), end_token=0)  # (EOS-ended)
    steps = _steps(first, [beam])
    assert [ev.token_id for ev, _ in steps] == [7, 8] and steps[-1][1].finish_reason == "stop"
    assert len(st.metrics.ttft.values) == 1  # (the whole search's, observed once per choice with tokens)
    (ev, fin), = _steps(second, [beam])
    assert ev is None and fin.finished and fin.finish_reason == "length" and second.req.output == []
    assert len(st.metrics.ttft.values) == 1


def test_a_beam_search_s_time_to_first_token_is_observed():
    """A beam choice's time to first token (the whole search's: its tokens come at once) is in the TTFT
    histogram, as any choice's is."""
    searches = _searches(n=1)
    choice, = searches.choices(PROMPT, RequestIds("r", "cmpl-r", "r"), index=0, batch_size=1)
    choice.arrival = 0.0  # (perf_counter's origin: the observation is positive)
    _steps(choice, [Beam(tokens=PROMPT + [9], cum_logprob=-0.5, prompt_tokens=len(PROMPT))])
    assert len(searches.st.metrics.ttft.values) == 1 and searches.st.metrics.ttft.values[0] > 0


def test_a_batch_s_beam_choices_and_searches_have_distinct_request_ids():
    """A batch of 2 prompts with n=2: each choice has its own request id, choice j of prompt p the engine id
    p * n + j (a non-beam choice's), and each prompt's search its own (its steps are named after it)."""
    searches = _searches(n=2)
    rids = RequestIds("r", "cmpl-r", "r")
    gens = [g for p in range(2) for g in searches.choices(PROMPT, rids, index=p, batch_size=2)]
    assert [g.req.rid for g in gens] == [rids.engine_rid(k, 4) for k in range(4)] == ["r-0", "r-1", "r-2", "r-3"]
    assert [(g.index, g.choice) for g in gens] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    search_rids = {g.search._run.args[3] for g in gens}  # (beam_search(engine, prompt, params, rid))
    assert search_rids == {"r-0", "r-1"}


# -- api_admin ------------------------------------------------------------------------------------------
class _FakeCache:
    def __init__(self) -> None:
        self.calls = []
        self.tree = SimpleNamespace(allocators={Tier.L1: object(), Tier.L2: object()}, num_resident_pages=[0, 0, 0])

    async def flush_async(self, tier, write_back, through_l3):
        self.calls.append(tier)
        return 0


def test_a_reset_whose_body_was_read_as_a_shutdown_began_is_refused_and_flushes_nothing():
    """POST /reset_prefix_cache: the server began shutting down while its body was read (an await): the reset is
    the 503 any request then gets and no tier is flushed; the same request before the shutdown resets."""
    from scheduler.api_admin import PrefixCacheReset
    from scheduler.server import _ServerState

    cache = _FakeCache()
    engine = SimpleNamespace(cache=cache, accepting=True, loop_stopped=False)
    st = SimpleNamespace(engine=engine, engine_error=None, draining=False,
                         limits=SimpleNamespace(max_body_bytes=1 << 20),
                         metrics=SimpleNamespace(registry=CollectorRegistry()))
    st.check_admitting = lambda: _ServerState.check_admitting(st)
    reset = PrefixCacheReset(st)

    def request(drains: bool):
        async def stream():
            st.draining = st.draining or drains  # (the shutdown begins while the body is read)
            yield b""
        return SimpleNamespace(headers={}, stream=stream, query_params=SimpleNamespace(multi_items=lambda: []))

    assert asyncio.run(reset(request(drains=False)))["pages_freed"] == {"l1": 0, "l2": 0}
    assert cache.calls == [Tier.L1, Tier.L2]
    cache.calls.clear()
    with pytest.raises(APIError) as exc:
        asyncio.run(reset(request(drains=True)))
    assert exc.value.status == 503 and "shutting down" in str(exc.value) and cache.calls == []


# -- replay_args ----------------------------------------------------------------------------------------
def _replay_config(*argv: str):
    """The replay's args and EngineConfig of `argv`, as its command line makes them (replay.run_cli)."""
    from scheduler.replay_args import build_parser, check_replay_args, config_from_replay_args, fill_defaults
    parser = build_parser()
    args = parser.parse_args(list(argv))
    fill_defaults(args)
    check_replay_args(parser, args)
    return args, config_from_replay_args(args)


def test_the_writable_check_leaves_no_file_it_made_and_keeps_one_it_found(tmp_path):
    """--json-out / --log-json checked before the replay: the directory is made, but no empty file is left (a
    replay refused after the check left an empty summary file); a file already there keeps its bytes."""
    import argparse
    from scheduler.replay_args import check_writable
    path = tmp_path / "sub" / "out.json"
    check_writable(argparse.ArgumentParser(), str(path), "json_out")
    assert path.parent.is_dir() and not path.exists()
    path.write_text("kept")
    check_writable(argparse.ArgumentParser(), str(path), "json_out")
    assert path.read_text() == "kept"


def test_a_simulated_replay_sizes_its_kv_in_bf16_unless_a_dtype_is_given():
    """--simulate prices a GPU deployment: its KV dtype left at auto is bfloat16 (the CPU's auto would be float32,
    halving every tier's pages of a GiB size); --dtype given wins; without --simulate auto stays auto."""
    assert _replay_config("--simulate")[1].dtype == "bfloat16"
    assert _replay_config("--simulate", "--dtype", "float32")[1].dtype == "float32"
    assert _replay_config()[1].dtype == "auto"


def test_l3_tokens_or_gib_0_is_no_l3_not_a_size_of_no_page():
    """--l3-tokens 0 and --l3-gib 0 are documented as "no L3": accepted, the L3 size 0 (not refused as a size
    that holds no page, which a positive size too small is)."""
    from scheduler.replay_memory import pool_pages
    for flag in ("--l3-tokens", "--l3-gib"):
        _, cfg = _replay_config(flag, "0")
        assert cfg.hicache.storage_size_gb == 0 and pool_pages(cfg)["L3"] == 0
    with pytest.raises(ValueError, match="--l3-gib 1e-09 holds no page"):
        _replay_config("--l3-gib", "1e-9")


def test_max_total_tokens_sizes_l1_over_the_sample_s_default():
    """The sample's L1 of 4,096 tokens gives way to an explicit --max-total-tokens (as to --num-pages): L1 is the
    tokens asked, in the replay's 16-token pages."""
    from scheduler.replay_memory import pool_pages
    args, cfg = _replay_config("--max-total-tokens", "8192")
    assert args.l1_tokens is None and pool_pages(cfg)["L1"] == 8192 // 16
    assert pool_pages(_replay_config()[1])["L1"] == 4096 // 16


def test_a_capacity_of_more_pages_than_a_tier_can_have_is_refused_naming_its_flag():
    """One page past MAX_TIER_PAGES (and a GiB size past float's range, counted as that) is refused naming the
    replay's flag given, not later naming an engine flag the user never gave; MAX_TIER_PAGES itself is a size."""
    from hicache.config import MAX_TIER_PAGES
    with pytest.raises(ValueError, match=r"--l1-tokens .*more than the 2,147,483,647 pages"):
        _replay_config("--l1-tokens", str((MAX_TIER_PAGES + 1) * 16))
    with pytest.raises(ValueError, match=r"--l3-gib 1e\+300: more than"):
        _replay_config("--l3-gib", "1e300")
    assert _replay_config("--l1-tokens", str(MAX_TIER_PAGES * 16))[1].num_pages == MAX_TIER_PAGES


# -- replay_memory --------------------------------------------------------------------------------------
def test_an_l2_of_one_page_still_has_its_l3_counted():
    """pool_pages (the simulated pools' memory check, the out-of-memory line): an L2 of a single page is an L2, its
    L3 sized and counted after it."""
    from scheduler.replay_memory import pool_pages
    _, cfg = _replay_config("--l2-tokens", "16", "--l3-tokens", "64")
    assert pool_pages(cfg) == {"L1": 4096 // 16, "L2": 1, "L3": 4}


def test_a_replay_without_hicache_counts_no_l2_or_l3_pages():
    """--disable-hicache: pool_pages counts L1 alone (the L2 / L3 sizes the engine would not build are not in the
    simulated pools' memory check, nor in its line)."""
    from scheduler.replay_memory import pool_pages
    assert pool_pages(_replay_config("--disable-hicache")[1]) == {"L1": 4096 // 16, "L2": 0, "L3": 0}


def test_the_out_of_memory_line_is_one_line():
    """A MemoryError of several lines building the pools is told in one line (its first)."""
    from scheduler.replay_memory import out_of_memory
    args, cfg = _replay_config("--simulate")
    line = out_of_memory(args, cfg, MemoryError("cannot allocate 8 GiB\ntraceback-ish detail"))
    assert "\n" not in line and "(cannot allocate 8 GiB)" in line and line.startswith("--l3-tokens 65536: ")


def test_a_simulated_pool_of_exactly_the_memory_it_may_have_is_not_refused(monkeypatch):
    """The simulated pools' check refuses only bookkeeping of more bytes than the process may have: exactly as
    many fit."""
    from hicache import simulated
    from scheduler.replay_memory import check_simulated_memory, pool_pages
    args, cfg = _replay_config("--simulate")
    need = simulated.simulated_pool_bytes(list(pool_pages(cfg).values()))
    monkeypatch.setattr(simulated, "memory_limit_bytes", lambda: need)
    check_simulated_memory(args, cfg)
    monkeypatch.setattr(simulated, "memory_limit_bytes", lambda: need - 1)
    with pytest.raises(ValueError, match="--l3-tokens 65536: a simulated pool of"):
        check_simulated_memory(args, cfg)


# -- choices --------------------------------------------------------------------------------------------
class _Gen:
    """What Choices reads of a Generation: its request's prompt, its events (text, ids, end, logprobs entries),
    its usage, close and fail."""

    def __init__(self, prompt: list[int], items: list[tuple]) -> None:
        self.req = SimpleNamespace(prompt=prompt, prompt_logprobs=None, params=SimpleNamespace(guided=None))
        self.st = SimpleNamespace(tokenizer=None, engine=SimpleNamespace(vocab_size=512),
                                  limits=SimpleNamespace(reasoning_parser=None))
        self.items, self.logprobs, self.stop_reason, self.closed = items, None, None, False

    async def events(self):
        for item in self.items:
            yield item

    def usage(self):
        from scheduler.api_models import Usage
        return Usage.of(len(self.req.prompt), sum(len(ids) for _, ids, _, _ in self.items), {})

    async def close(self, outcome: str = "aborted") -> None:
        self.closed = True

    def fail(self, fin) -> APIError:
        return APIError(503 if fin.finish_reason == "abort" else 500, f"failed: {fin.finish_reason}")


def _choices(gens: list[_Gen], **fields):
    from scheduler.api_inputs import parse_prompts
    from scheduler.choices import Choices
    prompts = [g.req.prompt for g in gens]
    for k, g in enumerate(gens):
        g.index = k // fields.get("n", 1)  # (prompt index: choice k is p * n + j)
    api_req, _, _ = parse_prompts({"prompt": prompts[::fields.get("n", 1)], **fields}, False, tokenizer=None,
                                  served_names=set(), model_name="tiny", vocab_size=512, prompt_limit=64,
                                  max_tokens_limit=32)
    return Choices(gens, False, "cmpl-r", api_req, "tiny")


def _end(reason: str):
    from scheduler.request import TokenEvent
    return TokenEvent("r", None, 1, finished=True, finish_reason=reason)


class _Connected:
    async def receive(self):
        await asyncio.Event().wait()


def test_a_choice_aborted_fails_the_response_with_a_503_and_ends_every_choice():
    """A choice that ends "abort" (the server shut down) fails the whole response (its 503), not a 200 with
    finish_reason "abort"; every choice is closed (aborted) after it."""
    gens = [_Gen([1, 2], [("a", [5], None, []), ("", [], _end("abort"), [])]),
            _Gen([1, 2], [("b", [6], _end("length"), [])])]
    with pytest.raises(APIError) as exc:
        asyncio.run(_choices(gens, n=2, max_tokens=2).body(_Connected()))
    assert exc.value.status == 503 and all(g.closed for g in gens)


def test_a_batch_s_choices_each_carry_their_own_prompt_s_prompt_logprobs(monkeypatch):
    """prompt_logprobs with a batch of 2 prompts and n=2: choices 0, 1 carry prompt 0's, choices 2, 3 prompt 1's
    (choice index p * n + j)."""
    from scheduler import prompt_logprobs_api
    monkeypatch.setattr(prompt_logprobs_api, "render", lambda ids, lps, k, tokenizer: ["of", ids[0]])
    gens = [_Gen(p, [("x", [9], _end("length"), [])]) for p in ([1, 2], [1, 2], [3, 4], [3, 4])]
    body = asyncio.run(_choices(gens, n=2, max_tokens=1, prompt_logprobs=0).body(_Connected()))
    assert [c["prompt_logprobs"] for c in body["choices"]] == [["of", 1], ["of", 1], ["of", 3], ["of", 3]]


def test_a_completion_stream_sends_prompt_token_ids_in_each_choice_s_first_chunk_only():
    """return_token_ids in a completion stream: each choice's first chunk carries its prompt's ids, later chunks
    none."""
    gens = [_Gen([1, 2], [("a", [5], None, []), ("b", [6], _end("length"), [])]),
            _Gen([3, 4], [("c", [7], None, []), ("d", [8], _end("length"), [])])]

    async def read():
        return [chunk async for chunk in _choices(gens, max_tokens=2, stream=True, return_token_ids=True).sse()]
    import json
    chunks = [json.loads(c[6:]) for c in asyncio.run(read()) if c != "data: [DONE]\n\n"]
    got = [(c["choices"][0]["index"], c["choices"][0].get("prompt_token_ids")) for c in chunks]
    assert sorted(got, key=lambda x: x[0]) == [(0, [1, 2]), (0, None), (1, [3, 4]), (1, None)]


def test_a_choice_whose_events_raise_fails_the_merge_not_ends_it_early():
    """merge (a request's several choices read together): one choice's stream raising (a bug) is raised to the
    reader (a 500 / a broken stream), not taken for that choice's end (a response silently cut short)."""
    from scheduler.choices import merge

    async def broken():
        yield "a"
        raise RuntimeError("a bug in a choice's events")

    async def fine():
        yield "b"

    async def read():
        return [item async for item in merge([broken(), fine()])]
    with pytest.raises(RuntimeError, match="a bug"):
        asyncio.run(read())


def test_an_answer_the_split_saw_no_thought_in_counts_no_reasoning_tokens():
    """--reasoning-parser: a choice whose text the split found no thought in (its think markers were special
    tokens left out of the text) counts 0 reasoning tokens, whatever its ids' counter made of them; one that
    reasoned counts the counter's total."""
    from scheduler.chat_answer import ChatAnswer
    from scheduler.reasoning import ReasoningSplitter
    choices = _choices([_Gen([1, 2], [])], max_tokens=1)
    counter = SimpleNamespace(total=lambda: 3)
    plain = ChatAnswer(ReasoningSplitter(), "none")
    plain.whole("hello")
    choices._ended(0, plain, counter)
    assert choices._reasoning_tokens == [0]
    thought = ChatAnswer(ReasoningSplitter(), "none")
    thought.whole("<think>hm</think>hello")
    choices._ended(0, thought, counter)
    assert choices._reasoning_tokens == [3]
