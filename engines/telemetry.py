"""Speculation counters: per request (in the final event) and engine-lifetime totals
(exported by /metrics). Plain integers, written only on the engine thread."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MethodStats:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    first_accepted: int = 0  # drafts whose first token was accepted


@dataclass
class SpecStats:
    """Drafted and accepted tokens, by method and by draft position."""

    by_method: dict[str, MethodStats] = field(default_factory=dict)
    accepted_per_position: list[int] = field(default_factory=list)
    gate_trips: dict[str, int] = field(default_factory=dict)

    def record(self, method: str, drafted: int, accepted: int) -> None:
        stats = self.by_method.setdefault(method, MethodStats())
        stats.drafts += 1
        stats.draft_tokens += drafted
        stats.accepted_tokens += accepted
        stats.first_accepted += accepted > 0
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def trip(self, gate: str) -> None:
        self.gate_trips[gate] = self.gate_trips.get(gate, 0) + 1

    @property
    def drafts(self) -> int:
        return sum(m.drafts for m in self.by_method.values())

    @property
    def draft_tokens(self) -> int:
        return sum(m.draft_tokens for m in self.by_method.values())

    @property
    def accepted_tokens(self) -> int:
        return sum(m.accepted_tokens for m in self.by_method.values())

    def merge(self, other: SpecStats) -> None:
        for method, stats in other.by_method.items():
            mine = self.by_method.setdefault(method, MethodStats())
            mine.drafts += stats.drafts
            mine.draft_tokens += stats.draft_tokens
            mine.accepted_tokens += stats.accepted_tokens
            mine.first_accepted += stats.first_accepted
        for position, count in enumerate(other.accepted_per_position):
            if position >= len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[position] += count
        for gate, count in other.gate_trips.items():
            self.gate_trips[gate] = self.gate_trips.get(gate, 0) + count

    def as_dict(self) -> dict:
        """The shape clients see in responses (`speculation`) and logs."""
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "by_method": {
                method: {
                    "drafts": s.drafts,
                    "draft_tokens": s.draft_tokens,
                    "accepted_tokens": s.accepted_tokens,
                }
                for method, s in sorted(self.by_method.items())
            },
            "accepted_per_position": list(self.accepted_per_position),
            "gate_trips": dict(self.gate_trips),
        }
