"""How often each position of a draft is accepted: per request, and for prompt lookup
by the length of the n-gram match that proposed the draft, over a server-wide prior.

`PositionRates.rates[j]` is the running chance that draft token j+1 is accepted once
the tokens before it were; a verify that rejects draft i tried positions 1..i and no
later one, so later positions learn only from the verifies that reached them.

Why by match length: on wide-salty's novel output (6 prompts x 160 tokens, every
position's lookup draft checked against the greedy output) a one-token match's first
draft token is accepted 13% of the time and its second, once the first was, 52%; a
three-token match's 90% and 93%. Rates pooled over every match length drafted long
after weak matches and short after strong ones: in the batch at two users that
served 1.13x plain batching, where a replay of the same output with per-match rates
and this machine's forward costs gives 1.24x.

Why server-wide: a request lives a few hundred tokens, too few verifies to learn a rate
per match length and position on its own. So the server keeps the same rates over all
requests (`LookupPrior`) and each request's own verifies pull its estimates away from
them -- a code edit copies its prompt far more often than a story does. These are
counts of accepted positions, never tokens: nothing of one request's text reaches
another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

SHRINK = 2.0  # pseudo-observations pulling a rarely reached position to its prior
SHRINK_CAP = 8  # a request's observations beyond this count no more against the pull
PRIOR_WEIGHT = 0.02  # the server's running average forgets slowly (traffic changes)


def shrunk(rate: float, observations: int, toward: float) -> float:
    """`rate` pulled towards `toward` by SHRINK pseudo-observations."""
    weight = min(observations, SHRINK_CAP)
    return (weight * rate + SHRINK * toward) / (weight + SHRINK)


def upper_bound(rate: float, observations: int, z: float = 1.0) -> float:
    """The upper end of the Wilson score interval (z standard errors) of a rate seen
    over `observations` trials: 0.5 after one miss, 0.13 after 200 at 11%."""
    n = max(observations, 1)
    centre = rate + z * z / (2 * n)
    spread = z * (rate * (1 - rate) / n + z * z / (4 * n * n)) ** 0.5
    return min(1.0, (centre + spread) / (1 + z * z / n))


def mean_then_running(old: float | None, value: float, weight: float, observations: int) -> float:
    """An average after its n-th observation: a plain mean at first (no early value
    outweighs the rest), then a running average with `weight`."""
    return value if old is None else old + max(weight, 1.0 / observations) * (value - old)


@dataclass
class PositionRates:
    """Running acceptance per draft position."""

    weight: float
    rates: list[float] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)  # verifies that tried the position

    def record(self, drafted: int, accepted: int) -> None:
        """A verify of `drafted` tokens accepted `accepted`: positions up to the first
        rejection were tried, later ones were not."""
        attempts = accepted + (1 if accepted < drafted else 0)
        for i in range(attempts):
            if i == len(self.rates):
                self.rates.append(0.0)
                self.reached.append(0)
            self.reached[i] += 1
            hit = 1.0 if i < accepted else 0.0
            self.rates[i] = mean_then_running(self.rates[i], hit, self.weight, self.reached[i])

    def chain(self, start: float) -> tuple[float, ...]:
        """Each position pulled towards the estimate of the one before it (the first
        towards `start`): a position rarely reached -- drafts are seldom that long --
        inherits what the last well-observed one says, instead of a prior that would
        keep long drafts from ever being tried."""
        estimates, previous = [], start
        for rate, reached in zip(self.rates, self.reached, strict=True):
            previous = shrunk(rate, reached, previous)
            estimates.append(previous)
        return tuple(estimates) or (start,)

    def over(self, prior: Sequence[float]) -> tuple[float, ...]:
        """Each position pulled towards the prior's estimate there, or past the prior's
        last observed position towards this one's estimate of the position before it
        (as `chain` does: a prior that never saw a draft get that far says nothing of
        it); positions this has not seen take the prior's."""
        estimates: list[float] = []
        for j in range(max(len(self.rates), len(prior))):
            toward = prior[j] if j < len(prior) else estimates[-1]
            if j < len(self.rates):
                toward = shrunk(self.rates[j], self.reached[j], toward)
            estimates.append(toward)
        return tuple(estimates)


@dataclass
class LookupPrior:
    """Prompt lookup acceptance per position by match length, over the server's life:
    the prior each request's own rates start from. Engine-thread state; `snapshot`
    is read from other threads."""

    by_match: dict[int, PositionRates] = field(default_factory=dict)

    def record(self, match: int, drafted: int, accepted: int) -> None:
        rates = self.by_match.setdefault(match, PositionRates(PRIOR_WEIGHT))
        rates.record(drafted, accepted)

    def estimates(self, match: int, fallback: Sequence[float]) -> tuple[float, ...]:
        """The server's rate for `match` at each position it has seen, read at the
        upper end of what its observations allow (`upper_bound`); `fallback` (the
        request's pooled estimate) while the match length was never verified.

        Optimistic because the prior learns only from drafts the gates chose to make:
        where it is too pessimistic nothing is drafted and nothing corrects it. (Read
        as plain averages, a fresh server's first requests -- novel prompts probed
        with two-token drafts that missed -- taught it that three-token matches miss,
        and at two users the batch never drafted again.) A match length that really
        misses is soon pulled down by its many observations; one tried rarely stays
        high enough to be tried."""
        rates = self.by_match.get(match)
        if rates is None or not rates.rates:
            return tuple(fallback)
        memory = round(1 / PRIOR_WEIGHT)  # a running average remembers about this many
        return tuple(
            upper_bound(rate, min(reached, memory))
            for rate, reached in zip(rates.rates, rates.reached, strict=True)
        )

    @property
    def matches(self) -> tuple[int, ...]:
        return tuple(self.by_match)

    def copy(self) -> LookupPrior:
        """The rates as they are now: a request's prior, which its own verifies (also
        recorded here) must not count a second time."""
        return LookupPrior(
            {
                m: PositionRates(r.weight, list(r.rates), list(r.reached))
                for m, r in self.by_match.items()
            }
        )

    def snapshot(self) -> dict:
        """Per match length: each position's rate and the verifies that reached it."""
        return {
            str(match): {
                "acceptance_per_position": [round(r, 3) for r in list(rates.rates)],
                "reached": list(rates.reached),
            }
            for match, rates in sorted(dict(self.by_match).items())
        }


@dataclass
class MatchProbes:
    """When a request tries a match length its estimates say to skip. A match length
    whose estimates were learned elsewhere (the server's prior, or this request's first
    few verifies) could otherwise never be drafted again in the request -- a loop
    whose every lookup is a three-token match, on a server whose stories taught it
    that three-token matches miss. So a match length skipped `backoff` times since its
    last verify is drafted once at the gate's prior; a probe that does not pay doubles
    the wait, one that does resets it."""

    min_backoff: int = 8
    max_backoff: int = 256
    skipped: dict[int, int] = field(default_factory=dict)
    backoff: dict[int, int] = field(default_factory=dict)
    probing: set[int] = field(default_factory=set)  # offered as probes, not verified yet

    def skip(self, match: int) -> bool:
        """Count a lookup of `match` not drafted; True when it is offered as a probe
        (a batch may still not draft it: then it is offered again after as many)."""
        skipped = self.skipped.get(match, 0) + 1
        if skipped < self.backoff.get(match, self.min_backoff):
            self.skipped[match] = skipped
            return False
        self.skipped[match] = 0
        self.probing.add(match)
        return True

    def verified(self, match: int, pays: bool) -> None:
        """A draft of `match` was verified; after it, drafting it `pays` or not."""
        self.skipped[match] = 0
        if pays:
            self.backoff.pop(match, None)
        elif match in self.probing:
            wait = self.backoff.get(match, self.min_backoff)
            self.backoff[match] = min(wait * 2, self.max_backoff)
        self.probing.discard(match)
