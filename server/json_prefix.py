"""An incremental JSON scanner: is the text so far still the start of a JSON value, and
where does that value end?

The untagged tool-call recogniser holds back output only while it can still become a
call; this scanner is how it knows, one character at a time, without re-parsing the
whole prefix on every token. It checks the grammar (RFC 8259) but builds no values:
the recogniser parses the finished text with `json.loads`. It reports landmarks (a
value starting, a key or string value finished, decoded) with where they sit, so the
recogniser can give up early on a key, tool name or value that no call could have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"
ESCAPES = '"\\/bfnrtu'
HEX = "0123456789abcdefABCDEF"
DIGITS = "0123456789"
LITERALS = {"t": "true", "f": "false", "n": "null"}
VALUE_STARTS = '{["-' + DIGITS + "".join(LITERALS)  # scalars only inside a container

# What the next non-blank character may be.
VALUE = "value"  # any value (top level, after ':' or after ',' in an array)
VALUE_OR_CLOSE = "value or ]"  # just after '['
KEY = "key"  # after ',' in an object
KEY_OR_CLOSE = "key or }"  # just after '{'
COLON = "colon"
COMMA_OR_CLOSE = "comma or close"
DONE = "done"


KEY_DONE, STRING_DONE, VALUE_BEGUN = "key", "string", "value"


@dataclass
class Landmark:
    """What one character finished or began: a key or string value read whole (`text`
    decoded), or a value begun (`text` its first character)."""

    kind: str  # KEY_DONE, STRING_DONE or VALUE_BEGUN
    text: str
    depth: int  # containers open around it: 1 = directly inside the top-level value
    key: str | None  # for a value directly inside an object: the key it belongs to


@dataclass
class JsonPrefix:
    """Feed characters; `failed` once the text cannot begin a JSON value, `complete`
    once one value has ended. Only objects and arrays are accepted at the top level."""

    stack: list[str] = field(default_factory=list)  # '{' / '[' of the open containers
    keys: list[str | None] = field(default_factory=list)  # the current key at each level
    expect: str = VALUE
    failed: bool = False
    _string: list[str] | None = None  # raw characters of an open string
    _string_is_key: bool = False
    _escape: int = 0  # 0: none; -1: after a backslash; n > 0: hex digits still due
    _literal: str = ""  # the rest of a true / false / null being read
    _number: str = ""  # the state of a number being read ("" when none)

    @property
    def complete(self) -> bool:
        return self.expect == DONE

    def feed(self, char: str) -> Landmark | None:
        """Advance by one character; returns the landmark it makes, if any."""
        if self.failed or self.complete:
            self.failed = True
            return None
        if self._string is not None:
            return self._string_char(char)
        if self._literal:
            self._literal_char(char)
            return None
        if self._number:
            if self._number_char(char):
                return None
            self._end_value()
        return self._structural(char)

    # --- strings, literals, numbers ---------------------------------------------------

    def _string_char(self, char: str) -> Landmark | None:
        raw = self._string
        assert raw is not None
        if self._escape == -1:
            self._escape = 4 if char == "u" else 0
            self.failed = char not in ESCAPES
        elif self._escape > 0:
            self._escape -= 1
            self.failed = char not in HEX
        elif char == "\\":
            self._escape = -1
        elif char == '"':
            return self._close_string()
        elif ord(char) < 0x20:
            self.failed = True
        raw.append(char)
        return None

    def _close_string(self) -> Landmark:
        raw, is_key = self._string, self._string_is_key
        self._string = None
        text = json.loads('"' + "".join(raw or ()) + '"')
        depth = len(self.stack)
        if is_key:
            self.keys[-1] = text
            self.expect = COLON
            return Landmark(KEY_DONE, text, depth, None)
        key = self._current_key()
        self._end_value()
        return Landmark(STRING_DONE, text, depth, key)

    def _literal_char(self, char: str) -> None:
        if char != self._literal[0]:
            self.failed = True
            return
        self._literal = self._literal[1:]
        if not self._literal:
            self._end_value()

    def _number_char(self, char: str) -> bool:
        """True if `char` continues the number (or breaks it: then `failed`); False if
        the number ended just before it."""
        state = self._number
        if char in DIGITS:
            if state == "0":  # no leading zeros
                self.failed = True
            elif state == "-" and char == "0":
                self._number = "0"
            else:
                self._number = {"-": "int", "0": "0", ".": "frac", "e": "exp", "e+": "exp"}.get(
                    state, state
                )
            return True
        if char == "." and state in ("0", "int"):
            self._number = "."
            return True
        if char in "eE" and state in ("0", "int", "frac"):
            self._number = "e"
            return True
        if char in "+-" and state == "e":
            self._number = "e+"
            return True
        if state in ("-", ".", "e", "e+"):  # a digit was due
            self.failed = True
            return True
        self._number = ""
        return False

    # --- structure ----------------------------------------------------------------------

    def _structural(self, char: str) -> Landmark | None:
        if char in WHITESPACE:
            return
        expect = self.expect
        if (
            expect in (VALUE, VALUE_OR_CLOSE)
            and char in VALUE_STARTS
            and (self.stack or char in "{[")
        ):
            return self._begin_value(char)
        if expect in (KEY, KEY_OR_CLOSE) and char == '"':
            self._string, self._string_is_key = [], True
        elif char == "}" and expect in (KEY_OR_CLOSE, COMMA_OR_CLOSE) and self._top("{"):
            self._close()
        elif char == "]" and expect in (VALUE_OR_CLOSE, COMMA_OR_CLOSE) and self._top("["):
            self._close()
        elif char == ":" and expect == COLON:
            self.expect = VALUE
        elif char == "," and expect == COMMA_OR_CLOSE:
            self.expect = KEY if self._top("{") else VALUE
        else:
            self.failed = True
        return None

    def _begin_value(self, char: str) -> Landmark:
        """Open the value `char` starts (one of VALUE_STARTS)."""
        landmark = Landmark(VALUE_BEGUN, char, len(self.stack), self._current_key())
        if char in "{[":
            self.stack.append(char)
            self.keys.append(None)
            self.expect = KEY_OR_CLOSE if char == "{" else VALUE_OR_CLOSE
        elif char == '"':
            self._string, self._string_is_key = [], False
        elif char in LITERALS:
            self._literal = LITERALS[char][1:]
        else:
            self._number = "0" if char == "0" else ("-" if char == "-" else "int")
        return landmark

    def _current_key(self) -> str | None:
        return self.keys[-1] if self._top("{") else None

    def _close(self) -> None:
        self.stack.pop()
        self.keys.pop()
        self._end_value()

    def _end_value(self) -> None:
        self.expect = COMMA_OR_CLOSE if self.stack else DONE

    def _top(self, kind: str) -> bool:
        return bool(self.stack) and self.stack[-1] == kind
