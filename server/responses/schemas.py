"""Pydantic request models of the OpenAI Responses API (`POST /v1/responses`).

Items and parts are discriminated by `type`; types we cannot honour (images, files,
hosted tools) parse into `Other*` models so the handler can refuse them by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictStr, Tag

from server.openai.schemas import FunctionSpec, OpenAIMetadata, SamplingFields


def _type_of(value: Any) -> Any:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


def _part_tag(value: Any) -> str:
    kind = _type_of(value)
    if kind in ("input_text", "output_text"):
        return "text"
    return "refusal" if kind == "refusal" else "other"


def _item_tag(value: Any) -> str:
    kind = _type_of(value)
    if kind is None:
        return "message"  # EasyInputMessage: {"role", "content"} without a type
    known = ("message", "function_call", "function_call_output", "reasoning")
    return kind if kind in known else "other"


def _tool_tag(value: Any) -> str:
    return "function" if _type_of(value) == "function" else "other"


class TextContent(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text"]
    text: StrictStr


class RefusalContent(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["refusal"]
    refusal: StrictStr


class OtherContent(BaseModel):
    """Images, files, audio: parsed so they can be refused by name."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr


ContentPart = Annotated[
    Annotated[TextContent, Tag("text")]
    | Annotated[RefusalContent, Tag("refusal")]
    | Annotated[OtherContent, Tag("other")],
    Discriminator(_part_tag),
]
Content = StrictStr | list[ContentPart]


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: Content


class ReasoningItem(BaseModel):
    """Earlier reasoning handed back by a client. Chat templates drop the reasoning of
    past turns, so it is accepted and not rendered."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]


class OtherItem(BaseModel):
    """Item types we do not serve (item_reference, hosted tool calls): refused by name."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_tag),
]


class FunctionTool(FunctionSpec):
    """Responses function tools are flat: {"type", "name", "description", "parameters"}."""

    type: Literal["function"]
    strict: StrictBool | None = None


class OtherTool(BaseModel):
    """Hosted tools (web_search, file_search, …): parsed so they can be refused by name."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr


ToolItem = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
    Discriminator(_tool_tag),
]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: dict[str, Any] | None = None


class ResponsesRequest(SamplingFields):
    """The Responses body. Tandem's sampling extensions (seed, top_k, stop, …) and the
    speculation overrides come from `SamplingFields`, as on the other surfaces."""

    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    tools: list[ToolItem] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    text: TextConfig | None = None
    previous_response_id: StrictStr | None = None
    store: StrictBool = True
    background: StrictBool | None = None
    conversation: Any = None
    metadata: OpenAIMetadata | None = None
