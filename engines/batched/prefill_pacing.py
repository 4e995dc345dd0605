"""How many prompt tokens the next prefill chunk takes while other rows decode.

While a chunk runs, every decoding row waits for its next token (alternating, the
rows' step follows the chunk; packed, their tokens ride in the chunk's forward,
`packed_forward`), so the chunk is sized by time, not by a constant: the pacer keeps
each chunk's time near `GAP_STEPS` of the rows' measured decode step, scaling the next
chunk by how the last one's time compared (at most doubling), so that no decoding
row's gap between tokens grows past a small multiple of its decode step. Later chunks
of a long prompt cost more per token (attention over a longer cache); the pacer
follows that as it goes. With no row decoding a prompt takes the engine's whole chunk.

Owned by the engine thread (the batched engine holds one).
"""

from __future__ import annotations

from dataclasses import dataclass

# A decoding row's longest gap is one chunk (packed) or one chunk and one decode step
# (alternating); sized to 2.5 decode steps, it stays under 3x the row's median gap
# with room for the controller's misses.
GAP_STEPS = 2.5
FLOOR = 16  # smaller chunks cost about as much as a decode step, for almost no prompt
SMOOTHING = 0.3  # weight of the newest decode step in the running estimate


@dataclass
class PrefillPacer:
    ceiling: int  # the engine's prefill chunk, taken when no row decodes
    chunk: int = 64  # the next chunk's size while rows decode
    decode_seconds: float | None = None  # a decode step without a chunk, smoothed

    def next_chunk(self, decoding: bool) -> int:
        return min(self.chunk, self.ceiling) if decoding else self.ceiling

    def observe_decode(self, seconds: float) -> None:
        """A decode step that carried no prompt chunk took `seconds`."""
        if seconds <= 0:
            return
        previous = self.decode_seconds
        self.decode_seconds = (
            seconds if previous is None else previous + SMOOTHING * (seconds - previous)
        )

    def budget(self, packed: bool) -> float | None:
        """The time a chunk may take beside the decoding rows (None: not measured yet)."""
        if self.decode_seconds is None:
            return None
        return (GAP_STEPS if packed else GAP_STEPS - 1.0) * self.decode_seconds

    def observe(self, tokens: int, seconds: float, packed: bool) -> None:
        """A chunk of `tokens` beside decoding rows took `seconds`: size the next one."""
        budget = self.budget(packed)
        if tokens <= 0 or seconds <= 0 or budget is None:
            return
        scaled = tokens * budget / seconds
        self.chunk = int(max(FLOOR, min(scaled, 2 * tokens, self.ceiling)))
