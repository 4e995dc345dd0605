"""Helpers the SDK-driven tests share: an OpenAI SDK on the in-process ASGI client,
collecting a streamed chat completion, a scheduler whose model writes scripted text,
and the real-model tier's chat helpers."""

from __future__ import annotations

import openai

from tests.conftest import make_client, start_scheduler
from tests.forcing import forcing_factory

# A function the real-model tiers ask instruction models to edit.
CODE = """def total_price(items, tax):
    subtotal = 0
    for item in items:
        subtotal = subtotal + item.price * item.quantity
    return subtotal * (1 + tax)
"""


def openai_sdk(http) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://tandem.test/v1", api_key="x", http_client=http, max_retries=0
    )


async def streamed_chat(http, **request) -> tuple[str, list, str | None]:
    """(content, tool-call deltas, finish reason) of a streamed chat completion."""
    stream = await openai_sdk(http).chat.completions.create(stream=True, **request)
    content, parts, finish = "", [], None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        parts += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return content, parts, finish


def forced_scheduler(
    model_dir, tokenizer, scripts: dict[str, str], fault_marker: str | None = None
):
    """For a module fixture (`yield from`): a scheduler whose model writes `scripts`
    (and whose engine fails a request whose prompt holds `fault_marker`)."""
    forcing = forcing_factory(tokenizer, scripts)
    scheduler = start_scheduler(
        model_dir, logits_processor_factory=forcing, fault_marker=fault_marker
    )
    yield scheduler
    scheduler.stop()


def served(model_dir):
    """For a module fixture (`yield from`): a running scheduler on `model_dir`."""
    scheduler = start_scheduler(model_dir)
    yield scheduler
    scheduler.stop()


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


async def post_chat(scheduler, **body) -> dict:
    """A greedy non-streamed chat completion that must succeed."""
    async with make_client(scheduler) as client:
        response = await client.post("/v1/chat/completions", json={"temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()
