"""Structured outputs' request fields (the engine does the work: scheduler/guided.py). Completions and chat
take any one of:

* OpenAI's `response_format`: {"type": "text"} (nothing), {"type": "json_object"} (any JSON object), or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict"?, "description"?}};
* vLLM's `guided_json` (a schema, as an object or as JSON text), `guided_regex`, `guided_choice` (a list of
  strings: the answer is one of them), `guided_grammar` (a Lark grammar, llguidance's dialect);
* vLLM's newer `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}, one key.

Two of them at once is a 400. A grammar the engine cannot compile is that request's 400, naming the field
it came from (server.py maps the engine's "guided")."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from scheduler.guided import GuidedSpec


class GuidedFieldError(ValueError):
    """A 400 naming `param`, the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Closed):
    name: StrictStr
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # (none: any JSON object)
    strict: StrictBool | None = None  # (llguidance follows the schema either way)


class ResponseFormat(_Closed):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Closed):
    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class GuidedFields(BaseModel):
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: StructuredOutputs | None = None

    def guided(self) -> tuple[str | None, GuidedSpec | None]:
        """(the field that asks for a grammar, its spec); (None, None) when none does. GuidedFieldError (the
        API's 400) for two at once, or a json_schema format without its `json_schema`."""
        asks = [(field, spec) for field, spec in self._asks() if spec is not None]
        if len(asks) > 1:
            raise GuidedFieldError(f"'{asks[0][0]}' and '{asks[1][0]}' both ask for a structured output: give one",
                                   asks[1][0])
        return asks[0] if asks else (None, None)

    def _asks(self):
        """(field, spec or None) of each field that may ask."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
            raise GuidedFieldError("'response_format' of type json_schema needs its 'json_schema'", "response_format")
        if fmt is not None and fmt.type != "text":
            schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else None
            yield "response_format", _spec("json_object", True) if schema is None else _spec("json", schema)
        for kind in ("json", "regex", "choice", "grammar"):
            yield f"guided_{kind}", _spec(kind, getattr(self, f"guided_{kind}"))
        so = self.structured_outputs
        if so is not None:
            keys = ("json", "regex", "choice", "grammar", "json_object")
            given = [k for k in keys if _of(so, k) not in (None, False)]
            if len(given) != 1:
                raise GuidedFieldError("'structured_outputs' takes exactly one of json, regex, choice, grammar, "
                                       "json_object", "structured_outputs")
            yield "structured_outputs", _spec(given[0], _of(so, given[0]))


def _of(so: StructuredOutputs, key: str):
    return so.json_ if key == "json" else getattr(so, key)


def _spec(kind: str, value) -> GuidedSpec | None:
    """A field's value as the engine's spec (None: the field is not given)."""
    if value is None:
        return None
    if kind == "json":
        return GuidedSpec("json_schema", value if isinstance(value, str) else json.dumps(value))
    if kind == "json_object":
        return GuidedSpec.json_object()
    return GuidedSpec(kind, json.dumps(value) if kind == "choice" else value)
