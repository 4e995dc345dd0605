"""What the scheduler reports as it works, for metrics and logs.

The scheduler calls a `SchedulerObserver` on the engine thread; the server's
Prometheus exporter implements it. Keeping the interface here keeps the dependency
one way (server -> scheduler) and the scheduler free of metric libraries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from engines.telemetry import SpecStats

log = logging.getLogger("tandem.requests")


@dataclass
class RequestRecord:
    """One finished request, as logs and metrics see it."""

    request_id: str
    surface: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_s: float | None
    ttft_s: float | None
    e2e_s: float
    modes: tuple[str, ...]
    speculation: SpecStats = field(default_factory=SpecStats)
    error: str | None = None
    scope: str = ""  # the API key's id (engines.request cache_scope); never the key
    images: int = 0  # images in the prompt (a vision-language model's)

    @property
    def tokens_per_second(self) -> float:
        if self.ttft_s is None or self.completion_tokens < 2:
            return 0.0
        decode = self.e2e_s - self.ttft_s
        return (self.completion_tokens - 1) / decode if decode > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "id": self.request_id,
            "surface": self.surface,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "images": self.images,
            "completion_tokens": self.completion_tokens,
            "queue_s": _round(self.queue_s),
            "ttft_s": _round(self.ttft_s),
            "e2e_s": _round(self.e2e_s),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "modes": list(self.modes),
            "speculation": {
                method: {"drafted": s.draft_tokens, "accepted": s.accepted_tokens}
                for method, s in sorted(self.speculation.by_method.items())
            },
            **({"error": self.error} if self.error else {}),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def log_request(record: RequestRecord) -> None:
    """The per-request line: readable text, and the fields for JSON log formatters."""
    methods = " ".join(
        f"{m}={s.accepted_tokens}/{s.draft_tokens}"
        for m, s in sorted(record.speculation.by_method.items())
    )
    log.info(
        "request %s %s: surface=%s prompt_tokens=%d cached=%d completion_tokens=%d "
        "ttft=%.3fs tok/s=%.1f modes=%s accepted/drafted: %s%s%s",
        record.request_id,
        record.finish_reason,
        record.surface or "-",
        record.prompt_tokens,
        record.cached_tokens,
        record.completion_tokens,
        record.ttft_s if record.ttft_s is not None else float("nan"),
        record.tokens_per_second,
        "+".join(record.modes) or "-",
        methods or "none",
        f" images={record.images}" if record.images else "",
        f" error={record.error!r}" if record.error else "",
        extra={"request": record.as_dict()},
    )


class SchedulerObserver(Protocol):
    def on_first_token(self, seconds: float) -> None: ...
    def on_token_gap(self, seconds: float) -> None: ...
    def on_finished(self, record: RequestRecord) -> None: ...
    def on_mode_switch(self, source: str, target: str, seconds: float) -> None: ...
    def on_batch_step(self, size: int) -> None: ...
    def on_speculation_step(self, size: int, drafted: list[int]) -> None: ...
    def on_step_time(self, model_s: float, overhead_s: float) -> None: ...


class NullObserver:
    def on_first_token(self, seconds: float) -> None:
        pass

    def on_token_gap(self, seconds: float) -> None:
        pass

    def on_finished(self, record: RequestRecord) -> None:
        pass

    def on_mode_switch(self, source: str, target: str, seconds: float) -> None:
        pass

    def on_batch_step(self, size: int) -> None:
        pass

    def on_speculation_step(self, size: int, drafted: list[int]) -> None:
        pass

    def on_step_time(self, model_s: float, overhead_s: float) -> None:
        pass
