"""One streamed agent turn, timed as a client sees it, on each surface the benchmark
speaks: Tandem's Messages and Responses APIs (the request as the client sent it) and
the peer's `/v1/completions` (the prompt text Tandem renders for it).

Time to first token is to the first event that carries output (a content block, an
output item or text delta); decode tok/s is (output tokens - 1) over the time from that
event to the last. Token counts and cached prompt tokens are the server's own `usage`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.agent_render import Answer

# Responses events that carry output (keep-alives are response.in_progress)
RESPONSES_OUTPUT = (".delta", "response.output_item.added")


@dataclass
class TurnResult:
    """One turn's figures and answer; `error` set when it failed."""

    ttft_s: float | None = None
    e2e_s: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    decode_tok_s: float | None = None
    # Tandem's own drafting for the turn (its final event's `speculation`):
    # method -> [drafted tokens, accepted tokens]; the peer reports none
    drafted: dict[str, list[int]] = field(default_factory=dict)
    answer: Answer | None = None
    raw_text: str = ""
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("answer", "raw_text")}
        out["answer"] = self.answer.short() if self.answer else None
        return out


@dataclass
class Collected:
    """What a stream has delivered so far."""

    started: float
    first: float | None = None
    last: float | None = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[tuple[str, str]] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    speculation: dict[str, Any] | None = None  # Tandem's, from its final event

    def output_event(self) -> None:
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now


async def sse_events(response: httpx.Response):
    """Each `data:` payload of an SSE stream as JSON (comments and [DONE] skipped)."""
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield json.loads(data)


def on_messages_event(event: dict, got: Collected) -> None:
    kind = event.get("type")
    if kind == "content_block_start":
        block = event["content_block"]
        got.output_event()
        if block.get("type") == "tool_use":
            got.calls.append((block["name"], ""))
    elif kind == "content_block_delta":
        got.output_event()
        delta = event["delta"]
        if delta["type"] == "text_delta":
            got.content.append(delta["text"])
        elif delta["type"] == "thinking_delta":
            got.reasoning.append(delta["thinking"])
        elif delta["type"] == "input_json_delta" and got.calls:
            name, args = got.calls[-1]
            got.calls[-1] = (name, args + delta["partial_json"])
    elif kind == "message_delta" and event.get("delta", {}).get("stop_reason"):
        usage = event["usage"]
        cached = usage.get("cache_read_input_tokens", 0)
        prompt = usage["input_tokens"] + cached + usage.get("cache_creation_input_tokens", 0)
        got.usage = {"prompt": prompt, "cached": cached, "output": usage["output_tokens"]}
        got.speculation = event.get("speculation")
    elif kind == "error":
        raise RuntimeError(f"error event: {event.get('error')}")


def on_responses_event(event: dict, got: Collected) -> None:
    kind = event.get("type", "")
    if kind.endswith(RESPONSES_OUTPUT) or kind in RESPONSES_OUTPUT:
        got.output_event()
    if kind == "response.output_text.delta":
        got.content.append(event["delta"])
    elif kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
        got.reasoning.append(event["delta"])
    elif kind == "response.output_item.done":
        item = event["item"]
        if item.get("type") == "function_call":
            got.calls.append((item["name"], item.get("arguments", "")))
        elif item.get("type") == "custom_tool_call":
            got.calls.append((item["name"], item.get("input", "")))
    elif kind in ("response.completed", "response.incomplete"):
        usage = event["response"]["usage"]
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        got.usage = {"prompt": usage["input_tokens"], "cached": cached}
        got.usage["output"] = usage["output_tokens"]
        got.speculation = event["response"].get("speculation")
    elif kind in ("response.failed", "error"):
        raise RuntimeError(f"{kind}: {event}")


def on_completions_event(event: dict, got: Collected) -> None:
    for choice in event.get("choices") or []:
        if choice.get("text"):
            got.output_event()
            got.content.append(choice["text"])
    if event.get("usage"):
        usage = event["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        got.usage = {
            "prompt": usage.get("prompt_tokens"),
            "cached": cached,
            "output": usage.get("completion_tokens"),
        }


def on_chat_event(event: dict, got: Collected) -> None:
    """mlx_lm.server's chat stream: content, `reasoning`, and whole tool calls."""
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning") or delta.get("tool_calls"):
            got.output_event()
        got.content.append(delta.get("content") or "")
        got.reasoning.append(delta.get("reasoning") or "")
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            got.calls.append((function.get("name", ""), function.get("arguments", "")))
    if event.get("usage"):
        on_completions_event({"usage": event["usage"]}, got)


HANDLERS = {
    "messages": on_messages_event,
    "responses": on_responses_event,
    "completions": on_completions_event,
    "chat": on_chat_event,
}


def normal_arguments(arguments: str) -> str:
    """Tool-call arguments compared as JSON values, not spellings."""
    try:
        return json.dumps(json.loads(arguments or "{}"), sort_keys=True, ensure_ascii=False)
    except ValueError:
        return arguments


def streamed_answer(got: Collected) -> Answer:
    calls = tuple((name, normal_arguments(args)) for name, args in got.calls)
    return Answer("".join(got.content).strip(), "".join(got.reasoning).strip(), calls)


def comparable(answer: Answer) -> Answer:
    """A parsed raw answer in the form a stream delivers it (see `streamed_answer`)."""
    calls = tuple((name, normal_arguments(args)) for name, args in answer.tool_calls)
    return Answer(answer.content.strip(), answer.reasoning.strip(), calls)


async def stream_turn(
    client: httpx.AsyncClient,
    url: str,
    surface: str,
    body: dict,
    headers: dict[str, str],
    timeout_s: float,
) -> tuple[TurnResult, Collected]:
    """POST `body` to `url`, streaming, and time it (errors are recorded, not raised)."""
    got = Collected(time.perf_counter())
    result = TurnResult()
    try:
        async with client.stream(
            "POST", url, json=body, headers=headers, timeout=timeout_s
        ) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text[:300]}")
            async for event in sse_events(response):
                HANDLERS[surface](event, got)
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as error:
        result.error = f"{type(error).__name__}: {error}"
    end = time.perf_counter()
    result.e2e_s = end - got.started
    if got.first is not None:
        result.ttft_s = got.first - got.started
    result.prompt_tokens = got.usage.get("prompt")
    result.cached_tokens = got.usage.get("cached")
    result.output_tokens = got.usage.get("output")
    methods = (got.speculation or {}).get("by_method") or {}
    result.drafted = {m: [s["draft_tokens"], s["accepted_tokens"]] for m, s in methods.items()}
    if result.output_tokens and result.output_tokens > 1 and got.first and got.last:
        span = got.last - got.first
        result.decode_tok_s = (result.output_tokens - 1) / span if span > 0 else None
    if result.error is None and not got.usage:
        result.error = "the stream ended without usage"
    return result, got
