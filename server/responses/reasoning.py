"""Reasoning that a stateless client carries between turns (`store: false` with
`include: ["reasoning.encrypted_content"]`, as Codex CLI sends).

The reasoning text goes out sealed (Fernet: AES-CBC with an HMAC) under a key made
when the server starts, bound to the caller's API-key scope; the next turn hands it
back and it is rendered again as the assistant turn's reasoning for templates that
keep it (e.g. between tool calls), so the prompt is what the model wrote. Nobody
else, no other key and no restarted server can read it: what cannot be opened is
dropped, as past reasoning is by templates that drop it anyway.
"""

from __future__ import annotations

import json

from cryptography.fernet import Fernet, InvalidToken

ENCRYPTED_CONTENT = "reasoning.encrypted_content"


class ReasoningSealer:
    """Seals and opens reasoning text; one per app (its key lives in memory only)."""

    def __init__(self, key: bytes | None = None) -> None:
        self._fernet = Fernet(key or Fernet.generate_key())

    def seal(self, scope: str, text: str) -> str:
        payload = json.dumps({"scope": scope, "text": text}, ensure_ascii=False)
        return self._fernet.encrypt(payload.encode()).decode("ascii")

    def open(self, scope: str, token: str) -> str | None:
        """The sealed text, or None when the token is not this server's, or another
        scope's, or damaged."""
        try:
            payload = json.loads(self._fernet.decrypt(token.encode("ascii")))
        except (InvalidToken, ValueError, UnicodeError):
            return None
        if not isinstance(payload, dict) or payload.get("scope") != scope:
            return None
        text = payload.get("text")
        return text if isinstance(text, str) else None
