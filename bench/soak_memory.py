"""The soak's memory samples: the server's RSS, gauges read from /metrics, and whether
memory stayed flat under load.

Why apart: reading /proc and Prometheus samples, and the flatness rule over a series,
are pure functions of their inputs; the run only collects the samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.soak_settings import Settings

MIB = 1 << 20


@dataclass(frozen=True)
class MemorySample:
    t: float
    rss_bytes: int | None
    mlx_active: float | None
    mlx_cache: float | None
    mlx_peak: float | None
    running: float | None
    waiting: float | None


def read_rss(pid: int | None) -> int | None:
    """Resident set size of `pid` in bytes (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gauge(counters: dict | None, name: str, **labels: str) -> float | None:
    """Sum of the samples of `name` whose labels include `labels`; None if absent."""
    if counters is None:
        return None
    values = [
        value
        for (sample, sample_labels), value in counters.items()
        if sample == name and labels.items() <= dict(sample_labels).items()
    ]
    return sum(values) if values else None


def memory_summary(
    samples: list[MemorySample], settings: Settings, after_drain: dict[str, Any]
) -> dict[str, Any]:
    """First, after warm-up, last and max of RSS under load (the samples up to the
    duration), or of MLX active memory when RSS cannot be read (not Linux, or another
    user's process). Warm-up and last are both taken under load, so they compare."""
    source = "rss_bytes" if any(s.rss_bytes is not None for s in samples) else "mlx_active"
    series = [
        (s.t, getattr(s, source))
        for s in samples
        if getattr(s, source) is not None and s.t <= settings.duration_s
    ]
    slack = settings.rss_slack_mb * MIB
    rule = f"last <= warm * {1 + settings.rss_tolerance:.2f} + {settings.rss_slack_mb:g} MB"
    if not series:
        return {"source": source, "rule": rule, "flat": None, "samples": len(samples)}
    warm = next((value for t, value in series if t >= settings.warmup_s), series[-1][1])
    last = series[-1][1]
    return {
        "source": source,
        "first": series[0][1],
        "warm": warm,
        "last": last,
        "max": max(value for _, value in series),
        "after_drain": after_drain.get(source),
        "warmup_s": settings.warmup_s,
        "rule": rule,
        "flat": last <= warm * (1 + settings.rss_tolerance) + slack,
        "samples": len(series),
    }
