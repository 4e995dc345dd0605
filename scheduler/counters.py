"""Scheduler-level counters for /metrics and /v1/stats, written on the engine thread."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerCounters:
    mode_switches: dict[tuple[str, str], int] = field(default_factory=dict)
    switch_seconds: list[float] = field(default_factory=list)  # recent, bounded
    migrated_requests: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)  # batch size -> steps
    steps: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which served from it

    def record_switch(self, source: str, target: str, seconds: float, migrated: int) -> None:
        key = (source, target)
        self.mode_switches[key] = self.mode_switches.get(key, 0) + 1
        self.switch_seconds.append(seconds)
        del self.switch_seconds[:-1000]
        self.migrated_requests += migrated

    def record_batch(self, size: int) -> None:
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
