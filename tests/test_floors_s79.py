"""Each floor pyproject.toml declares admits what the code calls: pip keeps an installed version that satisfies the
range, so a user who has the floor runs the engine on it. Session 79's hunt ran the server, guided, Redis, Responses
and chat-template tests with every dependency at its floor (`pip install --target DIR PKG==FLOOR`, DIR first on
PYTHONPATH) and found: at redis 5.0.0 every Redis L3's close raised AttributeError (no `aclose`); at llguidance 1.0
every guided request of a model with a tokenizer.json failed (TypeError: a list of EOS ids) and speculative guided
decoding cut its answers short (no draft-token masks); at jinja2 3.0 a checkpoint template using the `items` filter
(Qwen3-Coder's) did not compile, so the server refused it; at pydantic 2.5 a function call the openai SDK dumped
with `async_` was a 400 (a config key pydantic 2.5 does not know was silently ignored); and the test extra's openai
1.30 has none of the Responses types the tests import, and its pytest-asyncio 0.23.0 (pip pairs it with pytest 9)
fails the collection of every test file."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# package -> (the least version the code needs, what needs it, where that version was found)
NEEDS = {
    "redis": ((5, 0, 1), "redis.asyncio.Redis.aclose() (hicache/storage_redis.py RedisStore.release_loop)",
              "redis-py #2898 'Provide aclose() / close()', in its 5.0.1 release notes; 5.0.0 has no aclose"),
    "llguidance": ((1, 7, 0), "LLTokenizer(..., eos_token=[ids]) (scheduler/guided.py Guides._tokenizer); also "
                              "LLExecutor.unsafe_compute_mask_ptr_with_draft_token (fill_verify_masks), from 1.2.0",
                   "llguidance's _lib.pyi and a run: 1.6.0 raises TypeError on a list, 1.7.0 takes it"),
    "jinja2": ((3, 1, 0), "the `items` filter chat templates use (Qwen3-Coder's `tool_call.arguments|items`), "
                          "rendered as transformers renders them (scheduler/chat_template.py)",
               "jinja2 3.1.0 added the filter; transformers' apply_chat_template requires jinja2>=3.1.0"),
    "uvicorn": ((0, 29, 0), "uvicorn.Server.capture_signals (scheduler/serve.py _Server)", "uvicorn 0.29.0"),
    "pydantic": ((2, 5, 0), "pydantic.Discriminator and Tag (scheduler/responses_items.py)", "pydantic 2.5.0"),
    # the test extra's
    "pytest-asyncio": ((0, 24, 0), "the asyncio_default_fixture_loop_scope option pyproject's pytest section sets; and "
                                   "0.23.0, which does not cap pytest below 9, collects no test file under pytest 9 "
                                   "(AttributeError: 'FixtureManager' object has no attribute '_arg2fixturedefs')",
                       "pytest-asyncio 0.24.0 added the option (0.23 warns it is unknown) and requires pytest<9"),
    "openai": ((3, 8, 0), "ResponseFunctionToolCall's `async_`, which tests/test_responses_s52_hunt.py dumps",
               "openai 3.8.0's types/responses/response_function_tool_call.py; 3.7.0 has no async_"),
}

# pydantic.ConfigDict's keys at 2.5.0 (its __annotations__ there): pydantic ignores a key it does not know, silently
PYDANTIC_2_5_CONFIG_KEYS = frozenset({
    "alias_generator", "allow_inf_nan", "arbitrary_types_allowed", "coerce_numbers_to_str", "defer_build", "extra",
    "from_attributes", "frozen", "hide_input_in_errors", "ignored_types", "json_encoders", "json_schema_extra",
    "json_schema_mode_override", "json_schema_serialization_defaults_required", "loc_by_alias", "plugin_settings",
    "populate_by_name", "protected_namespaces", "regex_engine", "revalidate_instances", "schema_generator",
    "ser_json_bytes", "ser_json_timedelta", "str_max_length", "str_min_length", "str_strip_whitespace",
    "str_to_lower", "str_to_upper", "strict", "title", "use_enum_values", "validate_assignment", "validate_default",
    "validate_return", "validation_error_cause"})


def _floors() -> dict[str, tuple[int, ...]]:
    """Each dependency's `>=` version in pyproject.toml (the test extra's too), as a tuple of ints (name lower-cased,
    "_" as "-")."""
    floors = {}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for dep in project["dependencies"] + project["optional-dependencies"]["test"]:
        if m := re.match(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", dep):
            floors[m[1].lower().replace("_", "-")] = tuple(int(p) for p in m[2].strip(".").split("."))
    return floors


def _padded(version: tuple[int, ...]) -> tuple[int, ...]:
    return version + (0,) * (3 - len(version))


@pytest.mark.parametrize("package", sorted(NEEDS))
def test_each_floor_is_at_least_what_the_code_needs(package):
    need, what, source = NEEDS[package]
    floor = _floors().get(package)
    assert floor is not None, f"pyproject.toml declares no floor for {package}, which {what} needs"
    assert _padded(floor) >= need, (f"{package}>={'.'.join(map(str, floor))} admits a version without {what}; "
                                    f"it needs {'.'.join(map(str, need))} ({source})")


def test_the_models_use_only_config_keys_the_pydantic_floor_knows():
    """A key newer than the floor is ignored there, not refused: `validate_by_name` (pydantic 2.11) left the
    Responses' FunctionCallItem taking `async` by its alias only at 2.5, and a call the openai SDK dumped
    ("async_": its Python name) back in an input was a 400 "Extra inputs are not permitted"."""
    assert _padded(_floors()["pydantic"]) == (2, 5, 0), "the floor moved: take the key set of the new floor"
    import scheduler.server  # noqa: F401  (every request model of the API defined)
    from pydantic import BaseModel

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)
    ours = {c for c in subclasses(BaseModel) if c.__module__.split(".")[0] in ("scheduler", "hicache")}
    assert ours, "no model found"
    unknown = {f"{c.__module__}.{c.__qualname__}: {sorted(set(c.model_config) - PYDANTIC_2_5_CONFIG_KEYS)}"
               for c in ours if set(c.model_config) - PYDANTIC_2_5_CONFIG_KEYS}
    assert sorted(unknown) == []
