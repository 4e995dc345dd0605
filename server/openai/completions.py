"""POST /v1/completions (OpenAI legacy completions), JSON and SSE.

Logprobs cost a decode per token and per alternative (21 with `logprobs: 20`), and an
echoed prompt is thousands of tokens: formatting them runs in a worker thread, so the
event loop keeps serving other clients meanwhile.
"""

from __future__ import annotations

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
    parse_body,
    submit,
)
from server.json_body import PiecewiseJSONResponse
from server.openai.logprobs import completion_logprobs, join_logprobs, merge, prompt_logprobs
from server.openai.schemas import CompletionRequest
from server.prompts import completion_prompt_ids, fim_prompt_ids
from server.sse import DONE, sse_data
from server.usage import finish_reason_name, usage


def refuse_unsupported(body: CompletionRequest) -> None:
    if body.max_tokens == 0 and not (body.echo and body.logprobs is not None):
        raise bad_request(
            "max_tokens 0 only scores the prompt: it needs echo and logprobs", "max_tokens"
        )
    if body.echo and body.suffix:
        raise bad_request("echo cannot be combined with suffix", "echo")
    if body.best_of not in (None, 1):
        raise bad_request("best_of > 1 is not supported", "best_of")


@dataclass
class CompletionJob:
    gen: GenerationRequest
    model: str
    echo_text: str  # the prompt, when echo was asked for
    tokenizer: Any
    created: int = field(default_factory=lambda: int(time.time()))


def prompt_ids_for(tokenizer: Any, body: CompletionRequest, vocab_size: int) -> list[int]:
    if body.suffix:
        if not isinstance(body.prompt, str):
            raise bad_request("suffix needs a text prompt", "prompt")
        return fim_prompt_ids(tokenizer, body.prompt, body.suffix)
    return completion_prompt_ids(tokenizer, body.prompt, vocab_size)


def to_job(request: Request, body: CompletionRequest, model: str) -> CompletionJob:
    config = config_of(request)
    info = model_info_of(request)
    tokenizer, context = info.tokenizer, info.context_length
    refuse_unsupported(body)
    prompt_ids = prompt_ids_for(tokenizer, body, info.vocab_size)
    max_tokens = effective_max_tokens(
        body.max_tokens, len(prompt_ids), context, MaxTokens.of(config)
    )
    gen = build_request(
        new_request_id("cmpl"),
        body,
        prompt_ids,
        max_tokens,
        info.vocab_size,
        "completions",
        logprobs=body.logprobs,
    )
    if body.echo and body.logprobs is not None:  # prompt logprobs, as eval harnesses ask
        gen = replace(gen, prompt_logprobs=body.logprobs)
    echo = echo_text(tokenizer, body.prompt) if body.echo else ""
    return CompletionJob(gen, model, echo, tokenizer)


def echo_text(tokenizer: Any, prompt: str | list) -> str:
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if prompt and isinstance(prompt[0], str):
        return prompt[0]
    return tokenizer.decode(list(prompt))


def echoed_logprobs(job: CompletionJob, event: TokenEvent) -> tuple[dict, int]:
    """The prompt's part of an echoed `logprobs` object, and the text offset after it."""
    scored = event.prompt_logprobs or []
    return prompt_logprobs(job.tokenizer, job.gen.prompt_tokens, scored, job.echo_text)


def completion_json(job: CompletionJob, events: list[TokenEvent]) -> dict:
    last = events[-1]
    logprobs = None
    if job.gen.logprobs is not None:
        offset = 0
        if job.gen.prompt_logprobs is not None:
            prompt_part, offset = echoed_logprobs(job, events[0])
        logprobs, _ = completion_logprobs(job.tokenizer, merge(events), offset)
        if job.gen.prompt_logprobs is not None:
            logprobs = join_logprobs(prompt_part, logprobs)
    return {
        "id": job.gen.request_id,
        "object": "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": [
            {
                "index": 0,
                "text": job.echo_text + "".join(e.text for e in events),
                "logprobs": logprobs,
                "finish_reason": finish_reason_name(last),
            }
        ],
        "usage": usage(last),
        "speculation": last.speculation,
    }


async def create_completion(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    model = check_model(config_of(request), body.model)
    job = await off_the_loop(to_job, request, body, model)
    stream = submit(request, job.gen)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = completion_chunks(job, events_until_done(request, stream), include_usage)
        return event_stream(request, chunks)
    events = await collect_unless_disconnected(request, stream)
    if events is None:
        return Response(status_code=499)
    return await off_the_loop(completion_response, job, events)


def completion_response(job: CompletionJob, events: list[TokenEvent]) -> PiecewiseJSONResponse:
    """The finished completion, formatted and serialized (in a worker thread)."""
    return PiecewiseJSONResponse(completion_json(job, events))


async def completion_chunks(
    job: CompletionJob, events: AsyncIterator[TokenEvent], include_usage: bool
) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {
            "id": job.gen.request_id,
            "object": "text_completion",
            "created": job.created,
            "model": job.model,
            "choices": [choice],
        }

    last, offset, echoed = None, 0, not job.echo_text
    try:
        async for event in events:
            if not echoed:  # the prompt goes first, scored when asked
                echo_logprobs = None
                if job.gen.prompt_logprobs is not None:
                    echo_logprobs, offset = await off_the_loop(echoed_logprobs, job, event)
                yield sse_data(chunk(job.echo_text, None, echo_logprobs))
                echoed = True
            last = event
            logprobs = None
            if job.gen.logprobs is not None and event.logprobs:
                logprobs, offset = completion_logprobs(job.tokenizer, event.logprobs, offset)
            finish = finish_reason_name(event)
            if event.final:
                final = chunk(event.text, finish, logprobs)
                yield sse_data({**final, "speculation": event.speculation})
            elif event.text or logprobs:
                yield sse_data(chunk(event.text, None, logprobs))
    except (RequestFailed, RequestAborted) as exc:
        yield sse_data(openai_error_body(from_tandem_error(exc)))
    if include_usage and last is not None:
        yield sse_data({**chunk("", None), "choices": [], "usage": usage(last)})
    yield DONE
