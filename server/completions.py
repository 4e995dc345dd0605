"""POST /v1/completions (OpenAI legacy completions), JSON and SSE."""

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
from server.prompts import completion_prompt_ids
from server.schemas import CompletionRequest
from server.sse import DONE, sse_data
from server.usage import finish_reason_name, usage


def refuse_unsupported(body: CompletionRequest) -> None:
    if body.echo:
        raise bad_request("echo is not supported yet", "echo")
    if body.logprobs:
        raise bad_request("logprobs is not supported yet", "logprobs")
    if body.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported by this model", "suffix")
    if body.best_of not in (None, 1):
        raise bad_request("best_of > 1 is not supported", "best_of")


def to_generation_request(request: Request, body: CompletionRequest) -> GenerationRequest:
    config = config_of(request)
    info = scheduler_of(request).model_info
    refuse_unsupported(body)
    prompt_ids = completion_prompt_ids(info.tokenizer, body.prompt)
    max_tokens = effective_max_tokens(
        body.max_tokens, len(prompt_ids), info.context_length, config.max_tokens
    )
    return build_request(
        new_request_id("cmpl"), body, prompt_ids, max_tokens, len(info.tokenizer), "completions"
    )


def completion_json(gen: GenerationRequest, model: str, created: int, events: list[TokenEvent]):
    last = events[-1]
    return {
        "id": gen.request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": "".join(e.text for e in events),
                "logprobs": None,
                "finish_reason": finish_reason_name(last),
            }
        ],
        "usage": usage(last),
        "speculation": last.speculation,
    }


async def create_completion(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    model = check_model(config_of(request), body.model)
    gen = to_generation_request(request, body)
    stream = scheduler_of(request).submit(gen)
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = completion_chunks(
            gen, model, created, events_until_done(request, stream), include_usage
        )
        return StreamingResponse(chunks, media_type="text/event-stream")
    events = await collect_unless_disconnected(request, stream)
    if events is None:
        return Response(status_code=499)
    return JSONResponse(completion_json(gen, model, created, events))


async def completion_chunks(
    gen: GenerationRequest,
    model: str,
    created: int,
    events: AsyncIterator[TokenEvent],
    include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None) -> dict:
        return {
            "id": gen.request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }

    last = None
    try:
        async for event in events:
            last = event
            if event.final:
                yield sse_data(
                    {
                        **chunk(event.text, finish_reason_name(event)),
                        "speculation": event.speculation,
                    }
                )
            elif event.text:
                yield sse_data(chunk(event.text, None))
    except (RequestFailed, RequestAborted) as exc:
        yield sse_data(openai_error_body(from_tandem_error(exc)))
    if include_usage and last is not None:
        yield sse_data({**chunk("", None), "choices": [], "usage": usage(last)})
    yield DONE
