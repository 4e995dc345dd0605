"""The single stream's drafting policy: what the next step drafts, and what each verify
teaches the gates.

A step is plain (k = 0) unless a gate says drafting pays: a lookup's proposal -- prompt
lookup's, or the suffix drafter's from the API key's earlier requests, whichever is
expected to commit more -- cut to the length its match length's acceptance makes worth
verifying, or the draft model's
(or MTP head's) run up to where its confidence says to stop; with both ready, the one
expected to pay more. While the draft model drafts without pause, a few plain steps are
forced now and then, an A/B probe that keeps what drafting really gives measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.drafting.draft import DRAFT, LOOKUPS, PLD, SUFFIX, Draft
from engines.drafting.draft_model import DraftModelDrafter, DraftState
from engines.drafting.mtp import MTPDrafter, MTPState
from engines.gating.draft_confidence import ConfidenceCalibration, DraftStop
from engines.gating.draft_limits import DraftLimits
from engines.gating.gates import TRUSTED_ACCEPTANCE, speedup
from engines.gating.measured_costs import PLAIN, Measured, OnlineCosts, RealizedRates
from engines.single.active import Active

TRUSTED_SAMPLE = 32  # drafts before the draft model's acceptance is trusted


@dataclass
class SingleStreamPolicy:
    limits: DraftLimits
    costs: OnlineCosts  # verify and draft costs, learned as steps are served
    realized: RealizedRates | None  # what drafting gave as served (None: fixed costs)
    drafter: DraftModelDrafter | MTPDrafter | None
    confidence: ConfidenceCalibration  # how often the drafter is right, by how sure

    def measured(self, method: str, active: Active | None = None) -> Measured | None:
        """What drafting with `method` gave as served: the draft model's over the server
        (a property of the model pair), prompt lookup's over this request alone (it
        pays or not by the request's content, which the server's average hides)."""
        if self.realized is None:
            return None
        if method not in LOOKUPS:
            return self.realized.measured(method)
        gate = active.drafting.gates.get(method) if active is not None else None
        return gate.measured_against(self.realized.rate(PLAIN)) if gate is not None else None

    def propose(self, active: Active, model_state: DraftState | MTPState) -> Draft | None:
        """The next step's draft, or None for a plain step. `model_state` is the
        request's draft-model or MTP state, which the model drafter extends."""
        seq = active.seq
        left = seq.request.max_tokens - len(seq.generated) - 1
        k_max = min(self.limits.request_k(seq), left)
        pld_k_max = min(self.limits.request_k(seq, PLD), left)
        if max(k_max, pld_k_max) <= 0 or not active.drafting.gates or active.forced_plain > 0:
            return None
        gate = active.drafting.gates.get(DRAFT)
        if gate is not None and gate.open and self.realized and self.realized.plain_probe_due():
            active.forced_plain = 4  # an A/B probe: plain steps to compare drafting with
            return None
        pld_draft = self.better_lookup(
            active,
            self.propose_pld(active, pld_k_max) if PLD in active.drafting.gates else None,
            self.propose_suffix(active, pld_k_max) if SUFFIX in active.drafting.gates else None,
        )
        measured, trusted = self.measured(DRAFT), self.trusted_draft()
        k = gate.draft_length(k_max, self.costs.model(), measured, trusted=trusted) if gate else 0
        if k == 0 or (pld_draft is not None and self.prefer_pld(active, pld_draft, k)):
            return pld_draft
        # the gates said the draft model pays; its confidence says how far, up to k_max
        stop = DraftStop(self.costs.model(), self.confidence)
        draft = self.drafter.propose(
            model_state,
            active.tokens,
            k_max,
            seq.request.sampling,
            seq.rng,
            active.processors,
            position=len(seq.generated),
            stop=stop,
        )
        if draft is None:  # the MTP head has not seen the newest token (a restart)
            return pld_draft
        active.predicted = stop.predicted(len(draft.tokens))
        return draft

    def trusted_draft(self) -> bool:
        """The draft model's first token was accepted in at least half of its drafts
        over the server's life (once it drafted `TRUSTED_SAMPLE` times): it drafts until
        drafting is measured slower, whatever a request's latest rejections say."""
        if self.drafter is None:
            return False
        stats = self.limits.totals.by_method.get(self.drafter.method)
        if stats is None or stats.drafts < TRUSTED_SAMPLE:
            return False
        return stats.first_accepted >= TRUSTED_ACCEPTANCE * stats.drafts

    def prefer_pld(self, active: Active, pld_draft: Draft, draft_k: int) -> bool:
        """With both drafters ready, draft with the one expected to pay more this step:
        a long lookup match, or the lookup's measured acceptance making it the better
        deal (`pld_draft`: prompt lookup's or the suffix drafter's)."""
        if pld_draft.match_length >= self.limits.config.pld_preferred_match:
            draft_gate = active.drafting.gates[DRAFT]
            pld_gain = self.lookup_gain(active, pld_draft)
            draft_gain = speedup(draft_gate.acceptance(), draft_k, self.costs.model(), DRAFT)
            return pld_gain >= draft_gain
        return False

    def lookup_gain(self, active: Active, draft: Draft) -> float:
        """A lookup draft's expected speed-up over plain steps, by its gate's acceptance
        at its match length."""
        gate = active.drafting.gates[draft.gate]
        acceptance = gate.acceptance(draft.match_length, draft.confidences or None)
        return speedup(acceptance, len(draft.tokens), self.costs.model(), draft.method)

    def better_lookup(
        self, active: Active, pld_draft: Draft | None, suffix_draft: Draft | None
    ) -> Draft | None:
        """Of prompt lookup's and the suffix drafter's proposals, the one expected to
        pay more (prompt lookup's on a tie: the request's own context is the surer
        source)."""
        if pld_draft is None or suffix_draft is None:
            return pld_draft or suffix_draft
        better = self.lookup_gain(active, suffix_draft) > self.lookup_gain(active, pld_draft)
        return suffix_draft if better else pld_draft

    def propose_suffix(self, active: Active, k_max: int) -> Draft | None:
        """The suffix drafter's proposal from the key's earlier requests, cut to the
        length its gate finds worth verifying; with nothing worth proposing, an open
        gate rests a few tokens (plain steps then pipeline) and a closed one waits."""
        gate = active.drafting.gates[SUFFIX]
        if not gate.due:
            return None
        draft = active.seq.suffix.propose(active.tokens, k_max)
        if draft is None:
            if gate.open:
                gate.rest()
            else:
                gate.postpone()
            return None
        k = gate.draft_length(
            k_max, self.costs.model(), None, draft.match_length, prior=draft.confidences
        )
        if k == 0:  # a weak match: look again a little later, pipelining meanwhile
            if gate.open:
                gate.rest(2)
            return None
        draft.tokens, draft.confidences = draft.tokens[:k], draft.confidences[:k]
        return draft

    def propose_pld(self, active: Active, k_max: int) -> Draft | None:
        """The lookup's proposal, cut to the length its match length's acceptance makes
        worth verifying (None: not due, nothing found, or not worth it this step)."""
        gate = active.drafting.gates[PLD]
        if not gate.due:
            return None
        draft = active.drafting.pld.propose(active.tokens, k_max)
        if not gate.open and (
            draft is None or draft.match_length < self.limits.config.pld_probe_match
        ):
            gate.postpone()  # a probe needs real evidence of repetition
            return None
        if draft is None:
            return None
        k = gate.draft_length(
            k_max, self.costs.model(), self.measured(PLD, active), draft.match_length
        )
        if k == 0:
            return None
        draft.tokens = draft.tokens[:k]
        return draft

    def record(self, active: Active, draft: Draft, accepted: int) -> None:
        """A verify's outcome: the drafter's calibration, the counters, and the gate,
        which may close (a runtime trip)."""
        k = len(draft.tokens)
        if draft.confidences and draft.gate == DRAFT:  # the model drafter's calibration
            self.confidence.observe(draft.confidences, accepted)
        active.seq.spec.record(draft.method, k, accepted)
        self.limits.totals.record(draft.method, k, accepted)
        gate = active.drafting.gates[draft.gate]
        measured = self.measured(draft.gate, active)
        k_max = self.limits.request_k(active.seq, draft.gate)
        trusted = draft.gate == DRAFT and self.trusted_draft()
        if gate.record(
            k, accepted, k_max, self.costs.model(), measured, draft.match_length, trusted
        ):
            active.seq.spec.trip("runtime")
            self.limits.totals.trip("runtime")
