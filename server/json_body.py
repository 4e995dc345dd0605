"""JSON response bodies serialized in small pieces.

`json.dumps` is one C call that holds the GIL: for a 2 MB body (an echoed prompt with 20
logprobs per token) that is ~100 ms in which the event loop cannot run, even when the
call is made in a worker thread. Serializing long lists and objects item by item gives
the interpreter a chance to switch threads between items; the bytes are the same as
Starlette's `JSONResponse` writes.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

PIECE = 64  # lists and objects longer than this are serialized one item at a time


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
