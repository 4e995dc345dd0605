"""GET /openapi.json: an OpenAPI 3.1 document generated from the pydantic models.

Every documented route is one `Endpoint` in `ENDPOINTS`. To document a new surface
(Anthropic `/v1/messages`, `/v1/responses`), append an entry with its own request and
response models, the models of its stream events' `data`, and its own error model:

    Endpoint("POST", "/v1/messages", "Anthropic messages", "anthropic",
             request=MessagesRequest, response=Message, stream=(MessageStreamEvent,),
             errors=GENERATION_ERRORS, error_model=AnthropicError)

Path parameters (`/v1/responses/{response_id}`) are documented from the path itself.

Response models (server/openapi_models.py) only document (and let a fuzzer check) what
the server sends; they allow extra properties so adding a field never breaks a client
that validates.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from pydantic import BaseModel

from server.anthropic.schemas import CountTokensRequest, MessagesRequest
from server.config import ServerConfig
from server.openai.schemas import ChatCompletionRequest, CompletionRequest
from server.openapi_models import (
    AnthropicError,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    Deleted,
    Detokenized,
    Health,
    Message,
    MessageStreamEvent,
    ModelList,
    OpenAIError,
    OpenApiDocument,
    ResponseObject,
    ResponseStreamEvent,
    Stats,
    TokenCount,
    Tokenized,
    TokenizerInfo,
    UiStatus,
)
from server.responses.schemas import ResponsesRequest
from server.tokenizer_endpoints import DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"


# --- the documented endpoints -------------------------------------------------------------

ERROR_DESCRIPTIONS = {
    400: "Invalid request (validation, unsupported field, prompt longer than the context)",
    401: "Missing or invalid API key",
    404: "Unknown model",
    413: "Request body too large",
    429: "Rate limit exceeded (see Retry-After)",
    503: "Queue full or model not ready (see Retry-After)",
    504: "Request timed out",
}
GENERATION_ERRORS = (400, 401, 404, 413, 429, 503, 504)
TOKENIZER_ERRORS = (400, 401, 404, 413, 429, 503)  # 503 while the model loads
READ_ERRORS = (401, 429)


@dataclass(frozen=True)
class Endpoint:
    """One documented operation. `stream` lists the models an SSE event's `data` may
    carry (besides `[DONE]` and an error); `keys` names the ServerConfig fields holding
    the keys the route accepts (none: open); `only_if` names a ServerConfig flag that
    must be true for the route to exist."""

    method: str
    path: str
    summary: str
    tag: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    stream: tuple[type[BaseModel], ...] = ()
    text: bool = False
    media_types: tuple[str, ...] = ()  # other bodies: the web page's files
    errors: tuple[int, ...] = READ_ERRORS
    error_model: type[BaseModel] = OpenAIError
    keys: tuple[str, ...] = ("api_keys",)
    only_if: str | None = None


ENDPOINTS = (
    Endpoint(
        "POST",
        "/v1/completions",
        "OpenAI text completion",
        "openai",
        request=CompletionRequest,
        response=Completion,
        stream=(CompletionChunk,),
        errors=GENERATION_ERRORS,
    ),
    Endpoint(
        "POST",
        "/v1/chat/completions",
        "OpenAI chat completion",
        "openai",
        request=ChatCompletionRequest,
        response=ChatCompletion,
        stream=(ChatCompletionChunk,),
        errors=GENERATION_ERRORS,
    ),
    Endpoint(
        "POST",
        "/v1/responses",
        "OpenAI Responses",
        "openai",
        request=ResponsesRequest,
        response=ResponseObject,
        stream=(ResponseStreamEvent,),
        errors=GENERATION_ERRORS,
    ),
    Endpoint(
        "GET",
        "/v1/responses/{response_id}",
        "A stored response",
        "openai",
        response=ResponseObject,
        errors=(401, 404, 429),
    ),
    Endpoint(
        "DELETE",
        "/v1/responses/{response_id}",
        "Forget a stored response",
        "openai",
        response=Deleted,
        errors=(401, 404, 429),
    ),
    Endpoint(
        "POST",
        "/v1/messages",
        "Anthropic messages",
        "anthropic",
        request=MessagesRequest,
        response=Message,
        stream=(MessageStreamEvent,),
        errors=GENERATION_ERRORS,
        error_model=AnthropicError,
    ),
    Endpoint(
        "POST",
        "/v1/messages/count_tokens",
        "Anthropic token count",
        "anthropic",
        request=CountTokensRequest,
        response=TokenCount,
        errors=GENERATION_ERRORS,
        error_model=AnthropicError,
    ),
    # vLLM's tokenizer routes, at the root as vLLM has them (lm-eval asks for them there).
    Endpoint(
        "POST",
        "/tokenize",
        "Text or chat messages as the model's token ids",
        "tokenizer",
        request=TokenizeRequest,
        response=Tokenized,
        errors=TOKENIZER_ERRORS,
    ),
    Endpoint(
        "POST",
        "/detokenize",
        "Token ids as text",
        "tokenizer",
        request=DetokenizeRequest,
        response=Detokenized,
        errors=TOKENIZER_ERRORS,
    ),
    Endpoint(
        "GET",
        "/tokenizer_info",
        "The tokenizer's settings and chat template",
        "tokenizer",
        response=TokenizerInfo,
        errors=(*READ_ERRORS, 503),
    ),
    # 503 with Retry-After until the model has loaded, like generation.
    Endpoint(
        "GET",
        "/v1/models",
        "The served model",
        "openai",
        response=ModelList,
        errors=(*READ_ERRORS, 503),
    ),
    # While loading (or after a load failure) /health answers 503 with its own body.
    Endpoint(
        "GET",
        "/health",
        "Readiness",
        "operations",
        response=Health,
        errors=(503,),
        error_model=Health,
        keys=(),
    ),
    Endpoint("GET", "/v1/stats", "Counters as JSON", "operations", response=Stats),
    Endpoint(
        "GET",
        "/metrics",
        "Prometheus metrics",
        "operations",
        text=True,
        errors=(401,),  # never rate limited
        keys=("api_keys", "metrics_api_keys"),
        only_if="metrics",
    ),
    Endpoint("GET", "/openapi.json", "This document", "operations", response=OpenApiDocument),
    # The web page (server/ui): open, it asks for a key; its data endpoint is not.
    Endpoint(
        "GET",
        "/",
        "The web page",
        "web",
        media_types=("text/html",),
        errors=(),
        keys=(),
        only_if="ui",
    ),
    Endpoint(
        "GET",
        "/ui/static/{name}",
        "The web page's script, style and icon",
        "web",
        media_types=("text/html", "text/css", "text/javascript", "image/svg+xml"),
        errors=(404,),
        keys=(),
        only_if="ui",
    ),
    Endpoint(
        "GET",
        "/ui/status",
        "Live figures for the web page",
        "web",
        response=UiStatus,
        only_if="ui",
    ),
)


# --- building the document ----------------------------------------------------------------


def build_openapi(config: ServerConfig) -> dict[str, Any]:
    """The document for this server's configuration (routes that exist, auth in use)."""
    components: dict[str, Any] = {}
    paths: dict[str, dict[str, Any]] = {}
    for endpoint in ENDPOINTS:
        if endpoint.only_if and not getattr(config, endpoint.only_if):
            continue
        operation = build_operation(endpoint, config, components)
        paths.setdefault(endpoint.path, {})[endpoint.method.lower()] = operation
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "Tandem", "version": package_version()},
        "paths": paths,
        "components": {"schemas": dict(sorted(components.items()))},
    }
    if any("security" in op for item in paths.values() for op in item.values()):
        document["components"]["securitySchemes"] = security_schemes()
    return document


def security_schemes() -> dict[str, Any]:
    """The two ways a key may be presented (server/auth.py)."""
    return {
        "bearer": {"type": "http", "scheme": "bearer"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
    }


def requires_key(endpoint: Endpoint, config: ServerConfig) -> bool:
    return any(getattr(config, field) for field in endpoint.keys)


def documented_errors(endpoint: Endpoint, config: ServerConfig) -> list[int]:
    """401 only where a key is required, 429 only with a rate limit; the others can
    happen whatever the configuration."""
    return [
        status
        for status in endpoint.errors
        if (status != 401 or requires_key(endpoint, config))
        and (status != 429 or config.rate_limit_per_minute > 0)
    ]


def build_operation(endpoint: Endpoint, config: ServerConfig, components: dict) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": operation_id(endpoint),
        "summary": endpoint.summary,
        "tags": [endpoint.tag],
        "responses": {"200": success_response(endpoint, components)},
    }
    parameters = path_parameters(endpoint.path)
    if parameters:
        operation["parameters"] = parameters
    if endpoint.request is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": ref(endpoint.request, components)}},
        }
    error = ref(endpoint.error_model, components)
    for status in documented_errors(endpoint, config):
        operation["responses"][str(status)] = error_response(status, error)
    if requires_key(endpoint, config):
        operation["security"] = [{name: []} for name in security_schemes()]  # either one
    return operation


def success_response(endpoint: Endpoint, components: dict) -> dict[str, Any]:
    content: dict[str, Any] = {}
    if endpoint.response is not None:
        content["application/json"] = {"schema": ref(endpoint.response, components)}
    if endpoint.stream:
        chunks = [ref(model, components) for model in endpoint.stream]
        error = ref(endpoint.error_model, components)
        content["text/event-stream"] = {"schema": sse_event([*chunks, error])}
    if endpoint.text:
        content["text/plain"] = {"schema": {"type": "string"}}
    for media_type in endpoint.media_types:
        content[media_type] = {"schema": {"type": "string"}}
    return {"description": "OK", "content": content}


def sse_event(data_schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.2's reading of an SSE `schema`): its `data` is
    `[DONE]` or JSON matching one of `data_schemas` (a chunk, or an error mid-stream)."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": data_schemas},
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {"anyOf": [{"const": "[DONE]"}, json_data]},
        },
    }


def error_response(status: int, error_schema: dict[str, Any]) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": ERROR_DESCRIPTIONS.get(status, "Error"),
        "content": {"application/json": {"schema": error_schema}},
    }
    if status in (429, 503):
        response["headers"] = {"Retry-After": {"schema": {"type": "string"}}}
    return response


def ref(model: type[BaseModel], components: dict[str, Any]) -> dict[str, str]:
    """Add `model` (and the models it uses) to `components`; a reference to it."""
    schema = model.model_json_schema(ref_template=REF)
    for name, definition in {**schema.pop("$defs", {}), model.__name__: schema}.items():
        if components.setdefault(name, definition) != definition:
            raise ValueError(f"two different models are named {name!r}")
    return {"$ref": REF.format(model=model.__name__)}


def path_parameters(path: str) -> list[dict[str, Any]]:
    """`/v1/responses/{response_id}` -> a required string parameter `response_id`."""
    return [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in re.findall(r"{(\w+)}", path)
    ]


def operation_id(endpoint: Endpoint) -> str:
    words = re.sub(r"[^A-Za-z0-9]+", "_", endpoint.path).strip("_")
    return f"{endpoint.method.lower()}_{words}"


def package_version() -> str:
    try:
        return metadata.version("tandem-serve")
    except metadata.PackageNotFoundError:
        return "0.0.0"
