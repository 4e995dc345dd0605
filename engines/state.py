"""What a request carries between engines: `SequenceState`, one request's portable
state -- its cache and its own `Drafting` (gates, n-gram index, draft-model cache, MTP or
feature-drafter state) -- handed from one engine to the other when the scheduler
migrates the request. The single-stream engine's `Active` and the batch's `BatchRow`
hold the same `Drafting` object while they serve it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engines.cache.rollback import can_trim, trim_exact
from engines.drafting.draft_model import DraftState
from engines.drafting.entries import state_from_entry
from engines.drafting.mtp import MTPState
from engines.drafting.prompt_lookup import PromptLookupDrafter
from engines.gating.draft_limits import DraftLimits
from engines.gating.gates import MethodGate
from engines.sequence import Sequence


@dataclass
class Drafting:
    """A request's own drafting state: one object, handed from engine to engine with the
    request (never copied, never shared with another request), read and changed on the
    engine thread only. An engine taking the request fills what is missing (the gates
    from the server's priors, an empty n-gram index).

    `draft` is its draft model's cache while it is served alone; in the batch that cache
    is a row of the batch's ragged draft cache (`BatchRow.draft_fed` names its tokens), so
    `draft` is None there until the row leaves -- the row is what lets one draft forward
    serve every row. `mtp` is its MTP head's or feature drafter's state (None in the batch
    for a row that may not draft with it)."""

    gates: dict[str, MethodGate] | None = None
    pld: PromptLookupDrafter | None = None
    draft: DraftState | None = None
    mtp: MTPState | None = None

    def fill(self, limits: DraftLimits, seq: Sequence) -> None:
        """What an engine taking the request gives it where missing: its gates from the
        server's priors, an empty n-gram index."""
        if self.gates is None:
            self.gates = limits.initial_gates(seq)
        if self.pld is None:
            self.pld = PromptLookupDrafter(max_ngram=limits.config.pld_max_ngram)


@dataclass
class SequenceState:
    """A request's portable state: what migration between engines carries.

    `cache` holds `seq.all_tokens[:cached]`; the remaining tokens (at least the
    newest) are still to be fed. `seq.rng` carries the sampler's key chain. A prefix-
    cache entry is one too: its `drafting.draft` is the drafter's cache it keeps."""

    seq: Sequence
    cache: list
    cached: int
    drafting: Drafting = field(default_factory=Drafting)

    @classmethod
    def entry(cls, seq: Sequence, cache: list, cached: int, draft: DraftState | None):
        """A prefix-cache entry's state: the target's cache and the drafter's it keeps."""
        return cls(seq, cache, cached, Drafting(draft=draft))


MAX_REFED = 16  # target positions fed again so a drafter's entry lines up with it


def resume_drafter(state: SequenceState, ahead: int | None) -> SequenceState:
    """A request starting from a prefix-cache entry: its drafter's state from the entry
    (`state.drafting.draft`, of a drafter fed the target's hidden states whose positions depend
    on `ahead` tokens more; None: the drafter keeps no entries), lined up with the
    target's cache -- the drafter goes on where the target's prefill starts. Where it
    holds fewer positions (an EAGLE-3 chain's newest pair needs the token after the
    entry), the target is cut back to them (a few tokens prefilled again); where the
    target cannot be cut (recurrent layers), the drafter restarts at the hit."""
    drafting = state.drafting
    if drafting.mtp is not None or ahead is None or drafting.draft is None:
        return state
    mtp = state_from_entry(drafting.draft, state.seq.all_tokens, ahead)
    drafting.draft = None  # the entry's cache becomes the drafter's state, or nothing
    if mtp is None:
        return state
    if mtp.length > state.cached:
        for layer in mtp.cache:
            layer.set_lengths([state.cached])
        mtp.length = state.cached
    behind = state.cached - mtp.length
    if behind > MAX_REFED or (behind and not can_trim(state.cache, behind)):
        return state
    trim_exact(state.cache, behind)
    drafting.mtp = mtp
    return replace(state, cached=state.cached - behind)
