"""Responses `input` items -> the normalised chat messages every surface renders.

Messages keep their role (`developer` is a system turn); call items of every tool kind
become the assistant's tool calls (see `server/responses/tools.py`), their outputs
"tool" messages; earlier reasoning (as text, or sealed in `encrypted_content`) goes
with the assistant turn that follows it as `reasoning_content`, which templates that
keep reasoning between tool calls render and the others ignore. Images and files
become a text placeholder: this model reads text only, and an agent's session must go
on when a tool returns a screenshot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from server.errors import bad_request
from server.prompts import media_placeholder
from server.responses.schemas import (
    CustomToolCallItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    LocalShellCallItem,
    MessageItem,
    OtherContent,
    OtherItem,
    ReasoningItem,
    TextContent,
    ToolOutputItem,
)
from server.responses.tools import chat_tool_call

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
MEDIA_PARTS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}
CALL_ITEMS = (FunctionCallItem, CustomToolCallItem, LocalShellCallItem)
OUTPUT_ITEMS = (FunctionCallOutputItem, ToolOutputItem)

Opener = Callable[[str], str | None]  # encrypted_content -> reasoning text, or None


def content_text(content: str | list, param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, OtherContent):
            if part.type not in MEDIA_PARTS:
                raise bad_request(
                    f"{param} has an '{part.type}' part, which this server does not serve", param
                )
            texts.append(media_placeholder(MEDIA_PARTS[part.type]))
        else:
            texts.append(part.text if isinstance(part, TextContent) else part.refusal)
    return "".join(texts)


def reasoning_text(item: ReasoningItem, opener: Opener | None) -> str:
    """The text of an earlier reasoning item: its own, or its sealed content opened."""
    texts = [
        part["text"]
        for part in item.content or []
        if part.get("type") == "reasoning_text" and isinstance(part.get("text"), str)
    ]
    if not texts and item.encrypted_content and opener is not None:
        texts = [opener(item.encrypted_content) or ""]
    return "".join(texts)


def item_message(item: Any, param: str) -> dict | None:
    """One input item as a chat message; None for items that render as nothing."""
    if isinstance(item, MessageItem):
        return {"role": ROLES[item.role], "content": content_text(item.content, f"{param}.content")}
    if isinstance(item, CALL_ITEMS):
        call = chat_tool_call(item.model_dump(), param)
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    if isinstance(item, OUTPUT_ITEMS):
        output = content_text(item.output, f"{param}.output")
        return {"role": "tool", "tool_call_id": item.call_id, "content": output}
    if isinstance(item, OtherItem):
        raise bad_request(
            f"{param} is a '{item.type}' item, which this server does not serve", param
        )
    return None


def append_message(messages: list[dict], message: dict) -> None:
    """A tool call joins the assistant turn it follows, as chat's tool_calls do."""
    last = messages[-1] if messages else None
    joins = message.get("tool_calls") and not message["content"]
    if joins and last is not None and last["role"] == "assistant":
        last["tool_calls"] = [*last.get("tool_calls", []), *message["tool_calls"]]
    else:
        messages.append(message)


def normalize_input(
    value: str | list, param: str = "input", opener: Opener | None = None
) -> list[dict]:
    """Responses input -> the plain message dicts chat templates expect."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    reasoning = ""  # waiting for the assistant turn it belongs to
    for index, item in enumerate(value):
        if isinstance(item, ReasoningItem):
            reasoning += reasoning_text(item, opener)
            continue
        message = item_message(item, f"{param}[{index}]")
        if message is None:
            continue
        if message["role"] == "assistant" and reasoning:
            message["reasoning_content"], reasoning = reasoning, ""
        append_message(messages, message)
    return messages


def with_instructions(instructions: str | None, conversation: list[dict]) -> list[dict]:
    """Instructions are this request's system prompt; they are not carried to follow-ups."""
    if not instructions:
        return conversation
    return [{"role": "system", "content": instructions}, *conversation]
