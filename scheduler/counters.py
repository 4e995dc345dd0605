"""Scheduler-level counters for /v1/stats, written on the engine thread.

Durations and per-step histograms go to the observer (Prometheus); these are the
plain tallies /v1/stats and the tests read.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerCounters:
    mode_switches: dict[tuple[str, str], int] = field(default_factory=dict)
    migrated_requests: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)  # batch size -> steps
    generated_tokens: int = 0  # every request's, as published (live tokens/s on the web page)
    # requests that waited for another's prefill (scheduler/prefill_followers.py), by how
    # the wait ended: "served" (the prefill was in), "left" (the leader left), "stalled";
    # "copied": it started at once from a copy of the cache of a leader that decodes
    prefill_follows: dict[str, int] = field(default_factory=dict)

    def record_switch(self, source: str, target: str, migrated: int) -> None:
        key = (source, target)
        self.mode_switches[key] = self.mode_switches.get(key, 0) + 1
        self.migrated_requests += migrated

    def record_prefill_follow(self, outcome: str) -> None:
        self.prefill_follows[outcome] = self.prefill_follows.get(outcome, 0) + 1

    def record_batch(self, size: int) -> None:
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
