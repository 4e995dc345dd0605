"""Text-level stop sequences, as the OpenAI and Anthropic APIs define them.

A stop string can span token boundaries and tokenize differently in context, so we
match on decoded text. Text that might be the start of a stop string is held back
until it is known not to be, so a client never sees part of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopMatcher:
    stops: tuple[str, ...]
    held: str = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Consume decoded text; return (text safe to emit, matched stop string or None)."""
        buffer = self.held + text
        match_at, matched = -1, None
        for stop in self.stops:
            at = buffer.find(stop)
            if at != -1 and (match_at == -1 or at < match_at):
                match_at, matched = at, stop
        if matched is not None:
            self.held = ""
            return buffer[:match_at], matched
        keep = self._longest_stop_prefix_suffix(buffer)
        self.held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """Release held-back text once generation ends without a match."""
        text, self.held = self.held, ""
        return text

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if stop.startswith(buffer[-n:]):
                    longest = n
                    break
        return longest
