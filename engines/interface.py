"""What the scheduler drives: one interface both engines implement.

An engine serves sequences on the engine thread. Its operations, one name each:

  * `admit`: a new request starts, from an empty cache or a cached prefix of its prompt;
  * `step`: one step of every sequence it holds; returns a `StepResult`;
  * `hand_over`: a sequence leaves with its cache and drafting state (to the other
    engine, or parked while its client does not read), a step in flight committed
    first;
  * `take_over`: a sequence handed over continues here, its cache as it is;
  * `cancel`: a sequence ends here, its cache dropped;
  * `copy_cache`: a copy of a decoding sequence's cache of its committed tokens, which
    goes on unchanged (a request of its key arriving meanwhile starts from the copy);
  * `settle`: a step still in flight commits, so every sequence holds exactly its
    committed tokens again.

Everything a call produces comes back in its result: tokens to publish, caches to keep
for prefix reuse, and the step's measurements. The engine keeps nothing for the
caller to read and clear afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from mlx_lm.models.cache import make_prompt_cache

from engines.model.mrope import attach, prompt_positions
from engines.sequence import Sequence, StepOutput
from engines.state import SequenceState


@dataclass
class StepResult:
    """What one call into an engine produced."""

    outputs: list[StepOutput] = field(default_factory=list)  # tokens committed, per sequence
    released: list[SequenceState] = field(default_factory=list)  # finished sequences' caches
    checkpoints: list[SequenceState] = field(default_factory=list)  # prefilled prompts' caches
    # (rows, drafted) per row verified or decoded (the batched speculative engine)
    step_sizes: list[tuple[int, int]] = field(default_factory=list)
    forward_seconds: float = 0.0  # model time (the rest of the step is overhead)


@runtime_checkable
class Engine(Protocol):
    """Both engines (`SpeculativeEngine`, `BatchedSpeculativeEngine`, and the fallback
    `BatchedEngine`). Every call runs on the engine thread."""

    name: str
    model: Any  # the target forward it runs (the prompt scorer runs it too)

    @property
    def active_ids(self) -> list[str]: ...

    @property
    def has_capacity(self) -> bool: ...

    def admit(self, start: Sequence | SequenceState) -> None: ...

    def step(self) -> StepResult: ...

    def hand_over(self, request_id: str) -> tuple[SequenceState | None, StepResult]: ...

    def take_over(self, state: SequenceState) -> None: ...

    def cancel(self, request_id: str, keep: bool = False) -> bool: ...

    def copy_cache(self, request_id: str) -> SequenceState | None: ...

    def settle(self) -> StepResult: ...


def starting_state(start: Sequence | SequenceState, model: Any) -> SequenceState:
    """A new sequence's state: its own (a cached prefix), or an empty cache of `model`."""
    state = (
        start
        if isinstance(start, SequenceState)
        else SequenceState(start, make_prompt_cache(model), 0)
    )
    # a prompt with images on a model with 3-D positions: the cache carries them from
    # here through every move of the row (whoever's prefix it started from)
    attach(state.cache, 0, prompt_positions(state.seq.request.images))
    return state
