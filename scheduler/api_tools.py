"""Tool calling's request fields (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`; an assistant message's
`tool_calls`), as vLLM serves them:

* `tools` are rendered into the prompt by the chat template (its `tools` variable: Qwen3's lists them in the
  system turn), whatever the tool_choice;
* tool_choice "none": the answer is text; "auto" (the default when there are tools): the model may call
  them, its calls read from its text by the server's parser (`--enable-auto-tool-choice --tool-call-parser
  hermes`; without them "auto" is a 400, as vLLM's); "required": the answer is held (structured outputs,
  scheduler/guided.py) to a JSON list of calls, [{"name": ..., "parameters": {...}}, ...], one or more (one
  with parallel_tool_calls false); {"type": "function", "function": {"name": ...}}: the answer is held to
  that function's parameters schema and is its one call's arguments (finish_reason "stop", as OpenAI's);
* an assistant message's `tool_calls` reach the template with their arguments as objects (vLLM's: templates
  write them with tojson), a tool message's `tool_call_id` as it is.

Reading calls out of an answer: scheduler/chat_answer.py (a choice's message) and scheduler/tool_calls.py
(the parser)."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from scheduler.api_guided import GuidedFieldError
from scheduler.guided import GuidedSpec
from scheduler.tool_calls import ToolCall, json_text, loads_keeping_numbers


class ToolFieldError(GuidedFieldError):
    """A 400 naming `param` (a GuidedFieldError: a tool_choice may ask for a grammar, as the guided fields do)."""


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class FunctionDefinition(_Closed):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (none: any object)
    strict: StrictBool | None = None  # (the arguments follow a schema only where the answer is held to it)


class ToolDefinition(_Closed):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Closed):
    name: StrictStr


class NamedToolChoice(_Closed):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Closed):
    name: StrictStr
    arguments: StrictStr  # JSON text, as the API returned it
    # the openai SDK's stream helper's parse of `arguments` (null, or its object), in the message it built and a
    # conversation sends back (regression: a 400 "unknown field ...function.parsed_arguments"); left unused
    parsed_arguments: Any = None


class MessageToolCall(_Closed):
    """A call in an assistant message sent back (the API's own `tool_calls` items)."""
    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction
    index: StrictInt | None = None  # (the stream's position of the call, in a message the SDK added up; unused)

    def as_template_dict(self) -> dict:
        args: Any = self.function.arguments
        try:  # (vLLM's: templates write arguments with tojson, so JSON's text would be quoted twice (a list's too,
            # regression); none, "" or "null", are {}: a template wrote "arguments": } into the prompt, regression;
            # text that is no JSON stays text, where vLLM's json.loads fails the request)
            parsed = json.loads(args) if args.strip() else None
            args = {} if parsed is None else parsed
        except (ValueError, RecursionError):
            pass
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


ToolMode = Literal["none", "auto", "required", "named"]


class ToolFields(BaseModel):
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # (OpenAI's default: true)

    def tool_mode(self) -> ToolMode:
        """What the answer may do with the tools: no tools is "none" (a tool_choice of "auto" changes nothing)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        if not self.tools:
            return "none" if choice in (None, "none", "auto") else choice
        return choice or "auto"

    def check_tools(self, auto_enabled: bool) -> None:
        """ToolFieldError (the API's 400) for a tool_choice the tools or the server cannot serve."""
        names = [t.function.name for t in self.tools or ()]
        seen: set[str] = set()  # (regression: names.count per name, quadratic: 39,000 tools held the loop 17 s)
        if dup := next((n for n in names if n in seen or seen.add(n)), None):
            raise ToolFieldError(f"tool name {dup!r} is given twice", "tools")
        if "" in names:
            raise ToolFieldError("a tool's function name may not be empty", "tools")
        mode = self.tool_mode()
        if mode in ("required", "named") and not names:  # (a named choice by its function: /v1/responses' client
            # sent its own form, not the chat's this one was translated into; regression: that was quoted)
            what = f"naming function {self.tool_choice.function.name!r}" if mode == "named" else '"required"'
            raise ToolFieldError(f"tool_choice {what} needs 'tools'", "tool_choice")
        if mode == "named" and self.tool_choice.function.name not in names:
            raise ToolFieldError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not "
                                 f"in 'tools'", "tool_choice")
        if mode == "auto" and not auto_enabled:  # (vLLM's 400; tools with tool_choice "none" are served)
            raise ToolFieldError('"auto" tool choice (the default when tools are given) needs the server started with '
                                 '--enable-auto-tool-choice --tool-call-parser hermes; or send tool_choice "none", '
                                 '"required" or a named function', "tool_choice")

    def tool_spec(self) -> GuidedSpec | None:
        """The grammar a "required" or named tool_choice holds the answer to (None otherwise)."""
        mode = self.tool_mode()
        if mode == "named":
            params = self._tool(self.tool_choice.function.name).function.parameters
            return GuidedSpec("json_schema", json.dumps(params or {"type": "object"}))
        if mode != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": _parameters(t, _at(i))},
                  "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(self.tools)]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}} | _lift_defs(self.tools)
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return GuidedSpec("json_schema", json.dumps(schema))

    def _tool(self, name: str) -> ToolDefinition:
        return next(t for t in self.tools if t.function.name == name)


def required_calls(text: str) -> list[ToolCall] | None:
    """The calls of an answer held to a "required" list (None where the text is not one: cut off by max_tokens).
    A named function's one call is the answer's text as its arguments (scheduler/chat_answer.py)."""
    try:
        items = loads_keeping_numbers(text)  # (its numbers as the model wrote them: 1E999 is no Infinity)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    try:
        return [ToolCall(i["name"], json_text(i.get("parameters", {}))) for i in items]
    except RecursionError:  # (arguments nested deeper than json_text writes back: no list of calls, as unparsable)
        return None


def _at(index: int) -> str:
    """Where tool `index`'s parameters sit in a required list's schema (a JSON pointer, as a "$ref" writes it)."""
    return f"#/items/anyOf/{index}/properties/parameters"


def _parameters(tool: ToolDefinition, at: str) -> dict:
    """A tool's arguments schema, sitting at `at`: without its "$defs" (lifted to the top of the whole schema:
    `_lift_defs`), its other references into itself pointed at where it sits (`_repointed`)."""
    params = tool.function.parameters
    if not params:
        return {"type": "object"}
    # (its "$id" too: a base of its own would resolve "#/$defs/..." within it, where they no longer are)
    return _repointed({k: v for k, v in params.items() if k not in ("$defs", "$id")}, at)


_NAMED_SCHEMAS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")  # name -> schema
_DATA = ("enum", "const", "default", "examples")  # values, not schemas: a "$ref" in them is data


def _repointed(schema: Any, at: str) -> Any:
    """`schema` with its "$ref"s into itself ("#...", but "#/$defs/...": lifted) made to point under `at`
    (regression: draft-07's "#/definitions/...", which pydantic v1 and many generators write, "#/properties/..."
    and "#" pointed at the top of the whole list's schema: a 400 for a valid tool; vLLM's lifts "$defs" alone)."""
    if isinstance(schema, list):
        return [_repointed(s, at) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")) \
                and not value.startswith("#/$defs/"):  # (not "#name", a $anchor's: it names where it points)
            value = at + value[1:]
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            value = {name: _repointed(s, at) for name, s in value.items()}
        elif key not in _DATA:
            value = _repointed(value, at)
        out[key] = value
    return out


def _lift_defs(tools: list[ToolDefinition]) -> dict:
    """The tools' "$defs" at the top of the schema, where their "#/$defs/..." references point (vLLM's); a
    name two tools define differently is a 400."""
    defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        defs_of = (tool.function.parameters or {}).get("$defs") or {}
        for name, schema in defs_of.items() if isinstance(defs_of, dict) else ():
            schema = _repointed(schema, _at(i))
            if name in defs and defs[name] != schema:
                raise ToolFieldError(f"tools define '$defs' {name!r} differently; a required tool_choice needs "
                                     f"one definition", "tools")
            defs[name] = schema
    return {"$defs": defs} if defs else {}
