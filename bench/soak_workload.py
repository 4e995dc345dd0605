"""The soak's requests: which one to send next, sending it, and the tally of outcomes.

Why apart: the mix (chat or completions, streamed or not, short or long, abandoned
mid-stream or not) and how each outcome is classified do not depend on the sampling of
memory or on the verdict.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.serve_dataset import Prompt
from bench.soak_settings import Settings

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
DISCONNECTED = "disconnected"


@dataclass(frozen=True)
class Plan:
    """One request: where it goes, how long it is, whether it is abandoned early."""

    endpoint: str
    stream: bool
    max_tokens: int
    prompt: Prompt
    disconnect_after: int | None  # data events to read before hanging up

    @property
    def kind(self) -> str:
        return f"{self.endpoint}/{'stream' if self.stream else 'json'}/{self.max_tokens}"


@dataclass
class Tally:
    """What the workers did; single-threaded (asyncio), so no locks."""

    started: int = 0
    ok: int = 0
    disconnects: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)

    def record(self, plan: Plan, outcome: str | None) -> None:
        self.kinds[plan.kind] = self.kinds.get(plan.kind, 0) + 1
        if outcome is None:
            self.ok += 1
        elif outcome == DISCONNECTED:
            self.disconnects += 1
        else:
            self.errors[outcome] = self.errors.get(outcome, 0) + 1


def choose_plan(rng: random.Random, settings: Settings, prompts: list[Prompt]) -> Plan:
    stream = rng.random() < settings.stream_fraction
    long = rng.random() < settings.long_fraction
    max_tokens = settings.long_tokens if long else settings.short_tokens
    disconnect_after = None
    if stream and rng.random() < settings.disconnect_rate:
        disconnect_after = rng.randint(1, max(1, max_tokens // 2))
    return Plan(
        endpoint="chat" if rng.random() < settings.chat_fraction else "completions",
        stream=stream,
        max_tokens=max_tokens,
        prompt=rng.choice(prompts),
        disconnect_after=disconnect_after,
    )


def request_body(plan: Plan, model: str) -> dict[str, Any]:
    """`ignore_eos` so a request runs to its `max_tokens`: lengths stay as planned."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": plan.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": plan.stream,
    }
    if plan.endpoint == "chat":
        body["messages"] = list(plan.prompt.messages)
    else:
        body["prompt"] = plan.prompt.text
    return body


async def run_one(client: httpx.AsyncClient, plan: Plan, model: str) -> str | None:
    """None when the request completed; DISCONNECTED when we hung up; else the error."""
    body = request_body(plan, model)
    try:
        async with client.stream("POST", ENDPOINTS[plan.endpoint], json=body) as response:
            if response.status_code != 200:
                return await error_key(response)
            if plan.stream:
                return await read_stream(response, plan.disconnect_after)
            await response.aread()
            return body_error(response)
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def read_stream(response: httpx.Response, disconnect_after: int | None) -> str | None:
    """Read SSE events to `[DONE]`, or return early (closing the connection) to disconnect."""
    events = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return None
        error = event_error(data)
        if error:
            return error
        events += 1
        if disconnect_after is not None and events >= disconnect_after:
            return DISCONNECTED
    return "stream ended without [DONE]"


def event_error(data: str) -> str | None:
    """The error an SSE data line carries (mid-stream failure), if any."""
    try:
        event = json.loads(data)
    except ValueError:
        return "malformed SSE data"
    if not isinstance(event, dict):
        return "malformed SSE data"
    error = event.get("error")
    return f"stream error {error.get('type')}" if isinstance(error, dict) else None


def body_error(response: httpx.Response) -> str | None:
    try:
        return None if "choices" in response.json() else "response without choices"
    except ValueError:
        return "malformed JSON response"


async def error_key(response: httpx.Response) -> str:
    await response.aread()
    try:
        kind = response.json()["error"]["type"]
    except (ValueError, KeyError, TypeError):
        kind = "non-OpenAI error body"
    return f"HTTP {response.status_code} {kind}"
