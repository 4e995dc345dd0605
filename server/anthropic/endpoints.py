"""POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages), JSON and SSE.

The request becomes a prompt in `server/anthropic/prompt.py`; output is split by
`OutputParser` and laid out as thinking / text / tool_use blocks by `BlockStream`
(`server/anthropic/blocks.py`), a new block each time the kind changes. Fields that
only steer Anthropic's own service (`thinking`, `context_management`, `output_config.
effort`, `anthropic-beta` headers, `?beta=true`) are accepted and have no effect here.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engines.errors import RequestAborted, RequestFailed
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from engines.sequence import FinishReason
from scheduler import TokenEvent
from server.anthropic.blocks import BlockStream
from server.anthropic.images import take_images
from server.anthropic.prompt import forced_tool, render_prompt, skipped_tools, template_tools
from server.anthropic.schemas import CountTokensRequest, MessagesRequest, Metadata
from server.errors import anthropic_error_body, from_tandem_error
from server.generation import (
    MaxTokens,
    effective_max_tokens,
    speculation_overrides,
    stop_strings,
)
from server.http import (
    check_model,
    collect_unless_disconnected,
    config_of,
    event_stream,
    heartbeat_events,
    model_info_of,
    off_the_loop,
    output_markers,
    parse_body,
    submit,
)
from server.image_prompts import PromptImages, report_omitted, with_omitted_header
from server.keepalive import Quiet
from server.output_parser import OutputParser
from server.server_tools import note_skipped_tools
from server.structured import anthropic_output_format, output_constraint


@dataclass
class MessageJob:
    """A parsed Messages request and what formatting its output needs."""

    gen: GenerationRequest
    model: str
    tools: list | None
    starts_in_reasoning: bool
    cache_marked: int = 0  # prompt tokens up to the last cache_control mark (0: none)
    forced: bool = False  # tool_choice forces a call


# --- Request -> engine terms (pure) -------------------------------------------------


def sampling_params(body: MessagesRequest) -> SamplingParams:
    """Anthropic's defaults: temperature 1, no top-p / top-k cut."""
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
    )


def first_set(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def speculation(body: MessagesRequest) -> SpeculationOverrides:
    """Top-level switches win over the same switches inside `metadata`."""
    meta = body.metadata or Metadata()
    return speculation_overrides(
        first_set(body.enable_pld, meta.enable_pld),
        first_set(body.enable_draft, meta.enable_draft),
        first_set(body.num_draft_tokens, meta.num_draft_tokens),
    )


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def generation_request(
    body: MessagesRequest, prompt_ids: list[int], max_tokens: int
) -> GenerationRequest:
    return GenerationRequest(
        request_id=message_id(),
        prompt_tokens=tuple(prompt_ids),
        max_tokens=max_tokens,
        sampling=sampling_params(body),
        stop=stop_strings(body.stop_sequences),
        speculation=speculation(body),
        surface="messages",
    )


# --- Engine output -> Anthropic response (pure) -------------------------------------


def stop_reason(event: TokenEvent, tool_calls: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the final event."""
    if event.finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if event.matched_stop is not None:
        return "stop_sequence", event.matched_stop
    return ("tool_use" if tool_calls else "end_turn"), None


def message_usage(event: TokenEvent, cache_marked: int) -> dict[str, int]:
    """Anthropic's split of the prompt: tokens read from the prefix cache, tokens up to
    the last `cache_control` mark that were not (kept for the next request: as a
    checkpoint, or inside this request's cache), and the rest."""
    written = max(0, cache_marked - event.cached_tokens)
    return {
        "input_tokens": event.prompt_tokens - event.cached_tokens - written,
        "output_tokens": event.completion_tokens,
        "cache_read_input_tokens": event.cached_tokens,
        "cache_creation_input_tokens": written,
    }


def message_shell(job: MessageJob) -> dict:
    """The message before decoding: no content, usage as far as it is known."""
    return {
        "id": job.gen.request_id,
        "type": "message",
        "role": "assistant",
        "model": job.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": len(job.gen.prompt_tokens), "output_tokens": 0},
    }


def message_delta(event: TokenEvent, tool_calls: int, cache_marked: int) -> dict:
    """The closing summary; its usage is cumulative and final (the SDK overwrites)."""
    reason, sequence = stop_reason(event, tool_calls)
    return {
        "type": "message_delta",
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": message_usage(event, cache_marked),
        "speculation": event.speculation,
    }


def message_json(job: MessageJob, parser: OutputParser, events: list[TokenEvent]) -> dict:
    layout = BlockStream()
    for event in events:
        layout.feed(parser.step(event.text, event.final))
    layout.close()
    last = events[-1]
    reason, sequence = stop_reason(last, parser.tool_calls_emitted)
    return {
        **message_shell(job),
        "content": layout.blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": message_usage(last, job.cache_marked),
        "speculation": last.speculation,
    }


def sse_event(payload: dict) -> str:
    """Anthropic names every event: `event: <type>` before its data line."""
    data = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n"


# --- Handlers -----------------------------------------------------------------------


def to_job(request: Request, body: MessagesRequest, model: str) -> MessageJob:
    info = model_info_of(request)
    tools = template_tools(body)
    think = output_markers(request).think
    config = config_of(request)
    images = PromptImages(info.vision, config.image_limits)
    take_images(body, images)
    report_omitted(request, images, "messages")
    rendered = render_prompt(
        info.tokenizer,
        body,
        tools,
        think,
        info.prompt_checkpoints,
        images,
        info.template_traits,
    )
    prompt_images = images.locate(rendered.ids)
    caching = config.scheduler.prefix_cache_entries > 0
    max_tokens = effective_max_tokens(
        body.max_tokens,
        len(rendered.ids),
        info.context_length,
        MaxTokens.of(config),
    )
    gen = replace(generation_request(body, rendered.ids, max_tokens), images=prompt_images)
    fmt = (body.output_config.format if body.output_config else None) or body.output_format
    schema = anthropic_output_format(fmt)
    markers = output_markers(request)
    forced = forced_tool(body)
    constraint = output_constraint(
        schema,
        "output_config.format",
        forced,
        tools,
        markers,
        info,
        rendered.starts_in_reasoning,
        config_of(request).tool_call_grammar == "auto",
    )
    # Checkpoints matter only where caches cannot be cut back (hybrid, windowed models):
    # elsewhere every finished request's whole cache is kept and any prefix reused.
    checkpoints = rendered.checkpoints if info.prompt_checkpoints else ()
    gen = replace(gen, constraint=constraint, checkpoints=checkpoints)
    marked = max(rendered.checkpoints, default=0) if caching else 0
    return MessageJob(gen, model, tools, rendered.starts_in_reasoning, marked, forced[0])


async def create_message(request: Request) -> Response:
    body = await parse_body(request, MessagesRequest)
    model = check_model(config_of(request), body.model)
    job = await off_the_loop(to_job, request, body, model)
    note_skipped_tools(request.app.state.metrics, "messages", skipped_tools(body))
    stream = submit(request, job.gen)
    parser = OutputParser(
        output_markers(request), job.tools, job.starts_in_reasoning, forced=job.forced
    )
    if body.stream:
        events = message_events(job, parser, heartbeat_events(request, stream))
        return with_omitted_header(request, event_stream(request, events, keepalive=False))
    events = await collect_unless_disconnected(request, stream)
    if events is None:
        return Response(status_code=499)
    return with_omitted_header(request, JSONResponse(message_json(job, parser, events)))


def keepalive_events(started: bool) -> list[dict]:
    """A quiet stream's keep-alive: `ping`, and before the first token a `message_delta`
    with only usage, since Claude Code re-arms its idle watchdog on any event but ping
    (the final `message_delta` overwrites it; it counts no tokens, so costs nothing)."""
    events: list[dict] = [{"type": "ping"}]
    if not started:
        delta = {"stop_reason": None, "stop_sequence": None}
        events.append({"type": "message_delta", "delta": delta, "usage": {"output_tokens": 0}})
    return events


async def message_events(
    job: MessageJob, parser: OutputParser, events: AsyncIterator[TokenEvent | Quiet]
) -> AsyncIterator[str]:
    """message_start, ping, the blocks as they form, message_delta, message_stop; a
    failure mid-stream ends it with an `error` event in Anthropic's shape. While the
    stream is quiet (a long prefill), keep-alive events."""
    yield sse_event({"type": "message_start", "message": message_shell(job)})
    yield sse_event({"type": "ping"})
    layout = BlockStream()
    started = False
    try:
        async for event in events:
            if isinstance(event, Quiet):
                for payload in keepalive_events(started):
                    yield sse_event(payload)
                continue
            started = True
            for payload in layout.feed(parser.step(event.text, event.final)):
                yield sse_event(payload)
            if event.final:
                for payload in layout.close():
                    yield sse_event(payload)
                yield sse_event(message_delta(event, parser.tool_calls_emitted, job.cache_marked))
                yield sse_event({"type": "message_stop"})
    except (RequestFailed, RequestAborted) as exc:
        yield sse_event(anthropic_error_body(from_tandem_error(exc)))


async def count_message_tokens(request: Request) -> JSONResponse:
    """The prompt's token count, rendered exactly as /v1/messages would render it."""
    body = await parse_body(request, CountTokensRequest)
    check_model(config_of(request), body.model)
    think = output_markers(request).think
    count = await off_the_loop(counted_tokens, request, body, think)
    return JSONResponse({"input_tokens": count})


def counted_tokens(request: Request, body: CountTokensRequest, think) -> int:
    """The prompt's length as /v1/messages makes it, each image's tokens included."""
    info = model_info_of(request)
    images = PromptImages(info.vision, config_of(request).image_limits)
    take_images(body, images)
    tools = template_tools(body)
    traits = info.template_traits
    rendered = render_prompt(info.tokenizer, body, tools, think, images=images, traits=traits)
    images.locate(rendered.ids)  # the same refusal as /v1/messages gives
    return len(rendered.ids)
