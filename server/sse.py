"""Server-sent events framing (`data: …\\n\\n`), as the OpenAI streaming APIs use it."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


def sse_data(payload: dict[str, Any]) -> str:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return f"data: {text}\n\n"
