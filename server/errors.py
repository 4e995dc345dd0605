"""Every error a client can see, mapped to an HTTP status in one place.

OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from engines.errors import (
    ContextTooLong,
    InvalidRequest,
    QueueFull,
    RequestAborted,
    RequestFailed,
    RequestTimeout,
    ServerNotReady,
    TandemError,
)


class ApiError(Exception):
    """An error raised by the HTTP layer itself (auth, unknown model, bad JSON)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param=param)


def from_tandem_error(exc: TandemError) -> ApiError:
    """Translate an engine/scheduler error type to its HTTP meaning."""
    if isinstance(exc, ContextTooLong):
        return ApiError(400, str(exc), "invalid_request_error", code="context_length_exceeded")
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc), "invalid_request_error")
    if isinstance(exc, QueueFull):
        return ApiError(503, str(exc), "server_overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, ServerNotReady):
        return ApiError(503, str(exc), "server_unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, RequestTimeout):
        return ApiError(504, str(exc), "timeout", code="request_timeout")
    if isinstance(exc, RequestAborted):
        return ApiError(503, f"request aborted: {exc}", "server_unavailable")
    if isinstance(exc, RequestFailed):
        return ApiError(500, f"generation failed: {exc}", "server_error")
    return ApiError(500, str(exc), "server_error")


def openai_error_body(error: ApiError) -> dict:
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }


def openai_error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(openai_error_body(error), status_code=error.status, headers=error.headers)
