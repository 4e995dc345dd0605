"""POST /v1/chat/completions (OpenAI chat), JSON and SSE, with tools and reasoning.

Model output is split by `OutputParser` into `content`, `reasoning_content` and
`tool_calls`; with tool calls and a natural stop, finish_reason is "tool_calls".
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from engines.errors import RequestAborted, RequestFailed
from engines.request import GenerationRequest
from scheduler import TokenEvent
from server.errors import bad_request, from_tandem_error, openai_error_body
from server.generation import MaxTokens, build_request, effective_max_tokens, new_request_id
from server.http import (
    check_model,
    collect_unless_disconnected,
    config_of,
    event_stream,
    events_until_done,
    model_info_of,
    off_the_loop,
    output_markers,
    parse_body,
    submit,
)
from server.image_prompts import PromptImages, report_omitted, with_omitted_header
from server.json_body import PiecewiseJSONResponse
from server.openai.logprobs import chat_logprobs, merge
from server.openai.schemas import ChatCompletionRequest, ChatMessage, TextPart
from server.output_parser import OutputParser, ParsedDelta, ToolCall
from server.prompts import MEDIA_PARTS, media_placeholder, render_chat
from server.sse import DONE, sse_data
from server.structured import (
    chat_response_format,
    openai_tool_choice,
    output_constraint,
)
from server.usage import finish_reason_name, usage


@dataclass
class ChatJob:
    """A parsed chat request and what formatting its output needs."""

    gen: GenerationRequest
    model: str
    tools: list | None
    starts_in_reasoning: bool
    tokenizer: Any
    created: int = field(default_factory=lambda: int(time.time()))
    token_sources: bool = False  # tandem_token_sources: tag each token with its source
    forced: bool = False  # tool_choice forces a call


def message_text(message: ChatMessage, index: int) -> str:
    """A message's content as text: text parts joined, media parts as placeholders."""
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if isinstance(part, TextPart):
            texts.append(part.text)
        elif part.type in MEDIA_PARTS:
            texts.append(media_placeholder(MEDIA_PARTS[part.type]))
        else:
            raise bad_request(
                f"messages[{index}] has a '{part.type}' content part, which this server does "
                "not serve",
                f"messages[{index}].content",
            )
    return "".join(texts)


def tool_call_arguments(call: dict, index: int) -> dict:
    function = call.get("function") or {}
    if not isinstance(function, dict):
        raise bad_request(
            "a tool call's function must be an object with a name and arguments",
            f"messages[{index}].tool_calls",
        )
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:  # also a 4300+ digit integer
            raise bad_request(
                f"tool call arguments must be a JSON object: {exc}", f"messages[{index}]"
            ) from exc
    return {"name": function.get("name", ""), "arguments": arguments}


def take_images(messages: list[ChatMessage], images: PromptImages) -> None:
    """Each `image_url` part decoded and checked, and replaced by the text standing
    for it (`PromptImages.add`); other media parts stay, as placeholders."""
    for index, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart) or part.type != "image_url":
                continue
            param = f"messages[{index}].content[{j}].image_url"
            reference = (part.model_extra or {}).get("image_url")
            url = reference.get("url") if isinstance(reference, dict) else reference
            if not isinstance(url, str):
                raise bad_request(f"{param} must hold a url string", param)
            message.content[j] = TextPart(type="text", text=images.add_reference(url, param))


def normalize_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> the plain dicts chat templates expect."""
    normalized = []
    for index, message in enumerate(messages):
        entry: dict = {
            "role": "system" if message.role == "developer" else message.role,
            "content": message_text(message, index),
        }
        if message.tool_calls:
            entry["tool_calls"] = [
                {"id": c.get("id"), "type": "function", "function": tool_call_arguments(c, index)}
                for c in message.tool_calls
            ]
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.name:
            entry["name"] = message.name
        normalized.append(entry)
    return normalized


def to_job(request: Request, body: ChatCompletionRequest, model: str) -> ChatJob:
    config = config_of(request)
    info = model_info_of(request)
    forced = openai_tool_choice(body.tool_choice)
    schema = chat_response_format(body.response_format)
    tools = (
        [t.model_dump(exclude_none=True) for t in body.tools]
        if body.tools and body.tool_choice != "none"
        else None
    )
    markers = output_markers(request)
    images = PromptImages(info.vision, config.image_limits)
    take_images(body.messages, images)
    report_omitted(request, images, "chat")
    rendered = render_chat(
        info.tokenizer,
        normalize_messages(body.messages),
        tools,
        markers.think[0] if markers.think else None,
        checkpoint_system=info.prompt_checkpoints,
        images=images,
        traits=info.template_traits,
    )
    prompt_images = images.locate(rendered.ids)
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = effective_max_tokens(
        requested,
        len(rendered.ids),
        info.context_length,
        MaxTokens.of(config),
        "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    gen = build_request(
        new_request_id("chatcmpl"),
        body,
        rendered.ids,
        max_tokens,
        info.vocab_size,
        "chat",
        logprobs=logprobs,
    )
    constraint = output_constraint(
        schema,
        "response_format",
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
    return ChatJob(
        gen,
        model,
        tools,
        rendered.starts_in_reasoning,
        info.tokenizer,
        token_sources=body.tandem_token_sources,
        forced=forced[0],
    )


def new_parser(request: Request, job: ChatJob) -> OutputParser:
    return OutputParser(
        output_markers(request), job.tools, job.starts_in_reasoning, forced=job.forced
    )


def finish_name(event: TokenEvent, parser: OutputParser) -> str | None:
    name = finish_reason_name(event)
    return "tool_calls" if name == "stop" and parser.tool_calls_emitted else name


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return out if index is None else {"index": index, **out}


def choice_logprobs(job: ChatJob, events: list[TokenEvent]) -> dict | None:
    if job.gen.logprobs is None:
        return None
    return {"content": chat_logprobs(job.tokenizer, merge(events))}


def chat_json(job: ChatJob, parser: OutputParser, events: list[TokenEvent]) -> dict:
    parts = [parser.feed(e.text) for e in events] + [parser.finish()]
    content = "".join(p.content for p in parts)
    reasoning = "".join(p.reasoning for p in parts)
    calls = [c for p in parts for c in p.tool_calls]
    message: dict = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [tool_call_json(c) for c in calls]
    last = events[-1]
    return {
        "id": job.gen.request_id,
        "object": "chat.completion",
        "created": job.created,
        "model": job.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": choice_logprobs(job, events),
                "finish_reason": finish_name(last, parser),
            }
        ],
        "usage": usage(last),
        "speculation": last.speculation,
        **({"token_sources": token_sources(events)} if job.token_sources else {}),
    }


def token_sources(events: list[TokenEvent]) -> list[dict]:
    """The tandem_token_sources extension: per token, its source and the text it released
    (joined, the raw output the content was parsed from)."""
    return [
        {"source": source, "text": text} for e in events for source, text in e.token_sources or ()
    ]


async def create_chat_completion(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    model = check_model(config_of(request), body.model)
    job = await off_the_loop(to_job, request, body, model)
    stream = submit(request, job.gen)
    parser = new_parser(request, job)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = chat_chunks(job, parser, events_until_done(request, stream), include_usage)
        return with_omitted_header(request, event_stream(request, chunks))
    events = await collect_unless_disconnected(request, stream)
    if events is None:
        return Response(status_code=499)
    response = await off_the_loop(chat_response, job, parser, events)
    return with_omitted_header(request, response)


def chat_response(
    job: ChatJob, parser: OutputParser, events: list[TokenEvent]
) -> PiecewiseJSONResponse:
    """The finished completion, its output parsed and its logprobs formatted (a decode per
    token and per alternative), serialized in a worker thread to keep the loop free."""
    return PiecewiseJSONResponse(chat_json(job, parser, events))


def delta_fields(delta: ParsedDelta, first_tool_index: int) -> list[dict]:
    """The OpenAI `delta` objects for one parsed piece of output."""
    deltas = []
    if delta.reasoning:
        deltas.append({"reasoning_content": delta.reasoning})
    if delta.content:
        deltas.append({"content": delta.content})
    if delta.tool_calls:
        deltas.append(
            {
                "tool_calls": [
                    tool_call_json(call, first_tool_index + i)
                    for i, call in enumerate(delta.tool_calls)
                ]
            }
        )
    return deltas


async def chat_chunks(
    job: ChatJob,
    parser: OutputParser,
    events: AsyncIterator[TokenEvent],
    include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(delta: dict, finish: str | None, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {
            "id": job.gen.request_id,
            "object": "chat.completion.chunk",
            "created": job.created,
            "model": job.model,
            "choices": [choice],
        }

    yield sse_data(chunk({"role": "assistant", "content": ""}, None))
    last = None
    try:
        async for event in events:
            last = event
            before = parser.tool_calls_emitted
            parsed = parser.step(event.text, event.final)
            logprobs = choice_logprobs(job, [event]) if event.logprobs else None
            sources = token_sources([event]) if job.token_sources and event.token_ids else None
            for delta in delta_fields(parsed, before):
                tagged = {"token_sources": sources} if sources else {}
                yield sse_data({**chunk(delta, None, logprobs), **tagged})
                logprobs = sources = None
            if logprobs or sources:  # tokens whose text is still held back (a partial marker)
                tagged = {"token_sources": sources} if sources else {}
                yield sse_data({**chunk({}, None, logprobs), **tagged})
            if event.final:
                final = chunk({}, finish_name(event, parser))
                yield sse_data({**final, "speculation": event.speculation})
    except (RequestFailed, RequestAborted) as exc:
        yield sse_data(openai_error_body(from_tandem_error(exc)))
    if include_usage and last is not None:
        yield sse_data({**chunk({}, None), "choices": [], "usage": usage(last)})
    yield DONE
