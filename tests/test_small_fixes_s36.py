"""Small user-facing fixes (session 36): logit_bias errors that showed a literal '{key!r}', the replay's
--page-size help, the server's prompt limit past the model's positions, the replay's start line, the
GPU probes' --help and CPU refusal, page_size against an L1 sized from GPU memory, and the L3 path's
and tier sizes' wording. Each test names what it failed with."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.storage_file import open_store_file
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from test_server import ServerThread

REPO = Path(__file__).resolve().parents[1]
SIM = ["--simulate", "--no-progress", "--max-requests", "2"]  # the bundled sample, no model: fast


@pytest.fixture(scope="module")
def srv():
    """The tiny preset on the CPU with the default L1 (8,192 tokens) and its 4,096 positions."""
    engine = Engine(EngineConfig(model="tiny", device="cpu"))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
        yield s


def _complete(srv, **body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)


def test_a_bad_logit_bias_key_is_quoted_in_the_error(srv):
    """regression: a logit_bias key that is not a token id was answered "...got {key!r}" and
    "key {key!r} is not a token id ...": pydantic's PydanticCustomError fills {key}, not {key!r}."""
    for key in ("abc", "99999", "{top}"):
        r = _complete(srv, prompt=[1, 2, 3], max_tokens=1, logit_bias={key: 1})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and repr(key) in message and "{key" not in message, message
    assert "below the vocabulary size 512" in _complete(srv, prompt=[1], logit_bias={"99999": 1}).json()[
        "error"]["message"]


def test_the_replays_page_size_help_says_what_the_replay_does():
    """regression: replay_trace.py --help said "--page-size ... (default 16 on cuda, 4 on cpu)
    (default: 16)": the replay sets 16 on every device but kept the engine's help text."""
    from scheduler.replay_args import build_parser
    text = " ".join(build_parser().format_help().split())
    start = text.index("--page-size", text.index("engine:"))  # (its entry, not the usage line)
    entry = text[start:text.index("--num-pages", start)]
    assert "4 on cpu" not in entry and "16" in entry, entry


def test_the_prompt_limit_is_within_the_models_positions(srv):
    """regression: the server reported and enforced first a prompt limit of the L1 pool (8,192 tokens
    for the tiny preset on the CPU) while the model has 4,096 positions: a prompt of 4,097..8,192
    tokens passed that check and failed on another, different message."""
    limits = httpx.get(srv.url + "/hicache/status", timeout=30).json()["server"]["limits"]
    max_model_len = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    assert limits["max_prompt_tokens"] == max_model_len == 4096, (limits, max_model_len)
    for n in (4097, 8193):
        r = _complete(srv, prompt=[1] * n, max_tokens=1)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "prompt_too_long", r.text
        assert f"prompt of {n} tokens exceeds the limit of 4096 tokens" in err["message"], err
    assert _complete(srv, prompt=[1] * 4096, max_tokens=1).status_code == 200


def test_the_replay_says_what_it_runs_in_one_line_at_start(capsys, monkeypatch):
    """regression: the replay never said which trace, model, device and tier sizes it ran."""
    from scheduler.replay import run_cli
    monkeypatch.setattr(sys, "argv", ["replay_trace.py"])  # (the program's name starts its lines)
    s = run_cli(SIM)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("replay_trace.py: replaying")]
    assert len(lines) == 1, err
    line = lines[0]
    for part in ("sample_trace.jsonl", "(simulated)", "tiny on cpu", "L1 4,096 tokens", "L2 24,576 tokens",
                 "L3 65,536 tokens"):
        assert part in line, line
    assert "replaying" not in out and s["completed"] == 2


def _script(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("script, flags", [("probe_host.py", ["--transfers", "--pool-pages", "--direct-pages",
                                                               "--sleepy"]),
                                           ("probe_contention.py", []),
                                           ("profile_stages.py", ["--fine", "--cprofile", "--spans", "--ab"])])
def test_the_probes_help_prints_help(script, flags):
    """regression: probe_host.py / probe_contention.py --help started the probe (on the CPU: a
    "Torch not compiled with CUDA enabled" traceback); profile_stages.py --help showed only
    bench_hicache_stress.py's options, not its own (--fine, --cprofile N, --spans, --ab)."""
    proc = _script(f"scripts/{script}", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage:") and "Traceback" not in proc.stderr, proc
    for flag in flags:
        assert flag in proc.stdout, (flag, proc.stdout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
@pytest.mark.parametrize("script", ["probe_host.py", "probe_contention.py", "probe_pin.py", "probe_wait.py",
                                    "probe_sample.py", "probe_chain_wait.py"])
def test_the_gpu_probes_refuse_the_cpu_in_one_line(script):
    """regression: on the CPU they ended in a "Torch not compiled with CUDA enabled" traceback, not
    the one line "needs CUDA" (exit 2) of bench_kernels.py (probe_wait.py: "needs a GPU", exit 1)."""
    proc = _script(f"scripts/{script}")
    assert proc.returncode == 2 and "needs CUDA" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_page_size_is_not_held_to_8192_tokens_where_l1_is_sized_from_gpu_memory(monkeypatch):
    """regression: max_total_tokens 0 refused page_size > 8,192 "(--max-total-tokens 0)" even on CUDA,
    where L1 is sized from the GPU's memory, not from 8,192 tokens."""
    EngineConfig(device="cuda", max_total_tokens=0, page_size=16384)
    with pytest.raises(ValueError, match="8,192 tokens"):  # the CPU's L1: 0 means 8,192 tokens there
        EngineConfig(device="cpu", max_total_tokens=0, page_size=16384)
    with pytest.raises(ValueError, match="--page-size"):  # simulated: L1 is not sized from memory
        EngineConfig(device="cuda", max_total_tokens=0, page_size=16384, simulate=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # auto picks CUDA
    EngineConfig(device="auto", max_total_tokens=0, page_size=16384)


def test_an_empty_storage_path_and_the_l3_path_refusals_name_the_flag(tmp_path):
    """regression: HiCacheConfig(storage_path="") was taken as the current directory, and the store
    file's "refusing L3 storage path ..." errors named no flag."""
    with pytest.raises(ValueError, match="--hicache-storage-path"):
        HiCacheConfig(storage_path="")
    with pytest.raises(ValueError) as info:
        open_store_file(tmp_path, 4096)  # a directory
    message = str(info.value)
    assert message.startswith("refusing --hicache-storage-path") and "\n" not in message, message


def test_the_start_lines_small_tiers_show_mib():
    """regression: pools_line printed "(0.00 GiB)" for a tier under 5 MiB."""
    from scheduler.memory_plan import pools_line
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=100))
    line = pools_line(eng.status())
    assert line == "tiny on cpu (float32): L1 400 tokens (0.20 MiB)", line  # 204,800 bytes


def test_the_replays_out_of_memory_line_does_not_count_a_gpu_sized_l1_at_8192_tokens():
    """regression: a replay whose pools raised MemoryError named "2,048 L1 pages" (8,192 tokens, the CPU's
    default) where the engine had sized L1 from the GPU's memory."""
    from scheduler.replay_args import build_parser
    from scheduler.replay_memory import out_of_memory

    args = build_parser().parse_args([])
    line = out_of_memory(args, EngineConfig(device="cuda", max_total_tokens=0), MemoryError("cannot allocate"))
    assert "GPU's memory" in line and "cannot allocate" in line and "L1 pages" not in line, line
    line = out_of_memory(args, EngineConfig(device="cpu", max_total_tokens=0, page_size=4), MemoryError("x"))
    assert "2,048 L1" in line, line


@pytest.mark.parametrize("extra", [[], ["--device", "cpu"]])
def test_profile_stages_spans_refuses_a_device_without_cuda_before_it_runs(extra):
    """regression (session 38): `--spans` on the CPU ran the whole "none" tier, then ended in a "Torch not
    compiled with CUDA enabled" traceback from print_spans."""
    if torch.cuda.is_available() and not extra:
        pytest.skip("CUDA here: --spans runs")
    proc = _script("scripts/profile_stages.py", "--model", "tiny", "--spans", *extra)
    assert proc.returncode == 2 and "needs CUDA" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "none" not in proc.stdout, proc.stdout  # refused before any tier ran


def test_hicache_flags_without_enable_hicache_are_named_at_start(monkeypatch, capsys):
    """regression (session 38): `hicache-serve --hicache-size-gb 1` without --enable-hicache started with L1
    alone and said nothing of the flag; the start-up lines now name the flags that change nothing."""
    from scheduler import serve

    parser = serve.build_parser()
    given = ["--hicache-size-gb", "1", "--disable-hicache-prefetch", "--hicache-policy", "always"]
    assert serve._idle_hicache_flags(parser, parser.parse_args(given)) == [
        "--hicache-size-gb", "--hicache-policy", "--disable-hicache-prefetch"]
    assert serve._idle_hicache_flags(parser, parser.parse_args(["--enable-hicache", *given])) == []
    assert serve._idle_hicache_flags(parser, parser.parse_args(["--hicache-policy", "cost"])) == []  # (the default)
    ran = []
    monkeypatch.setattr(serve._Server, "run", lambda self: ran.append(True))  # start, then return at once
    assert serve.main(["--port", "0", "--device", "cpu", "--model", "tiny", "--hicache-size-gb", "1"]) == 0 and ran
    err = capsys.readouterr().err
    assert "ignored without --enable-hicache (L1 only): --hicache-size-gb\n" in err, err
