"""A Responses request's `input` items (scheduler/api_responses.py): messages (text parts only), function calls and
their outputs, reasoning items, each validated as OpenAI's (an earlier response's `output` items may be sent back as
they came: the SDK's fields that change nothing here are accepted), told apart by `type` (a message's where it has
none)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, StrictBool, StrictStr, Tag, TypeAdapter, model_validator
from pydantic_core import PydanticCustomError

from scheduler.api_models import _Strict


class TextPart(_Strict):
    """A message's text: an input_text part, or an output_text one (an earlier response's, sent back)."""
    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None  # (an output_text's, as this server sent it: left unused)
    logprobs: list[Any] | None = None
    parsed: Any = None  # (the openai SDK's parse helpers add it to the parts they return)


def _text_parts_only(parts: Any) -> None:
    for part in parts if isinstance(parts, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in ("input_text", "output_text"):
            raise PydanticCustomError("unsupported_value", "content parts of type {kind} are not supported (this "
                                      "server takes text only: 'input_text' / 'output_text' parts or a string)",
                                      {"kind": repr(kind)})


class MessageItem(_Strict):
    type: Literal["message"] | None = "message"  # (null: a message, as a null takes its default elsewhere)
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[TextPart]
    id: StrictStr | None = None  # (an output message's, sent back)
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    # OpenAI's: an assistant message's place in a turn, which the SDK's types ask clients to send back (Codex does;
    # an output's model_dump() carries it at null): accepted, changing nothing (regression: a 400)
    phase: Literal["commentary", "final_answer"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _parts(cls, data: Any) -> Any:
        _text_parts_only(data.get("content") if isinstance(data, dict) else None)
        return data


class FunctionCallItem(_Strict):
    # `async` by its name in the SDK's type too (its model_dump() writes "async_": a 400 of an output sent back)
    # (populate_by_name: pydantic 2.11's validate_by_name is ignored by the declared floor, 2.5)
    model_config = ConfigDict(**_Strict.model_config, populate_by_name=True)
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    parsed_arguments: Any = None  # (the openai SDK's stream helper's parse of `arguments`: left unused)
    # OpenAI's fields of a call and of its output (the SDK's types): accepted, changing nothing (regression: a 400)
    caller: Any = None
    namespace: StrictStr | None = None
    async_: StrictBool | None = Field(None, alias="async")


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[TextPart]
    id: StrictStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    caller: Any = None  # (as a call's: accepted, changing nothing)
    namespace: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _parts(cls, data: Any) -> Any:
        _text_parts_only(data.get("output") if isinstance(data, dict) else None)
        return data


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


class ReasoningItem(_Strict):
    """An earlier response's thinking, sent back: its text becomes its assistant turn's reasoning_content."""
    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return "\n".join(p.text for p in self.content or self.summary)


_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
          "reasoning": ReasoningItem}


def _item_kind(item: Any) -> Any:
    """An item's type: a message's where it has none (or null), as the API's easy input message."""
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return "message" if kind is None else kind


InputItem = Annotated[Union[tuple(Annotated[model, Tag(kind)] for kind, model in _ITEMS.items())],
                      Discriminator(_item_kind)]
_INPUT_ITEM = TypeAdapter(InputItem)
