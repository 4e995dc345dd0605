"""The response models GET /openapi.json documents (documentation only).

Why apart: the server builds its replies as dicts; these models only describe them, for
the document and for the fuzzer that checks replies against it. They allow extra
properties (`Open`) so adding a field never breaks a client that validates.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class Open(BaseModel):
    """A response object: the listed fields are promised, more may appear."""

    model_config = ConfigDict(extra="allow")


class ErrorDetail(Open):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(Open):
    error: ErrorDetail


class Usage(Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(Open):
    index: int
    text: str
    finish_reason: str | None


class Completion(Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(Open):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(Open):
    index: int
    message: AssistantMessage
    finish_reason: str | None


class ChatCompletion(Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(Open):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Open):
    index: int
    delta: ChatDelta
    finish_reason: str | None


class ChatCompletionChunk(Open):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(Open):
    object: Literal["list"]
    data: list[ModelCard]


class Health(Open):
    status: str
    error: str | None = None


class Stats(Open):
    model: str
    mode: str
    uptime_s: float
    requests: dict[str, Any]


class UiStatus(Open):
    model: str
    state: str
    engine: str
    requests: dict[str, Any]
    tokens: dict[str, Any]
    speculation: dict[str, Any]
    yours: list[dict[str, Any]]


class AnthropicErrorDetail(Open):
    type: str
    message: str


class AnthropicError(Open):
    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicUsage(Open):
    input_tokens: int
    output_tokens: int


class Message(Open):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage


class MessageStreamEvent(Open):
    type: str


class TokenCount(Open):
    input_tokens: int


class Tokenized(Open):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class Detokenized(Open):
    prompt: str


class TokenizerInfo(Open):
    """vLLM's: the tokenizer's settings, whatever they hold, plus these."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None = None


class ResponseObject(Open):
    id: str
    object: Literal["response"]
    created_at: float
    status: str
    model: str
    output: list[dict[str, Any]]


class ResponseStreamEvent(Open):
    type: str
    sequence_number: int


class Deleted(Open):
    id: str
    object: str
    deleted: bool


class OpenApiDocument(Open):
    openapi: str
    info: dict[str, Any]
    paths: dict[str, Any]
