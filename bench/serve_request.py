"""One streamed request of `tandem bench serve`: its body, and the timing of its chunks.

Why apart: reading each API's stream (OpenAI chat and completions, Anthropic messages)
into a `RequestRecord` is its own concern; failures become an error type on the record.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.serve_dataset import Prompt
from bench.serve_settings import ENDPOINTS, Settings
from bench.stats import RequestRecord


@dataclass
class Chunk:
    """What one SSE event contributes: content text, token counts, or an error."""

    text: str = ""
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None


def request_body(settings: Settings, model: str, prompt: Prompt, seed: int | None) -> dict:
    """The streaming request for the chosen endpoint."""
    body: dict[str, Any] = {"model": model, "max_tokens": settings.max_tokens, "stream": True}
    body["temperature"] = settings.temperature
    if settings.endpoint == "messages":
        system = [m["content"] for m in prompt.messages if m["role"] == "system"]
        body["messages"] = [m for m in prompt.messages if m["role"] != "system"]
        if system:
            body["system"] = "\n\n".join(system)
        return body
    if settings.endpoint == "chat":
        body["messages"] = list(prompt.messages)
    else:
        body["prompt"] = prompt.text
    body["stream_options"] = {"include_usage": True}
    if seed is not None:
        body["seed"] = seed
    if settings.ignore_eos:
        body["ignore_eos"] = True
    return body


def read_chunk(endpoint: str, data: dict[str, Any]) -> Chunk:
    """Content and usage of one decoded SSE `data:` payload."""
    if endpoint == "messages":
        return read_anthropic_event(data)
    if isinstance(data.get("error"), dict):
        return Chunk(error=f"stream error: {data['error'].get('type', 'error')}")
    text = ""
    for choice in data.get("choices") or []:
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            text += delta.get("content") or delta.get("reasoning_content") or ""
        else:
            text += choice.get("text") or ""
    usage = data.get("usage") or {}
    return Chunk(text, usage.get("prompt_tokens"), usage.get("completion_tokens"))


def read_anthropic_event(data: dict[str, Any]) -> Chunk:
    """Anthropic streams: text in `content_block_delta`, prompt tokens in
    `message_start`, the final output token count in `message_delta`."""
    kind = data.get("type")
    if kind == "content_block_delta":
        delta = data.get("delta") or {}
        return Chunk(text=delta.get("text") or delta.get("thinking") or "")
    if kind == "message_start":
        usage = (data.get("message") or {}).get("usage") or {}
        return Chunk(input_tokens=usage.get("input_tokens"))
    if kind == "message_delta":
        usage = data.get("usage") or {}
        return Chunk(
            input_tokens=usage.get("input_tokens"), output_tokens=usage.get("output_tokens")
        )
    if kind == "error":
        return Chunk(error=f"stream error: {(data.get('error') or {}).get('type', 'error')}")
    return Chunk()


async def send_request(
    client: httpx.AsyncClient, settings: Settings, body: dict, prompt_index: int
) -> RequestRecord:
    """Stream one request, timing each content chunk's arrival. Failures become an
    error type on the record (`HTTP 503`, an exception class), never an exception."""
    record = RequestRecord(prompt_index=prompt_index)
    start = time.perf_counter()
    try:
        async with client.stream("POST", ENDPOINTS[settings.endpoint], json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}"
                return record
            await read_stream(response, settings.endpoint, record, start)
    except Exception as exc:  # every failure is a data point, counted by type
        record.error = type(exc).__name__
        return record
    record.e2el = time.perf_counter() - start
    if record.error is None:
        record.success = True
        if not record.usage_reported:
            record.output_tokens = len(record.chunk_times)
    return record


async def read_stream(
    response: httpx.Response, endpoint: str, record: RequestRecord, start: float
) -> None:
    parts: list[str] = []
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            break
        chunk = read_chunk(endpoint, json.loads(payload))
        if chunk.error:
            record.error = chunk.error
            break
        if chunk.text:
            record.chunk_times.append(time.perf_counter() - start)
            parts.append(chunk.text)
        if chunk.input_tokens is not None:
            record.input_tokens = chunk.input_tokens
        if chunk.output_tokens is not None:
            record.output_tokens = chunk.output_tokens
            record.usage_reported = True
    record.text = "".join(parts)
