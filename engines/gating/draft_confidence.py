"""Where a draft model's proposal stops: at the token it is unsure of, by what that costs.

A fixed draft length k is wrong on most steps: on an easy stretch the draft would be
right for many more tokens, on a hard one its second token is already a guess, and every
guess costs a draft step and a wider verify. The draft model says which is which: its
probability for the token it proposes. HF transformers' assisted generation stops below
a fixed confidence (0.4), but a fixed threshold suits one pair only -- a draft distilled
from its target is right even when unsure. So:

* `ConfidenceCalibration` learns, over the server's life (a property of the model pair),
  the chance that a draft token is accepted given the draft's probability for it, in
  bins, each pulled towards the pair's pooled rate while it has few observations.
* `DraftStop` follows one proposal token by token: expected committed tokens E(i) =
  1 + r_1 + r_1 r_2 + ... (r_j the calibrated acceptance of draft j) against its cost
  verify(i+1) + i * draft_step. Drafting goes on while one more token is expected to add
  more than the proposal's best rate so far (marginal above average), and the proposal
  is then cut to its best length, the draft steps already spent counted for every length.

Measured offline on wide-stories with the saltyduckegg draft (teacher-forced, 12
prompts, costs measured on this CPU): 1.30x plain against 1.16x for the best fixed k;
with a matched draft (every token accepted) it drafts to the cap, as a fixed k would.
Stopping by the draft's own numbers never changes what is accepted: the verify is
exact for any proposal length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.drafting.draft import DRAFT
from engines.gating.measured_costs import CostModel, monotone_fit

BINS = 10
PRIOR_WEIGHT = 2.0  # pseudo-observations pulling a bin towards the pooled rate
MEMORY = 512.0  # observations per bin beyond which older ones fade (content changes)


@dataclass
class ConfidenceCalibration:
    """P(draft token accepted | every draft before it accepted), by the draft's probability
    for the token. Before any observation a bin's rate is its confidence itself."""

    hits: list[float] = field(default_factory=lambda: [0.0] * BINS)
    seen: list[float] = field(default_factory=lambda: [0.0] * BINS)
    _rates: list[float] | None = None

    @staticmethod
    def bin_of(confidence: float) -> int:
        return min(max(int(confidence * BINS), 0), BINS - 1)

    def acceptance(self, confidence: float) -> float:
        if self._rates is None:
            self._rates = self._fit()
        return self._rates[self.bin_of(confidence)]

    def observe(self, confidences: list[float], accepted: int) -> None:
        """A verify of a proposal with these confidences accepted `accepted` drafts: the
        drafts up to and including the first rejection were tried, the rest were not."""
        for i, confidence in enumerate(confidences[: accepted + 1]):
            b = self.bin_of(confidence)
            self.hits[b] += 1.0 if i < accepted else 0.0
            self.seen[b] += 1.0
            if self.seen[b] > MEMORY:
                self.hits[b] *= MEMORY / self.seen[b]
                self.seen[b] = MEMORY
        self._rates = None

    def _fit(self) -> list[float]:
        """Each bin's rate pulled towards the pooled rate (itself pulled towards the
        bin's midpoint), then made non-decreasing in confidence: a surer draft is not
        wrong more often, and one noisy bin borrows from its neighbours."""
        total_hits, total_seen = sum(self.hits), sum(self.seen)
        rates = []
        for b in range(BINS):
            midpoint = (b + 0.5) / BINS
            pooled = (total_hits + PRIOR_WEIGHT * midpoint) / (total_seen + PRIOR_WEIGHT)
            rates.append((self.hits[b] + PRIOR_WEIGHT * pooled) / (self.seen[b] + PRIOR_WEIGHT))
        return monotone_fit(rates)

    def snapshot(self) -> dict:
        """Per bin: the rate in use and the observations behind it (for /v1/stats; read
        from other threads, so the cached rates are read once)."""
        rates = self._rates
        if rates is None:
            rates = self._fit()
        return {
            f"{b / BINS:.1f}": {"acceptance": round(rates[b], 3), "seen": round(self.seen[b])}
            for b in range(BINS)
        }


@dataclass
class DraftStop:
    """One proposal's stopping rule, fed each draft token's confidence as it is drafted."""

    cost: CostModel
    calibration: ConfidenceCalibration
    confidences: list[float] = field(default_factory=list)
    expected: list[float] = field(default_factory=lambda: [1.0])  # E(0), E(1), ...
    reach: float = 1.0  # chance that every draft so far is accepted
    best_rate: float = 1.0  # a plain step: one token per unit of cost

    def add(self, confidence: float) -> bool:
        """Record the newest draft token; True if drafting one more is expected to pay."""
        self.confidences.append(confidence)
        acceptance = self.calibration.acceptance(confidence)
        self.reach *= acceptance
        self.expected.append(self.expected[-1] + self.reach)
        i = len(self.confidences)
        draft_step = self.cost.draft_cost(i + 1) - self.cost.draft_cost(i)  # a block's: 0
        self.best_rate = max(self.best_rate, self.expected[i] / self.cost.step_cost(i, DRAFT))
        # the next token's acceptance, before it is drafted: this one's (confidence comes
        # in runs, so it is a better guess than the pair's average)
        gain = self.reach * acceptance
        extra = self.cost.verify_cost(i + 2) - self.cost.verify_cost(i + 1) + draft_step
        return gain >= self.best_rate * extra

    def best_length(self) -> int:
        """The number of drafts to verify (at least one: the gates decided that drafting
        pays; the draft steps taken are spent whatever is verified)."""
        rates = {}
        for k in range(1, len(self.expected)):
            tokens, cost = self.predicted(k)
            rates[k] = tokens / cost
        return max(rates, key=lambda k: (rates[k], -k))

    def predicted(self, k: int) -> tuple[float, float]:
        """(tokens, cost in plain steps) expected for verifying the first k drafts, every
        draft step taken so far counted."""
        spent = self.cost.draft_cost(len(self.confidences))
        return self.expected[k], self.cost.verify_cost(k + 1) + spent
