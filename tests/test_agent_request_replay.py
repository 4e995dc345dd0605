"""Replay what real coding agents sent (tests/data/agent_requests/, recorded with
tests/agent_clients/capture_server.py) through the in-process app.

Why: these bodies carry every field, header and message shape the clients really use
(Claude Code's mid-conversation `system` message, `thinking`, `context_management`,
`max_tokens: 32000`; Codex's `namespace` and `web_search` tools, `include`,
`client_metadata`; ...). Each must be served: 200 and a valid stream or body in that
API's own shape, checked with the official SDKs' types.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from anthropic.types import RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from tests.agent_clients.agent_model import build_agent_model
from tests.conftest import MODEL_NAME, make_client, start_scheduler

FIXTURES = Path(__file__).parent / "data" / "agent_requests"
NAMES = sorted(p.name for p in FIXTURES.glob("*.json"))
# Headers the transport sets itself, or that only name the recording's connection.
DROPPED_HEADERS = {"host", "content-length", "connection", "accept-encoding"}
# A small cap keeps the replay fast: a request asking for 32000 tokens gets this many.
MAX_TOKENS = 16

ANTHROPIC_EVENT = TypeAdapter(RawMessageStreamEvent)
RESPONSES_EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def long_context_scheduler(tmp_path_factory):
    """A tiny model whose context holds a coding agent's 20k-token prompt."""
    model_dir = build_agent_model(tmp_path_factory.mktemp("models") / "agent")
    scheduler = start_scheduler(model_dir)
    yield scheduler
    scheduler.stop()


def load_fixture(name: str) -> dict:
    recorded = json.loads((FIXTURES / name).read_text())
    headers = {
        k: v
        for k, v in recorded["headers"].items()
        if k.lower() not in DROPPED_HEADERS and v != "<removed>"
    }
    query = [(k, v) for k, values in recorded["query"].items() for v in values]
    body = {**recorded["body"], "model": MODEL_NAME}
    return {"path": recorded["path"], "query": query, "headers": headers, "body": body}


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) for each SSE event; comments (keep-alives) are skipped."""
    events = []
    for block in text.split("\n\n"):
        lines = [line for line in block.splitlines() if line and not line.startswith(":")]
        if not lines:
            continue
        name = next((line[6:].strip() for line in lines if line.startswith("event:")), None)
        data = "\n".join(line[5:].lstrip() for line in lines if line.startswith("data:"))
        events.append((name, data))
    return events


def check_anthropic_stream(text: str) -> None:
    payloads = [json.loads(data) for _, data in sse_events(text)]
    # `ping` is a documented keep-alive event the SDK's union leaves out.
    events = [ANTHROPIC_EVENT.validate_python(p) for p in payloads if p.get("type") != "ping"]
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert "message_delta" in kinds, kinds


def check_responses_stream(text: str) -> None:
    events = [RESPONSES_EVENT.validate_python(json.loads(data)) for _, data in sse_events(text)]
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created", kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert not any(k in ("error", "response.failed") for k in kinds), kinds


def check_chat_stream(text: str) -> None:
    events = sse_events(text)
    assert events[-1][1] == "[DONE]", events[-1]
    chunks = [ChatCompletionChunk.model_validate(json.loads(d)) for _, d in events[:-1]]
    assert any(c.choices and c.choices[0].finish_reason for c in chunks), chunks[-1]


def check_served(path: str, body: dict, response) -> None:
    assert response.status_code == 200, f"{response.status_code}: {response.text[:2000]}"
    if not body.get("stream"):
        assert path.endswith("/chat/completions"), path
        ChatCompletion.model_validate(response.json())
        return
    assert response.headers["content-type"].startswith("text/event-stream")
    if path.endswith("/messages"):
        check_anthropic_stream(response.text)
    elif path.endswith("/responses"):
        check_responses_stream(response.text)
    else:
        check_chat_stream(response.text)


def test_every_client_is_recorded():
    """The fixtures cover each client this suite drives for real."""
    prefixes = ("claude-code-", "codex-", "openai-agents-", "mini-swe-agent-")
    assert all(any(n.startswith(p) for n in NAMES) for p in prefixes), NAMES


@pytest.mark.parametrize("name", NAMES)
async def test_recorded_request_is_served(long_context_scheduler, name):
    recorded = load_fixture(name)
    async with make_client(long_context_scheduler, max_tokens=MAX_TOKENS) as client:
        response = await client.post(
            recorded["path"],
            params=recorded["query"],
            headers=recorded["headers"],
            json=recorded["body"],
            timeout=300,
        )
    check_served(recorded["path"], recorded["body"], response)


async def test_claude_code_count_tokens_matches_messages(long_context_scheduler):
    """Claude Code's first body through count_tokens counts what /v1/messages renders."""
    recorded = load_fixture("claude-code-2.1-first.json")
    body = {
        k: v
        for k, v in recorded["body"].items()
        if k in ("model", "messages", "system", "tools", "thinking", "tool_choice")
    }
    async with make_client(long_context_scheduler, max_tokens=MAX_TOKENS) as client:
        counted = await client.post(
            "/v1/messages/count_tokens", headers=recorded["headers"], json=body, timeout=120
        )
        assert counted.status_code == 200, counted.text[:2000]
        served = await client.post(
            "/v1/messages",
            headers=recorded["headers"],
            json={**recorded["body"], "stream": False},
            timeout=300,
        )
    assert served.status_code == 200, served.text[:2000]
    assert counted.json()["input_tokens"] == served.json()["usage"]["input_tokens"] + sum(
        served.json()["usage"].get(k) or 0
        for k in ("cache_read_input_tokens", "cache_creation_input_tokens")
    )
