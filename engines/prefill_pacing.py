"""How many prompt tokens the next prefill chunk takes, alone or while other rows decode.

While a chunk runs, every decoding row waits for its next token (alternating, the
rows' step follows the chunk; packed, their tokens ride in the chunk's forward,
`packed_forward`), so the chunk is sized by time, not by a constant: the pacer keeps
each chunk's time near `GAP_STEPS` of the rows' measured decode step, scaling the next
chunk by how the last one's time compared (at most doubling), so that no decoding
row's gap between tokens grows past a small multiple of its decode step. Later chunks
of a long prompt cost more per token (attention over a longer cache); the pacer
follows that as it goes.

A prompt prefilling alone takes chunks of about `LONE_SECONDS`: long enough that a
chunk's fixed cost (a pass over the weights) is small beside its tokens, short enough
that a cancel, a newcomer or a switch of engines waits for at most one such chunk (a
fixed 2048-token chunk took about 40 s on a 2-core CPU with a 0.5B model, where
mlx-lm's own prefill is fastest with 256-token chunks: about 5 s there). On a fast
device the chunk grows to the engine's configured one.

Owned by the engine thread (each engine holds one).
"""

from __future__ import annotations

from dataclasses import dataclass

# A decoding row's longest gap is one chunk (packed) or one chunk and one decode step
# (alternating); sized to 2.5 decode steps, it stays under 3x the row's median gap
# with room for the controller's misses.
GAP_STEPS = 2.5
FLOOR = 16  # smaller chunks cost about as much as a decode step, for almost no prompt
LONE_SECONDS = 5.0
LONE_FLOOR = 64  # below this a lone chunk's fixed cost starts to show
SMOOTHING = 0.3  # weight of the newest decode step in the running estimate


@dataclass
class PrefillPacer:
    ceiling: int  # the engine's configured prefill chunk: no chunk is larger
    chunk: int = 64  # the next chunk's size while rows decode
    lone: int = 512  # the next chunk's size when nothing else runs
    decode_seconds: float | None = None  # a decode step without a chunk, smoothed

    def next_chunk(self, decoding: bool) -> int:
        return min(self.chunk if decoding else self.lone, self.ceiling)

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

    def observe(self, tokens: int, seconds: float, packed: bool, decoding: bool = True) -> None:
        """A chunk of `tokens` (beside decoding rows, or alone) took `seconds`: size the
        next one of its kind."""
        if tokens <= 0 or seconds <= 0:
            return
        if not decoding:
            scaled = tokens * LONE_SECONDS / seconds
            self.lone = int(max(LONE_FLOOR, min(scaled, 2 * tokens, self.ceiling)))
            return
        budget = self.budget(packed)
        if budget is None:
            return
        scaled = tokens * budget / seconds
        self.chunk = int(max(FLOOR, min(scaled, 2 * tokens, self.ceiling)))
