"""Small pure helpers that turn a final TokenEvent into OpenAI response fields."""

from __future__ import annotations

from engines.sequence import FinishReason
from scheduler import TokenEvent

_FINISH_NAMES = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
    FinishReason.ERROR: "error",
}


def finish_reason_name(event: TokenEvent) -> str | None:
    return _FINISH_NAMES[event.finish_reason] if event.finish_reason else None


def usage(event: TokenEvent) -> dict[str, int]:
    return {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.prompt_tokens + event.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": event.cached_tokens},
    }
