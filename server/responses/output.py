"""Output items of a Responses API response and the stream events that build them.

`OutputAssembler` turns parsed deltas into reasoning, message and tool call items
(function, custom, local shell: see `server/responses/tools.py`), step by step, so
streamed and non-streamed responses come from one code path.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable

from server.output_parser import ParsedDelta, ToolCall
from server.responses.tools import ToolSet, call_item, chat_tool_call


def new_item_id(prefix: str) -> str:
    """OpenAI-style ids: resp_…, msg_…, fc_…, rs_…"""
    return f"{prefix}_{uuid.uuid4().hex}"


EVENT_PREFIX = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


def new_text_item(kind: str) -> dict:
    if kind == "message":
        return {
            "type": "message",
            "id": new_item_id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
    return {
        "type": "reasoning",
        "id": new_item_id("rs"),
        "status": "in_progress",
        "summary": [],
        "content": [],
    }


def empty_part(kind: str) -> dict:
    if kind == "message":
        return {"type": "output_text", "text": "", "annotations": []}
    return {"type": "reasoning_text", "text": ""}


class OutputAssembler:
    """Builds output items from parsed deltas and returns the stream events that build
    them (without sequence numbers). Text goes to the open reasoning or message item,
    opening a new one when the kind changes; a function call arrives whole."""

    def __init__(
        self, tools: ToolSet | None = None, seal: Callable[[str], str] | None = None
    ) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item receiving text
        self._tools = tools or ToolSet()
        self._seal = seal  # reasoning text -> encrypted_content, when the client asked

    def feed(self, delta: ParsedDelta) -> list[dict]:
        events = []
        if delta.reasoning:
            events += self._add_text("reasoning", delta.reasoning)
        if delta.content:
            events += self._add_text("message", delta.content)
        for call in delta.tool_calls:
            events += self._close("completed") + self._add_call(call)
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the open item: 'incomplete' when generation hit max_output_tokens."""
        return self._close(status)

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _add_text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed") + self._open_item(kind)
        item = self._open
        item["content"][0]["text"] += text
        delta = {"type": f"{EVENT_PREFIX[kind]}.delta", **self._where(item), "content_index": 0}
        delta["delta"] = text
        if kind == "message":
            delta["logprobs"] = []
        return [*events, delta]

    def _open_item(self, kind: str) -> list[dict]:
        item = new_text_item(kind)
        self.items.append(item)
        self._open = item
        added = self._item_event("response.output_item.added", item)
        part = empty_part(kind)
        item["content"].append(part)
        where = {**self._where(item), "content_index": 0}
        return [added, {"type": "response.content_part.added", **where, "part": dict(part)}]

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        if item["type"] == "reasoning" and self._seal is not None:
            item["encrypted_content"] = self._seal(part["text"])
        where = {**self._where(item), "content_index": 0}
        done = {"type": f"{EVENT_PREFIX[item['type']]}.done", **where, "text": part["text"]}
        if item["type"] == "message":
            done["logprobs"] = []
        part_done = {"type": "response.content_part.done", **where, "part": copy.deepcopy(part)}
        return [done, part_done, self._item_event("response.output_item.done", item)]

    def _add_call(self, call: ToolCall) -> list[dict]:
        """A call arrives whole: added (in progress, its argument text empty), the
        argument text as one delta and done, then the item done."""
        done = call_item(call, self._tools, new_item_id("fc"))
        text_field = {"function_call": "arguments", "custom_tool_call": "input"}.get(done["type"])
        started = {**done, "status": "in_progress"}
        if text_field:
            started[text_field] = ""
        self.items.append(started)
        added = self._item_event("response.output_item.added", started)
        where = self._where(started)
        started.update(done)
        events = [added]
        if done["type"] == "function_call":
            arguments = done["arguments"]
            events += [
                {"type": "response.function_call_arguments.delta", **where, "delta": arguments},
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": done["name"],
                    "arguments": arguments,
                },
            ]
        elif done["type"] == "custom_tool_call":
            text = done["input"]
            events += [
                {"type": "response.custom_tool_call_input.delta", **where, "delta": text},
                {"type": "response.custom_tool_call_input.done", **where, "input": text},
            ]
        return [*events, self._item_event("response.output_item.done", started)]

    def _item_event(self, kind: str, item: dict) -> dict:
        return {"type": kind, "output_index": self.items.index(item), "item": copy.deepcopy(item)}


def assistant_turn(items: list[dict]) -> dict:
    """The model's output as the assistant message a follow-up renders (reasoning of
    past turns is dropped, as chat templates do)."""
    text = "".join(
        part["text"] for item in items if item["type"] == "message" for part in item["content"]
    )
    calls = [call for call in map(chat_tool_call, items) if call is not None]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
