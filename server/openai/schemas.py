"""Pydantic request models for the OpenAI surfaces.

Unknown fields are ignored (clients send many we do not use); wrong types and
out-of-range values fail validation and become a 400 in OpenAI's error shape.
Fields we understand but cannot honour are rejected explicitly, never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from server.generation import SamplingFields

TokenId = Annotated[int, Field(strict=True, ge=0)]

# OpenAI's limits on `metadata`: it is stored with a response, so its size is bounded.
MetadataKey = Annotated[StrictStr, Field(max_length=64)]
MetadataValue = Annotated[StrictStr, Field(max_length=512)]
OpenAIMetadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(strict=True, ge=0)] | None = 16  # 0: score the prompt
    echo: StrictBool = False
    logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(strict=True, ge=1)] | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class OtherPart(BaseModel):
    """Image, audio, file parts: parsed so we can refuse them by name."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionSpec


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None
    metadata: OpenAIMetadata | None = None  # validated like OpenAI's, then unused
    # Tandem extension: each token's source (a drafter or the target) in the output
    tandem_token_sources: StrictBool = False
