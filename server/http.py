"""Request plumbing shared by every API surface: body parsing, model lookup,
running a generation to completion while watching for the client to leave."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import StreamingResponse

from engines.errors import ServerNotReady, TandemError
from engines.request import GenerationRequest
from scheduler import RequestStream, Scheduler, TokenEvent
from server import json_body as strict_json
from server.auth import caller_key_id
from server.config import ServerConfig
from server.errors import ApiError, bad_request
from server.keepalive import Quiet, with_heartbeats, with_keepalive

Body = TypeVar("Body", bound=BaseModel)
Job = TypeVar("Job")


async def off_the_loop(build: Callable[..., Job], *args: object) -> Job:
    """Run request preparation (body decoding, template rendering, tokenizing, grammar
    compiling) in a worker thread. Tokenizing costs about 1 ms per thousand prompt
    tokens: on the event loop a long prompt would pause every other client's stream."""
    return await anyio.to_thread.run_sync(build, *args)


def require_json(request: Request) -> None:
    """415 unless the body is declared JSON. A web page can POST `text/plain` to any
    address without asking (no CORS preflight); `application/json` it cannot."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(
            415,
            f"Content-Type must be application/json, not {media_type or 'missing'!r}",
            "invalid_request_error",
            code="unsupported_media_type",
        )


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The request body as `model`. Decoding runs in a worker thread: a body at the
    4 MB limit takes ~30 ms to decode and validate, a pause for every other stream."""
    require_json(request)
    raw = await request.body()
    return await off_the_loop(decode_body, raw, model)


def decode_body(raw: bytes, model: type[Body]) -> Body:
    """`raw` JSON validated as `model`, or a 400 that names the first bad field."""
    try:
        data = strict_json.loads(raw)
        # JSON may escape lone UTF-16 surrogates ("\ud800") that are no text at all, and
        # a number such as 1e999 reads as infinity: neither could be written back out.
        json.dumps(data, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from exc
    except UnicodeEncodeError as exc:
        raise bad_request(f"request body has invalid Unicode (a lone surrogate): {exc}") from exc
    except RecursionError as exc:
        raise bad_request("request body is nested too deeply") from exc
    except strict_json.NotAJSONNumber as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from exc
    except ValueError as exc:  # an integer past Python's 4300-digit parsing limit, 1e999
        reason = str(exc).split(";")[0]  # not the advice to call sys.set_int_max_str_digits
        raise bad_request(f"request body has a value that cannot be parsed: {reason}") from exc
    if strict_json.nesting_depth(raw) > strict_json.MAX_NESTING:
        raise bad_request(f"request body nests deeper than {strict_json.MAX_NESTING} levels")
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except RecursionError as exc:
        raise bad_request("request body is nested too deeply") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param) from exc


def check_model(config: ServerConfig, requested: str | None) -> str:
    name = config.served_model_name
    if requested and requested != name:
        raise ApiError(
            404,
            f"model '{requested}' does not exist; this server serves '{name}'",
            "invalid_request_error",
            param="model",
            code="model_not_found",
        )
    return name


def scheduler_of(request: Request) -> Scheduler:
    return request.app.state.scheduler


def submit(request: Request, gen: GenerationRequest) -> RequestStream:
    """Hand `gen` to the scheduler; its prefix reuse stays within the caller's API key
    (one shared scope when the server has no keys)."""
    scope = caller_key_id(request.scope) or ""
    return scheduler_of(request).submit(replace(gen, cache_scope=scope))


def model_info_of(request: Request):
    """The loaded model's facts; 503 while it is still loading (or failed to load)."""
    info = scheduler_of(request).model_info
    if info is None:
        raise ServerNotReady("the model is still loading")
    return info


def config_of(request: Request) -> ServerConfig:
    return request.app.state.config


async def collect_unless_disconnected(
    request: Request, stream: RequestStream
) -> list[TokenEvent] | None:
    """All of a request's events, or None if the client disconnected first
    (in which case the request is cancelled and its engine slot freed)."""
    events: list[TokenEvent] | None = None
    failure: TandemError | None = None

    async with anyio.create_task_group() as group:

        async def watch_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            stream.cancel()
            group.cancel_scope.cancel()

        group.start_soon(watch_disconnect)
        try:
            events = await stream.collect()
        except TandemError as exc:
            failure = exc  # re-raised outside the group, so it is not an ExceptionGroup
        finally:
            group.cancel_scope.cancel()
    if failure is not None:
        raise failure
    if events is None:
        request.app.state.metrics.count_disconnect()
    return events


async def events_until_done(request: Request, stream: RequestStream) -> AsyncIterator[TokenEvent]:
    """Iterate a stream; leaving before its final event (the client disconnected and
    the response task was cancelled) cancels the request and counts the disconnect."""
    try:
        async for event in stream:
            yield event
    finally:
        if not stream.done:
            request.app.state.metrics.count_disconnect()
        stream.cancel()


def event_stream(request: Request, chunks: AsyncIterator[str], keepalive: bool = True):
    """An SSE response; with `keepalive`, an SSE comment goes out while it is quiet
    (surfaces whose keep-alive is an event of their own send it themselves)."""
    if keepalive:
        chunks = with_keepalive(chunks, config_of(request).stream_keepalive)
    return StreamingResponse(chunks, media_type="text/event-stream")


def heartbeat_events(request: Request, stream: RequestStream) -> AsyncIterator[TokenEvent | Quiet]:
    """A request's events, with QUIET whenever none came for `--stream-keepalive`."""
    events = events_until_done(request, stream)
    return with_heartbeats(events, config_of(request).stream_keepalive)


def output_markers(request: Request):
    """The model's reasoning/tool markers, resolved once per app (the tokenizer exists
    only after the model loaded)."""
    from server.output_parser import OutputMarkers

    state = request.app.state
    if getattr(state, "output_markers", None) is None:
        config = config_of(request)
        state.output_markers = OutputMarkers.for_tokenizer(
            model_info_of(request).tokenizer,
            config.tool_call_parser,
            config.reasoning_parser,
            config.strict_tool_calls,
        )
    return state.output_markers
