"""Which way each committed token was produced: accepted from a drafter, or by the target.

Both engines record a verify's outcome (`SpecStats.record(method, drafted, accepted)`)
immediately before committing that verify's tokens: its `accepted` drafted tokens,
then the target's own token (the correction or the bonus). So the next `accepted`
commits after a record come from `method`, and every other commit (a plain step, the
token after a verify's accepted run) was sampled by the target. `SourcedSpecStats`
notes each record for the sequence's `TokenSources`; `Sequence.commit` takes a source
per token. The tags describe tokens, they never choose them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.telemetry import SpecStats

TARGET = "target"  # sampled (or argmax) by the target model, not a drafter's accepted token


@dataclass
class TokenSources:
    """Each committed token's source and released text, until its event takes them."""

    method: str = TARGET  # the drafter whose accepted tokens are still to be committed
    pending: int = 0  # how many of them
    undelivered: list[tuple[str, str]] = field(default_factory=list)  # (source, text)

    def expect(self, method: str, accepted: int) -> None:
        """The next `accepted` commits are `method`'s drafted tokens, accepted."""
        self.method, self.pending = method, accepted

    def add(self, text: str) -> None:
        """One token was committed, releasing `text` (possibly empty)."""
        if self.pending > 0:
            self.pending -= 1
            self.undelivered.append((self.method, text))
        else:
            self.undelivered.append((TARGET, text))

    def take(self, count: int) -> list[tuple[str, str]]:
        """The last `count` committed tokens' (source, text), for an event carrying
        `count` tokens; earlier ones that no event carried (a failed commit) are dropped."""
        taken = self.undelivered[len(self.undelivered) - count :] if count else []
        self.undelivered = []
        return taken


@dataclass
class SourcedSpecStats(SpecStats):
    """`SpecStats` that also tells the sequence's `TokenSources` about each verify."""

    sources: TokenSources = field(default_factory=TokenSources)

    def record(self, method: str, drafted: int, accepted: int) -> None:
        super().record(method, drafted, accepted)
        self.sources.expect(method, accepted)
