"""The user-facing docs (README.md, docs/design.md, docs/reliability.md) against the code, so that the
docs cannot drift unnoticed: every flag they name exists in the parser it belongs to, with the
choices and defaults they state, and every flag of the engine, server and replay parsers is in the
README; the README's module table lists exactly the modules there are; every path, script, test,
HTTP route, environment variable and code name they cite exists; the quick-start commands and the
console scripts run what they say. Markdown is read with regular expressions; no engine is started."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import re
import tomllib
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/design.md", "docs/reliability.md")
PACKAGES = ("kernels", "hicache", "scheduler")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SCRIPT = re.compile(r"(?<![\w/.-])(?:scripts/)?([a-z_]+\.py)\b")
# file names in the docs that are a command's input or output, not files of this repository
EXAMPLE_FILES = {"T.jsonl", "out.json", "run.jsonl", "trace.json", "timeline.png", "config.json", "tokenizer.json"}


# -- reading the docs ------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def doc(name: str) -> str:
    return (REPO / name).read_text()


def prose(text: str) -> str:
    """The text without its fenced code blocks (their backticks would pair with the prose's)."""
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^\s*```{lang}\n(.*?)^\s*```", text, flags=re.S | re.M)


def spans(text: str) -> list[str]:
    """Inline code spans of `text` (outside fenced blocks)."""
    return re.findall(r"`([^`]+)`", prose(text))


def between(text: str, start: str, end: str) -> str:
    head, found, rest = text.partition(start)
    assert found, f"the docs no longer contain {start!r}"
    return rest.split(end, 1)[0]


def bullet(start: str) -> str:
    """The README's top-level bullet that starts with `start` (up to the next one or the next blank line)."""
    return re.search(rf"^- \*\*{re.escape(start)}.*?(?=^- |^\s*$)", doc("README.md"), flags=re.S | re.M).group(0)


def described_flags(text: str) -> list[tuple[str, str, str]]:
    """(flag, its metavar or {choices}, its parenthetical description) for each flag span in `text`;
    a description is the balanced parenthesis right after the span (inner flags are references)."""
    out = []
    for m in re.finditer(r"`(--[a-z][a-z0-9-]*)((?: [^`]*)?)`", text):
        rest, described = text[m.end():], ""
        opening = re.match(r"\s+\(", rest)
        if opening:
            depth = 0
            for i, ch in enumerate(rest[opening.end() - 1:], opening.end() - 1):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    described = rest[opening.end():i]
                    break
        out.append((m.group(1), m.group(2).strip(), described))
    return out


def stated_default(description: str) -> str | None:
    """The value after a clause that starts with "default" ("...; default 8192", "(default 4)"), not
    "by default ..."."""
    m = re.search(r"(?:^|[;,]\s*)default\s+`?(\d[\d,]*\d|\d|[a-z_][\w-]*)`?(?=[;,)\s]|$)", description)
    return m.group(1) if m else None


def same_value(stated: str, actual) -> bool:
    if isinstance(actual, (int, float)) and not isinstance(actual, bool):
        return re.fullmatch(r"\d[\d,]*(\.\d+)?", stated) is not None and float(stated.replace(",", "")) == actual
    return stated == str(actual)


# -- the parsers -----------------------------------------------------------------------------------
def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each documented option string of `parser` (not --help, not the hidden ones) -> its action."""
    return {s: a for a in parser._actions for s in a.option_strings
            if s.startswith("--") and s != "--help" and a.help is not argparse.SUPPRESS}


@lru_cache(maxsize=None)
def engine_options() -> dict[str, argparse.Action]:
    from scheduler.config import add_engine_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return options(parser)


@lru_cache(maxsize=None)
def server_options() -> dict[str, argparse.Action]:
    from scheduler.serve import build_parser
    return options(build_parser())


@lru_cache(maxsize=None)
def replay_options() -> dict[str, argparse.Action]:
    from scheduler.replay_args import build_parser
    return options(build_parser())


@lru_cache(maxsize=None)
def script_flags(name: str) -> frozenset[str]:
    """The flags scripts/`name` takes: the "--..." string literals of its source (argparse's or its own
    argv handling) and of the scripts it imports (bench_common's shared flags, the benchmark that
    profile_stages.py passes its other arguments to); replay_trace.py's are the replay parser's."""
    if name == "replay_trace.py":
        return frozenset(replay_options())
    tree = ast.parse((REPO / "scripts" / name).read_text())
    flags = {n.value for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and FLAG.fullmatch(n.value)}
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for module in names:
            if (REPO / "scripts" / f"{module}.py").exists() and f"{module}.py" != name:
                flags |= script_flags(f"{module}.py")
    return frozenset(flags)


def all_scripts() -> list[str]:
    return sorted(p.name for p in (REPO / "scripts").glob("*.py"))


def pytest_flags() -> set[str]:
    return {"--help"} | set(re.findall(r'addoption\("(--[\w-]+)"', (REPO / "tests" / "conftest.py").read_text()))


# -- (1), (2) flags --------------------------------------------------------------------------------
def check_described(flags: list[tuple[str, str, str]], parser: dict[str, argparse.Action]) -> list[str]:
    """What the docs' {choices} and stated defaults get wrong about `parser`."""
    from scheduler.presets import PRESETS
    wrong = []
    for flag, metavar, description in flags:
        action = parser.get(flag)
        if action is None:
            continue  # reported by the caller
        choices = re.fullmatch(r"\{([^}]*)\}", metavar)
        if choices:
            stated = choices.group(1).split(",")
            actual = action.choices if action.choices is not None else [*PRESETS, "DIR"]  # --model
            if sorted(stated) != sorted(actual):
                wrong.append(f"{flag} {{{','.join(stated)}}}: the parser's choices are {list(actual)}")
        default = stated_default(description)
        if default is not None and not same_value(default, action.default):
            wrong.append(f"{flag}: the docs say default {default}, the parser's is {action.default!r}")
    return wrong


def test_main_flags_are_the_engine_flags_with_their_choices_and_defaults():
    text = between(doc("README.md"), "Main flags:", "Server only:")
    flags = described_flags(text)
    named = {f for f, _, _ in flags}
    assert named - set(engine_options()) == set(), "README's Main flags names flags the engine has not"
    assert set(engine_options()) - named == set(), "engine flags missing from README's Main flags"
    assert check_described(flags, engine_options()) == []


def test_server_only_flags_are_the_servers_own():
    text = between(doc("README.md"), "Server only:", ".\n")
    named = set(FLAG.findall(text))
    server_only = set(server_options()) - set(engine_options())
    assert named == server_only, "README's Server only list against scheduler/serve.py's own flags"
    http = bullet("HTTP")
    assert set(FLAG.findall(http)) - set(server_options()) == set()
    assert check_described(described_flags(http), server_options()) == []


def test_replay_bullet_flags_are_the_replays_and_every_replay_flag_is_in_the_readme():
    text = bullet("Replay a trace")
    assert set(FLAG.findall(text)) - set(replay_options()) - {"--help"} == set()
    assert check_described(described_flags(text), replay_options()) == []
    readme = set(FLAG.findall(doc("README.md")))
    assert set(replay_options()) - readme == set(), "replay flags no README line mentions"


def test_readme_command_lines_parse(monkeypatch):
    """The server's and the replay's example command lines are accepted by their parsers. (Whether their port is
    free here is no claim of the README's: regression, the test failed while anything listened on 8000.)"""
    from scheduler import serve
    from scheduler.replay_args import build_parser as replay_parser
    from scheduler.serve import _check_server_args, build_parser as server_parser
    monkeypatch.setattr(serve, "_bind_problem", lambda host, port: None)
    text = " ".join(prose(doc("README.md")).split())
    serve = re.findall(r"`python -m scheduler\.server ([^`]*)`", text)
    replay = re.findall(r"`python scripts/replay_trace\.py ([^`]*)`", text)
    assert serve and replay
    for line in serve:
        assert _check_server_args(server_parser().parse_args(line.split())) is None
    for line in replay:
        replay_parser().parse_args(line.split())


def script_flag_claims(text: str, carry: bool) -> list[tuple[str, str]]:
    """(script, flag) pairs: a flag in the same span as a script name belongs to it; with `carry`
    (a list of scripts and their flags) a flag alone in a span belongs to the last script named
    before it (to the next one before any)."""
    claims, last, pending = [], None, []
    for span in spans(text):
        scripts = SCRIPT.findall(span)
        if scripts:
            claims += [(scripts[-1], f) for f in FLAG.findall(span.split(scripts[-1], 1)[1])]
            if carry:
                claims += [(scripts[0], f) for f in pending]
                pending, last = [], scripts[-1]
        elif carry:
            flags = FLAG.findall(span)
            claims += [(last, f) for f in flags] if last else []
            pending += [] if last else flags
    return claims


@pytest.mark.parametrize("name", DOCS)
def test_flags_named_with_a_script_are_that_scripts(name):
    text = doc(name)
    claims = script_flag_claims(text, carry=False)
    if name == "README.md":
        claims += script_flag_claims(bullet("Benchmarks"), carry=True)
    missing = sorted({f"{script} {flag}" for script, flag in claims
                      if (REPO / "scripts" / script).exists() and flag not in script_flags(script)})
    assert missing == []


@pytest.mark.parametrize("name", DOCS)
def test_every_flag_the_docs_name_exists(name):
    """A flag named anywhere is one of the engine's, the server's, the replay's, a script's or
    pytest's, and where the docs state its default or choices in the engine's terms they hold."""
    known = set(server_options()) | set(replay_options()) | pytest_flags()
    for script in all_scripts():
        known |= script_flags(script)
    assert sorted(set(FLAG.findall(prose(doc(name)))) - known) == []
    engine = [d for d in described_flags(prose(doc(name))) if d[0] in engine_options()]
    assert check_described(engine, engine_options()) == []


def test_config_field_defaults_the_design_notes_state():
    from hicache.config import HiCacheConfig
    from scheduler.config import EngineConfig
    defaults = {f.name: f.default for cls in (HiCacheConfig, EngineConfig) for f in dataclasses.fields(cls)}
    stated = re.findall(r"`(\w+)`(?:\s*\(|,\s*)default\s+(\d[\d,.]*\d|\d)", " ".join(prose(doc(n)) for n in DOCS))
    checked = [(name, value) for name, value in stated if name in defaults]
    assert len(checked) >= 4, "the defaults the design notes state are no longer found"
    assert [(n, v, defaults[n]) for n, v in checked if not same_value(v, defaults[n])] == []


def test_outcomes_and_server_defaults_the_readme_states():
    from hicache.outcomes import MIN_OUTCOMES
    from scheduler.server import ServerLimits
    main_flags = between(doc("README.md"), "Main flags:", "Server only:")
    assert int(re.search(r"relative to\s+a recompute's, once (\d+) were timed", main_flags).group(1)) == MIN_OUTCOMES
    default_max = re.search(r"without `max_tokens` a completion gets (\d+) tokens", bullet("HTTP")).group(1)
    assert int(default_max) == ServerLimits.default_max_tokens


def test_failure_kinds_the_reliability_page_lists_are_the_counted_ones():
    from hicache.metrics import FAILURE_KINDS
    promise = between(doc("docs/reliability.md"), "counters in `metrics()`: `failures` by kind", "`fallbacks`")
    listed = re.findall(r"`(\w+)`", promise)
    assert sorted(listed) == sorted(FAILURE_KINDS)


# -- (3) the module table --------------------------------------------------------------------------
def test_module_table_lists_exactly_the_modules():
    table = between(doc("README.md"), "## How the code is laid out", "\n## ")
    rows = []
    for row in re.findall(r"^\| (`[^|]*) \|", table, flags=re.M):
        package = None
        for name in re.findall(r"`([^`]+)`", row):
            package = name.split("/")[0] if "/" in name else package
            rows.append(name if "/" in name else f"{package}/{name}")
    listed = set(rows)
    assert len(rows) == len(listed), "a module is in the table twice"
    actual = {f"{p}/{f.name}" for p in PACKAGES for f in (REPO / p).glob("*.py") if f.name != "__init__.py"}
    assert sorted(listed - actual) == [], "the table lists modules that do not exist"
    assert sorted(actual - listed) == [], "modules the table leaves out"


# -- (4) paths, scripts, tests ---------------------------------------------------------------------
@pytest.mark.parametrize("name", DOCS)
def test_cited_paths_exist(name):
    text = prose(doc(name))
    missing = []
    for path in set(re.findall(r"(?<![\w/.-])((?:[\w.-]+/)+[\w.-]+\.(?:py|sh|md|json|jsonl|png|toml))\b", text)):
        if not path.startswith("../") and not (REPO / path).exists():
            missing.append(path)
    for file in set(re.findall(r"(?<![\w/.-])([\w-]+\.(?:py|sh))\b", text)):  # bare names: a script, test or module
        if not any((REPO / d / file).exists() for d in ("scripts", "tests", *PACKAGES)):
            missing.append(file)
    for file in set(re.findall(r"`([\w.-]+\.(?:json|jsonl|png|md))`", text)) - EXAMPLE_FILES:
        if not any((REPO / d / file).exists() for d in ("", "docs", "data")) and file != "DESIGN.md":
            missing.append(file)
    assert sorted(missing) == []


def test_every_script_is_in_the_readme():
    """Each command in scripts/ is named in the README (bench_common.py is the benchmarks' library)."""
    scripts = {p.name for p in (REPO / "scripts").iterdir() if p.suffix in (".py", ".sh")} - {"bench_common.py"}
    assert sorted(s for s in scripts if not re.search(rf"(?<![\w.-]){re.escape(s)}\b", doc("README.md"))) == []


@lru_cache(maxsize=None)
def defined_tests() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for f in (REPO / "tests").glob("test_*.py"):
        for m in re.finditer(r"^\s*(?:async\s+)?def (test_\w+)", f.read_text(), flags=re.M):
            found.setdefault(m.group(1), set()).add(f.name)
    return found


@pytest.mark.parametrize("name", DOCS)
def test_cited_tests_exist_in_the_file_cited(name):
    """`file::test[id]` names a test function of that file; a bare `test_x[id]` one of some test file
    (parametrized ids are not checked: the docs abbreviate them)."""
    wrong = []
    for span in spans(doc(name)):
        for file, test in re.findall(r"(?:(?:tests/)?(test_\w+\.py)::)?\b(test_\w+)\b(?!\.py)", span):
            where = defined_tests().get(test, set())
            if not where or (file and file not in where):
                wrong.append(f"{file}::{test} (defined in {sorted(where) or 'no test file'})")
    for file in re.findall(r"\b(test_\w+\.py)\b", prose(doc(name))):
        if not (REPO / "tests" / file).exists():
            wrong.append(file)
    assert wrong == []


# -- (5) quick start, CI, console scripts ----------------------------------------------------------
def test_quick_start_commands_exist_and_ci_runs_the_test_command():
    commands = re.findall(r"^bash (scripts/\S+)", code_blocks(doc("README.md"), "bash")[0], flags=re.M)
    assert commands == ["scripts/run.sh", "scripts/test.sh"]
    assert all((REPO / c).is_file() for c in commands)
    assert re.search(r"^exec python scripts/replay_trace\.py", (REPO / "scripts/run.sh").read_text(), flags=re.M)
    test_sh = (REPO / "scripts/test.sh").read_text()
    assert "export TRITON_INTERPRET=1" in test_sh and "python -m pytest" in test_sh
    ci = [line for line in (REPO / ".ci/run").read_text().splitlines() if not line.lstrip().startswith("#")]
    assert "bash scripts/test.sh" in ci
    pinned = re.search(r"\(`(torch==[\d.]+)`\)", doc("README.md")).group(1)
    assert f'"{pinned}"' in (REPO / "scripts/setup.sh").read_text()


def test_console_scripts_resolve():
    """hicache-serve and hicache-replay name a module and function that exist (hicache-replay named a
    module scheduler.replay_cli that never existed: the installed command was a ModuleNotFoundError)."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) >= {"hicache-serve", "hicache-replay"}
    for command, target in scripts.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function, None)), f"{command} = {target}"
    for command in re.findall(r"(?<![\w-])(hicache-[a-z]+)(?![\w-])", " ".join(prose(doc(n)) for n in DOCS)):
        assert command in scripts, f"the docs name a command {command} that pyproject.toml does not install"


def test_in_process_example_names_exist():
    from scheduler.engine import Engine
    block = code_blocks(doc("README.md"), "python")[0]
    for module, names in re.findall(r"from ([\w.]+) import ([\w, ]+)", block):
        for name in names.split(","):
            assert hasattr(importlib.import_module(module), name.strip()), f"{module}.{name.strip()}"
    for method in set(re.findall(r"\beng\.(\w+)\(", block)):
        assert callable(getattr(Engine, method, None)), f"Engine.{method}"
    for cls, kwargs in re.findall(r"\b(EngineConfig|SamplingParams)\(([^()]*)\)", block):
        module = importlib.import_module("scheduler.config" if cls == "EngineConfig" else "scheduler.request")
        fields = {f.name for f in dataclasses.fields(getattr(module, cls))}
        assert set(re.findall(r"(\w+)=", kwargs)) <= fields, cls
    from hicache.config import HiCacheConfig
    hicache_fields = {f.name for f in dataclasses.fields(HiCacheConfig)}
    assert set(re.findall(r"with_hicache\((\w+)=", block)) <= hicache_fields


# -- (6) routes, (7) environment -------------------------------------------------------------------
def test_readme_routes_are_served():
    source = (REPO / "scheduler/server.py").read_text()
    served = {re.sub(r"\{[^}]*\}", "{}", r) for r in re.findall(r'@(?:app\.\w+|get)\("(/[^"]*)"\)', source)}
    named = {re.sub(r"\{[^}]*\}", "{}", r) for r in re.findall(r"`(/[\w/{}.-]*)`", bullet("HTTP"))}
    assert len(named) >= 6
    assert sorted(named - served) == []


def test_environment_variables_named_are_read():
    code = "\n".join(p.read_text() for d in (*PACKAGES, "tests") for p in (REPO / d).glob("*.py"))
    code += (REPO / "scripts/test.sh").read_text()
    docs = " ".join(doc(n) for n in DOCS)
    named = set(re.findall(r"`([A-Z][A-Z0-9_]+)=", docs)) | set(re.findall(r"\b(TRITON_INTERPRET|HICACHE_\w+)\b", docs))
    assert {"HICACHE_PDL", "TRITON_INTERPRET"} <= named
    unread = [v for v in sorted(named) if not re.search(rf"environ(?:\.get\(|\.setdefault\(|\[)\"{v}\"|export {v}=|"
                                                         rf"\"{v}\": ", code)]
    assert unread == []
    from kernels import pdl
    assert re.search(r'"HICACHE_PDL", "1"\) != "0"', (REPO / "kernels/pdl.py").read_text()) and hasattr(pdl, "_enabled")
    examples = re.search(r"`HICACHE_STATEFUL_EXAMPLES=N` runs more examples \(CI: (\d+)\)", doc("docs/reliability.md"))
    assert f'"HICACHE_STATEFUL_EXAMPLES", "{examples.group(1)}"' in (REPO / "tests/test_stateful_manager.py").read_text()


# -- code names ------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def code_text() -> str:
    dirs = (*PACKAGES, "scripts", "tests")
    return "\n".join(p.read_text() for d in dirs for p in (REPO / d).glob("*.py")) + (REPO / "pyproject.toml").read_text()


@pytest.mark.parametrize("name", DOCS)
def test_code_names_the_docs_cite_exist(name):
    """Every snake_case or called name in a code span (a function, field, constant, metric or log
    key) occurs in the code, and every `Class.attribute` is one of that class (or its mixins)."""
    classes = {}
    for package in PACKAGES:
        for path in (REPO / package).glob("*.py"):
            for cls in re.findall(r"^class (\w+)", path.read_text(), flags=re.M):
                classes[cls] = f"{package}.{path.stem}"
    missing = []
    for span in spans(doc(name)):
        for word in re.findall(r"(?<![\w./-])([A-Za-z_]\w*_\w+|[A-Za-z_]\w*(?=\())", span):
            if not word.startswith("test_") and not re.search(rf"\b{re.escape(word)}\b", code_text()):
                missing.append(word)
        for cls, attr in re.findall(r"\b([A-Z]\w*)\.(\w+)", span):
            if cls in classes:
                c = getattr(importlib.import_module(classes[cls]), cls)
                sources = "".join(Path(importlib.import_module(k.__module__).__file__).read_text()
                                  for k in c.__mro__ if k.__module__.split(".")[0] in PACKAGES)
                if not hasattr(c, attr) and f"self.{attr} =" not in sources and f"{attr}:" not in sources:
                    missing.append(f"{cls}.{attr}")
    assert sorted(set(missing)) == []
