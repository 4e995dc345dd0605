"""When drafting pays, and how far to draft: the gates and adaptive k.

Plain decoding yields one token per target step (cost 1). Drafting k tokens yields
E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens, where a_i is the chance that draft i
is accepted once the drafts before it were, at cost V(k+1) (target forward over k+1
tokens, measured relative to a plain step) plus k draft-model steps for the draft
method. We draft the k that maximises E(k)/cost(k), and not at all (k = 0) when no k
beats plain decoding. The a_i are learned per position: acceptance comes in runs (a
draft that copies the prompt, or a draft model on an easy stretch, is right for many
tokens once it is right for the first), so a_2, a_3, ... are usually higher than a_1,
and a model that assumed one rate for every position would draft too short.

* Prompt gate: a prompt with little n-gram repetition starts with PLD closed.
* Runtime gate: a running acceptance estimate closes a method when it stops paying;
  a closed method is re-probed after a back-off, so PLD re-engages when the output
  turns repetitive.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engines.drafting.draft import DRAFT
from engines.gating.measured_costs import CostModel, Measured, mean_then_running

MIN_SPEEDUP = 1.03  # a draft length must beat plain decoding by this much
TRUSTED_ACCEPTANCE = 0.5  # a draft model accepted this often drafts until measured slower
MEASURED_SLOWER = 0.95  # measured drafting speed-up below which drafting stops: clearly
# slower, not the noise of a running average near 1
SHRINK = 2.0  # pseudo-observations pulling a rarely reached position to the one before it
SHRINK_CAP = 8  # observations beyond this count no more against the pull
Acceptance = float | Sequence[float]  # per-position acceptance; a float: the same everywhere
Calibration = Callable[[int], float] | None  # k -> measured / predicted speed-up


def _shrunk(rate: float, observations: int, toward: float) -> float:
    """`rate` pulled towards `toward` by SHRINK pseudo-observations."""
    weight = min(observations, SHRINK_CAP)
    return (weight * rate + SHRINK * toward) / (weight + SHRINK)


def _chained(rates: list[float], reached: list[int], first_toward: float) -> tuple[float, ...]:
    """Each position's rate pulled towards the estimate before it (the first towards
    `first_toward`) while it has few observations."""
    estimates, previous = [], first_toward
    for rate, count in zip(rates, reached, strict=True):
        previous = _shrunk(rate, count, previous)
        estimates.append(previous)
    return tuple(estimates)


def expected_tokens(acceptance: Acceptance, k: int) -> float:
    """1 + a_1 + a_1 a_2 + ... + a_1...a_k: the tokens a verify of k drafts commits in
    expectation. Positions past the given rates take the last one."""
    rates = (acceptance,) if isinstance(acceptance, int | float) else tuple(acceptance)
    total = reach = 1.0
    for i in range(k):
        reach *= rates[min(i, len(rates) - 1)]
        total += reach
    return total


def speedup(acceptance: Acceptance, k: int, cost: CostModel, method: str) -> float:
    """Expected tokens per unit of plain-step cost when drafting k with `method`."""
    return expected_tokens(acceptance, k) / cost.step_cost(k, method)


def best_draft_length(
    acceptance: Acceptance,
    k_max: int,
    cost: CostModel,
    method: str,
    calibration: Calibration = None,
    floor: float = MIN_SPEEDUP,
) -> int:
    """The k in 1..k_max with the best tokens-per-cost, or 0 if none beats plain by
    `floor`; `calibration(k)` corrects each prediction by how far it was off when
    served."""
    best_k, best = 0, floor
    for k in range(1, k_max + 1):
        gain = speedup(acceptance, k, cost, method) * (calibration(k) if calibration else 1.0)
        if gain > best:
            best_k, best = k, gain
    return best_k


def prompt_repetition_score(tokens: list[int] | tuple[int, ...], n: int = 3) -> float:
    """Fraction of the prompt's n-grams that already occurred earlier in it."""
    seen: set[tuple[int, ...]] = set()
    repeats = total = 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        total += 1
        if gram in seen:
            repeats += 1
        seen.add(gram)
    return repeats / total if total else 0.0


@dataclass
class MethodGate:
    """Runtime gate for one drafting method within one request.

    Acceptance is learned per draft position (`acceptance()`), starting from the prior
    `alpha`; a closed gate waits `cooldown` plain tokens before a probe, doubling the
    wait after each failed probe (so a novel stream pays for at most a few probes)."""

    method: str
    alpha: float  # the prior: acceptance assumed at every position before any verify
    open: bool = True
    cooldown: int = 0
    backoff: int = 8
    min_backoff: int = 8
    max_backoff: int = 256
    weight: float = 0.25
    probe_k: int = 2
    last_k: int = 0  # the draft length of the latest verify
    rates: list[float] = field(default_factory=list)  # per position: running acceptance
    reached: list[int] = field(default_factory=list)  # per position: verifies that got there
    # prompt lookup: per position, rates and verifies that got there, by the length of
    # the n-gram match that proposed the draft (a one-token match is a much weaker hint
    # than three, at the first position and along the copy)
    by_match: dict[int, tuple[list[float], list[int]]] = field(default_factory=dict)
    # what this method's verifies really committed per second in this request, averaged
    # over about ten verifies: prompt lookup's yield swings from a whole copy to nothing
    # verify to verify, and a four-verify average (the rates' weight) closed the gate on
    # a short bad run: type hints on Qwen2.5-Coder-1.5B 1.58x -> 1.90x plain in replay
    outcome_weight: float = 0.1
    outcome_tokens: float | None = None
    outcome_seconds: float | None = None
    outcomes: int = 0
    min_outcomes: int = 8
    idle: int = 0  # plain tokens an open gate sits out: it had nothing to propose (`rest`)

    def acceptance(self, match: int = 0, prior: Acceptance | None = None) -> tuple[float, ...]:
        """Per-position acceptance a_1, a_2, ...: each position's running rate, pulled
        towards the estimate of the position before it (the first: towards the prior)
        while it has few observations. A position rarely reached -- drafts are seldom
        that long -- so inherits what the last well-observed one says, instead of a
        prior that would keep long drafts from ever being tried. With `match` (a prompt
        lookup draft's n-gram length), the rates are that match length's own, its a_1
        pulled towards the pooled a_1: on code edits a three-token match's draft was
        accepted at 90% at every position, a one-token match's first token at 20%, and
        rates pooled past the first position drafted weak matches long and strong
        ones short. `prior`: the drafter's own estimate for this draft (a suffix draft's
        frequencies in the key's earlier requests), used for a match length this
        request has not yet verified."""
        pooled = _chained(self.rates, self.reached, self.alpha) or (self.alpha,)
        if match not in self.by_match:
            if prior:
                return (prior,) if isinstance(prior, int | float) else tuple(prior)
            return pooled
        rates, reached = self.by_match[match]
        return _chained(rates, reached, pooled[0]) or pooled

    def expected(self, k: int) -> float:
        return expected_tokens(self.acceptance(), k)

    def draft_length(
        self,
        k_max: int,
        cost: CostModel,
        measured: Measured | None = None,
        match: int = 0,
        trusted: bool = False,
        prior: Acceptance | None = None,
    ) -> int:
        """How many tokens to draft this step (0 = do not draft with this method). An open
        gate that finds no k worth drafting for any match length closes, so the steps
        until its probe are pipelined plain steps: a gate that is open but never drafts
        would cost every step its pipelining and gather no evidence. (One weak match
        that does not pay is skipped without closing.)"""
        if self.open:
            k = self.open_length(k_max, cost, measured, match, trusted, prior)
            if k == 0 and not self._pays(k_max, cost, measured, trusted):
                self.open, self.cooldown = False, self.backoff
            return k
        return min(self.probe_k, k_max) if self.cooldown <= 0 else 0

    def _pays(
        self, k_max: int, cost: CostModel, measured: Measured | None, trusted: bool = False
    ) -> bool:
        """Some draft length pays, pooled or for a match length seen."""
        return any(
            self.open_length(k_max, cost, measured, match, trusted) > 0
            for match in (0, *self.by_match)
        )

    def open_length(
        self,
        k_max: int,
        cost: CostModel,
        measured: Measured | None,
        match: int = 0,
        trusted: bool = False,
        prior: Acceptance | None = None,
    ) -> int:
        """The predicted best k, unless what was measured says otherwise (`measured`:
        drafting with this method against plain steps as served, None until both were
        seen). Each k's prediction is corrected by how far it was off when served (the
        cost model misses per-step overheads; real acceptance comes in runs, not
        independently per position), and a prediction that measurement contradicts is
        not trusted. A draft model accepted at least half the time -- over the server's
        life (`trusted`) or in this request -- drafts its best predicted k, even one
        predicted to gain nothing, until drafting is measured slower: a few rejections
        in a row (common at 50-60% acceptance) say little about the next tokens, and a
        gate that closed on them lost 10-20% against mlx-lm's fixed k."""
        calibration = measured.calibration if measured else None
        acceptance = self.acceptance(match, prior)
        if measured is not None and measured.speedup < MEASURED_SLOWER:
            return 0
        predicted = best_draft_length(acceptance, k_max, cost, self.method, calibration)
        trusted = self.method == DRAFT and (trusted or acceptance[0] >= TRUSTED_ACCEPTANCE)
        if predicted == 0 and (trusted or (measured and measured.speedup >= MIN_SPEEDUP)):
            return best_draft_length(acceptance, k_max, cost, self.method, calibration, 0.0)
        return predicted

    def record(
        self,
        drafted: int,
        accepted: int,
        k_max: int,
        cost: CostModel,
        measured: Measured | None = None,
        match: int = 0,
        trusted: bool = False,
    ) -> bool:
        """Update after a verify (`match`: the prompt lookup match length that proposed
        it); returns True if this closed the gate (a trip)."""
        self.last_k = drafted
        if match and drafted:
            self._learn_positions(*self.by_match.setdefault(match, ([], [])), drafted, accepted)
        self._learn_positions(self.rates, self.reached, drafted, accepted)
        pays = self._pays(k_max, cost, measured, trusted)
        was_open, self.open = self.open, pays
        if pays:
            self.backoff = self.min_backoff
            return False
        self.cooldown = self.backoff
        self.backoff = min(self.backoff * 2, self.max_backoff)
        return was_open

    def _learn_positions(
        self, rates: list[float], reached: list[int], drafted: int, accepted: int
    ) -> None:
        attempts = accepted + (1 if accepted < drafted else 0)
        for i in range(attempts):  # positions after the first rejection were not tried
            hit = 1.0 if i < accepted else 0.0
            if i == len(rates):
                rates.append(hit)
                reached.append(0)
            reached[i] += 1
            rates[i] = self._learned(rates[i], hit, reached[i])

    def observe_outcome(self, seconds: float, tokens: int) -> None:
        """A verify of this method as served: its wall time and the tokens it committed."""
        self.outcomes += 1
        weight, n = self.outcome_weight, self.outcomes
        self.outcome_tokens = mean_then_running(self.outcome_tokens, float(tokens), weight, n)
        self.outcome_seconds = mean_then_running(self.outcome_seconds, seconds, weight, n)

    def measured_against(self, plain_rate: float | None) -> Measured | None:
        """This request's drafting with the method, as served, against plain steps'
        tokens/s (None until both are known). For prompt lookup, whose worth depends on
        the request's own text: a prediction built from acceptance runs seen earlier
        (the output copied its prompt, then stopped) must give way to what the
        request's verifies commit now."""
        if plain_rate is None or self.outcomes < self.min_outcomes or not self.outcome_seconds:
            return None
        return Measured(self.outcome_tokens / self.outcome_seconds / plain_rate, {})

    def _learned(self, rate: float | None, hit: float, observations: int) -> float:
        return mean_then_running(rate, hit, self.weight, observations)

    def close(self) -> None:
        """Start closed (prompt gate): no drafting on weak matches, but a probe at the
        first strong one, and a failed probe waits a doubled back-off. A prompt that does
        not repeat itself says little about whether the answer will copy it: a code edit's
        prompt (code, an instruction) scored under the threshold, and waiting out a
        back-off first cost the rename 16 plain tokens of a copy that was there from its
        first token (4.6x -> 6.2x plain in replay on Qwen2.5-Coder-1.5B)."""
        self.open = False
        self.backoff = min(self.backoff * 2, self.max_backoff)
        self.cooldown = 0

    def postpone(self, tokens: int = 4) -> None:
        """A probe was due but had nothing to propose; look again a bit later."""
        self.cooldown = tokens

    def rest(self, tokens: int = 4) -> None:
        """An open gate's drafter found nothing to propose (the key's earlier requests
        hold no match): sit out a few tokens, so they run as pipelined plain steps."""
        self.idle = tokens

    def plain_token(self) -> None:
        if not self.open and self.cooldown > 0:
            self.cooldown -= 1
        self.idle = max(0, self.idle - 1)

    @property
    def due(self) -> bool:
        """True if this method may draft at the next step."""
        return (self.open and self.idle <= 0) or (not self.open and self.cooldown <= 0)
