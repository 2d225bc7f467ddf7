"""Sampling defaults from a checkpoint's generation_config.json, for the fields an HTTP request leaves out
or sets to null, as vLLM's `--generation-config auto` (its default) serves them: Qwen3's
{"temperature": 0.6, "top_k": 20, "top_p": 0.95} make a request without those fields sample as the
model's creator recommends. `hicache-serve --generation-config vllm`, a preset (no file), a checkpoint
without the file or a key the file leaves out (or sets to null): OpenAI's neutral default (temperature 1,
top_p 1, top_k and min_p off, repetition_penalty 1). A request's own value always wins (temperature 0:
greedy). `--generation-config DIR` (vLLM's third form) reads DIR's file instead of the checkpoint's, for any
model. The in-process Engine API (SamplingParams) takes no defaults from here.

Only the five keys below are read, as vLLM reads them (do_sample and the rest are ignored; vLLM's sixth,
max_new_tokens, is not taken: max_tokens keeps the server's defaults). Each value is held to the range
the API holds the request field to (`range_problem`, which api_models uses for temperature and top_p);
one out of range or of another JSON type is a CheckpointError naming the file and the key, at start-up.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.loader import CheckpointError
from scheduler.request import REPETITION_MAX

GENERATION_CONFIG_FILE = "generation_config.json"
# key: (lowest, whether the lowest is allowed, highest (allowed), the range as the API's messages write it)
_RANGES: dict[str, tuple[float, bool, float, str]] = {
    "temperature": (0.0, True, 100.0, "[0, 100]"),
    "top_p": (0.0, False, 1.0, "(0, 1]"),
    "min_p": (0.0, True, 1.0, "[0, 1]"),
    "repetition_penalty": (0.0, False, REPETITION_MAX, f"(0, {REPETITION_MAX:g}]"),
}
TOP_K_MIN = -1  # top_k: an integer >= -1 (0 and -1: off), as the API's field (scheduler/sampler_fields.py)


def range_problem(key: str, value: float | None) -> str | None:
    """What is wrong with a number for `key` (temperature, top_p, min_p, repetition_penalty), as the
    rest of a message that names the key ("must be in [0, 100], got 150"); None: in range, or None."""
    if value is None:
        return None
    low, low_allowed, high, text = _RANGES[key]
    inside = (low <= value if low_allowed else low < value) and value <= high  # (NaN: outside)
    return None if inside else f"must be in {text}, got {value}"


@dataclass(frozen=True)
class GenerationDefaults:
    """A request field's default where the request leaves it out or sets it to null; None: OpenAI's."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def given(self) -> dict[str, float | int]:
        """The defaults the file set, by key."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def fill(self, req: Any) -> Any:
        """A copy of the request model (api_models' _SamplingFields) with these in the fields it leaves
        out or sets to null; the request itself when there is nothing to fill."""
        update = {k: v for k, v in self.given().items() if getattr(req, k) is None}
        return req.model_copy(update=update) if update else req

    def describe(self) -> str | None:
        """The start-up line, or None when the file set none."""
        given = self.given()
        if not given:
            return None
        values = ", ".join(f"{k} {v}" for k, v in given.items())
        return f"sampling defaults from {GENERATION_CONFIG_FILE}: {values} (--generation-config vllm: OpenAI's)"


def _problem(key: str, value: Any) -> str | None:
    if key == "top_k":
        if isinstance(value, bool) or not isinstance(value, int) or value < TOP_K_MIN:
            return f"must be an integer >= {TOP_K_MIN} (0 or -1: off), got {json.dumps(value)}"
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number, got {json.dumps(value)}"
    return range_problem(key, value)


def read_generation_defaults(checkpoint_dir: str | Path) -> GenerationDefaults:
    """generation_config.json's sampling defaults in `checkpoint_dir` (no file: none). Raises
    CheckpointError naming the file (and the key) when it is unreadable or a value is wrong."""
    path = Path(checkpoint_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return GenerationDefaults()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, not {type(data).__name__}")
    values: dict[str, float | int] = {}
    for field in dataclasses.fields(GenerationDefaults):
        key, value = field.name, data.get(field.name)
        if value is None:  # left out or null: OpenAI's default
            continue
        problem = _problem(key, value)
        if problem:
            raise CheckpointError(f"{path}: '{key}' {problem}")
        values[key] = value if key == "top_k" else float(value)
    return GenerationDefaults(**values)
