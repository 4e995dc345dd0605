"""Pydantic request models for the Anthropic Messages surface.

Unknown fields are ignored (SDKs and Claude Code send many we do not use: `citations`,
`service_tier`, `context_management`, `anthropic-beta` features); `cache_control` is
kept where it marks a prefix to cache (see `server/anthropic/prompt.py`); wrong types
and out-of-range values fail validation and become a 400 in Anthropic's error shape.
Content blocks are told apart by their `type`, so a text block with a bad `text` is
reported as such instead of as "some other block".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
)

Temperature = Annotated[
    float, Field(strict=True, ge=0.0, le=2.0)
]  # Anthropic says 0..1; OpenAI's 2 is fine
DraftTokens = Annotated[StrictInt, Field(ge=0, le=64)]


def _type_of(value: Any) -> Any:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


def text_as_blocks(value: Any) -> Any:
    """A plain string is shorthand for one text block; None for none."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content blocks")
    return value


def _result_tag(value: Any) -> str:
    return "text" if _type_of(value) == "text" else "other"


CacheControl = dict[str, Any] | None  # {"type": "ephemeral", "ttl"?}: a prefix to keep


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl = None


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    cache_control: CacheControl = None


class OtherBlock(BaseModel):
    """Image, document, search result, ...: images and documents become a placeholder,
    the others are refused by name."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr


ResultBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[OtherBlock, Tag("other")],
    Discriminator(_result_tag),
]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: Annotated[list[ResultBlock], BeforeValidator(text_as_blocks)] = []
    is_error: StrictBool | None = None
    cache_control: CacheControl = None


class ThinkingBlock(BaseModel):
    """Reasoning from an earlier turn, sent back by clients; not rendered again."""

    model_config = ConfigDict(extra="allow")
    type: Literal["thinking", "redacted_thinking"]


_BLOCK_TAGS = {"text", "tool_use", "tool_result", "thinking", "redacted_thinking"}


def _block_tag(value: Any) -> str:
    kind = _type_of(value)
    if kind == "redacted_thinking":
        return "thinking"
    return kind if isinstance(kind, str) and kind in _BLOCK_TAGS else "other"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_tag),
]


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant", "system"]  # Claude Code sends system turns here
    content: Annotated[list[ContentBlock], BeforeValidator(text_as_blocks)]


class ToolDefinition(BaseModel):
    """A client tool; server tools (`type: "web_search_..."`, ...) are not offered."""

    model_config = ConfigDict(extra="ignore")
    name: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    type: StrictStr | None = None
    description: StrictStr | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class SpeculationFields(BaseModel):
    """Tandem's per-request speculation switches, top-level or inside `metadata`."""

    model_config = ConfigDict(extra="ignore")
    enable_pld: StrictBool | None = None
    enable_draft: StrictBool | None = None
    num_draft_tokens: DraftTokens | None = None


class Metadata(SpeculationFields):
    user_id: Annotated[StrictStr, Field(max_length=256)] | None = None  # Anthropic's limit


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: StrictStr | None = None  # accepted and ignored, like `thinking`
    format: dict[str, Any] | None = None


class MessagesPrompt(BaseModel):
    """What is rendered into the prompt: shared by /v1/messages and count_tokens."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: Annotated[list[TextBlock], BeforeValidator(text_as_blocks)] = []
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # accepted; reasoning is split whenever emitted


class CountTokensRequest(MessagesPrompt):
    pass


class MessagesRequest(MessagesPrompt, SpeculationFields):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: list[StrictStr] | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    stream: StrictBool = False
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    output_format: dict[str, Any] | None = None  # the older spelling of output_config.format
