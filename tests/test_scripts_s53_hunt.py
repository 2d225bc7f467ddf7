"""Regressions from session 53's hunt of the benchmark scripts (/tmp/hunt_scripts/REPORT.md): bench_speculative
timed failed requests as tokens produced (1.7e9 tok/s, exit 0); bench_restart's --storage-path deleted the user's
file and left PATH.index; --json's stdout carried the human tables after the JSON; bad flags ended in tracebacks
(some after the whole benchmark had run) or in runs that measured nothing and exited 0. Most tests stop at the
argument checks, before any model loads; main(argv) is called in-process."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from script_helpers import CPU, REPO, load, refused


def script(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"})


# -- 1. bench_speculative ------------------------------------------------------------------------------------
SPEC = [*CPU, "--batches", "1", "--drafts", "1", "--context", "32", "--prompt-tokens", "32", "--block-tokens", "8",
        "--repeats", "1", "--max-tokens", "4"]


@pytest.mark.parametrize("flags, says", [
    (["--max-tokens", "100000"], "max_tokens 100000 exceeds the limit"),
    (["--temperature", "-1"], "temperature must be"),
    (["--top-p", "0"], "top_p must be"),
    (["--repetition-penalty", "0"], "repetition_penalty must be"),
    (["--block-tokens", "0"], "--block-tokens: must be >= 1"),
    (["--repeats", "0"], "--repeats: must be >= 1"),
    (["--context", "2", "--drafts", "3"], "--context 2 must be at least a page"),
    (["--batches", "1,,2"], "--batches: expected a comma list"),
    (["--prompt-lookup-min", "9", "--prompt-lookup-max", "2"], "prompt_lookup_min (9) must not exceed"),
])
def test_speculative_refuses_what_its_requests_would_fail_on_before_the_engine(capsys, flags, says):
    spec = load("bench_speculative")
    assert says in refused(capsys, spec.parse_args, [*SPEC, *flags])


def test_speculative_a_failed_timed_request_ends_the_run_without_figures(capsys):
    """regression: generate() never read each result's error: every request failed, 1.7e9 tok/s, exit 0."""
    spec = load("bench_speculative")

    class Failing:
        async def generate_async(self, prompts, params):
            return [SimpleNamespace(output_ids=[], error="max_tokens too large") for _ in prompts]
    line = refused(capsys, lambda: asyncio.run(spec.generate(Failing(), [[1, 2]], 4, "cpu")), code=1)
    assert "1 of 1 requests failed: max_tokens too large" in line


def test_speculative_tokens_are_those_produced(monkeypatch):
    """regression: tokens/s counted batch x max_tokens whatever was produced: here each request's output is cut
    to one token, so the rate is at most 1 token over each run's seconds."""
    spec = load("bench_speculative")
    real = spec.generate

    async def cut(engine, prompts, max_tokens, device, **sampling):
        seconds, outputs = await real(engine, prompts, max_tokens, device, **sampling)
        return 1.0, [out[:1] for out in outputs]  # (one second a run: tokens/s = tokens)
    monkeypatch.setattr(spec, "generate", cut)
    out = asyncio.run(spec.main_async(spec.parse_args(SPEC)))
    assert all(r["tok_s_off"] == r["tok_s_on"] == 1.0 for r in out["runs"]), out["runs"]


# -- 2. --storage-path -----------------------------------------------------------------------------------------
@pytest.fixture
def places(tmp_path):
    precious = tmp_path / "precious.kv"
    precious.write_text("keep")
    (tmp_path / "adir").mkdir()
    return SimpleNamespace(precious=precious, adir=tmp_path / "adir", missing=tmp_path / "nodir" / "x.kv",
                           new=tmp_path / "new.kv")


@pytest.mark.parametrize("name, extra", [("bench_restart", []), ("bench_hicache", ["--tier", "l3"]),
                                         ("bench_hicache_stress", ["--tiers", "l3"])])
@pytest.mark.parametrize("which, says", [("precious", "exists"), ("adir", "is a directory"),
                                         ("missing", "its directory does not exist")])
def test_a_storage_path_it_cannot_create_and_remove_is_refused_before_any_work(capsys, places, name, extra,
                                                                                 which, says):
    """regression: an existing file was used and deleted at exit; a directory or a missing one: a traceback."""
    mod = load(name)
    path = getattr(places, which)
    line = refused(capsys, mod.parse_args, [*CPU, *extra, "--storage-path", str(path)])
    assert f"--storage-path {path}" in line and says in line
    assert places.precious.read_text() == "keep"


def test_an_existing_index_beside_the_storage_path_is_refused_too(capsys, places):
    Path(str(places.new) + ".index").write_text("keep")
    line = refused(capsys, load("bench_restart").parse_args, [*CPU, "--storage-path", str(places.new)])
    assert "new.kv.index exists" in line


def test_the_storage_path_help_says_the_file_is_created_and_removed():
    out = script("scripts/bench_restart.py", "--help").stdout
    assert "created by the benchmark and removed at exit" in " ".join(out.split())


def test_benchdir_removes_the_file_and_its_index_it_created_and_never_a_file_it_did_not(places):
    from bench_cli import BenchDir  # (scripts/ on the path: load() above)
    load("bench_common")
    bench = BenchDir(str(places.new))
    path = bench.l3_path("restart")
    Path(path).write_text("l3")
    Path(path + ".index").write_text("index")  # (bench_restart's persisted L3 writes it)
    bench.close()
    assert not Path(path).exists() and not Path(path + ".index").exists()  # (regression: the index stayed)
    assert not Path(bench.dir).exists()
    kept = BenchDir(str(places.precious))  # (the scripts refuse it; BenchDir still never deletes it)
    kept.close()
    assert places.precious.read_text() == "keep"


def test_restart_with_a_new_storage_path_leaves_nothing(tmp_path):
    path = tmp_path / "l3.kv"
    rc = load("bench_restart").main([*CPU, "--prefix-tokens", "64", "--storage-path", str(path)])
    assert rc == 0 and sorted(p.name for p in tmp_path.iterdir()) == []


# -- 3. --json: only JSON on stdout ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["scripts/bench_transfer.py", "--device", "cpu", "--quick", "--json"],
    ["scripts/bench_engine.py", *CPU, "--quick", "--json"],
    ["scripts/profile_stages.py", *CPU, "--requests", "8", "--num-prefixes", "2", "--prefix-tokens", "32",
     "--warmup", "2", "--json"],
])
def test_json_stdout_is_json_alone_and_the_tables_go_to_stderr(argv):
    proc = script(*argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    json.loads(proc.stdout)  # (regression: the human summary followed the JSON)
    assert proc.stderr.strip()


# -- 4. bad flags: one line, exit 2, before the run ------------------------------------------------------------
ENGINE = [*CPU, "--pool-tokens", "4096", "--prefill-tokens", "32", "--decode-batches", "1", "--decode-prompt", "16",
          "--decode-tokens", "4", "--tail-context", "64", "--repeats", "2"]


@pytest.mark.parametrize("flags, says", [
    (["--banned-decode", "0,4,4"], "--banned-decode: each value must be >= 1"),
    (["--sampled-decode", "1,4"], "--sampled-decode: expected 3 comma-separated integers"),
    (["--penalized-decode", "1,x,4"], "--penalized-decode: expected an integer"),
    (["--guided-decode", "2,4,1"], "--guided-decode: TOKENS must be >= 2"),
    (["--guided-decode", "1,4,4", "--guided-tokenizer", "/nonexistent"], "--guided-tokenizer: cannot read"),
    (["--decode-batches", "1,,2"], "--decode-batches: expected a comma list"),
    (["--prefill-tokens", "0"], "--prefill-tokens: each value must be >= 1"),
    (["--decode-tokens", "1"], "--decode-tokens must be >= 2"),
    (["--repeats", "0"], "--repeats: must be >= 1"),
    (["--tail-context", "8"], "--tail-context 8 must be at least a page"),
    (["--device", "foo"], "--device foo: not a torch device"),
    (["--decode-tokens", "100000"], "max_tokens 100000 exceeds the limit"),  # (the engine's refusal)
])
def test_bench_engine_refuses_bad_flags_before_the_benchmark(capsys, flags, says):
    """regression: the extra decodes' flags were parsed after the main benchmark had run, then a traceback."""
    assert says in refused(capsys, load("bench_engine").main, [*ENGINE, *flags])


@pytest.mark.parametrize("name, argv, says", [
    ("bench_hicache_stress", [*CPU, "--tiers", ""], "--tiers: expected a comma list"),
    ("bench_hicache_stress", [*CPU, "--tiers", " , "], "--tiers: expected a comma list"),
    ("bench_hicache_stress", [*CPU, "--tier", "l2", "--tiers", "l3"], "--tier and --tiers"),
    ("bench_hicache_stress", [*CPU, "--decode-only", "--decode-repeats", "0"], "--decode-repeats: must be >= 1"),
    ("bench_hicache_stress", [*CPU, "--warmup", "-1"], "--warmup: must be >= 0"),
    ("bench_hicache", [*CPU, "--host-ratio", "0"], "--host-ratio: must be > 0"),
    ("bench_hicache", [*CPU, "--page-size", "-4"], "page_size (--page-size) must be >= 0"),
    ("bench_restart", [*CPU, "--io-workers", "0"], "--io-workers: must be >= 1"),
    ("bench_restart", [*CPU, "--prefix-tokens", "0"], "--prefix-tokens: each value must be >= 1"),
])
def test_parse_args_refusals(capsys, name, argv, says):
    assert says in refused(capsys, load(name).parse_args, argv)


@pytest.mark.parametrize("name, argv, says", [
    ("check_restore_equivalence", [*CPU, "--iterations", "0"], "--iterations: must be >= 1"),
    ("check_restore_equivalence", [*CPU, "--page-size", "0"], "--page-size must be >= 1"),
    ("check_restore_equivalence", [*CPU, "--prefix-tokens", "100000", "--page-size", "4"],
     "prompt of 100001 tokens exceeds"),
    ("bench_transfer", ["--device", "cpu", "--tokens", "10"], "each size must be at least a page"),
    ("bench_transfer", ["--device", "cpu", "--tokens", "16", "--backends", "foo"], "'foo' is not one of"),
    ("bench_transfer", ["--device", "foo"], "not a torch device"),
    ("bench_http", [*CPU, "--new-tokens", "1"], "--new-tokens must be >= 2"),
    ("bench_http", [*CPU, "--rounds", "0"], "--rounds: must be >= 1"),
    ("profile_stages", [*CPU, "--cprofile", "x"], "--cprofile: expected an integer"),
    ("profile_stages", [*CPU, "--tiers", "l3"], "runs its tiers itself"),
    ("bench_storage", ["--shapes", "foo"], "'foo' is not one of 8b, tiny"),
    ("bench_storage", ["--backends", "filee"], "'filee' is not one of redis, file"),
    ("bench_storage", ["--tiny-op-pages", "0"], "--tiny-op-pages: must be >= 1"),
])
def test_main_refusals(capsys, name, argv, says):
    assert says in refused(capsys, load(name).main, argv)


def test_bench_storage_starts_no_redis_for_the_file_backend(monkeypatch, capsys):
    storage = load("bench_storage")

    def no_redis():
        raise AssertionError("started a redis-server for --backends file")
    monkeypatch.setattr(storage, "start_redis", no_redis)
    storage.main(["--backends", "file", "--shapes", "tiny", "--tiny-pages", "16", "--tiny-op-pages", "4",
                  "--iters", "2"])
    assert "| file | tiny |" in capsys.readouterr().out


def test_make_bpe_tokenizer_refuses_a_missing_or_empty_corpus_and_one_too_small(capsys, tmp_path):
    bpe = load("make_bpe_tokenizer")
    (tmp_path / "empty").mkdir()
    out = tmp_path / "tok"
    for corpus in ("/nonexistent/dir", str(tmp_path / "empty")):  # (regression: a 263-token tokenizer, rc 0)
        line = refused(capsys, bpe.main, ["--out", str(out), "--corpus", corpus])
        assert "not a directory holding .py files" in line
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.py").write_text("def f(x):\n    return x + 1\n" * 20)
    line = refused(capsys, bpe.main, ["--out", str(out), "--corpus", str(small), "--vocab-tokens", "5000"], code=1)
    assert "of the 5,000 asked" in line and not out.exists()
