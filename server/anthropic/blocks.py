"""Parsed model output laid out as Anthropic content blocks and their stream events.

The JSON body and the SSE stream are built by the same `BlockStream`, so they always
agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from server.output_parser import ParsedDelta, ToolCall


def tool_use_id(call: ToolCall) -> str:
    return f"toolu_{call.id.removeprefix('call_')}"


def empty_block(kind: str) -> dict:
    """A text or thinking block as content_block_start announces it."""
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


@dataclass
class BlockStream:
    """Lays parsed output out as content blocks, in order, returning the stream events
    that build them. A new block starts whenever the kind of output changes. A text or
    thinking block opens at its first non-whitespace character: whitespace between
    blocks (the "\\n\\n" after </think>) is not worth a block of its own, and Anthropic
    refuses whitespace-only text blocks when a client sends the message back.
    Within one delta, reasoning comes before text and text before tool calls."""

    blocks: list[dict] = field(default_factory=list)
    open_kind: str | None = None
    held_kind: str | None = None
    held: str = ""  # leading whitespace waiting for its block to open

    def feed(self, delta: ParsedDelta) -> list[dict]:
        events = []
        if delta.reasoning:
            events += self._text("thinking", delta.reasoning)
        if delta.content:
            events += self._text("text", delta.content)
        for call in delta.tool_calls:
            events += self._tool_use(call)
        return events

    def close(self) -> list[dict]:
        """End of output: close the open block; held whitespace is dropped."""
        self.held_kind, self.held = None, ""
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _text(self, kind: str, text: str) -> list[dict]:
        if self.open_kind == kind:
            return [self._append(kind, text)]
        pending = self.held + text if self.held_kind == kind else text
        if not pending.strip():
            self.held_kind, self.held = kind, pending
            return []
        events = self.close()
        events.append(self._open(kind, empty_block(kind)))
        events.append(self._append(kind, pending))
        return events

    def _tool_use(self, call: ToolCall) -> list[dict]:
        events = self.close()
        block = {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": {}}
        events.append(self._open("tool_use", block))
        arguments = call.arguments_object()
        self.blocks[-1]["input"] = arguments
        delta = {"type": "input_json_delta", "partial_json": json.dumps(arguments)}
        events.append(
            {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}
        )
        return events + self.close()

    def _open(self, kind: str, block: dict) -> dict:
        self.blocks.append(dict(block))
        self.open_kind = kind
        return {
            "type": "content_block_start",
            "index": len(self.blocks) - 1,
            "content_block": block,
        }

    def _append(self, kind: str, text: str) -> dict:
        self.blocks[-1][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}
