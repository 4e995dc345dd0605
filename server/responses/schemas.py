"""Pydantic request models of the OpenAI Responses API (`POST /v1/responses`).

Items and parts are discriminated by `type`; types we cannot honour parse into
`Other*` models so the handler can refuse them by name (items), show a placeholder
(images, files) or leave them out (hosted tools). Codex CLI's fields that only steer
OpenAI's service (`prompt_cache_key`, `client_metadata`, `reasoning`, `include`
values other than `reasoning.encrypted_content`, `parallel_tool_calls`) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictStr, Tag

from server.generation import SamplingFields
from server.openai.schemas import FunctionSpec, OpenAIMetadata


def _type_of(value: Any) -> Any:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


def _part_tag(value: Any) -> str:
    kind = _type_of(value)
    if kind in ("input_text", "output_text"):
        return "text"
    return "refusal" if kind == "refusal" else "other"


ITEM_TYPES = (
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "local_shell_call",
    "local_shell_call_output",
    "reasoning",
)


def _item_tag(value: Any) -> str:
    kind = _type_of(value)
    if kind is None:
        return "message"  # EasyInputMessage: {"role", "content"} without a type
    return kind if kind in ITEM_TYPES else "other"


def _tool_tag(value: Any) -> str:
    kind = _type_of(value)
    return kind if kind in ("function", "namespace", "custom", "local_shell") else "other"


def _member_tag(value: Any) -> str:
    return "custom" if _type_of(value) == "custom" else "function"


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
    namespace: StrictStr | None = None


class CustomToolCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["custom_tool_call"]
    call_id: StrictStr
    name: StrictStr
    input: StrictStr
    namespace: StrictStr | None = None


class LocalShellCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["local_shell_call"]
    call_id: StrictStr
    action: dict[str, Any]


class ToolOutputItem(BaseModel):
    """A tool's result: of a function, a custom tool or a local shell call."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["custom_tool_call_output", "local_shell_call_output"]
    call_id: StrictStr
    output: Content


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: Content


class ReasoningItem(BaseModel):
    """Earlier reasoning handed back by a client: as text, or as the opaque
    `encrypted_content` this server gave it (see `server/responses/reasoning.py`)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]
    content: list[dict[str, Any]] | None = None
    encrypted_content: StrictStr | None = None


class OtherItem(BaseModel):
    """Item types we do not serve (item_reference, hosted tool calls): refused by name."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[LocalShellCallItem, Tag("local_shell_call")]
    | Annotated[ToolOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ToolOutputItem, Tag("local_shell_call_output")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_tag),
]


class FunctionTool(FunctionSpec):
    """Responses function tools are flat: {"type", "name", "description", "parameters"}."""

    type: Literal["function"]
    strict: StrictBool | None = None


class CustomTool(BaseModel):
    """A freeform tool taking one string (its `format` may give a grammar)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["custom"]
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    format: dict[str, Any] | None = None


NamespaceMember = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")],
    Discriminator(_member_tag),
]


class NamespaceTool(BaseModel):
    """Function and custom tools grouped under a name (Codex CLI's sub-agent tools)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["namespace"]
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    tools: list[NamespaceMember]


class LocalShellTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["local_shell"]


class OtherTool(BaseModel):
    """Hosted tools (web_search, file_search, …): not offered to the model."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr


ToolItem = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[CustomTool, Tag("custom")]
    | Annotated[LocalShellTool, Tag("local_shell")]
    | Annotated[OtherTool, Tag("other")],
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
    include: list[StrictStr] | None = None  # "reasoning.encrypted_content" is honoured
