"""What a request carries between engines: `SequenceState`, one request's portable
state, its cache and its own drafting state (gates, n-gram index, draft-model cache, MTP
state), handed from one engine to the other when the scheduler migrates the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.drafting.draft_model import DraftState
from engines.drafting.mtp import MTPState
from engines.drafting.prompt_lookup import PromptLookupDrafter
from engines.gating.gates import MethodGate
from engines.sequence import Sequence


@dataclass
class SequenceState:
    """A request's portable state: what migration between engines carries.

    `cache` holds `seq.all_tokens[:cached]`; the remaining tokens (at least the
    newest) are still to be fed. `seq.rng` carries the sampler's key chain. The
    drafting state is the sequence's own: its gates, its n-gram index and its
    draft-model cache travel with it and are never shared with another request."""

    seq: Sequence
    cache: list
    cached: int
    gates: dict[str, MethodGate] | None = None  # drafting state, kept across a round trip
    pld: PromptLookupDrafter | None = None
    draft: DraftState | None = None
    mtp: MTPState | None = None
