"""The mode policy: which engine owns the model for the next step.

One active request is served by the speculative engine; `batch_threshold` or more by
the batched engine. Going back waits until the load has stayed below the threshold
for `return_steps` consecutive steps, so a brief dip does not flap between modes.
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
    _below: int = 0  # consecutive steps with load under the threshold while batched

    def choose(self, current: Mode, active: int) -> Mode:
        """The mode for the next step, given the number of active requests."""
        if active >= self.batch_threshold:
            self._below = 0
            return Mode.BATCHED
        if current == Mode.SPECULATIVE:
            return current
        if active == 0:
            self._below = 0
            return Mode.SPECULATIVE
        self._below += 1
        if self._below >= self.return_steps:
            self._below = 0
            return Mode.SPECULATIVE
        return current
