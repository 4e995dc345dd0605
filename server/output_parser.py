"""Splitting generated text into content, reasoning and tool calls, as it streams.

Built on mlx-lm's `TextStateMachine` (text-level matching of markers such as
`<think>` and `<tool_call>`, holding back partial markers) and its tool parsers
(`mlx_lm.tool_parsers.*.parse_tool_call`). Markers come from the tokenizer (what
mlx-lm infers from the chat template and vocabulary) unless overridden with
--tool-call-parser / --reasoning-parser. Calls written without their tags are
recognised in the plain-text part (server/untagged_tool_calls.py) unless
--strict-tool-calls. Every API surface formats the same `ParsedDelta`s in its own shape.
"""

from __future__ import annotations

import importlib
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import TextStateMachine

from server import json_body as strict_json
from server.untagged_tool_calls import UntaggedCalls

log = logging.getLogger(__name__)

NORMAL, REASONING, TOOL = "normal", "reasoning", "tool"
REASONING_PARSERS = {"think": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}


@dataclass(frozen=True)
class OutputMarkers:
    """Which markers this model uses; None disables that split. `untagged`: also
    recognise tool calls written without their markers."""

    think: tuple[str, str] | None = None
    tool: tuple[str, str | None] | None = None
    tool_parser: Callable[[str, Any], Any] | None = None
    untagged: bool = True

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        tool_call_parser: str = "auto",
        reasoning_parser: str = "auto",
        strict_tool_calls: bool = False,
    ) -> OutputMarkers:
        """`tool_call_parser` "none" turns off tool-call parsing, untagged calls too."""
        think = None
        if reasoning_parser == "auto" and tokenizer.has_thinking:
            think = (tokenizer.think_start, tokenizer.think_end)
        elif reasoning_parser in REASONING_PARSERS:
            think = REASONING_PARSERS[reasoning_parser]
        tool, parser = None, None
        if tool_call_parser == "auto" and tokenizer.has_tool_calling:
            tool, parser = (
                (tokenizer.tool_call_start, tokenizer.tool_call_end),
                (tokenizer.tool_parser),
            )
        elif tool_call_parser not in ("auto", "none"):
            module = importlib.import_module(f"mlx_lm.tool_parsers.{tool_call_parser}")
            tool, parser = (module.tool_call_start, module.tool_call_end), module.parse_tool_call
        untagged = not strict_tool_calls and tool_call_parser != "none"
        return cls(think, tool, parser, untagged)


def strict_arguments(arguments: Any) -> str:
    """A parsed call's arguments as JSON text. ValueError where a client could not read
    them: NaN or Infinity, which a model can write and mlx-lm's parsers let through."""
    if isinstance(arguments, str):
        try:
            strict_json.loads(arguments)
        except strict_json.NotAJSONNumber:
            raise
        except (ValueError, RecursionError):
            pass  # not JSON at all: passed on as the parser gave it
        return arguments
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def arguments_object(self) -> dict:
        try:
            value = json.loads(self.arguments)
        except (ValueError, RecursionError):  # also a 4300+ digit integer
            return {}
        return value if isinstance(value, dict) else {}


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class OutputParser:
    """Feed text deltas; get back what is safe to emit, split by kind. Tool calls are
    parsed only when the request offered tools; otherwise their markup is content.
    A forced call (tool_choice required / named, `forced`) is written in the markup its
    grammar gives: tagged for JSON-in-tags models, else bare JSON, which is then read
    as a call even with --strict-tool-calls (the grammar let nothing else through)."""

    def __init__(
        self,
        markers: OutputMarkers,
        tools: list | None = None,
        start_in_reasoning: bool = False,
        forced: bool = False,
    ) -> None:
        self.tools = tools
        self.parser = markers.tool_parser
        transitions: dict[str, list] = {NORMAL: []}
        if markers.think:
            transitions[NORMAL].append((markers.think[0], REASONING))
            transitions[REASONING] = [(markers.think[1], NORMAL)]
        if markers.tool and tools and self.parser:
            start, end = markers.tool
            transitions[NORMAL].append((start, TOOL))
            if REASONING in transitions:
                transitions[REASONING].append((start, TOOL))
            transitions[TOOL] = [(end, NORMAL)] if end else []
        self.machine = TextStateMachine(transitions)
        initial = REASONING if start_in_reasoning and markers.think else NORMAL
        self.state = self.machine.make_state(initial)
        self.tool_text = ""
        self.tool_calls_emitted = 0
        self.reasoning_tokens = 0  # output tokens spent reasoning (Responses usage)
        untagged = markers.untagged or forced
        self.untagged = UntaggedCalls(tools) if tools and untagged else None

    def feed(self, text: str, tokens: int = 0) -> ParsedDelta:
        """Split `text` (`tokens` output tokens) by kind, counting reasoning tokens."""
        before = self.state[0]
        self.state, segments = TextStateMachine.split(self.state, text)
        self._count_reasoning(tokens, before, segments)
        return self._collect(segments)

    def _count_reasoning(self, tokens: int, before: str, segments: list) -> None:
        """An event's tokens count as reasoning by the share of its text said in the
        reasoning state; text that is all markers (or held back as a possible one)
        counts by whether reasoning was or is the state (`<think>`, `</think>`)."""
        said = sum(len(text) for _, text in segments)
        if said:
            thought = sum(len(text) for state, text in segments if state == REASONING)
            self.reasoning_tokens += round(tokens * thought / said)
        elif REASONING in (before, self.state[0]):
            self.reasoning_tokens += tokens

    def step(self, text: str, final: bool, tokens: int = 0) -> ParsedDelta:
        """One event's text (`tokens` output tokens) split by kind; the final event also
        releases held text."""
        parsed = self.feed(text, tokens)
        if not final:
            return parsed
        tail = self.finish()
        return ParsedDelta(
            parsed.content + tail.content,
            parsed.reasoning + tail.reasoning,
            parsed.tool_calls + tail.tool_calls,
        )

    def finish(self) -> ParsedDelta:
        """End of generation: release held text; a tool call without an end marker ends here."""
        self.state, held, current = TextStateMachine.flush(self.state)
        delta = self._collect([(current, held)])
        if self.tool_text.strip():
            self._complete_tool_call(delta)
        if self.untagged:
            delta.content += self.untagged.finish()
        return delta

    def _collect(self, segments: list[tuple[str | None, str]]) -> ParsedDelta:
        delta = ParsedDelta()
        for index, (state, text) in enumerate(segments):
            if state in (REASONING, TOOL) and self.untagged:
                delta.content += self.untagged.interrupt()
            if state == REASONING:
                delta.reasoning += text
            elif state == TOOL:
                self.tool_text += text
                if index < len(segments) - 1:  # the machine left the tool state
                    self._complete_tool_call(delta)
            elif self.untagged:
                self._plain_text(text, delta)
            else:
                delta.content += text
        return delta

    def _plain_text(self, text: str, delta: ParsedDelta) -> None:
        """Text outside any markers: content, unless it is an untagged tool call."""
        content, calls = self.untagged.feed(text)
        delta.content += content
        for name, arguments in calls:
            delta.tool_calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
            self.tool_calls_emitted += 1

    def _complete_tool_call(self, delta: ParsedDelta) -> None:
        text, self.tool_text = self.tool_text, ""
        try:
            parsed = self.parser(text, self.tools)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("could not parse a tool call (%s); returning it as text", exc)
            delta.content += text
            return
        try:
            calls = [
                ToolCall(str(call.get("name", "")), strict_arguments(call.get("arguments", {})))
                for call in (parsed if isinstance(parsed, list) else [parsed])
            ]
        except ValueError as exc:
            log.warning("a tool call's arguments are not JSON (%s); returning it as text", exc)
            delta.content += text
            return
        delta.tool_calls.extend(calls)
        self.tool_calls_emitted += len(calls)
