"""The mode policy: which engine owns the model for the next step.

One active request is served by the speculative engine; `batch_threshold` or more by
the batched engine. Going back needs at most one active request (the speculative
engine holds one sequence, so with a threshold above 2 the batch keeps serving two),
and waits until that has held for `return_steps` consecutive steps, so a brief dip
does not flap between modes; a request arriving when nothing runs starts
speculative at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Mode(str, enum.Enum):
    SPECULATIVE = "speculative"
    BATCHED = "batched"


@dataclass
class ModePolicy:
    batch_threshold: int = 2
    return_steps: int = 4
    # False where a batched row cannot leave its batch (caches that cannot trim): the
    # speculative engine takes over again only when the batch has emptied.
    migrate_back: bool = True
    _below: int = 0  # consecutive steps with one active request while batched

    def choose(self, current: Mode, active: int, idle: bool = False) -> Mode:
        """The mode for the next step, given the number of active requests; `idle`:
        nothing is running, so going back migrates nothing and needs no hysteresis."""
        if active >= self.batch_threshold:
            self._below = 0
            return Mode.BATCHED
        if current == Mode.SPECULATIVE:
            return current
        if active == 0 or idle:
            self._below = 0
            return Mode.SPECULATIVE
        if not self.migrate_back:
            return current
        if active > 1:  # the speculative engine could take only one of them
            self._below = 0
            return current
        self._below += 1
        if self._below >= self.return_steps:
            self._below = 0
            return Mode.SPECULATIVE
        return current
