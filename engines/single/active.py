"""A request while the single-stream engine serves it: the sequence, its target cache,
and its drafters' per-request state.

Owned by the engine thread. The engine (`engines.single.engine`) steps it and the
policy (`engines.single.policy`) reads it to decide what the next step drafts; it lives
in its own module so that neither of the two imports the other for it. On hand-over it
becomes a `SequenceState` (`engines.state`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from engines.sequence import Sequence
from engines.state import Drafting


@dataclass
class Active:
    seq: Sequence
    cache: list
    cached: int  # tokens of seq.all_tokens held in the cache
    processors: list
    # the request's own drafting state, every field set (`SpeculativeEngine.take_over`)
    drafting: Drafting = field(default_factory=Drafting)
    in_flight: mx.array | None = None  # a plain token sampled but not committed
    in_flight_logprobs: mx.array | None = None  # the distribution it was sampled from
    history: mx.array | None = None  # tokens in the cache (+ in flight), for penalties
    forced_plain: int = 0  # plain tokens still to run for an A/B probe
    predicted: tuple[float, float] = (0.0, 0.0)  # this step's draft: tokens, cost predicted

    @property
    def tokens(self) -> list[int]:
        return self.seq.all_tokens
