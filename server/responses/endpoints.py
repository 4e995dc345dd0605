"""POST /v1/responses (the OpenAI Responses API), JSON and SSE; GET and DELETE of
stored responses.

Input items become the normalised messages the chat surface renders. Output is split
by `OutputParser`, then `OutputAssembler` (server/responses/output.py) builds the Responses
output items and the stream events that build them. `previous_response_id` continues a
conversation kept in `ResponseStore`, an LRU on app.state bounded by entries and bytes
and scoped by API key. A finished response is assembled and stored in a worker thread:
its work grows with the output, and on the event loop it would pause every stream.

The text inside <think>…</think> is the model's raw reasoning, so it goes where OpenAI
puts raw chain of thought: `content: [{"type": "reasoning_text"}]` of a reasoning item,
streamed as `response.reasoning_text.delta`; `summary` stays empty (we write none).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import count

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engines.errors import RequestAborted, RequestFailed
from engines.request import GenerationRequest
from engines.sequence import FinishReason
from scheduler import TokenEvent
from server.auth import caller_key_id
from server.errors import ApiError, bad_request, from_tandem_error
from server.generation import MaxTokens, build_request, effective_max_tokens
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
from server.json_body import PiecewiseJSONResponse
from server.keepalive import Quiet
from server.output_parser import OutputParser
from server.prompts import render_chat
from server.responses.images import take_images
from server.responses.inputs import normalize_input, with_instructions
from server.responses.output import OutputAssembler, assistant_turn, new_item_id
from server.responses.reasoning import ENCRYPTED_CONTENT, ReasoningSealer
from server.responses.schemas import (
    ResponsesRequest,
)
from server.responses.store import ResponseStore, StoredResponse
from server.responses.tools import ToolSet, tool_set
from server.server_tools import note_skipped_tools
from server.structured import (
    openai_tool_choice,
    output_constraint,
    responses_text_format,
)

# --- request -> engine terms (pure) ------------------------------------------------


def refuse_unsupported(body: ResponsesRequest) -> None:
    """Fields we understand but cannot honour are refused by name, never ignored."""
    if body.background:
        raise bad_request("background responses are not supported", "background")
    if body.conversation is not None:
        raise bad_request(
            "conversation objects are not supported; use previous_response_id", "conversation"
        )


# --- the store of recent responses ----------------------------------------------------


def store_of(request: Request) -> ResponseStore:
    """The app's store, created on first use (tests may put a smaller one there first)."""
    state = request.app.state
    if getattr(state, "responses_store", None) is None:
        state.responses_store = ResponseStore(max_bytes=config_of(request).responses_store_bytes)
    return state.responses_store


def sealer_of(request: Request) -> ReasoningSealer:
    """The app's reasoning sealer, made on first use; its key lives in memory only."""
    state = request.app.state
    if getattr(state, "reasoning_sealer", None) is None:
        state.reasoning_sealer = ReasoningSealer()
    return state.reasoning_sealer


def scope_of(request: Request) -> str:
    """Whose responses a request may see: its API key's id ("" when there are no keys)."""
    return caller_key_id(request.scope) or ""


def not_found(response_id: str, param: str | None = None) -> ApiError:
    code = "previous_response_not_found" if param else "response_not_found"
    return ApiError(
        404, f"no response with id '{response_id}' is stored", "invalid_request_error", param, code
    )


def previous_response(
    store: ResponseStore, scope: str, response_id: str | None
) -> StoredResponse | None:
    if response_id is None:
        return None
    entry = store.get(scope, response_id)
    if entry is None:
        raise not_found(response_id, "previous_response_id")
    return entry


def final_status(event: TokenEvent) -> str:
    return "incomplete" if event.finish_reason == FinishReason.LENGTH else "completed"


def response_usage(event: TokenEvent, reasoning_tokens: int = 0) -> dict:
    return {
        "input_tokens": event.prompt_tokens,
        "input_tokens_details": {"cached_tokens": event.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": event.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": event.prompt_tokens + event.completion_tokens,
    }


# --- one request ------------------------------------------------------------------------


@dataclass
class ResponsesJob:
    """A parsed Responses request and what formatting its output needs."""

    gen: GenerationRequest
    model: str
    body: ResponsesRequest
    conversation: list[dict]  # history and this input, without instructions
    tools: list | None  # chat-shaped, for the output parser
    starts_in_reasoning: bool
    scope: str  # the caller's store scope
    toolset: ToolSet = field(default_factory=ToolSet)  # how calls become output items
    seal: Callable[[str], str] | None = None  # reasoning -> encrypted_content, if asked
    created_at: int = field(default_factory=lambda: int(time.time()))
    forced: bool = False  # tool_choice forces a call
    images: tuple = ()  # the conversation's images, as the stored response keeps them


def response_object(
    job: ResponsesJob,
    status: str,
    items: list[dict],
    last: TokenEvent | None,
    reasoning_tokens: int = 0,
) -> dict:
    """The Response resource; `last` is the final event once generation ended, and
    `reasoning_tokens` how many of its output tokens were reasoning."""
    body, sampling = job.body, job.gen.sampling
    return {
        "id": job.gen.request_id,
        "object": "response",
        "created_at": job.created_at,
        "completed_at": int(time.time()) if last is not None else None,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": job.model,
        "output": items,
        "parallel_tool_calls": True,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "text": {"format": (body.text.format if body.text else None) or {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "truncation": "disabled",
        "metadata": body.metadata or {},
        "user": body.user,
        "usage": response_usage(last, reasoning_tokens) if last is not None else None,
        "speculation": last.speculation if last is not None else None,
    }


def to_job(request: Request, body: ResponsesRequest, model: str) -> ResponsesJob:
    refuse_unsupported(body)
    forced = openai_tool_choice(body.tool_choice)
    schema = responses_text_format(body.text.format if body.text else None)
    config, info = config_of(request), model_info_of(request)
    scope = scope_of(request)
    previous = previous_response(store_of(request), scope, body.previous_response_id)
    conversation = previous.messages() if previous is not None else []
    sealer = sealer_of(request)
    images = PromptImages(info.vision, config.image_limits)
    take_images(body, images)
    images.adopt(previous.images if previous is not None else ())  # the earlier turns'
    report_omitted(request, images, "responses")
    conversation += normalize_input(body.input, opener=partial(sealer.open, scope))
    if not conversation:
        raise bad_request("input has no message to answer", "input")
    toolset = tool_set(body.tools, body.tool_choice)
    tools = toolset.chat_tools or None
    markers = output_markers(request)
    rendered = render_chat(
        info.tokenizer,
        with_instructions(body.instructions, conversation),
        tools,
        markers.think[0] if markers.think else None,
        "input",
        checkpoint_system=info.prompt_checkpoints,
        images=images,
        traits=info.template_traits,
    )
    prompt_images = images.locate(rendered.ids)
    max_tokens = effective_max_tokens(
        body.max_output_tokens,
        len(rendered.ids),
        info.context_length,
        MaxTokens.of(config),
        "max_output_tokens",
    )
    gen = build_request(
        new_item_id("resp"), body, rendered.ids, max_tokens, info.vocab_size, "responses"
    )
    constraint = output_constraint(
        schema,
        "text.format",
        forced,
        tools,
        markers,
        info,
        rendered.starts_in_reasoning,
        config.tool_call_grammar == "auto",
    )
    gen = replace(
        gen, constraint=constraint, checkpoints=rendered.checkpoints, images=prompt_images
    )
    seal = partial(sealer.seal, scope) if ENCRYPTED_CONTENT in (body.include or ()) else None
    return ResponsesJob(
        gen,
        model,
        body,
        conversation,
        tools,
        rendered.starts_in_reasoning,
        scope,
        toolset,
        seal,
        forced=forced[0],
        images=images.stored(),
    )


def remember(store: ResponseStore, job: ResponsesJob, items: list[dict], result: dict) -> None:
    if job.body.store:
        conversation = [*job.conversation, assistant_turn(items)]
        entry = StoredResponse.of(conversation, result, job.images)
        store.put(job.scope, job.gen.request_id, entry)


def sse_event(payload: dict) -> str:
    """Responses streams name each event: `event: <type>` then its JSON."""
    data = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n"


def framed(payloads: Iterable[dict], numbers: Iterator[int]) -> list[str]:
    """SSE frames for events, numbered in the order they are sent."""
    return [sse_event({**payload, "sequence_number": next(numbers)}) for payload in payloads]


async def create_response(request: Request) -> Response:
    body = await parse_body(request, ResponsesRequest)
    model = check_model(config_of(request), body.model)
    job = await off_the_loop(to_job, request, body, model)
    note_skipped_tools(request.app.state.metrics, "responses", job.toolset.skipped)
    stream = submit(request, job.gen)
    parser = OutputParser(
        output_markers(request), job.tools, job.starts_in_reasoning, forced=job.forced
    )
    store = store_of(request)
    if body.stream:
        events = response_events(job, parser, heartbeat_events(request, stream), store)
        return with_omitted_header(request, event_stream(request, events, keepalive=False))
    collected = await collect_unless_disconnected(request, stream)
    if collected is None:
        return Response(status_code=499)
    response = await off_the_loop(finished_response, job, parser, collected, store)
    return with_omitted_header(request, response)


def finished_response(
    job: ResponsesJob, parser: OutputParser, events: list[TokenEvent], store: ResponseStore
) -> PiecewiseJSONResponse:
    """A finished generation's response, its items built as the stream would build them,
    stored, and serialized (all of which runs in a worker thread)."""
    last, status = events[-1], final_status(events[-1])
    assembler = OutputAssembler(job.toolset, job.seal)
    for event in events:
        assembler.feed(parser.step(event.text, event.final, len(event.token_ids)))
    assembler.finish(status)
    result = response_object(job, status, assembler.items, last, parser.reasoning_tokens)
    remember(store, job, assembler.items, result)
    return PiecewiseJSONResponse(result)


def closing_events(
    job: ResponsesJob,
    assembler: OutputAssembler,
    event: TokenEvent,
    store: ResponseStore,
    reasoning_tokens: int = 0,
) -> list[dict]:
    """The events that end a stream: the open item closed and the final response, stored
    before it is sent so a follow-up can name it at once."""
    status = final_status(event)
    payloads = assembler.finish(status)
    result = response_object(job, status, assembler.items, event, reasoning_tokens)
    remember(store, job, assembler.items, result)
    return [*payloads, {"type": f"response.{status}", "response": result}]


async def response_events(
    job: ResponsesJob,
    parser: OutputParser,
    events: AsyncIterator[TokenEvent | Quiet],
    store: ResponseStore,
) -> AsyncIterator[str]:
    """The SSE stream: created, in_progress, the items' events, then completed or
    incomplete (stored before it is sent, so a follow-up can name it at once); a
    failure mid-stream sends an `error` event, then ends with `response.failed` (the
    response so far, status failed, its error filled in), as OpenAI's streams do.
    While the stream is quiet (a long prefill), `response.in_progress` again with the
    response so far: Codex CLI's idle timer counts events only."""
    numbers = count()
    start = response_object(job, "in_progress", [], None)
    opening = [
        {"type": "response.created", "response": start},
        {"type": "response.in_progress", "response": start},
    ]
    for line in framed(opening, numbers):
        yield line
    assembler = OutputAssembler(job.toolset, job.seal)
    try:
        async for event in events:
            if isinstance(event, Quiet):
                snapshot = response_object(job, "in_progress", assembler.items, None)
                for line in framed(
                    [{"type": "response.in_progress", "response": snapshot}], numbers
                ):
                    yield line
                continue
            tokens = len(event.token_ids)
            payloads = assembler.feed(parser.step(event.text, event.final, tokens))
            if event.final:
                payloads += await off_the_loop(
                    closing_events, job, assembler, event, store, parser.reasoning_tokens
                )
            for line in framed(payloads, numbers):
                yield line
    except (RequestFailed, RequestAborted) as exc:
        error = from_tandem_error(exc)
        failure = {"type": "error", "code": error.code or error.type, "message": error.message}
        failed = response_object(job, "failed", assembler.items, None)
        failed["error"] = {"code": "server_error", "message": error.message}
        closing = [
            {**failure, "param": error.param},
            {"type": "response.failed", "response": failed},
        ]
        for line in framed(closing, numbers):
            yield line


async def retrieve_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    entry = store_of(request).get(scope_of(request), response_id)
    if entry is None:
        raise not_found(response_id)
    return Response(entry.body, media_type="application/json")


async def delete_response(request: Request) -> JSONResponse:
    response_id = request.path_params["response_id"]
    if not store_of(request).delete(scope_of(request), response_id):
        raise not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
