"""Throttle for access-log lines of refused requests (401, 421, 429): a client
without a key must not be able to fill the disk or bury the log at network speed."""

from __future__ import annotations

import logging
import time

from server.buckets import TokenBuckets

REFUSED = frozenset({401, 421, 429})


class RefusedRequestLogThrottle(logging.Filter):
    """Pass `burst` refused-request lines at once and `per_minute` after that; the next
    line that passes says how many were left out."""

    def __init__(self, per_minute: float = 30, burst: float = 10) -> None:
        super().__init__()
        self.budget = TokenBuckets(per_minute, burst=burst, max_buckets=1)
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if not args or args[-1] not in REFUSED:
            return True
        if self.budget.take("refused", time.monotonic()):
            self.dropped += 1
            return False
        if self.dropped:
            record.msg = f"{record.msg} (and %d more refused requests not logged)"
            record.args = (*args, self.dropped)
            self.dropped = 0
        return True
