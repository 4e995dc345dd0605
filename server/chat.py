"""POST /v1/chat/completions (OpenAI chat), JSON and SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engines.errors import RequestAborted, RequestFailed
from engines.request import GenerationRequest
from scheduler import TokenEvent
from server.errors import bad_request, from_tandem_error, openai_error_body
from server.generation import build_request, effective_max_tokens, new_request_id
from server.http import (
    check_model,
    collect_unless_disconnected,
    config_of,
    events_until_done,
    parse_body,
    scheduler_of,
)
from server.prompts import chat_prompt_ids
from server.schemas import ChatCompletionRequest
from server.sse import DONE, sse_data
from server.usage import finish_reason_name, usage


def refuse_unsupported(body: ChatCompletionRequest) -> None:
    if body.tools:
        raise bad_request("tools are not supported yet", "tools")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise bad_request(
            "response_format other than 'text' is not supported yet", "response_format"
        )
    if body.logprobs:
        raise bad_request("logprobs is not supported yet", "logprobs")


def to_generation_request(request: Request, body: ChatCompletionRequest) -> GenerationRequest:
    config = config_of(request)
    info = scheduler_of(request).model_info
    refuse_unsupported(body)
    prompt_ids = chat_prompt_ids(info.tokenizer, body.messages)
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = effective_max_tokens(
        requested, len(prompt_ids), info.context_length, config.max_tokens
    )
    return build_request(
        new_request_id("chatcmpl"), body, prompt_ids, max_tokens, len(info.tokenizer), "chat"
    )


def chat_json(gen: GenerationRequest, model: str, created: int, events: list[TokenEvent]):
    last = events[-1]
    return {
        "id": gen.request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(e.text for e in events)},
                "logprobs": None,
                "finish_reason": finish_reason_name(last),
            }
        ],
        "usage": usage(last),
        "speculation": last.speculation,
    }


async def create_chat_completion(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    model = check_model(config_of(request), body.model)
    gen = to_generation_request(request, body)
    stream = scheduler_of(request).submit(gen)
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = chat_chunks(gen, model, created, events_until_done(request, stream), include_usage)
        return StreamingResponse(chunks, media_type="text/event-stream")
    events = await collect_unless_disconnected(request, stream)
    if events is None:
        return Response(status_code=499)
    return JSONResponse(chat_json(gen, model, created, events))


async def chat_chunks(
    gen: GenerationRequest,
    model: str,
    created: int,
    events: AsyncIterator[TokenEvent],
    include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(delta: dict, finish: str | None) -> dict:
        return {
            "id": gen.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    yield sse_data(chunk({"role": "assistant", "content": ""}, None))
    last = None
    try:
        async for event in events:
            last = event
            if event.text:
                yield sse_data(chunk({"content": event.text}, None))
            if event.final:
                final = chunk({}, finish_reason_name(event))
                yield sse_data({**final, "speculation": event.speculation})
    except (RequestFailed, RequestAborted) as exc:
        yield sse_data(openai_error_body(from_tandem_error(exc)))
    if include_usage and last is not None:
        yield sse_data({**chunk({}, None), "choices": [], "usage": usage(last)})
    yield DONE
