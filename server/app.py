"""The Starlette application: a list of routes, error handlers, and the lifespan
that starts and stops the scheduler's engine thread."""

from __future__ import annotations

import contextlib
import logging
import time

import mlx.core as mx
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

from engines.errors import ServerNotReady, TandemError
from engines.platform.blas import describe_blas
from scheduler import Scheduler, SchedulerState
from server.anthropic.endpoints import count_message_tokens, create_message
from server.auth import PROCESS_SALT, ApiKeyMiddleware
from server.config import ServerConfig
from server.errors import ApiError, error_response_for, from_tandem_error
from server.hosts import ANY_HOST, HostCheck
from server.http import model_info_of
from server.limits import BodyReadTimeout, BodySizeLimit, RateLimit
from server.metrics import Metrics
from server.openai.chat import create_chat_completion
from server.openai.completions import create_completion
from server.responses.endpoints import create_response, delete_response, retrieve_response
from server.tokenizer_endpoints import detokenize, tokenize, tokenizer_info
from server.ui import ui_routes

log = logging.getLogger(__name__)


async def health(request: Request) -> JSONResponse:
    """Open to anyone (supervisors, balancers): a failure is named, never detailed;
    its exception is in the server log."""
    scheduler: Scheduler = request.app.state.scheduler
    state = scheduler.state
    healthy = scheduler.serving
    status = "draining" if state == SchedulerState.READY and scheduler.draining else state.value
    body = {"status": "ok" if healthy else status}
    if state == SchedulerState.FAILED:
        loaded = scheduler.model_info is not None
        body["error"] = "the engine failed" if loaded else "the model failed to load"
    return JSONResponse(body, status_code=200 if healthy else 503)


async def list_models(request: Request) -> JSONResponse:
    """The served model; 503 with Retry-After until the server takes requests (loaded and
    warmed up) and while it drains, like /health and generation: clients polling this for
    readiness then never meet a 503 on their first request."""
    config: ServerConfig = request.app.state.config
    scheduler: Scheduler = request.app.state.scheduler
    if not scheduler.serving:
        state = "shutting down" if scheduler.draining else scheduler.state.value
        raise ServerNotReady(f"server is {state}")
    info = model_info_of(request)
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": config.served_model_name,
                    "object": "model",
                    "created": request.app.state.started,
                    "owned_by": "tandem",
                    "root": config.served_model_name,  # never a path on this disk
                    "max_model_len": info.context_length,
                    # LM Studio's and Ollama's word for it: whether images reach the model
                    "capabilities": {"vision": info.vision is not None},
                }
            ],
        }
    )


async def openapi_endpoint(request: Request) -> JSONResponse:
    from server.openapi import build_openapi

    return JSONResponse(build_openapi(request.app.state.config))


async def metrics_endpoint(request: Request) -> Response:
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def stats_endpoint(request: Request) -> JSONResponse:
    return JSONResponse(request.app.state.metrics.stats())


def error_response(request: Request, error: ApiError) -> JSONResponse:
    """The one place an error becomes a response: counted, then shaped."""
    request.app.state.metrics.count_error(error.type)
    return error_response_for(request.url.path, error)


async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(request, exc)


async def on_tandem_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(request, from_tandem_error(exc))


async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    headers = dict(exc.headers or {})  # e.g. Allow on 405
    return error_response(
        request, ApiError(exc.status_code, str(exc.detail), kind, headers=headers)
    )


async def on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return error_response(request, ApiError(500, "internal server error", "server_error"))


def key_salt(config: ServerConfig, scheduler: Scheduler) -> bytes:
    """The salt of API-key ids: kept with the prefix cache on disk, so a key's entries
    there serve it after a restart (a new one when the keys change); else per process."""
    disk = scheduler.prefix_disk
    if disk is None or not config.api_keys:
        return PROCESS_SALT
    try:
        return disk.scope_salt(config.api_keys)
    except OSError as error:  # keyed entries on disk then serve only this process
        log.warning("prefix cache on disk: no API-key id salt in %s: %s", disk.directory, error)
        return PROCESS_SALT


def build_middleware(
    config: ServerConfig, metrics: Metrics, salt: bytes = PROCESS_SALT
) -> list[Middleware]:
    """Outermost first: Host check (keyless servers by default), CORS, body size and read time,
    API key, rate limit."""
    middleware = []
    if ANY_HOST not in config.allowed_hosts:
        middleware.append(Middleware(HostCheck, allowed=config.allowed_hosts))
    if config.allowed_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.allowed_origins),
                allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"],
            )
        )
    middleware.append(
        Middleware(
            BodySizeLimit,
            max_bytes=config.max_body_bytes,
            on_refused=lambda: metrics.count_error("request_too_large"),
        )
    )
    middleware.append(
        Middleware(
            BodyReadTimeout,
            timeout=config.body_timeout,
            on_refused=lambda: metrics.count_error("request_timeout"),
        )
    )
    middleware.append(
        Middleware(
            ApiKeyMiddleware,
            keys=config.api_keys,
            metrics_keys=config.metrics_api_keys,
            on_denied=lambda: metrics.count_error("authentication_error"),
            salt=salt,
        )
    )
    if config.rate_limit_per_minute > 0:
        middleware.append(
            Middleware(
                RateLimit,
                per_minute=config.rate_limit_per_minute,
                on_refused=lambda: metrics.count_error("rate_limit_error"),
            )
        )
    return middleware


def slash_redirect_or_404(routes: list[Route]):
    """The router's fallback: a path that matches a route once its trailing slash is
    added or removed is redirected there with a relative Location (Starlette's own
    redirect builds an absolute URL from the Host header, which the client chose)."""

    async def fallback(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if scope["type"] == "http" and path not in ("", "/"):
            other = "/" + (path.rstrip("/") if path.endswith("/") else path + "/").lstrip("/")
            moved = {**scope, "path": other}
            if any(route.matches(moved)[0] != Match.NONE for route in routes):
                query = scope.get("query_string", b"").decode("latin-1")
                location = other + (f"?{query}" if query else "")
                await RedirectResponse(location)(scope, receive, send)
                return
        raise HTTPException(404, "Not Found")

    return fallback


def create_app(config: ServerConfig, scheduler: Scheduler | None = None) -> Starlette:
    """Build the app. The scheduler is started by the lifespan unless already running."""
    scheduler = scheduler or Scheduler(config.scheduler)
    metrics = Metrics(config.served_model_name, scheduler, describe_blas())
    scheduler.observer = metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        owns_scheduler = not scheduler.started
        if owns_scheduler:
            scheduler.start()
        yield
        if owns_scheduler:
            scheduler.stop()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/messages", create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_message_tokens, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),  # vLLM's, at the root
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/v1/stats", stats_endpoint, methods=["GET"]),
        Route("/openapi.json", openapi_endpoint, methods=["GET"]),
    ]
    if config.metrics:
        routes.append(Route("/metrics", metrics_endpoint, methods=["GET"]))
    if config.ui:
        routes.extend(ui_routes(str(mx.default_device())))
    app = Starlette(
        routes=routes,
        middleware=build_middleware(config, metrics, key_salt(config, scheduler)),
        exception_handlers={
            ApiError: on_api_error,
            TandemError: on_tandem_error,
            HTTPException: on_http_error,
            Exception: on_unexpected_error,
        },
        lifespan=lifespan,
    )
    app.router.redirect_slashes = False
    app.router.default = slash_redirect_or_404(routes)
    app.state.config = config
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.output_markers = None
    app.state.started = int(time.time())
    return app
