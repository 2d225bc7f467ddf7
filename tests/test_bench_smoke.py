"""Smoke tests of the benchmark scripts on the CPU (tiny model, tiny sizes): they run end to end,
their JSON carries the documented keys, every output equals recompute and the integrity check passes.
The scripts' main(argv) is called in-process (no second interpreter start-up)."""
import json

import pytest

from script_helpers import CPU, load


@pytest.fixture(scope="module")
def latency():
    return load("bench_hicache")


@pytest.fixture(scope="module")
def stress():
    return load("bench_hicache_stress")


LATENCY_KEYS = {"outputs_match", "integrity", "latency_ms", "hit_tokens", "floor_ms", "ratio_to_floor", "gib_s",
                "tier", "policy", "model", "prefix_tokens", "restore_ms", "l3_extents", "limits", "decisions"}


def check_latency(r: dict, tier: str, iterations: int) -> None:
    assert LATENCY_KEYS <= set(r), LATENCY_KEYS - set(r)
    assert r["outputs_match"] is True, r["notes"]
    assert r["integrity"] == "passed"
    assert r["tier"] == tier and r["model"] == "tiny"
    assert {"p50", "mean"} <= set(r["latency_ms"]) and r["latency_ms"]["p50"] > 0
    assert set(r["hit_tokens"]) == {"l1", "l2", "l3"}
    assert set(r["gib_s"]) == {"d2h", "h2d", "h2s", "s2h"}
    assert {"h2d_gib_s", "d2h_gib_s", "file_read_gib_s", "tail_forward_ms"} <= set(r["limits"])
    assert r["limits"]["tail_forward_ms"] > 0
    assert {"sources", "policy_skips"} <= set(r["decisions"])
    if tier != "none":  # --policy always: every measured request restored from the forced tier
        assert r["decisions"]["sources"][tier] == iterations
        assert r["floor_ms"] > 0 and r["ratio_to_floor"] > 0
        assert r["restore_ms"] > 0 and r["gib_s"]["h2d"] > 0
    else:
        assert r["floor_ms"] is None and r["decisions"]["sources"]["recompute"] == iterations


def test_latency_l2_sweep_with_recompute(latency, tmp_path):
    out = tmp_path / "l2.json"
    rc = latency.main(CPU + ["--tier", "l2", "--policy", "always", "--prefix-tokens", "33,64", "--iterations", "4",
                             "--warmup-alternations", "1", "--compare-recompute", "--out", str(out),
                             "--storage-path", str(tmp_path / "l3.kv")])
    assert rc == 0
    results = json.loads(out.read_text())
    assert [r["prefix_tokens"] for r in results] == [33, 64]
    for r in results:
        check_latency(r, "l2", 4)
        assert r["hit_tokens"]["l2"] == 4 * r["reusable_tokens"]
        assert r["speedup_vs_recompute"] > 0 and r["recompute"]["outputs_match"] is True
        assert r["outputs_match_l1_hit"] is True and r["mismatches_vs_recompute"] == 0
    assert results[0]["tail_tokens"] == 33 - 32 + 1  # page size 4 on the CPU


def test_latency_l3_cold_json_stdout(latency, tmp_path, capsys):
    path = tmp_path / "l3.kv"
    rc = latency.main(CPU + ["--tier", "l3", "--policy", "always", "--prefix-tokens", "64", "--iterations", "4",
                             "--warmup-alternations", "1", "--storage-cache", "cold", "--storage-path", str(path),
                             "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)  # --json: stdout is pure JSON
    check_latency(r, "l3", 4)
    assert r["hit_tokens_by_source"]["l3"] == 4 * 64
    assert r["l3_extents"] >= 1 and r["limits"]["file_read_gib_s"] > 0 and r["gib_s"]["s2h"] > 0
    assert r["storage_cache"] == "cold"
    assert not path.exists()  # the benchmark's L3 file is removed


def test_latency_none(latency, tmp_path):
    out = tmp_path / "none.json"
    assert latency.main(CPU + ["--tier", "none", "--prefix-tokens", "40", "--iterations", "2",
                               "--warmup-alternations", "0", "--out", str(out), "--trace", str(tmp_path / "trace"),
                               "--storage-path", str(tmp_path / "l3.kv")]) == 0
    check_latency(json.loads(out.read_text()), "none", 2)
    trace = tmp_path / "trace" / "none_40.json.gz"  # --trace: two more requests under the profiler
    assert trace.stat().st_size > 0
    assert load("trace_copies").main([str(trace), "--json"]) == 1  # a CPU trace: read fine, no copies (said so)


STRESS_KEYS = {"tier", "req_s", "latency_ms", "hit_tokens", "recomputed_tokens", "bytes", "integrity",
               "outputs_match"}


def test_stress_tiers_and_decode(stress, tmp_path):
    out = tmp_path / "stress.json"
    rc = stress.main(CPU + ["--tiers", "none,l2,l2small,l3", "--policy", "always", "--num-prefixes", "4",
                            "--prefix-tokens", "48", "--requests", "16", "--warmup", "2",
                            "--decode-batch", "4", "--decode-tokens", "6", "--decode-repeats", "2", "--json",
                            "--out", str(out), "--storage-path", str(tmp_path / "l3.kv")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["outputs_match"] is True and res["integrity"] == "passed"
    assert res["baseline"] == "none"
    bound = res["bound"]  # 4 prefixes: their first uses recompute in every tier, the other 12 may hit
    assert (bound["cold_requests"], bound["hit_requests"]) == (4, 12)
    assert bound["hit_ms_for_2x"] is not None and bound["ceiling_vs_baseline"] is None  # no device floor on the CPU
    tiers = {r["tier"]: r for r in res["tiers"]}
    assert set(tiers) == {"none", "l2", "l2small", "l3"}
    assert all(r["differs_from_recompute"] == [] for r in tiers.values())  # float32: exact
    assert tiers["l2small"]["capacity_pages"]["l2"] == tiers["l3"]["capacity_pages"]["l2"]
    for r in tiers.values():
        assert STRESS_KEYS <= set(r), STRESS_KEYS - set(r)
        assert {"p50", "p95", "p99"} <= set(r["latency_ms"])
        assert r["completed"] == 16 and r["req_s"] > 0 and r["outputs_match"] is True
        assert set(r["bytes"]) == {"d2h", "h2d", "h2s", "s2h"}
    assert tiers["none"]["bytes"]["d2h"] == 0
    assert tiers["l2"]["hit_tokens"]["l2"] > 0 and tiers["l2"]["bytes"]["h2d"] > 0
    assert tiers["l3"]["tokens_read_from_l3"] > 0 and tiers["l3"]["bytes"]["h2s"] > 0
    d = res["decode"]
    assert d["outputs_match"] is True and d["ratio_on_off"] > 0
    assert d["hicache_on"]["decode_tok_s"] > 0 and d["hicache_off"]["decode_tok_s"] > 0
    assert d["hicache_on"]["bytes"]["d2h"] > 0 and d["hicache_off"]["bytes"]["d2h"] == 0


def test_stress_single_tier_checks_against_reference(stress, tmp_path):
    out = tmp_path / "one.json"
    rc = stress.main(CPU + ["--tier", "l2", "--num-prefixes", "3", "--prefix-tokens", "32", "--requests", "9",
                            "--warmup", "0", "--batch-size", "3", "--out", str(out),
                            "--storage-path", str(tmp_path / "l3.kv")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["baseline"] == "reference" and [r["tier"] for r in res["tiers"]] == ["l2"]
    assert res["outputs_match"] is True and res["integrity"] == "passed"


def test_stress_profile_and_trace(stress, tmp_path):
    """--profile stores the loop's host time per function; --trace writes a chrome trace per tier."""
    out = tmp_path / "p.json"
    rc = stress.main(CPU + ["--tiers", "none,l2", "--num-prefixes", "2", "--prefix-tokens", "32", "--requests", "4",
                            "--warmup", "0", "--profile", "--trace", str(tmp_path / "trace"), "--json",
                            "--out", str(out)])
    assert rc == 0
    l2 = {r["tier"]: r for r in json.loads(out.read_text())["tiers"]}["l2"]
    assert l2["host_profile"] and {"function", "calls", "own_ms", "cum_ms"} <= set(l2["host_profile"][0])
    assert any("Admission" in r["function"] or "admission.py" in r["function"] for r in l2["host_profile_stages"])
    assert (tmp_path / "trace" / "l2.json.gz").stat().st_size > 0


def test_profile_stages_times_each_stage_and_restores_the_engine(capsys):
    from scheduler.admission import Admission

    before = Admission.__dict__["prefill_batch"]
    mod = load("profile_stages")
    assert mod.main(CPU + ["--num-prefixes", "2", "--prefix-tokens", "32", "--requests", "4", "--warmup", "0"]) == 0
    printed = capsys.readouterr().out
    assert "Admission.prefill_batch" in printed and "ModelRunner.launch" in printed
    assert Admission.__dict__["prefill_batch"] is before  # the timers are gone again


def test_profile_stages_fine_times_module_functions_and_restores_them(capsys):
    """--fine also wraps plain functions looked up in a module (fill_staging, sample) and
    methods the stages call; --cprofile prints cProfile's table. Everything is put back."""
    import scheduler.runner as runner
    from hicache.manager import CacheManager

    before = runner.sample, CacheManager.__dict__["decide"]
    mod = load("profile_stages")
    args = CPU + ["--num-prefixes", "2", "--prefix-tokens", "32", "--requests", "4", "--warmup", "0"]
    assert mod.main(args + ["--fine", "--cprofile", "5"]) == 0
    printed = capsys.readouterr().out
    assert "runner.sample" in printed and "CacheManager.decide" in printed and "tottime" in printed
    assert (runner.sample, CacheManager.__dict__["decide"]) == before


def test_profile_stages_ab_variants_switch_the_kernels_and_put_the_defaults_back():
    """--ab NAME: each variant's set-up changes what the next engine captures (split-K, PDL); the
    last entry puts every default back; an unknown name is refused."""
    from kernels import pdl, skinny_gemm

    mod = load("profile_stages")
    split_k_for, on = skinny_gemm.split_k_for, pdl._enabled
    labels = {name: [label for label, _ in mod.ab_variants(name)] for name in ("split-k", "pdl")}
    assert labels == {"split-k": ["split", "whole", "defaults"], "pdl": ["pdl", "no pdl", "defaults"]}
    *variants, (_, reset) = mod.ab_variants("split-k")
    variants[1][1]()
    assert skinny_gemm.split_k_for(4096, 12288) == 1
    *variants, _ = mod.ab_variants("pdl")
    variants[1][1]()
    assert pdl._enabled is False
    reset()
    assert (skinny_gemm.split_k_for, pdl._enabled) == (split_k_for, on)
    with pytest.raises(SystemExit, match="--ab takes one of"):
        mod.ab_variants("nope")


def test_dense_gap_reports_the_two_tokens_logits(latency):
    """What the latency script records where a full prefill and an L1-hit tail pick different first
    tokens: both tokens' logits from a dense forward, their gap and the logits' spread."""
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine

    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=32))
    prompt = list(range(1, 30))
    gap = latency.dense_gap(eng, prompt, 5, 9)
    logits = eng.model.forward_dense(__import__("torch").tensor(prompt), last_only=True)[0]
    assert gap["gap"] == pytest.approx((logits[5] - logits[9]).item(), abs=1e-5)
    assert gap["logit_std"] > 0 and (gap["recompute"], gap["l1_hit"]) == (5, 9)


def test_bench_beam_search_computes_less_with_the_prefix_cache(capsys):
    """scripts/bench_beam_search.py: each configuration searched in an engine with the prefix cache and in one
    without; with it, the steps compute only the beams' last pages (fewer tokens than sent), without it every
    token sent; both engines' beams agree on the float32 tiny model and pass their integrity checks."""
    assert load("bench_beam_search").main([*CPU, "--prompt-tokens", "40", "--beam-widths", "1,3", "--max-tokens", "5",
                                           "--repeats", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["integrity"] == {"cache": "passed", "no_cache": "passed"}
    assert [(r["prompt_tokens"], r["beam_width"]) for r in out["rows"]] == [(40, 1), (40, 3)]
    for r in out["rows"]:
        assert r["sent_tokens"] == 40 * 5 + 10 + (r["beam_width"] - 1) * (4 * 40 + 10)
        assert r["no_cache_computed_tokens"] == r["sent_tokens"]
        assert r["cache_computed_tokens"] < r["sent_tokens"] / 2
        assert r["beams_equal"] == "2/2" and r["cache_s"] > 0 and r["greedy_s"] > 0


def test_bench_shared_prefill_computes_a_shared_prompt_once(capsys):
    """scripts/bench_shared_prefill.py: requests arriving together with one prompt compute it once with the shared
    prefill, each in full without it (the A/B switch is put back after)."""
    import scheduler.admission as admission
    share_min = admission.PREFILL_SHARE_MIN_TOKENS
    assert load("bench_shared_prefill").main([*CPU, "--prompt-tokens", "100", "--requests", "3", "--repeats", "1",
                                              "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert admission.PREFILL_SHARE_MIN_TOKENS == share_min and out["integrity"] == "passed"
    (row,) = out["rows"]
    assert row["apart_computed_tokens"] == 300 and row["shared_computed_tokens"] == 100 + 2 * 4
    assert row["shared_s"] > 0 and row["apart_s"] > 0


def test_bench_preemption_runs_more_requests_at_once_below_ratio_one(capsys):
    """scripts/bench_preemption.py: at ratio 1 L1 holds few whole reservations at once, below it more run and some are
    preempted; on the CPU every request streams the same tokens at each ratio."""
    assert load("bench_preemption").main([*CPU, "--requests", "12", "--prompt-tokens", "16", "--max-tokens", "200",
                                          "--mean-output-tokens", "60", "--l1-tokens", "512", "--ratios", "1,0",
                                          "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    whole, short = out["rows"]
    assert out["integrity"] == "passed" and whole["ratio"] == 1 and short["ratio"] == 0
    assert whole["preempted"] == 0 and whole["peak_running"] == 512 // 4 // 54  # (each reserves 54 pages of 4)
    assert short["peak_running"] > whole["peak_running"] and short["preempted"] > 0
    assert whole["same_outputs"] == short["same_outputs"] == 12 and short["output_tokens"] == whole["output_tokens"]


def test_bench_restart_serves_the_prompts_after_a_restart_from_the_kept_l3(capsys, tmp_path):
    """scripts/bench_restart.py: the engine started on the persisted L3 file adopts the prompts its predecessor
    computed, serves each from L3 with the same token, and its integrity passes (the file and index go)."""
    path = tmp_path / "l3.kv"
    assert load("bench_restart").main([*CPU, "--prefix-tokens", "40,100", "--storage-path", str(path),
                                       "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["integrity"] == "passed" and out["adopted_pages"] >= (40 + 100) // 4
    for r in out["rows"]:
        assert r["l3_tokens_at_start"] == r["prefix_tokens"] and r["same_output"] and not r["errors"]
        assert r["hit_tokens"]["l3"] >= r["prefix_tokens"] - 4
    assert not path.exists()


def test_bench_allocator_reports_both_layouts(capsys):
    assert load("bench_allocator").main(["--pages", "6", "--repeats", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pages"] == 6
    for layout in ("run", "scattered"):
        assert set(out["us_per_call"][layout]) == {"alloc", "give_to_tree", "free_from_tree"}
        assert all(v > 0 for v in out["us_per_call"][layout].values())


def test_file_read_limit_also_times_the_read_with_the_cpu_cache_flushed(tmp_path, monkeypatch):
    """A warm raw read back to back can come from the CPU's last-level cache: the limit also reports
    the read after flushing it (a buffer of twice its size written); a cold read does not need it."""
    common = load("bench_common")
    monkeypatch.setattr(common, "last_level_cache_bytes", lambda: 1 << 20)
    warm = common.file_read_limit(str(tmp_path), 1 << 20, 2, cold=False, pinned=False)
    assert warm["file_read_gib_s"] > 0 and warm["file_read_llc_cold_gib_s"] > 0
    cold = common.file_read_limit(str(tmp_path), 1 << 20, 2, cold=True, pinned=False)
    assert cold["file_read_llc_cold_gib_s"] is None
    assert not list(tmp_path.iterdir())  # the probe file is removed


def test_last_level_cache_bytes_reads_the_largest_listed_cache(tmp_path, monkeypatch):
    common = load("bench_common")
    for i, size in enumerate(["48K", "2048K", "300M"]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    monkeypatch.setattr(common.glob, "glob", lambda pattern: sorted(str(p / "size") for p in tmp_path.iterdir()))
    assert common.last_level_cache_bytes() == 300 << 20
    monkeypatch.setattr(common.glob, "glob", lambda pattern: [])
    assert common.last_level_cache_bytes() is None


def test_a_checkpoint_sized_tokenizer_is_trained_and_its_masks_timed(tmp_path, capsys):
    """scripts/make_bpe_tokenizer.py (here a 300-token vocabulary from two small files) and
    scripts/probe_guided_masks.py over it: each grammar's median step for each row count."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def weather(city, days):\n    return {'city': city, 'days': days}\n" * 20)
    (corpus / "b.py").write_text('"""Sunny in Paris, rain in Oslo."""\nunit = "celsius"\n' * 20)
    info = load("make_bpe_tokenizer").build(tmp_path / "tok", 300, corpus, 1 << 20)
    from scheduler.tokenizer import HFTokenizer
    tok = HFTokenizer(str(tmp_path / "tok"))
    text = "def f(city): return '<tool_call>' + city"
    assert tok.decode(tok.encode(text)) == text and info["vocab"] == tok.tok.get_vocab_size() <= 300 + 7
    assert tok.tok.token_to_id("<|im_end|>") is not None
    load("probe_guided_masks").main(["--tokenizer", str(tmp_path / "tok"), "--vocab-size", "320", "--rows", "1,2",
                                     "--steps", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert set(out["median_step_us"]) == {f"{g}_r{r}" for g in ("text", "json", "calls") for r in (1, 2)}
    assert all(us > 0 for us in out["median_step_us"].values())


def test_bench_speculative_times_both_steps_and_decodes_equal_tokens(capsys):
    """scripts/bench_speculative.py: a decode step and verify steps are timed, and greedy decode with speculation
    gives every request the tokens it gives without (the repeat workload's drafts accepted)."""
    assert load("bench_speculative").main([*CPU, "--batches", "1,2", "--drafts", "1,3", "--max-tokens", "16",
                                           "--prompt-tokens", "48", "--context", "48", "--block-tokens", "12",
                                           "--prompt-lookup-min", "1", "--prompt-lookup-max", "4", "--oracle-drafts",
                                           "--repeats", "1",
                                           "--draft-policy", "always", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["integrity"] == "passed"
    assert [s["batch"] for s in out["steps"]] == [1, 2]
    # float32 on the CPU: the plain run's tokens, as drafts, are all accepted
    oracle = [r for r in out["runs"] if r["workload"] == "oracle"]
    assert len(oracle) == 2 and all(0 < r["accepted_tokens"] == r["draft_tokens"] for r in oracle)
    assert 0 <= out["greedy_margins"]["tied_rows"] <= 1
    assert all(s["decode_ms"] > 0 and s["verify_1_ms"] > 0 and s["verify_3_ms"] > 0 for s in out["steps"])
    assert {(r["workload"], r["batch"]) for r in out["runs"]} == {(w, b) for w in ("random", "repeat", "again", "oracle")
                                                                  for b in (1, 2)}
    # served again: every draft from the prefix cache (the first answers), all accepted
    again = [r for r in out["runs"] if r["workload"] == "again"]
    assert all(0 < r["cache_accepted_tokens"] == r["accepted_tokens"] == r["draft_tokens"] for r in again)
    for r in out["runs"]:
        assert r["outputs_equal"] == f"{r['batch']}/{r['batch']}" and r["tok_s_on"] > 0 and r["tok_s_off"] > 0
    assert sum(r["draft_tokens"] for r in out["runs"]) > 0


def test_bench_speculative_sampled_steps_and_decode(capsys):
    """--temperature: the step-cost rows and the requests are sampled (drafts accepted by rejection sampling): the
    oracle's drafts (the plain run's sampled tokens) are drafted and only some accepted."""
    assert load("bench_speculative").main([*CPU, "--batches", "2", "--drafts", "3", "--max-tokens", "12",
                                           "--prompt-tokens", "48", "--context", "48", "--block-tokens", "12",
                                           "--prompt-lookup-min", "1", "--prompt-lookup-max", "4", "--oracle-drafts",
                                           "--repeats", "1",
                                           "--temperature", "0.8", "--top-p", "0.9", "--draft-policy", "always",
                                           "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["integrity"] == "passed" and (out["temperature"], out["top_p"]) == (0.8, 0.9)
    assert out["steps"][0]["verify_3_ms"] > 0
    [oracle] = [r for r in out["runs"] if r["workload"] == "oracle"]
    assert oracle["verify_steps"] > 0 and 0 <= oracle["accepted_tokens"] < oracle["draft_tokens"]


def test_the_hicache_benchmarks_pass_their_engine_overrides_to_with_hicache():
    """--kernel-restore-max-tokens, --disable-kernel-calibration, --disable-whole-first and --disable-outcomes
    reach the engine's hicache config; none given changes nothing (the A/B of session 69 needs the second)."""
    import argparse
    common = load("bench_common")
    p = argparse.ArgumentParser()
    common.add_engine_mode_args(p)
    assert common.hicache_override_args(p.parse_args([])) == {}
    args = p.parse_args(["--kernel-restore-max-tokens", "0", "--disable-kernel-calibration", "--disable-whole-first",
                         "--disable-outcomes"])
    assert common.hicache_override_args(args) == {"kernel_restore_max_tokens": 0, "kernel_calibration": False,
                                                  "whole_first": False, "learn_outcomes": False}
