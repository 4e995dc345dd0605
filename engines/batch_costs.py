"""What a batched forward costs, and the draft length that pays most for a batch.

A batched step verifies `[B, 1 + K]`: every row feeds its newest token and up to K
drafted ones (shorter drafts are padded). Its cost depends on the tokens in the
forward, n = B * (1 + K), and -- when any row drafts with the draft model -- on K
batched draft-model steps. Row i commits E_i(k_i) = 1 + a_1 + a_1 a_2 + ... (k_i terms)
tokens in expectation (a_i learned per position, see `gates`). The step's K maximises
sum_i E_i / cost; K = 0 is plain batching, and with one row this is the single-stream rule.

Costs start from the single-stream startup measurement (verify cost of n tokens
relative to a plain step, extended linearly past the measured n) and are replaced by
seconds measured on the engine's own forwards as they accumulate.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from engines.gates import MIN_SPEEDUP, Acceptance, CostModel, expected_tokens


@dataclass
class RowOption:
    """One way a row can draft this step: up to `cap` tokens at per-position acceptance
    `acceptance` (a float: the same at every position)."""

    acceptance: Acceptance
    cap: int
    uses_draft_model: bool


@dataclass
class _Average:
    """The median of the latest samples: one slow step (a first allocation, a busy
    machine, lazily evaluated work of another kind landing in it) cannot skew it."""

    recent: deque = field(default_factory=lambda: deque(maxlen=9))
    samples: int = 0

    def add(self, seconds: float) -> None:
        self.samples += 1
        self.recent.append(seconds)

    @property
    def value(self) -> float:
        return statistics.median(self.recent)


@dataclass
class BatchCosts:
    """Forward costs by tokens per forward (target) and rows per forward (draft)."""

    prior: CostModel
    learn: bool = True
    min_samples: int = 3
    explore_every: int = 8
    target: dict[int, _Average] = field(default_factory=dict)
    draft: dict[int, _Average] = field(default_factory=dict)
    decisions: int = 0

    def observe_target(self, tokens: int, seconds: float) -> None:
        if self.learn:
            self.target.setdefault(tokens, _Average()).add(seconds)

    def observe_draft(self, rows: int, seconds_per_step: float) -> None:
        if self.learn:
            self.draft.setdefault(rows, _Average()).add(seconds_per_step)

    def target_cost(self, tokens: int) -> float:
        known = {n: a for n, a in self.target.items() if a.samples >= self.min_samples}
        return _scaled(_monotone(known), tokens, self._prior_ratio)

    def draft_cost(self, rows: int) -> float:
        """One batched draft-model step over `rows` rows, in target_cost's units."""
        known = {n: a for n, a in self.draft.items() if a.samples >= self.min_samples}
        if rows in known and self._target_known():
            return known[rows].value
        return self.prior.draft_step * self.target_cost(rows)

    def _target_known(self) -> bool:
        return any(a.samples >= self.min_samples for a in self.target.values())

    def _prior_ratio(self, tokens: int) -> float:
        """Startup verify cost of `tokens` tokens vs a plain step, linear past the table."""
        verify = self.prior.verify
        if tokens <= len(verify):
            return verify[tokens - 1]
        slope = (verify[-1] - verify[0]) / (len(verify) - 1) if len(verify) > 1 else verify[0]
        return verify[-1] + max(slope, 0.0) * (tokens - len(verify))

    def step_cost(self, rows: int, k: int, draft_model: bool) -> float:
        cost = self.target_cost(rows * (1 + k))
        return cost + (k * self.draft_cost(rows) if draft_model and k else 0.0)

    def explore(
        self, choice: tuple[int, bool], rates: dict[tuple[int, bool], float], rows: int
    ) -> tuple[int, bool]:
        """Now and then, the best-rated choice one draft token longer or shorter whose
        forward size (rows * (1 + K) tokens) has too few measurements."""
        self.decisions += 1
        if not self.learn or self.decisions % self.explore_every:
            return choice
        k = choice[0]
        unmeasured = [
            option
            for option in rates
            if abs(option[0] - k) == 1 and self._samples(rows * (1 + option[0])) < self.min_samples
        ]
        return max(unmeasured, key=rates.get) if unmeasured else choice

    def _samples(self, tokens: int) -> int:
        average = self.target.get(tokens)
        return average.samples if average else 0

    def as_dict(self) -> dict:
        return {
            "target_seconds_by_tokens": {
                n: round(a.value, 6) for n, a in sorted(self.target.items())
            },
            "draft_seconds_by_rows": {n: round(a.value, 6) for n, a in sorted(self.draft.items())},
        }


def _monotone(known: dict[int, _Average]) -> dict[int, float]:
    """Measured seconds made non-decreasing in tokens (a forward over more tokens never
    costs less), by pooling adjacent violators weighted by their sample counts."""
    blocks: list[list[float]] = []  # [weighted mean, weight, count of points]
    for n in sorted(known):
        blocks.append([known[n].value, float(known[n].samples), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (v1, w1, c1), (v2, w2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    values = [value for value, _, count in blocks for _ in range(count)]
    return dict(zip(sorted(known), values, strict=True))


def _scaled(known: dict[int, float], n: int, prior) -> float:
    """Measured seconds for n when known; else the nearest measured point scaled by
    the prior's ratio; else the prior ratio itself (all callers compare like units)."""
    if n in known:
        return known[n]
    if not known:
        return prior(n)
    nearest = min(known, key=lambda m: (abs(m - n), m))
    return known[nearest] * prior(n) / prior(nearest)


def choose_draft_length(
    costs: BatchCosts, rows: list[list[RowOption]], k_max: int
) -> tuple[int, bool]:
    """(K, run the draft model) maximising expected committed tokens per unit cost.

    `rows[i]` lists row i's drafting options (empty: the row just decodes). A row
    drafts with whichever option yields more at the chosen K. Every `explore_every`
    decisions, a neighbouring K whose forward size has not been measured yet is
    tried instead, so a pessimistic prior cannot keep the best K from being found."""
    batch = len(rows)
    any_model = any(o.uses_draft_model for options in rows for o in options)
    rates = {(0, False): batch / costs.step_cost(batch, 0, False)}
    for k in range(1, k_max + 1):
        for with_model in (False, True) if any_model else (False,):
            tokens = sum(_row_expectation(options, k, with_model) for options in rows)
            rates[(k, with_model)] = tokens / costs.step_cost(batch, k, with_model)
    best = max(rates, key=rates.get)
    if rates[best] < rates[(0, False)] * MIN_SPEEDUP:
        best = (0, False)
    return costs.explore(best, rates, batch)


def _row_expectation(options: list[RowOption], k: int, with_model: bool) -> float:
    usable = [o for o in options if with_model or not o.uses_draft_model]
    return max((expected_tokens(o.acceptance, min(k, o.cap)) for o in usable), default=1.0)
