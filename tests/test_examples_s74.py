"""The README's copyable examples, run as written (session 74's "the examples run as written" hunt).

tests/test_docs_truth.py checks that the names and flags the docs cite exist and that the example command lines
parse; nothing ran them. Here each one runs on the CPU, read out of README.md itself, so an edit of either the
README or the code that breaks a snippet a user copies fails here: the in-process block (and its async comment),
the server's command line with the README's chat template, served in process, answering the curl body (sent with
the curl's header) and the openai SDK as the README builds its client, the replay command with its JSON records,
the simulated replay's example flags, and the timeline command on the replay's log.
"""
from __future__ import annotations

import asyncio
import json
import re
import shlex
from pathlib import Path

import httpx
import pytest

from test_server import ServerThread

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
PROSE = " ".join(README.split())  # (inline commands wrap lines)


def block(lang: str, index: int = 0) -> str:
    """The README's `index`th fenced block of `lang`, dedented."""
    blocks = re.findall(rf"^( *)```{lang}\n(.*?)^\1```", README, flags=re.M | re.S)
    indent, body = blocks[index]
    return "\n".join(line[len(indent):] for line in body.splitlines())


def inline(prefix: str) -> str:
    """The arguments of the README's inline command `prefix ...`."""
    return re.search(rf"`{re.escape(prefix)} ([^`]*)`", PROSE).group(1)


def test_in_process_block_runs_as_written():
    """The "In process" block, executed as it stands, then its async comment's statements in turn."""
    code = block("python")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    (result,) = scope["results"]
    assert result.error is None and len(result.output_ids) == 8
    statements = re.search(r"# async: (.*)", code).group(1).split("; ")
    assert [s.split()[0] for s in statements] == ["await", "async", "await"]
    body = "\n".join("    " + s for s in statements)
    exec(f"async def run(eng, prompt, params):\n    events = []\n{body.replace(': ...', ': events.append(ev)')}\n"
         f"    return events", scope)
    events = asyncio.run(scope["run"](scope["eng"], [1, 2, 3], scope["SamplingParams"](max_tokens=3)))
    assert events[-1].finished and events[-1].error is None


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """hicache-serve of the README's command line, plus the README's --chat-template for the presets' tokenizer,
    served in this process (its port left to ServerThread: the README's 8000 may be taken here)."""
    from scheduler import serve
    argv = inline("python -m scheduler.server").split()
    template = re.search(r"`--chat-template '([^']*)'`", PROSE).group(1)
    built = {}
    mp = pytest.MonkeyPatch()
    mp.setattr(serve, "_bind_problem", lambda host, port: None)
    mp.setattr(serve._Server, "run", lambda self: built.setdefault("server", self))
    try:
        assert serve.main([*argv, "--chat-template", template]) == 0
    finally:
        mp.undo()
    with ServerThread(built["server"].config.app) as s:
        yield s


def test_curl_example_is_answered(served):
    """The curl line: its header and its -d body, byte for byte; and the same body without `model` (README: "it
    may be left out")."""
    words = shlex.split(block("bash", 1).replace("\\\n", " "))
    assert words[0] == "curl"
    url, header, data = words[1], words[words.index("-H") + 1], words[words.index("-d") + 1]
    path = "/" + url.split("/", 1)[1]
    name, value = (part.strip() for part in header.split(":", 1))
    r = httpx.post(served.url + path, content=data, headers={name: value}, timeout=60)
    assert r.status_code == 200, r.text
    body = json.loads(data)
    assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
    r = httpx.post(served.url + path, json={k: v for k, v in body.items() if k != "model"}, timeout=60)
    assert r.status_code == 200, r.text


def test_openai_sdk_client_as_the_readme_builds_it(served):
    """`OpenAI(base_url="http://localhost:8000/v1", api_key="unused")`, pointed at this server's port: a
    completion, a chat (the README's template) and a Response."""
    openai = pytest.importorskip("openai")
    call = re.search(r"`OpenAI\(base_url=\"http://localhost:8000(/v1)\", api_key=\"(\w+)\"\)`", PROSE)
    client = openai.OpenAI(base_url=served.url + call.group(1), api_key=call.group(2), max_retries=0, timeout=60)
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=4)
    assert completion.usage.completion_tokens == 4
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    response = client.responses.create(model="tiny", input="hi", max_output_tokens=4)
    assert client.responses.retrieve(response.id).id == response.id


def replay_main(argv: list[str]) -> int:
    from scheduler.replay import main
    return main(argv)


def test_replay_and_timeline_commands_run(tmp_path, monkeypatch, capsys):
    """`python scripts/replay_trace.py --trace T.jsonl ... --json-out out.json` on two lines of the bundled trace
    (as fast as possible, logged by the Timeline bullet's `--log-json run.jsonl`), its records one per line; then
    `python scripts/timeline.py run.jsonl --chrome trace.json --png timeline.png` on that log."""
    monkeypatch.chdir(tmp_path)
    lines = (REPO / "scheduler/sample_trace.jsonl").read_text().splitlines()[:2]
    argv = inline("python scripts/replay_trace.py").split()
    trace = argv[argv.index("--trace") + 1]
    Path(trace).write_text("\n".join(lines) + "\n")
    assert replay_main([*argv, "--time-scale", "0", "--no-progress", "--log-json", "run.jsonl"]) == 0
    out = json.loads(Path(argv[argv.index("--json-out") + 1]).read_text())
    assert [r["line"] for r in out["request_records"]] == [1, 2]
    assert out["failed"] == 0
    import importlib.util
    spec = importlib.util.spec_from_file_location("timeline_script", REPO / "scripts/timeline.py")
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    assert timeline.main(inline("python scripts/timeline.py").split()) in (0, None)
    assert json.loads(Path("trace.json").read_text()) and Path("timeline.png").stat().st_size > 0
    assert "Requests" in capsys.readouterr().out


def test_simulated_replay_example_flags_run(capsys):
    """The `--simulate` example (`--model qwen3-8b --l1-tokens 200000 --l3-gib 2000`) on the bundled sample's
    first requests: every request completes (its bookkeeping fits this machine, as the README promises)."""
    example = re.search(r"`--simulate` replays.*?\(e\.g\. `([^`]*)`", PROSE).group(1).split()
    assert replay_main(["--simulate", *example, "--max-requests", "20", "--no-progress"]) == 0
    assert "20 (20 completed, 0 failed)" in capsys.readouterr().out
