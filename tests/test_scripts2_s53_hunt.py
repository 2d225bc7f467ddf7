"""Regressions from session 53's hunt of the benchmark scripts (/tmp/hunt_scripts/REPORT.md, sections 6 and 7), the
second part: bench_beam_search, bench_shared_prefill, bench_allocator, probe_guided_masks, probe_chain_wait,
plot_latency, trace_copies and trace_kernels. Bad flags ended in tracebacks (some after the model had loaded) or in
runs that ignored a flag or measured nothing and exited 0; an unreadable input file was a traceback. Each refusal is
now argparse's one line, exit 2, before any model loads (main / parse_args called in-process)."""
from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest

from script_helpers import CPU, load, refused


# -- bad flags: one line, exit 2, before the model loads -------------------------------------------------------
@pytest.mark.parametrize("name, argv, says", [
    ("bench_beam_search", ["--beam-widths", "11"], "--beam-widths: each width must be in [1, 10]"),
    ("bench_beam_search", ["--beam-widths", "0"], "--beam-widths: each value must be >= 1"),
    ("bench_beam_search", ["--beam-widths", "1,,2"], "--beam-widths: expected a comma list"),
    ("bench_beam_search", ["--max-tokens", "0"], "--max-tokens: must be >= 1"),
    ("bench_beam_search", ["--max-tokens", "5000"], "max_tokens 5000 exceeds the limit 4096"),
    ("bench_beam_search", ["--prompt-tokens", "5000"], "5031 tokens exceeds the model's 4096 positions"),
    ("bench_beam_search", ["--num-pages", "3"], "the L1 pool has 3"),
    ("bench_beam_search", ["--repeats", "0"], "--repeats: must be >= 1"),
    ("bench_shared_prefill", ["--requests", "0"], "--requests: each value must be >= 1"),
    ("bench_shared_prefill", ["--requests", "-1"], "--requests: each value must be >= 1"),
    ("bench_shared_prefill", ["--repeats", "0"], "--repeats: must be >= 1"),
    ("bench_shared_prefill", ["--tail-tokens", "-5"], "--tail-tokens: must be >= 0"),
    ("bench_shared_prefill", ["--prompt-tokens", "9000"], "9000 tokens exceeds the model's 4096 positions"),
    ("bench_shared_prefill", ["--prompt-tokens", "4000", "--tail-tokens", "97"], "prompt (4097)"),
    ("bench_preemption", ["--ratios", "1,1.5"], "--ratios: each ratio must be in [0, 1]"),
    ("bench_preemption", ["--ratios", "x"], "--ratios: expected a comma list of numbers"),
    ("bench_preemption", ["--requests", "0"], "--requests: must be >= 1"),
    ("bench_preemption", ["--max-tokens", "5000"], "max_tokens 5000 exceeds the limit 4096"),
    ("bench_preemption", ["--prompt-tokens", "3000", "--max-tokens", "2000"], "exceeds the model's 4096 positions"),
    ("bench_preemption", ["--l1-tokens", "1000"], "the L1 pool has 250"),
    ("probe_chain_wait", ["--rounds", "0"], "--rounds: must be >= 1"),
    ("probe_chain_wait", ["--slots", "0"], "--slots: must be >= 1"),
    ("probe_chain_wait", ["--new-tokens", "0"], "--new-tokens: must be >= 1"),
    ("probe_chain_wait", ["--new-tokens", "5000"], "max_tokens 5000 exceeds the limit 4096"),
    ("probe_chain_wait", ["--prompt-tokens", "5000"], "exceeds the model's 4096 positions"),
    ("probe_chain_wait", ["--device", "foo"], "--device: invalid choice"),
])
def test_engine_scripts_refuse_bad_flags_before_the_model_loads(capsys, monkeypatch, name, argv, says):
    mod = load(name)

    def no_engine(*a, **k):
        raise AssertionError("an engine was built")
    monkeypatch.setattr(mod, "Engine", no_engine)
    device = [] if "--device" in argv else ["--device", "cpu"]
    assert says in refused(capsys, mod.parse_args, ["--model", "tiny", *device, *argv])


@pytest.mark.parametrize("argv, says", [
    (["--pages", "0"], "--pages: must be >= 1"), (["--pages", "-1"], "--pages: must be >= 1"),
    (["--repeats", "0"], "--repeats: must be >= 1"), (["--repeats", "-3"], "--repeats: must be >= 1"),
])
def test_bench_allocator_refuses_counts_below_one(capsys, argv, says):
    """regression: --pages 0 timed empty operations, --repeats 0 a StatisticsError."""
    assert says in refused(capsys, load("bench_allocator").main, argv)


@pytest.mark.parametrize("argv, says", [
    (["--steps", "5"], "--steps must exceed the 5 warm-up steps"),
    (["--grammars", "foo"], "'foo' is not one of text, json, calls"),
    (["--grammars", "text,,json"], "--grammars: expected a comma list"),
    (["--rows", "0"], "--rows: each value must be >= 1"),
    (["--vocab-size", "151936"], "--vocab-size needs --tokenizer"),
    (["--tokenizer", "/nonexistent"], "--tokenizer: cannot read the tokenizer's"),
])
def test_probe_guided_masks_refuses_bad_flags(capsys, argv, says):
    """regression: --steps 5 a StatisticsError (the first 5 steps dropped), --grammars foo a KeyError, --vocab-size
    without --tokenizer silently ignored (the masks 512 ids wide)."""
    assert says in refused(capsys, load("probe_guided_masks").main, argv)


def test_probe_guided_masks_help_says_the_warm_up_steps_and_the_vocab_size_rule(capsys):
    with pytest.raises(SystemExit):
        load("probe_guided_masks").parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "the first 5 are warm-up" in out and "without --tokenizer refused" in out


def test_probe_chain_wait_a_failed_request_ends_the_run(capsys, monkeypatch):
    """regression: with every request failed it printed 0 tokens/s and exited 0."""
    chain = load("probe_chain_wait")

    class Failing:
        vocab_size, stats = 512, {"chained_steps": 0}

        def __init__(self, config):
            pass

        def validate(self, prompt, params):
            pass

        def generate(self, prompts, params):  # (the warm-up's one request served; the round's two fail)
            failed = len(prompts) > 1
            return [SimpleNamespace(output_ids=[] if failed else [1], error="out of pages" if failed else None)
                    for _ in prompts]
    monkeypatch.setattr(chain, "Engine", Failing)
    kept = chain.admission.Admission.chain_decode_batch
    line = refused(capsys, chain.main, [*CPU, "--requests", "2", "--slots", "1", "--prompt-tokens", "8",
                                        "--new-tokens", "2", "--rounds", "1"], code=1)
    assert "2 of 2 requests failed: out of pages" in line
    assert chain.admission.Admission.chain_decode_batch is kept


# -- input files: one line naming the file, exit 2 --------------------------------------------------------------
@pytest.fixture
def files(tmp_path):
    (tmp_path / "bad.json").write_text('{"x":')
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "adir").mkdir()
    (tmp_path / "bad.json.gz").write_text("not gzip")
    return tmp_path


@pytest.mark.parametrize("name", ["trace_copies", "trace_kernels", "plot_latency"])
@pytest.mark.parametrize("which, says", [
    ("missing.json", "No such file or directory"), ("adir", "Is a directory"), ("bad.json", "not JSON"),
    ("empty.json", None), ("list.json", None), ("bad.json.gz", "Not a gzipped file"),
])
def test_an_unreadable_input_file_is_one_line_naming_it(capsys, files, name, which, says):
    """regression: FileNotFoundError, IsADirectoryError, JSONDecodeError, KeyError, TypeError tracebacks."""
    if name == "plot_latency" and which == "bad.json.gz":
        return  # (plot_latency reads plain JSON: the gzip case is the trace readers')
    path = str(files / which)
    out = ["--out", str(files / "plot.png")] if name == "plot_latency" else []  # (never docs/latency.png)
    line = refused(capsys, load(name).main, [path, *out])
    assert f"error: {path}: " in line
    shape = {"trace_copies": "not a chrome trace", "trace_kernels": "not a chrome trace",
             "plot_latency": "no rows" if which == "list.json" else "not bench_hicache.py's JSON"}[name]
    assert (says or shape) in line


def test_trace_copies_says_a_trace_without_copies_and_exits_1(tmp_path, capsys):
    """regression: an empty table, exit 0 (trace_kernels says "no GPU kernels", exit 1)."""
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 1}]}, f)
    assert load("trace_copies").main([str(path)]) == 1
    assert "no copies in the trace" in capsys.readouterr().err


ROW = {"prefix_tokens": 32, "latency_ms": {"p50": 1.5}, "model": "tiny", "device": "cpu"}


def test_plot_latency_titles_the_data_and_prints_the_file_it_wrote(tmp_path, capsys):
    """regression: the title said "H200, bf16" whatever ran; --out x printed x, matplotlib wrote x.png."""
    plot = load("plot_latency")
    assert plot.title([ROW, {**ROW, "model": "qwen3-8b", "dtype": "bfloat16"}]) == \
        "Forced-tier restore latency, qwen3-8b/tiny, cpu, bfloat16"
    assert plot.title([{"prefix_tokens": 1}]) == "Forced-tier restore latency"
    data = tmp_path / "latency_l2.json"
    data.write_text(json.dumps([ROW]))
    assert plot.main([str(data), "--out", str(tmp_path / "plot")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "plot.png") and (tmp_path / "plot.png").is_file()


@pytest.mark.parametrize("out, says", [("/nonexistent/x.png", "its directory does not exist"),
                                       ("adir", "is a directory"), ("x.foo", ".foo is no image format")])
def test_plot_latency_refuses_an_out_it_cannot_write_before_drawing(capsys, files, out, says):
    data = files / "latency.json"
    data.write_text(json.dumps(ROW))
    out = out if out.startswith("/") else str(files / out)
    assert says in refused(capsys, load("plot_latency").main, [str(data), "--out", out])
