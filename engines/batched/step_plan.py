"""What the batched speculative engine's next step is, decided in one place.

A step is one of: commit the plain step in flight (queueing the next one first while
the batch stays plain: `batched_pipeline`), a prefill chunk of a newcomers' group
(alternating with decode steps while rows decode, or carried in their verify forward
where the model packs: `packed_forward`), start a pipeline of plain steps,
or draft and verify unpipelined (a plain step too where it cannot be pipelined: a
measuring probe, logits processors, newcomers prefilling). Nothing to do is a step
too (idle).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from engines.batched.costs import BatchPlan
from engines.batched.drafting import BatchRow
from engines.batched.pipeline import InFlight, pipelinable


class StepKind(enum.Enum):
    IDLE = "idle"  # no row decodes, no prompt prefills
    COMMIT = "commit"  # commit the plain step in flight
    PREFILL = "prefill"  # one chunk of a prefill group
    PIPELINE = "pipeline"  # queue a plain step and the next, commit the first
    VERIFY = "verify"  # draft as `batch` plans (K may be 0) and verify


@dataclass(frozen=True)
class StepPlan:
    kind: StepKind
    batch: BatchPlan | None = None  # VERIFY: each row's draft and the step's K
    queue_next: bool = False  # COMMIT: queue the next plain step before reading this one
    carry: bool = False  # VERIFY: the verify's forward carries a prefill chunk (packed)


def plan_step(
    in_flight: InFlight | None,
    prefilling: bool,
    rows: list[BatchRow],
    last: StepKind,
    plan_rows: Callable[[], BatchPlan],
    probe_due: Callable[[int], bool],
    carry: bool = False,
) -> StepPlan:
    """The next step, from what is in flight, whether a group is `prefilling`, the
    decoding `rows`, the `last` step's kind, the rows' drafting plan and whether a plain
    step is due to be measured (`probe_due`: a plain step to time, not a pipeline).
    With `carry` (the model packs, `packed_forward`), a prefill chunk rides in the
    rows' verify forward instead of alternating with it."""
    if in_flight is not None:
        keep_going = in_flight.plain_after and not prefilling and pipelinable(rows)
        return StepPlan(StepKind.COMMIT, queue_next=keep_going)
    if prefilling and not (rows and (carry or last == StepKind.PREFILL)):
        # A prefill chunk is a step of its own, alternating with verifies while rows
        # decode (they wait for one chunk or one verify, never both), unless it rides in
        # their verify; it returns the first tokens of the prompts it completes.
        return StepPlan(StepKind.PREFILL)
    if not rows:
        return StepPlan(StepKind.IDLE)
    batch = plan_rows()
    probe = probe_due(len(rows))
    if batch.k == 0 and not probe and not prefilling and pipelinable(rows):
        return StepPlan(StepKind.PIPELINE)
    return StepPlan(StepKind.VERIFY, batch, carry=prefilling and carry)
