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
        anthropic_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.anthropic_message = anthropic_message  # Anthropic's wording, where it differs
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


def context_exceeded(prompt_len: int, context: int, requested: int | None = None) -> ApiError:
    """The one refusal every surface shares when a prompt does not fit, worded as OpenAI
    and Anthropic word it: clients recognise an overflow by these words (litellm's
    ContextWindowExceededError, Claude Code's compaction on "prompt is too long"), not
    by the code alone."""
    if requested:
        message = (
            f"This model's maximum context length is {context} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the messages, "
            f"{requested} in the completion). Please reduce the length of the messages or "
            "completion."
        )
        anthropic = (
            f"input length and `max_tokens` exceed context limit: {prompt_len} + "
            f"{requested} > {context}, decrease input length or `max_tokens` and try again"
        )
    else:
        message = (
            f"This model's maximum context length is {context} tokens. However, your "
            f"messages resulted in {prompt_len} tokens. Please reduce the length of the "
            "messages."
        )
        anthropic = f"prompt is too long: {prompt_len} tokens > {context} maximum"
    return ApiError(
        400,
        message,
        "invalid_request_error",
        code="context_length_exceeded",
        anthropic_message=anthropic,
    )


def from_tandem_error(exc: TandemError) -> ApiError:
    """Translate an engine/scheduler error type to its HTTP meaning."""
    if isinstance(exc, ContextTooLong):
        return context_exceeded(exc.prompt_tokens, exc.context, exc.requested)
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


ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    421: "permission_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_error_body(error: ApiError) -> dict:
    """Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
    message = error.anthropic_message or error.message
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(path: str, error: ApiError) -> dict:
    """Each API answers errors in its own shape."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_body(error)
    return openai_error_body(error)


def error_response_for(path: str, error: ApiError) -> JSONResponse:
    return JSONResponse(
        error_body_for(path, error), status_code=error.status, headers=error.headers
    )
