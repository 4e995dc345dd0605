"""Tool calls a model wrote without their tags.

Small models asked (by their chat template) for `<tool_call>{...}</tool_call>` often
write just the JSON, bare or in a ```json fence. When the request offered tools, an
output that is such a call is returned as one: after optional whitespace and an
optional ```json (or ```) fence, a JSON object `{"name": ..., "arguments": {...}}`
(or "parameters" in place of "arguments"; no other keys), or a list of them, naming
declared tools, each arguments object valid for its tool's JSON schema. Anything else
stays text, byte for byte.

Streaming decides as it goes: text is held back only while what came so far can still
become a call (blank, a fence opening, or a JSON prefix whose keys and tool name fit a
call); the moment it cannot, everything held is released as content and the rest of the
output passes straight through. A call is emitted as soon as its JSON closes; blanks
and the closing fence after it are dropped, and another call may follow. The tagged
formats are parsed first (by `OutputParser`); this only sees the plain-text part.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import jsonschema_rs

from server import json_body as strict_json
from server.json_prefix import KEY_DONE, VALUE_BEGUN, WHITESPACE, JsonPrefix, Landmark

log = logging.getLogger(__name__)

ARGUMENT_KEYS = ("arguments", "parameters")
CALL_KEYS = frozenset({"name", *ARGUMENT_KEYS})
FENCE_OPEN = re.compile(r"```(?:json)?[ \t]*\r?\n?\s*", re.IGNORECASE)  # then the JSON
FENCE_OPENING = re.compile(r"`{1,3}|```(?:j|js|jso|json)?[ \t]*\r?\n?\s*", re.IGNORECASE)
FENCE_CLOSING = re.compile(r"\s*`{0,3}")

START, FENCE, JSON, AFTER_FENCED, TEXT = "start", "fence", "json", "after fenced", "text"

Call = tuple[str, dict]  # a tool's name and its arguments


class ToolSchemas:
    """The declared tools by name, with a validator for each one's arguments (compiled
    on first use, offline: a remote `$ref` is never fetched). A schema that cannot be
    compiled checks only that the arguments are an object."""

    def __init__(self, tools: list[dict]) -> None:
        functions = [tool.get("function", tool) for tool in tools]
        self.schemas = {f["name"]: f.get("parameters") for f in functions if "name" in f}
        self._validators: dict[str, Any] = {}

    def call_of(self, value: Any) -> Call | None:
        """(name, arguments) if `value` is a call to a declared tool; else None."""
        if not isinstance(value, dict) or not set(value) <= CALL_KEYS or len(value) != 2:
            return None
        name = value.get("name")
        arguments = next(value[key] for key in ARGUMENT_KEYS if key in value)
        if not isinstance(name, str) or name not in self.schemas:
            return None
        if not isinstance(arguments, dict):
            return None
        return (name, arguments) if self._valid(name, arguments) else None

    def _valid(self, name: str, arguments: dict) -> bool:
        if name not in self._validators:
            self._validators[name] = self._compile(name)
        validator = self._validators[name]
        return validator is None or validator.is_valid(arguments)

    def _compile(self, name: str) -> Any:
        schema = self.schemas[name]
        if not isinstance(schema, dict):
            return None
        try:
            return jsonschema_rs.validator_for(schema, offline=True)
        except (ValueError, TypeError) as exc:
            log.info("tool %r has a schema we cannot compile (%s); any object passes", name, exc)
            return None


class UntaggedCalls:
    """Feed the plain-text part of the output; get back (content released, calls)."""

    def __init__(self, tools: list[dict]) -> None:
        self.tools = ToolSchemas(tools)
        self.mode = START
        self.held: list[str] = []  # everything held back, as fed
        self.fence = ""  # the fence opening or closing read so far
        self.json: list[str] = []  # the JSON candidate read so far
        self.scanner = JsonPrefix()
        self.found = 0  # calls recognised so far

    def feed(self, text: str) -> tuple[str, list[Call]]:
        released: list[str] = []
        calls: list[Call] = []
        for index, char in enumerate(text):
            if self.mode == TEXT:
                released.append(text[index:])
                break
            released.append(self._step(char, calls))
        return "".join(released), calls

    def interrupt(self) -> str:
        """Other output (reasoning, a tagged call) comes next: a candidate cut short is
        text; blanks (and a fence never closed) after a recognised call are dropped."""
        if self.mode in (START, AFTER_FENCED) and self.found:
            self._reset_after_call()
            return ""
        if self.mode == START:
            return self._take_held()
        return self._release()

    def finish(self) -> str:
        """End of output: whatever is still held is text, unless it only trails a call."""
        return self.interrupt()

    # --- one character ------------------------------------------------------------------

    def _step(self, char: str, calls: list[Call]) -> str:
        self.held.append(char)
        if self.mode == START:
            return self._at_start(char)
        if self.mode == FENCE:
            return self._in_fence(char)
        if self.mode == JSON:
            return self._in_json(char, calls)
        return self._after_fenced(char)

    def _at_start(self, char: str) -> str:
        if char in WHITESPACE:
            return ""
        if char == "`":
            self.mode, self.fence = FENCE, char
            return ""
        if char in "{[":
            return self._begin_json(char, fenced=False)
        return self._release()

    def _in_fence(self, char: str) -> str:
        if char in "{[" and FENCE_OPEN.fullmatch(self.fence):
            return self._begin_json(char, fenced=True)
        self.fence += char
        return "" if FENCE_OPENING.fullmatch(self.fence) else self._release()

    def _begin_json(self, char: str, fenced: bool) -> str:
        self.mode, self.fenced = JSON, fenced
        self.json, self.scanner = [], JsonPrefix()
        return self._in_json(char, [])

    def _in_json(self, char: str, calls: list[Call]) -> str:
        self.json.append(char)
        landmark = self.scanner.feed(char)
        if self.scanner.failed or (landmark and not self._could_be_call(landmark)):
            return self._release()
        if not self.scanner.complete:
            return ""
        found = self._calls("".join(self.json))
        if found is None:
            return self._release()
        calls.extend(found)
        self.found += len(found)
        self._reset_after_call()
        if self.fenced:
            self.mode, self.fence = AFTER_FENCED, ""
        return ""

    def _after_fenced(self, char: str) -> str:
        """Blanks and the closing fence after a fenced call are dropped."""
        self.fence += char
        if self.fence.endswith("```"):
            self._reset_after_call()
            return ""
        return "" if FENCE_CLOSING.fullmatch(self.fence) else self._release()

    # --- deciding ---------------------------------------------------------------------

    def _could_be_call(self, landmark: Landmark) -> bool:
        """Whether the JSON so far still fits a call (or a list of calls): an object
        where a call goes, only a call's keys, a declared tool's name as a string, and
        an object as the arguments."""
        stack = self.scanner.stack
        call_depth = 1 if stack[0] == "{" else 2
        if landmark.depth == 0:
            return True  # the top-level object or list itself
        if landmark.depth < call_depth:
            return landmark.kind == VALUE_BEGUN and landmark.text == "{"  # a call in the list
        if landmark.depth > call_depth:
            return True  # inside the arguments
        if landmark.kind == KEY_DONE:
            return landmark.text in CALL_KEYS
        if landmark.key == "name":
            if landmark.kind == VALUE_BEGUN:
                return landmark.text == '"'
            return landmark.text in self.tools.schemas
        return landmark.kind != VALUE_BEGUN or landmark.text == "{"  # the arguments

    def _calls(self, text: str) -> list[Call] | None:
        """The calls a finished JSON text makes; None unless all of it is calls."""
        try:
            value = strict_json.loads(text)  # NaN in arguments: no client could read it
        except (ValueError, RecursionError):
            return None
        items = value if isinstance(value, list) else [value]
        calls = [self.tools.call_of(item) for item in items]
        if not calls or any(call is None for call in calls):
            return None
        return calls  # type: ignore[return-value]

    def _release(self) -> str:
        """This output is text: everything held goes out, and so does all that follows."""
        self.mode = TEXT
        return self._take_held()

    def _take_held(self) -> str:
        text = "".join(self.held)
        self.held = []
        return text

    def _reset_after_call(self) -> None:
        self.mode, self.held, self.json, self.fence = START, [], [], ""
