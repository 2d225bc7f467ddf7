"""What the code's own text names exists (session 74's hunt): every `--flag` in a string literal of hicache/,
scheduler/ and scripts/ (error and warning messages, help texts, docstrings shown as --help) is an option of some
parser (the server's, the replay's, a script's, pytest's), and one in the engine's or the server's packages is an
option of hicache-serve or hicache-replay, the programs that raise them; the replay's flags built from argparse
dests (flag_name) are its options; `EngineConfig.x` / `ServerLimits.x` / `hicache.x` name fields; and a refused
request names the field at fault (regression: a negative id in `stop_token_ids` was a 400 with param "stop").
A renamed flag or field left behind in a message sends the user the wrong way; tests/test_docs_truth.py pins the
same for README.md and docs/. Fast: parsers built, sources parsed, no engine."""
from __future__ import annotations

import ast
import dataclasses
import re
from functools import lru_cache
from pathlib import Path

import pytest

from hicache.config import HiCacheConfig
from scheduler import replay_args, replay_memory, serve
from scheduler.api_inputs import parse_prompts
from scheduler.api_models import APIError
from scheduler.config import EngineConfig
from scheduler.server import ServerLimits

REPO = Path(__file__).resolve().parents[1]
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
# flags of other programs, named as theirs: (file, flag) -> why
FOREIGN = {
    ("hicache/transfer.py", "--gather"): "the module docstring's diagram: an arrow through the gather kernel",
    ("hicache/transfer.py", "--one"): "the diagram: an arrow through one DMA",
    ("hicache/transfer.py", "--scatter"): "the diagram: an arrow through the scatter kernel",
    ("scheduler/prompt_logprobs_api.py", "--max-logprobs"): "vLLM's flag, named as vLLM's",
    **{("scripts/bench_storage.py", f): "redis-server's, for the benchmark's own server"
       for f in ("--bind", "--save", "--appendonly", "--maxmemory", "--maxmemory-policy")},
}


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (REPO / folder).glob("*.py"))


def string_flags(path: Path) -> list[tuple[int, str]]:
    """(line, flag) of each `--flag` in the file's string literals (an f-string's literal parts included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out += [(node.lineno, flag) for flag in FLAG.findall(node.value)]
    return out


def option_strings(parser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


@lru_cache(maxsize=None)
def program_flags() -> frozenset[str]:
    """hicache-serve's and hicache-replay's options (the engine's among both)."""
    return frozenset(option_strings(serve.build_parser()) | option_strings(replay_args.build_parser()))


@lru_cache(maxsize=None)
def all_flags() -> frozenset[str]:
    """Every option of every parser: the programs', each script's add_argument literals, pytest's (conftest)."""
    flags = set(program_flags()) | {"--help"}
    for path in sources("scripts"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    flags |= set(re.findall(r'addoption\("(--[\w-]+)"', (REPO / "tests" / "conftest.py").read_text()))
    return frozenset(flags)


def unknown(flag: str, known: frozenset[str]) -> bool:
    """A flag no parser has; one ending in "-" ("--hicache-*") is a prefix that must start some option."""
    if flag.endswith("-"):
        return not any(k.startswith(flag) for k in known)
    return flag not in known


def test_every_flag_a_source_string_names_is_an_option_of_some_parser():
    missing = [f"{path.relative_to(REPO)}:{line} {flag}" for path in sources("hicache", "scheduler", "scripts")
               for line, flag in string_flags(path)
               if (str(path.relative_to(REPO)), flag) not in FOREIGN and unknown(flag, all_flags())]
    assert missing == []


def test_the_engine_and_server_packages_name_the_options_of_the_programs_that_raise_them():
    """hicache/ and scheduler/ speak to hicache-serve's and hicache-replay's users: a flag only a benchmark script
    takes (--storage-path for --hicache-storage-path) would be the wrong one there."""
    wrong = [f"{path.relative_to(REPO)}:{line} {flag}" for path in sources("hicache", "scheduler")
             for line, flag in string_flags(path)
             if (str(path.relative_to(REPO)), flag) not in FOREIGN and unknown(flag, program_flags())]
    assert wrong == []


def test_the_replays_flags_built_from_dests_are_its_options():
    """replay_memory.flag_name(dest) names the option in the replay's refusals and warnings: each dest it is given
    is one whose option has that spelling."""
    dests = {*replay_args.REPLAY_OPTIONS, *replay_args.REPLAY_MINIMUMS, *replay_args.POSITIVE_OPTIONS,
             *(k for keys in replay_memory.TIER_SIZE_OPTIONS.values() for k in keys), "json_out", "log_json"}
    options = option_strings(replay_args.build_parser())
    assert sorted(d for d in dests if replay_memory.flag_name(d) not in options) == []


def test_the_config_fields_a_string_names_are_fields():
    """`EngineConfig.x`, `ServerLimits.x` and `hicache.x` (a HiCacheConfig field) in the code's strings and in the
    docs; `hicache.x` may also be a module of hicache/ (or the cost policy's logger, hicache.cost)."""
    attrs = {name: {f.name for f in dataclasses.fields(cls)} | set(dir(cls))
             for name, cls in (("EngineConfig", EngineConfig), ("ServerLimits", ServerLimits))}
    attrs["hicache"] = ({f.name for f in dataclasses.fields(HiCacheConfig)} | {"cost"}
                        | {p.stem for p in (REPO / "hicache").glob("*.py")})
    named = re.compile(r"\b(EngineConfig|ServerLimits|hicache)\.([a-z_][a-z0-9_]*)")
    texts = [(str(p.relative_to(REPO)), n.value) for p in sources("hicache", "scheduler", "scripts")
             for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    texts += [(name, (REPO / name).read_text()) for name in ("README.md", "docs/design.md", "docs/reliability.md")]
    wrong = sorted({f"{where}: {owner}.{field}" for where, text in texts for owner, field in named.findall(text)
                    if field not in attrs[owner]})
    assert wrong == []


@pytest.mark.parametrize("field, param", [({"stop_token_ids": [-1]}, "stop_token_ids"),
                                          ({"stop": [3, -1], "stop_token_ids": [2]}, "stop"),
                                          ({"stop": 3, "stop_token_ids": [5, -2]}, "stop_token_ids")])
def test_a_negative_stop_token_id_names_the_field_that_held_it(field, param):
    """(regression: `stop_token_ids: [-1]` was a 400 with param "stop", a field the request had not sent)"""
    with pytest.raises(APIError) as err:
        parse_prompts({"prompt": [1, 2, 3], "max_tokens": 4, **field}, False, tokenizer=None, served_names={"tiny"},
                      model_name="tiny", vocab_size=512, prompt_limit=64, max_tokens_limit=16)
    assert (err.value.status, err.value.param) == (400, param) and param in err.value.message, err.value.message
