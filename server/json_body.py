"""JSON as RFC 8259 has it, read strictly and written in small pieces.

Python's reader takes NaN, Infinity and -Infinity, which no JSON client can read back:
`loads` refuses them, so nothing a client or a model wrote with them is echoed.

`json.dumps` is one C call that holds the GIL: for a 2 MB body (an echoed prompt with 20
logprobs per token) that is ~100 ms in which the event loop cannot run, even when the
call is made in a worker thread. Serializing long lists and objects item by item gives
the interpreter a chance to switch threads between items; the bytes are the same as
Starlette's `JSONResponse` writes.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from starlette.responses import JSONResponse

PIECE = 64  # lists and objects longer than this are serialized one item at a time


class NotAJSONNumber(ValueError):
    """NaN, Infinity or -Infinity in a JSON text."""


def _refuse_constant(name: str) -> None:
    raise NotAJSONNumber(f"{name} is not a JSON number")


def loads(text: str | bytes) -> Any:
    """`json.loads` without NaN and the infinities (ValueError, like any bad JSON)."""
    return json.loads(text, parse_constant=_refuse_constant)


# Deeper bodies are refused: json.loads reads ~1000 levels, but writing such a value back
# (an echoed field), a template or a grammar compile would run out of stack later, after
# the generation had run. No JSON schema or message list a client sends comes close.
MAX_NESTING = 100
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_depth(raw: bytes) -> int:
    """How deeply the arrays and objects of valid JSON text nest (0: a scalar). Strings
    are cut out first (brackets in them do not count); the rest is counted in numpy, so
    a 4 MB body costs milliseconds."""
    encoding = json.detect_encoding(raw)  # json.loads also reads UTF-16 and UTF-32
    if encoding not in ("utf-8", "utf-8-sig"):
        raw = raw.decode(encoding).encode("utf-8")
    brackets = np.frombuffer(_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), np.uint8)
    if brackets.size == 0:
        return 0
    opens = (brackets == ord("[")) | (brackets == ord("{"))
    return int(np.cumsum(np.where(opens, 1, -1)).max())


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def pieces(value: Any) -> str:
    """`dumps(value)`, built from one small `json.dumps` call per flat container."""
    if flat(value):
        return dumps(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{dumps(str(k))}:{pieces(v)}" for k, v in value.items()) + "}"
    return "[" + ",".join(pieces(item) for item in value) + "]"


def flat(value: Any) -> bool:
    """A scalar, or a short container of scalars: cheap enough for one `json.dumps`."""
    if isinstance(value, dict):
        inner = value.values()
    elif isinstance(value, list | tuple):
        inner = value
    else:
        return True
    return len(value) <= PIECE and not any(isinstance(v, dict | list | tuple) for v in inner)


class PiecewiseJSONResponse(JSONResponse):
    """A JSONResponse whose rendering lets other threads (the event loop) run."""

    def render(self, content: Any) -> bytes:
        return pieces(content).encode("utf-8")
