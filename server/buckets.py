"""Token buckets keyed by caller, in bounded memory: the arithmetic behind the request
rate limit and the failed-key limit."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated: float


class TokenBuckets:
    """`per_minute` tokens a minute per caller, bursts up to `burst` (default the same).

    Buckets are kept in least-recently-used order. One untouched long enough to be
    full again is the same as a new one, so it is dropped; beyond `max_buckets`
    callers the least recently seen are forgotten (they get a fresh burst)."""

    def __init__(self, per_minute: float, burst: float | None = None, max_buckets: int = 4096):
        self.per_minute = per_minute
        self.burst = per_minute if burst is None else burst
        self.max_buckets = max_buckets
        self.buckets: OrderedDict[str, _Bucket] = OrderedDict()

    @property
    def refill_s(self) -> float:
        """How long an empty bucket takes to be full again."""
        return 60.0 * self.burst / self.per_minute

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)

    def wait(self, who: str, now: float) -> float:
        """0 if `who` has a token now, else seconds until it will; charges nothing."""
        bucket = self._refilled(who, now)
        return 0.0 if bucket.tokens >= 1 else (1 - bucket.tokens) * 60.0 / self.per_minute

    def take(self, who: str, now: float) -> float:
        """Like `wait`, and spends the token when there is one."""
        wait = self.wait(who, now)
        if not wait:
            self.buckets[who].tokens -= 1
        return wait

    def _refilled(self, who: str, now: float) -> _Bucket:
        self._forget_idle(now)
        bucket = self.buckets.pop(who, None) or _Bucket(self.burst, now)
        self.buckets[who] = bucket  # most recently seen last
        if len(self.buckets) > self.max_buckets:
            self.buckets.popitem(last=False)
        gained = (now - bucket.updated) * self.per_minute / 60.0
        bucket.tokens = min(self.burst, bucket.tokens + gained)
        bucket.updated = now
        return bucket

    def _forget_idle(self, now: float) -> None:
        while self.buckets:
            who, oldest = next(iter(self.buckets.items()))
            if now - oldest.updated < self.refill_s:
                return
            del self.buckets[who]
