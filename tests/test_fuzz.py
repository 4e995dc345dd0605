"""The OpenAPI document describes the server truthfully: it is valid OpenAPI 3.1, it
lists every route, and schemathesis, fuzzing a live `tandem serve` from that document,
finds no 5xx and no response the document does not describe. Requests that fuzzing once
found to break the server are replayed at the end."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.applications import Starlette
from starlette.routing import Route

from scheduler import Scheduler
from server.app import create_app
from server.config import ServerConfig
from server.openapi import ENDPOINTS
from tests.conftest import MODEL_NAME
from tests.test_process import BLAS_PRELOAD, env_without, running_server

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
FUZZED = [
    (endpoint.method, endpoint.path, mode)
    for endpoint in ENDPOINTS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or endpoint.request is not None
]
# Always sent besides the generated cases, so both success shapes (JSON and SSE) are
# checked every run; a new streaming surface adds its own here.
STREAMING_BODIES = {
    "/v1/completions": {"prompt": "Once", "stream": True},
    "/v1/responses": {"input": "hi", "stream": True},
    "/v1/messages": {
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    },
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    },
}
MAX_EXAMPLES = 25  # per operation and mode: about 10 s in all on 2 CPU cores


def fuzz_id(value) -> str:
    return value.value if isinstance(value, GenerationMode) else str(value)


def build_app(scheduler: Scheduler, **config_overrides) -> Starlette:
    """The app as tests/conftest.py's `make_client` builds it."""
    config = ServerConfig(
        scheduler=scheduler.config, served_model_name=MODEL_NAME, **config_overrides
    )
    return create_app(config, scheduler)


async def fetch_document(app: Starlette, headers: dict[str, str] | None = None) -> dict:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tandem.test") as client:
        response = await client.get("/openapi.json", headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def documented_operations(document: dict) -> set[tuple[str, str]]:
    return {
        (method.upper(), path)
        for path, item in document["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    }


def app_operations(app: Starlette) -> set[tuple[str, str]]:
    return {
        (method, route.path)
        for route in app.routes
        if isinstance(route, Route) and route.methods
        for method in route.methods
        if method != "HEAD"  # Starlette adds HEAD to every GET route
    }


# --- the document -------------------------------------------------------------------------


async def test_openapi_document_is_valid_openapi_3_1(scheduler):
    document = await fetch_document(build_app(scheduler))
    assert document["openapi"].startswith("3.1.")
    schemathesis.openapi.from_dict(document).validate()  # the OpenAPI 3.1 meta-schema


async def test_every_route_of_the_app_is_documented_and_nothing_else(scheduler):
    app = build_app(scheduler)
    assert documented_operations(await fetch_document(app)) == app_operations(app)


async def test_without_metrics_the_metrics_route_is_neither_served_nor_documented(scheduler):
    app = build_app(scheduler, metrics=False)
    documented = documented_operations(await fetch_document(app))
    assert documented == app_operations(app)
    assert ("GET", "/metrics") not in documented


async def test_request_bodies_come_from_the_pydantic_models(scheduler):
    document = await fetch_document(build_app(scheduler))
    schemas = document["components"]["schemas"]
    for path, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model}"}
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert "ChatMessage" in schemas  # nested models are collected too
    assert "$defs" not in str(document)


async def test_generation_errors_use_the_openai_error_shape(scheduler):
    app = build_app(scheduler, api_keys=("k",), rate_limit_per_minute=600)
    document = await fetch_document(app, headers={"authorization": "Bearer k"})
    responses = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(responses) == {"200", "400", "401", "404", "413", "429", "503", "504"}
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    for status in ("400", "401", "404", "413", "429", "503", "504"):
        schema = responses[status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/OpenAIError"}
    detail = document["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}


async def test_security_schemes_only_when_keys_are_required(scheduler):
    open_document = await fetch_document(build_app(scheduler))
    assert "securitySchemes" not in open_document["components"]
    for path, item in open_document["paths"].items():
        assert "security" not in item["get" if "get" in item else "post"], path
    assert "401" not in open_document["paths"]["/v1/models"]["get"]["responses"]
    assert "429" not in open_document["paths"]["/v1/models"]["get"]["responses"]

    keyed = build_app(scheduler, api_keys=("secret",))
    document = await fetch_document(keyed, headers={"x-api-key": "secret"})
    assert document["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
    }
    either = [{"bearer": []}, {"apiKey": []}]
    for path, method in (("/v1/chat/completions", "post"), ("/v1/models", "get")):
        assert document["paths"][path][method]["security"] == either
        assert "401" in document["paths"][path][method]["responses"]
    health = document["paths"]["/health"]["get"]
    assert "security" not in health and "401" not in health["responses"]
    schemathesis.openapi.from_dict(document).validate()


async def test_a_metrics_key_alone_guards_only_the_metrics_route(scheduler):
    app = build_app(scheduler, metrics_api_keys=("scraper",))
    document = await fetch_document(app)
    assert "security" in document["paths"]["/metrics"]["get"]
    assert "security" not in document["paths"]["/v1/models"]["get"]


# --- fuzzing a live server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def live_server(tiny_model_dir):
    """`--max-tokens 16` keeps every generated request cheap: asking for more is a 400."""
    args = [str(tiny_model_dir), "--served-model-name", MODEL_NAME, "--max-tokens", "16"]
    with running_server(args, env_without(*BLAS_PRELOAD)) as proc:
        yield proc


@pytest.fixture(scope="module")
def live_schema(live_server):
    config = schemathesis.Config.from_dict({"base-url": live_server.url, "request-timeout": 30})
    return schemathesis.openapi.from_url(f"{live_server.url}/openapi.json", config=config)


@pytest.fixture(scope="module")
def session():
    with requests.Session() as session:
        yield session


# Hypothesis drives schemathesis's strategies directly: `schemathesis.pytest.from_fixture`
# (its lazy-schema plugin) fails on pytest 9 (`Function` has no `_nodeid`).
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("method", "path", "mode"), FUZZED, ids=fuzz_id)
def test_live_server_answers_as_its_openapi_document_says(live_schema, session, method, path, mode):
    """Positive cases (valid bodies) and, for bodies, negative ones (invalid on purpose):
    no 5xx, and every answer has a documented status, content type and shape."""
    operation = live_schema[path][method]
    seen: Counter[tuple[int, str]] = Counter()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        response = case.call_and_validate(session=session, checks=CHECKS)
        seen[response.status_code, media_type(response)] += 1

    pinned = mode is GenerationMode.POSITIVE and path in STREAMING_BODIES
    if pinned:
        streaming = operation.Case(body=STREAMING_BODIES[path], media_type="application/json")
        run = example(case=streaming)(run)
    run()
    if pinned:
        assert seen[200, "application/json"] and seen[200, "text/event-stream"], seen


def media_type(response: schemathesis.Response) -> str:
    return response.headers.get("content-type", [""])[0].split(";")[0].strip()


# --- what fuzzing found -------------------------------------------------------------------

FOUND_BY_FUZZING = [
    pytest.param(
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "repetition_penalty": 5e-324, "logprobs": 1},
        id="completions-tiny-repetition-penalty",
    ),
    pytest.param(
        "/v1/completions",
        {
            "prompt": "hi",
            "max_tokens": 2,
            "repetition_penalty": 5e-324,
            "logprobs": 1,
            "stream": True,
        },
        id="completions-stream-tiny-repetition-penalty",
    ),
    pytest.param(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "repetition_penalty": 5e-324,
            "logprobs": True,
        },
        id="chat-tiny-repetition-penalty",
    ),
    pytest.param(
        "/v1/messages",
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": []}]}]},
        id="messages-list-block-type",
    ),
    pytest.param(
        "/v1/messages/count_tokens",
        {"messages": [{"role": "user", "content": [{"type": []}]}]},
        id="count-tokens-list-block-type",
    ),
]


def strict_json(text: str) -> object:
    """JSON as RFC 8259 has it: NaN and Infinity are not numbers there."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(("path", "body"), FOUND_BY_FUZZING)
def test_requests_that_fuzzing_found_get_a_client_error_or_valid_json(live_server, path, body):
    """Each once answered 500 (or invalid JSON): now a 4xx or valid JSON."""
    response = httpx.post(f"{live_server.url}{path}", json=body, timeout=30)
    assert response.status_code < 500, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                strict_json(line[len("data: ") :])
    else:
        strict_json(response.text)
