"""What a request carries between engines: `SequenceState`, one request's portable
state, its cache and its own drafting state (gates, n-gram index, draft-model cache, MTP
state), handed from one engine to the other when the scheduler migrates the request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engines.cache.rollback import can_trim, trim_exact
from engines.drafting.draft_model import DraftState
from engines.drafting.entries import state_from_entry
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


MAX_REFED = 16  # target positions fed again so a drafter's entry lines up with it


def resume_drafter(state: SequenceState, ahead: int | None) -> SequenceState:
    """A request starting from a prefix-cache entry: its drafter's state from the entry
    (`state.draft`, of a drafter fed the target's hidden states whose positions depend
    on `ahead` tokens more; None: the drafter keeps no entries), lined up with the
    target's cache -- the drafter goes on where the target's prefill starts. Where it
    holds fewer positions (an EAGLE-3 chain's newest pair needs the token after the
    entry), the target is cut back to them (a few tokens prefilled again); where the
    target cannot be cut (recurrent layers), the drafter restarts at the hit."""
    if state.mtp is not None or ahead is None or state.draft is None:
        return state
    mtp = state_from_entry(state.draft, state.seq.all_tokens, ahead)
    if mtp is None:
        return replace(state, draft=None)
    if mtp.length > state.cached:
        for layer in mtp.cache:
            layer.set_lengths([state.cached])
        mtp.length = state.cached
    behind = state.cached - mtp.length
    if behind > MAX_REFED or (behind and not can_trim(state.cache, behind)):
        return replace(state, draft=None)
    trim_exact(state.cache, behind)
    return replace(state, cached=state.cached - behind, draft=None, mtp=mtp)
