"""Pydantic request models for the OpenAI surfaces.

Unknown fields are ignored (clients send many we do not use); wrong types and
out-of-range values fail validation and become a 400 in OpenAI's error shape.
Fields we understand but cannot honour are rejected explicitly, never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

TokenId = Annotated[int, Field(strict=True, ge=0)]

# OpenAI's limits on `metadata`: it is stored with a response, so its size is bounded.
MetadataKey = Annotated[StrictStr, Field(max_length=64)]
MetadataValue = Annotated[StrictStr, Field(max_length=512)]
OpenAIMetadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """Fields shared by every OpenAI generation endpoint."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None
    min_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = None
    seed: StrictInt | None = None
    presence_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(strict=True, ge=0.01, le=10.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(strict=True, ge=-100.0, le=100.0)]] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(strict=True, ge=1)] = 1
    user: str | None = None
    ignore_eos: StrictBool = False  # vLLM extension: generate to max_tokens
    # Speculation overrides (honoured once the speculative engine lands).
    enable_pld: StrictBool | None = None
    enable_draft: StrictBool | None = None
    num_draft_tokens: Annotated[int, Field(strict=True, ge=0, le=64)] | None = None


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
