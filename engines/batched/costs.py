"""What a batched forward costs, and the draft length that pays most for a batch.

A batched step verifies `[B, 1 + K]`: every row feeds its newest token and up to K
drafted ones (shorter drafts are padded). Its cost depends on the tokens in the
forward, n = B * (1 + K), and -- when any row drafts with the draft model -- on K
batched draft-model steps. Row i commits E_i(k_i) = 1 + a_1 + a_1 a_2 + ... (k_i terms)
tokens in expectation (a_i learned per position, see `gates`). The step's K maximises
sum_i E_i / cost; K = 0 is plain batching, and with one row this is the single-stream rule.

Costs start from the single-stream startup measurement (verify cost of n tokens
relative to a plain step, extended linearly past the measured n) and are replaced by
seconds measured on the engine's own forwards as they accumulate: plain steps at
different batch sizes measure the cost curve in tokens, and sizes between or past
measured ones follow it (`_scaled`).

Predictions are then checked against outcomes, as the single-stream gates do: per
batch size and kind of step (plain, prompt lookup, draft model), running averages of
the tokens each step really committed and the seconds it really took beside what was
predicted for it. Their ratio calibrates that kind's predicted rate, so drafting that
measurably commits fewer tokens per second than plain steps at this batch size stops,
whatever the cause (optimistic acceptance, forward sizes that cost more than their
neighbours, bookkeeping). A plain step now and then keeps the comparison current.

Calibration corrects the average prediction, not the marginal choice: the steps a
chooser picks for a small promised gain can still lose. So the outcomes also gate
directly: a kind of drafting whose steps have really committed fewer tokens per second
than plain steps at this batch size waits (`outcome_vetoes`), but for one probe step in
`probe_every`, so rows that start to copy their context are noticed.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from engines.gating.gates import MIN_SPEEDUP, Acceptance, expected_tokens
from engines.gating.measured_costs import CostModel, mean_then_running

PLAIN, LOOKUP, MODEL = "plain", "lookup", "model"  # kinds of batched step

# A batch of several rows drafts only when that promises this much over a plain step.
# Calibration corrects the average prediction, not the marginal one: on a compute-bound
# CPU (wide-salty, 8 rows, prompt lookup at ~58% acceptance) steps chosen for a promised
# 3-8% gain ran 3-4% slower than plain batching in aggregate.
BATCH_MIN_SPEEDUP = 1.08


@dataclass
class RowOption:
    """One way a row can draft this step: up to `cap` tokens at per-position acceptance
    `acceptance` (a float: the same at every position)."""

    acceptance: Acceptance
    cap: int
    uses_draft_model: bool


@dataclass(frozen=True)
class BatchPlan:
    """A step's draft length K, whether the draft model runs, and what is predicted for
    it: committed tokens and cost -- in seconds when `in_seconds` (some forward was
    measured when it was made), else in the start-up prior's units."""

    k: int
    with_model: bool
    tokens: float
    cost: float
    in_seconds: bool = False

    @property
    def kind(self) -> str:
        return MODEL if self.with_model else LOOKUP if self.k else PLAIN

    @property
    def rate(self) -> float:
        return self.tokens / self.cost


@dataclass
class _Outcome:
    """Running averages of one kind of step's real tokens and seconds and of the tokens
    and seconds predicted for it; real rate over predicted rate calibrates the kind."""

    averages: tuple[float, float, float, float] | None = None
    steps: int = 0

    def add(self, values: tuple[float, float, float, float], weight: float) -> None:
        """A plain mean at first (the first step must not outweigh the next ten), then
        a running average."""
        self.steps += 1
        old = self.averages or (None,) * 4
        self.averages = tuple(
            mean_then_running(o, v, weight, self.steps) for o, v in zip(old, values, strict=True)
        )

    @property
    def factor(self) -> float:
        tokens, seconds, predicted_tokens, predicted_seconds = self.averages
        return (tokens / seconds) / (predicted_tokens / predicted_seconds)


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
    # Drafting steps commit from 1 to 1 + K tokens per row: a kind of drafting is judged
    # by its outcomes only after this many (three unlucky ones once closed drafting at
    # 2 rows for the rest of a run, as it did for the single-stream gates).
    min_drafting_samples: int = 12
    explore_every: int = 8
    outcome_weight: float = 0.1
    plain_every: int = 48
    probe_every: int = 32
    target: dict[int, _Average] = field(default_factory=dict)
    draft: dict[int, _Average] = field(default_factory=dict)
    outcomes: dict[tuple[int, str], _Outcome] = field(default_factory=dict)
    # steps served at (rows) since a (rows, kind) step last ran
    since: dict[tuple[int, str], int] = field(default_factory=dict)
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

    def plan(
        self, rows: int, k: int, with_model: bool, tokens: float, draft_steps: int | None = None
    ) -> BatchPlan:
        """A plan for `rows` rows with its predicted cost, in the units costs are in now;
        the draft model runs `draft_steps` forwards (default k: no drafting row's own
        cap is shorter)."""
        cost = self.step_cost(rows, k, with_model, draft_steps)
        return BatchPlan(k, with_model, tokens, cost, in_seconds=self._target_known())

    def plain_plan(self, rows: int) -> BatchPlan:
        return self.plan(rows, 0, False, float(rows))

    def observe_outcome(self, rows: int, plan: BatchPlan, tokens: int, seconds: float) -> None:
        """A verify step of `rows` rows as served: the tokens it committed and its wall
        time from planning to commit. A plan predicted in the prior's units (made before
        any forward was measured -- also on the step whose forward is the first to be
        measured enough) is not comparable with seconds and is skipped."""
        if not self.learn or not plan.in_seconds:
            return
        for kind in (PLAIN, LOOKUP, MODEL):
            waited = self.since.get((rows, kind), 0) + 1
            self.since[rows, kind] = 0 if plan.kind == kind else waited
        outcome = self.outcomes.setdefault((rows, plan.kind), _Outcome())
        outcome.add((float(tokens), seconds, plan.tokens, plan.cost), self.outcome_weight)

    def calibration(self, rows: int, kind: str) -> float:
        """Measured rate over predicted rate of `kind` steps at `rows` rows (1 until
        measured enough, `_measured`)."""
        outcome = self._measured(rows, kind)
        return outcome.factor if outcome else 1.0

    def realized_rate(self, rows: int, kind: str) -> float | None:
        """Tokens per second `kind` steps at `rows` rows really committed (None until
        measured enough, `_measured`)."""
        outcome = self._measured(rows, kind)
        if outcome is None:
            return None
        tokens, seconds, _, _ = outcome.averages
        return tokens / seconds

    def _measured(self, rows: int, kind: str) -> _Outcome | None:
        """The outcomes of `kind` at `rows` rows once there are `min_samples` plain steps
        or `min_drafting_samples` drafting ones."""
        outcome = self.outcomes.get((rows, kind))
        enough = self.min_samples if kind == PLAIN else self.min_drafting_samples
        return outcome if outcome is not None and outcome.steps >= enough else None

    def outcome_vetoes(self, rows: int, kind: str) -> bool:
        """Whether `kind` steps at `rows` rows have really committed fewer tokens per
        second than plain steps there, and are not due a probe (one step in
        `probe_every` without them)."""
        if kind == PLAIN:
            return False
        drafting, plain = self.realized_rate(rows, kind), self.realized_rate(rows, PLAIN)
        if drafting is None or plain is None or drafting >= plain:
            return False
        return self.since.get((rows, kind), 0) < self.probe_every

    def plain_probe_due(self, rows: int) -> bool:
        """While drafting runs at `rows` rows, a plain step until plain steps there are
        measured, and then one every `plain_every` drafting steps."""
        if not self.learn or not self._target_known():
            return False
        plain = self.outcomes.get((rows, PLAIN))
        unmeasured = plain is None or plain.steps < self.min_samples
        return unmeasured or self.since.get((rows, PLAIN), 0) >= self.plain_every

    def _target_known(self) -> bool:
        return any(a.samples >= self.min_samples for a in self.target.values())

    def _prior_ratio(self, tokens: int) -> float:
        """Startup verify cost of `tokens` tokens vs a plain step, linear past the table."""
        verify = self.prior.verify
        if tokens <= len(verify):
            return verify[tokens - 1]
        slope = (verify[-1] - verify[0]) / (len(verify) - 1) if len(verify) > 1 else verify[0]
        return verify[-1] + max(slope, 0.0) * (tokens - len(verify))

    def step_cost(
        self, rows: int, k: int, draft_model: bool, draft_steps: int | None = None
    ) -> float:
        cost = self.target_cost(rows * (1 + k))
        steps = k if draft_steps is None else min(k, draft_steps)
        if self.prior.block_draft:  # one drafter forward drafts the whole proposal
            steps = min(steps, 1)
        return cost + (steps * self.draft_cost(rows) if draft_model and k else 0.0)

    def explore(self, choice: BatchPlan, plans: dict[BatchPlan, float], rows: int) -> BatchPlan:
        """Now and then, the best-rated plan one draft token longer or shorter whose
        forward size (rows * (1 + K) tokens) has too few measurements."""
        self.decisions += 1
        if not self.learn or self.decisions % self.explore_every:
            return choice
        unmeasured = [
            plan
            for plan in plans
            if abs(plan.k - choice.k) == 1 and self._samples(rows * (1 + plan.k)) < self.min_samples
        ]
        return max(unmeasured, key=plans.get) if unmeasured else choice

    def _samples(self, tokens: int) -> int:
        average = self.target.get(tokens)
        return average.samples if average else 0

    def as_dict(self) -> dict:
        return {
            "target_seconds_by_tokens": {
                n: round(a.value, 6) for n, a in sorted(self.target.items())
            },
            "draft_seconds_by_rows": {n: round(a.value, 6) for n, a in sorted(self.draft.items())},
            "calibration_by_rows": {
                f"{rows}/{kind}": round(self.calibration(rows, kind), 3)
                for rows, kind in sorted(list(self.outcomes))
            },
            "realized_tokens_per_second_by_rows": {
                f"{rows}/{kind}": round(rate, 2)
                for rows, kind in sorted(list(self.outcomes))
                if (rate := self.realized_rate(rows, kind)) is not None
            },
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
    """Seconds for a forward over n tokens, from the measured points: exact when n was
    measured; between two measured sizes, on the line joining them; past the largest,
    along the slope of the measured upper half (on a compute-bound device every extra
    token costs about the same, which the single-stream prior, measured on few tokens,
    cannot know), never below the nearest measured point scaled by the prior's ratio;
    otherwise that scaled point, or the prior ratio itself before anything was measured
    (all callers compare like units)."""
    if n in known:
        return known[n]
    if not known:
        return prior(n)
    sizes = sorted(known)
    below = [m for m in sizes if m < n]
    above = [m for m in sizes if m > n]
    if below and above:
        low, high = below[-1], above[0]
        return known[low] + (known[high] - known[low]) * (n - low) / (high - low)
    nearest = min(known, key=lambda m: (abs(m - n), m))
    by_prior = known[nearest] * prior(n) / prior(nearest)
    if not below or len(sizes) < 2:
        return by_prior
    top = sizes[-1]
    base = next(m for m in sizes if m >= top / 2)
    base = base if base < top else sizes[-2]
    slope = (known[top] - known[base]) / (top - base)
    return max(known[top] + slope * (n - top), by_prior)


def choose_draft_length(costs: BatchCosts, rows: list[list[RowOption]], k_max: int) -> BatchPlan:
    """The plan (K, run the draft model) maximising committed tokens per second.

    `rows[i]` lists row i's drafting options (empty: the row just decodes). A row
    drafts with whichever option yields more at the chosen K. Each kind's predicted
    rate is scaled by its measured calibration at this batch size, a kind that has
    really committed fewer tokens per second than plain steps here sits out (bar
    probes), and drafting must beat plain decoding by `MIN_SPEEDUP` (one row, the
    single-stream rule) or `BATCH_MIN_SPEEDUP` (several rows). Every `explore_every`
    decisions, a neighbouring K whose forward size has not been measured yet is tried
    instead, so a pessimistic prior cannot keep the best K from being found."""
    batch = len(rows)
    model_cap = max((o.cap for options in rows for o in options if o.uses_draft_model), default=0)
    plain = costs.plain_plan(batch)
    plans = [plain]
    for k in range(1, k_max + 1):
        for with_model in (False, True) if model_cap else (False,):
            tokens = sum(_row_expectation(options, k, with_model) for options in rows)
            plans.append(costs.plan(batch, k, with_model, tokens, model_cap))
    rated = {
        plan: plan.rate * costs.calibration(batch, plan.kind)
        for plan in plans
        if not costs.outcome_vetoes(batch, plan.kind)
    }
    best = max(rated, key=rated.get)
    margin = MIN_SPEEDUP if batch == 1 else BATCH_MIN_SPEEDUP
    if rated[best] < rated[plain] * margin or costs.plain_probe_due(batch):
        best = plain
    return costs.explore(best, rated, batch)


def _row_expectation(options: list[RowOption], k: int, with_model: bool) -> float:
    usable = [o for o in options if with_model or not o.uses_draft_model]
    return max((expected_tokens(o.acceptance, min(k, o.cap)) for o in usable), default=1.0)
