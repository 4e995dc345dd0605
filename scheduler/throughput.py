"""Measured decode throughput per engine, and the serial-wait rule built on it.

Batching n streams is not always faster than serving them one after another
speculatively: with a well-matched draft a lone stream can run at 2x a plain step,
while a batch of n costs more than one step on compute-bound hardware (a 2-core CPU
batches 2 streams for ~1.4x the tokens). When that holds, a newcomer can wait for the
running request to finish rather than join a batch -- but only within a wait budget
the operator chose (`--spec-wait-budget`), since waiting costs it time to first token.

Rates are measured on the engine thread, from the wall time between consecutive
steps of the same shape (same mode and batch size, nobody admitted in between), so
prefills and switches do not count as decode time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

WINDOW_STEPS = 32  # recent steps a rate is averaged over
MIN_STEPS = 4  # steps before a rate is trusted


@dataclass
class RateWindow:
    """Tokens per second over the last `WINDOW_STEPS` steady steps."""

    samples: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW_STEPS))

    def add(self, tokens: int, seconds: float) -> None:
        if seconds > 0:
            self.samples.append((tokens, seconds))

    @property
    def rate(self) -> float | None:
        if len(self.samples) < MIN_STEPS:
            return None
        seconds = sum(s for _, s in self.samples)
        return sum(t for t, _ in self.samples) / seconds


@dataclass
class ThroughputModel:
    """Measured tokens/s: the speculative engine (one stream) and batches by size."""

    speculative: RateWindow = field(default_factory=RateWindow)
    batched: dict[int, RateWindow] = field(default_factory=dict)
    learning: bool = True  # False: fixed rates (tests, or an operator's known numbers)

    @classmethod
    def assumed(cls, speculative: float, batched: dict[int, float]) -> ThroughputModel:
        """Fixed rates in tokens/s, never updated, so scheduling decisions repeat."""

        def fixed(rate: float) -> RateWindow:
            window = RateWindow()
            for _ in range(MIN_STEPS):
                window.add(round(rate), 1.0)
            return window

        return cls(fixed(speculative), {n: fixed(r) for n, r in batched.items()}, learning=False)

    def record(self, batched: bool, batch_size: int, tokens: int, seconds: float) -> None:
        if not self.learning:
            return
        if batched:
            self.batched.setdefault(batch_size, RateWindow()).add(tokens, seconds)
        else:
            self.speculative.add(tokens, seconds)

    def serial_is_faster(self, batch_size: int) -> bool:
        """True only when both rates are measured and one speculative stream beats a
        batch of `batch_size`; unmeasured means batch (and so measure it)."""
        serial = self.speculative.rate
        window = self.batched.get(batch_size)
        batch = window.rate if window else None
        return serial is not None and batch is not None and serial > batch

    def as_dict(self) -> dict:
        return {
            "speculative_tokens_per_s": self.speculative.rate,
            "batched_tokens_per_s": {
                str(size): window.rate for size, window in sorted(self.batched.items())
            },
        }


def serial_wait_fits(
    budget_s: float,
    now: float,
    running_tokens_left: int,
    waiters: Iterable[tuple[float, int]],
    tokens_per_s: float,
) -> bool:
    """Would each waiter (arrival time, max_tokens), served one after another at
    `tokens_per_s` once the running work is done, start within `budget_s` of arriving?

    Uses max_tokens, an upper bound on each request's length, so a wait is only chosen
    when it is sure to end in time; a request that stops early only starts others sooner.
    """
    ahead_s = running_tokens_left / tokens_per_s
    for arrived, max_tokens in waiters:
        if now - arrived + ahead_s > budget_s:
            return False
        ahead_s += max_tokens / tokens_per_s
    return True
