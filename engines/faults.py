"""Test hooks (`--inject-fault-on MARKER`): a request whose prompt holds the marker
fails on purpose at one point of the engines, so tests can check that a failure stays
with its own request while every other row continues exactly.

`MARKER` alone fails the request's fourth commit (`Sequence.commit`, the original
hook); `MARKER@point` fails it at a point of the batched speculative engine instead:

* `insert`: while joining the engine, after its caches were built;
* `merge`: while its rows join the running batch, after the batch's caches took them;
* `prefill`: after a prefill chunk of its group ran;
* `verify`: after a verify forward scored the batch, before any row rolled back;
* `draft`: after the model drafter (draft model or MTP head) drafted for the batch,
  each row it fed, before the drafts were kept;
* `lookup`: as the row's prompt-lookup or suffix drafter is about to propose.

The request names the point; the engine raises `RowFault` there, which the engine's
containment turns into that request's failure alone -- or, at the drafting points,
into the request going on without the drafter that failed (`batched/containment.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

POINTS = ("insert", "merge", "prefill", "verify", "draft", "lookup")


class RowFault(RuntimeError):
    """A failure that belongs to the named requests (an injected fault, or one raised
    while handling those rows alone)."""

    def __init__(self, request_ids: list[str], message: str) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)


def arm(seq: Any, marker: str | None, text: str) -> None:
    """Set the sequence's fault hook from its prompt's text: `inject_fault` for the
    commit hook, `fault_at` for a point of the batched engine."""
    if not marker or marker not in text:
        return
    point = next((p for p in POINTS if f"{marker}@{p}" in text), None)
    if point is None:
        seq.inject_fault = True
    else:
        seq.fault_at = point


def check(rows: Iterable[Any], point: str) -> None:
    """Raise `RowFault` for the rows (anything with a `.seq`) whose request asked to
    fail at `point`."""
    failing = [row.seq.request_id for row in rows if getattr(row.seq, "fault_at", None) == point]
    if failing:
        raise RowFault(failing, f"injected fault at {point} in request {failing[0]}")
