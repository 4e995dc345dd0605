"""What a drafter proposes, and the names of the drafting methods.

A leaf: every drafter, gate and cost model names methods through these constants, so
none of them imports another to learn a name. Drafters come in two shapes, one protocol
each: a lookup drafter (prompt lookup, suffix decoding) belongs to one request and keeps
its index itself, `propose(context, k)` (`Drafter`); a model drafter (the draft model,
the MTP head) is one object for every request and is handed the request's own state,
RNG and sampling settings, `propose(state, context, k, params, rng, ...)`
(`ModelDrafter`). A draft carries the tokens and, for a stochastic drafter, the
probabilities q it sampled them from (None = one-hot).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from engines.request import SamplingParams
from engines.sample.sampling import RandomStream

PLD = "pld"
DRAFT = "draft"
MTP = "mtp"  # the model's own multi-token-prediction head (engines.drafting.mtp)
SUFFIX = "suffix"  # the API key's recent requests (engines.drafting.suffix)
DFLASH = "dflash"  # a DFlash block drafter fed the target's layers (feature_drafters)
EAGLE3 = "eagle3"  # an EAGLE-3 speculator fed the target's layers (feature_drafters)
ASSISTANT = "assistant"  # Gemma-4's assistant, reading the target's K/V (drafting.assistant)
# the model drafters: one drafts at a time, under the one DRAFT gate
MODEL_DRAFTERS = (DRAFT, MTP, DFLASH, EAGLE3, ASSISTANT)
LOOKUPS = (PLD, SUFFIX)  # drafters that copy tokens: free to make, gated by match length


@dataclass
class Draft:
    method: str  # PLD, SUFFIX or one of MODEL_DRAFTERS
    tokens: list[int]
    probs: mx.array | None  # (k, V) float32 q for sampled drafts; None = one-hot
    # PLD: length of the n-gram that matched; SUFFIX: the match's length rounded down
    # to a power of two (`engines.drafting.suffix.match_bucket`). Gates learn by it.
    match_length: int = 0
    confidences: list[float] = field(default_factory=list)  # draft model: its p(token)

    @property
    def gate(self) -> str:
        """The gate that rules this draft: a model drafter's (DRAFT) for the draft model
        and the MTP head alike -- one model drafter serves at a time -- else its own."""
        return DRAFT if self.method in MODEL_DRAFTERS else self.method


class DraftStopRule(Protocol):
    """Where an unsure model draft ends (`engines.gating.draft_confidence.DraftStop`,
    which the gates own): named here so the drafters never import the gating package."""

    confidences: list[float]

    def add(self, confidence: float) -> bool: ...

    def best_length(self) -> int: ...


class Drafter(Protocol):
    """A lookup drafter of one request: up to k tokens that may follow `context`, or None."""

    def propose(self, context: list[int], k: int) -> Draft | None: ...


class ModelDrafter(Protocol):
    """A model drafter shared by every request: up to k tokens that may follow `context`,
    drafted on the request's `state` (its draft cache) with its sampling settings and RNG
    (`position`: the output position, for seeded draws; `stop`: where an unsure draft
    ends, `engines.gating.draft_confidence`), or None."""

    method: str

    def propose(
        self,
        state: Any,
        context: list[int],
        k: int,
        params: SamplingParams,
        rng: RandomStream,
        processors: list | None = None,
        position: int = 0,
        stop: DraftStopRule | None = None,
    ) -> Draft | None: ...
