"""One request as the scheduler tracks it, and the events and log record it ends with.

A `TrackedRequest` lives on the engine thread from submit to its final event: its
sequence, its stream, and the times that make up its latency. Events are built here
so every path that ends a request (finish, error, cancel, abort) reports the same
usage, timings and speculation statistics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from engines.request import GenerationRequest
from engines.sequence import FinishReason, Sequence, StepOutput
from engines.state import SequenceState
from engines.telemetry import SpecStats
from scheduler.observer import RequestRecord
from scheduler.stream import RequestStream, TokenEvent


@dataclass
class TrackedRequest:
    """Scheduler bookkeeping for one request, owned by the engine thread."""

    request: GenerationRequest
    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    arrived: float
    seq: Sequence | None = None
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    modes: list[str] = field(default_factory=list)
    prompt_logprobs: list | None = None  # scored prompt, until the first event carries it
    delivered: int = 0  # events handed to the stream
    paused_at: float | None = None  # out of the engine: its client stopped reading
    parked: SequenceState | None = None  # the paused sequence, KV cache and all
    disk_checked: bool = False  # the prefix cache's disk tier was asked for its prompt
    disk_entry: Any = None  # the disk entry read ahead for it (`PrefixReuse.waits_for_disk`)
    # Prefill followers (scheduler/prefill_followers.py): whether it was asked if it waits for
    # another request's prefill, the one it waits for (None: none, or no longer), and
    # the prompt positions whose cache its own prefill keeps for requests waiting on it
    # (its sequence's `keep_at` is this set).
    follow_checked: bool = False
    following: Any = None
    keep_at: set[int] = field(default_factory=set)

    @property
    def unread(self) -> int:
        return self.delivered - self.stream.consumed


def key_of(tracked: TrackedRequest) -> str:
    """The fairness key: requests are queued and counted per API key scope."""
    return tracked.request.cache_scope


@dataclass
class Command:
    """A request from the asyncio side to the engine thread."""

    kind: str  # "submit" | "cancel" | "abort_all"
    request_id: str = ""
    tracked: TrackedRequest | None = None
    reason: str = ""


def token_event(tracked: TrackedRequest, token_ids: list[int], text: str, **kw: Any) -> TokenEvent:
    """An event carrying the request's usage so far; the first one also carries its
    scored prompt."""
    scored, tracked.prompt_logprobs = tracked.prompt_logprobs, None
    return TokenEvent(
        prompt_logprobs=scored,
        request_id=tracked.request.request_id,
        token_ids=token_ids,
        text=text,
        prompt_tokens=len(tracked.request.prompt_tokens),
        completion_tokens=tracked.completion_tokens,
        cached_tokens=tracked.cached_tokens,
        token_sources=tracked.seq.sources.take(len(token_ids)) if tracked.seq else None,
        **kw,
    )


def request_timings(tracked: TrackedRequest) -> dict[str, float]:
    now = time.monotonic()
    timings = {"e2e_s": now - tracked.arrived}
    if tracked.admitted is not None:
        timings["queue_s"] = tracked.admitted - tracked.arrived
    if tracked.first_token is not None:
        timings["ttft_s"] = tracked.first_token - tracked.arrived
    return timings


def final_event(
    tracked: TrackedRequest,
    reason: FinishReason,
    output: StepOutput | None = None,
    error: str | None = None,
    error_kind: str | None = None,
) -> tuple[TokenEvent, RequestRecord]:
    """The request's last event (with its last tokens, if any) and its log record."""
    event = token_event(
        tracked,
        output.token_ids if output else [],
        output.text if output else "",
        finish_reason=reason,
        matched_stop=output.matched_stop if output else None,
        logprobs=output.logprobs if output else None,
        error=error,
        error_kind=error_kind or ("failed" if reason == FinishReason.ERROR else None),
        speculation=tracked.seq.spec.as_dict() if tracked.seq else None,
    )
    event.timings = request_timings(tracked)
    record = RequestRecord(
        request_id=tracked.request.request_id,
        surface=tracked.request.surface,
        finish_reason=reason.value,
        prompt_tokens=len(tracked.request.prompt_tokens),
        cached_tokens=tracked.cached_tokens,
        completion_tokens=tracked.completion_tokens,
        queue_s=event.timings.get("queue_s"),
        ttft_s=event.timings.get("ttft_s"),
        e2e_s=event.timings["e2e_s"],
        modes=tuple(tracked.modes),
        speculation=tracked.seq.spec if tracked.seq else SpecStats(),
        error=error,
        scope=tracked.request.cache_scope,
        images=len(tracked.request.images),
    )
    return event, record
