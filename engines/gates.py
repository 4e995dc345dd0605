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

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from engines.drafters import DRAFT
from engines.position_rates import LookupPrior, MatchProbes, PositionRates, mean_then_running

MIN_SPEEDUP = 1.03  # a draft length must beat plain decoding by this much
TRUSTED_ACCEPTANCE = 0.5  # a draft model accepted this often drafts until measured slower
MEASURED_SLOWER = 0.95  # measured drafting speed-up below which drafting stops: clearly
# slower, not the noise of a running average near 1
PLAIN = "plain"
Acceptance = float | Sequence[float]  # per-position acceptance; a float: the same everywhere
Calibration = Callable[[int], float] | None  # k -> measured / predicted speed-up


@dataclass(frozen=True)
class CostModel:
    """verify[n-1] = cost of a target forward over n tokens / cost of a plain step;
    draft_step = cost of one draft-model token / cost of a plain target step."""

    verify: tuple[float, ...]
    draft_step: float = 0.0
    plain_seconds: float = 0.0  # a pipelined plain step at start-up (0 = not measured)

    @property
    def max_tokens(self) -> int:
        return len(self.verify)

    def verify_cost(self, n: int) -> float:
        return self.verify[min(n, len(self.verify)) - 1]

    def step_cost(self, k: int, method: str) -> float:
        return self.verify_cost(k + 1) + (k * self.draft_step if method == DRAFT else 0.0)

    @classmethod
    def assumed(cls, max_tokens: int, per_token: float = 0.15, draft_step: float = 0.1):
        """A stand-in when measuring is not wanted (tests): linear verify cost."""
        return cls(tuple(1.0 + per_token * n for n in range(max_tokens)), draft_step)

    @classmethod
    def measure(cls, model, draft_model, max_tokens: int, rounds: int = 5) -> CostModel:
        """Time forwards of 1..max_tokens tokens on a warm cache against pipelined plain
        steps (what drafting must beat), robust to a noisy shared machine. Each round
        times every size between two runs of plain steps, and each cost is a ratio to
        the mean of its own round's plain runs, so a machine that slows down or speeds
        up during the measurement (another process, throttling) changes the plain step
        and the forwards alike; the median over rounds drops a round that a burst of
        interference hit; and the verify costs are fitted to be non-decreasing in n
        (more tokens never cost less)."""
        target_cache = _warm_cache(model)
        draft_cache = _warm_cache(draft_model) if draft_model is not None else None
        _forward_seconds(model, target_cache, max_tokens)  # warm-up: graph, allocations
        by_round, plains = [], []
        for _ in range(rounds):
            before = _pipelined_step_seconds(model, target_cache)
            forwards = [_forward_seconds(model, target_cache, n) for n in range(1, max_tokens + 1)]
            draft = _pipelined_step_seconds(draft_model, draft_cache) if draft_cache else 0.0
            plain = (before + _pipelined_step_seconds(model, target_cache)) / 2
            plains.append(plain)
            by_round.append([seconds / plain for seconds in forwards] + [draft / plain])
        medians = [statistics.median(column) for column in zip(*by_round, strict=True)]
        verify = monotone_fit([max(1.0, ratio) for ratio in medians[:-1]])
        return cls(tuple(verify), medians[-1], statistics.median(plains))

    def as_dict(self) -> dict:
        return {
            "verify": [round(c, 4) for c in self.verify],
            "draft_step": round(self.draft_step, 4),
        }


def running_average(old: float | None, value: float, weight: float) -> float:
    """An exponential moving average; the first value starts it."""
    return value if old is None else old + weight * (value - old)


def monotone_fit(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in squared error (pool adjacent
    violators): one noisy size is averaged with its neighbours instead of lifting every
    larger size to its level, as a running maximum would."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean_b, count_b), (mean_a, count_a) = blocks.pop(), blocks.pop()
            count = count_a + count_b
            blocks.append([(mean_a * count_a + mean_b * count_b) / count, count])
    return [mean for mean, count in blocks for _ in range(count)]


def _warm_cache(model, context: int = 32):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, context), dtype=mx.int32), cache=cache))
    return cache


def _forward_seconds(model, cache, n: int, repeats: int = 1) -> float:
    """The fastest of `repeats` forwards of n tokens (rolled back after each)."""
    tokens = mx.zeros((1, n), dtype=mx.int32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        logits = model(tokens, cache=cache)
        mx.eval(mx.argmax(logits[0], axis=-1))
        best = min(best, time.perf_counter() - start)
        trim_prompt_cache(cache, n)
    return best


def _pipelined_step_seconds(model, cache, steps: int = 4) -> float:
    """Seconds per step of `steps` pipelined plain steps (rolled back after)."""
    token = mx.argmax(model(mx.zeros((1, 1), dtype=mx.int32), cache=cache)[0, -1:], axis=-1)
    mx.eval(token)
    start = time.perf_counter()
    for _ in range(steps):
        following = mx.argmax(model(token[None], cache=cache)[0, -1:], axis=-1)
        mx.async_eval(following)
        token.item()
        token = following
    token.item()
    seconds = (time.perf_counter() - start) / steps
    trim_prompt_cache(cache, steps + 1)
    return seconds


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
    positions: PositionRates | None = None  # per position, every verify of the method
    # prompt lookup: per position by the length of the n-gram match that proposed the
    # draft (a one-token match is a much weaker hint than three, all the way along),
    # over the server's rates for that match length (`prior`)
    by_match: dict[int, PositionRates] = field(default_factory=dict)
    prior: LookupPrior | None = None  # the server's, which this request's verifies teach
    prior_at_start: LookupPrior | None = None  # what it knew before this request
    probes: MatchProbes = field(default_factory=MatchProbes)
    # what this method's verifies really committed per second in this request
    outcome_tokens: float | None = None
    outcome_seconds: float | None = None
    outcomes: int = 0
    min_outcomes: int = 8

    def __post_init__(self) -> None:
        if self.positions is None:
            self.positions = PositionRates(self.weight)
        if self.prior is not None and self.prior_at_start is None:
            self.prior_at_start = self.prior.copy()

    def acceptance(self, match: int = 0) -> tuple[float, ...]:
        """Per-position acceptance a_1, a_2, ...: each position's running rate over this
        request's verifies, pulled towards the position before it (the first: towards
        the prior `alpha`) while it has few observations (`PositionRates.chain`). With
        `match` (a prompt lookup draft's n-gram length): that match length's own rates
        in this request, pulled towards the server's for it, themselves pulled towards
        the pooled estimate while the server has seen few such drafts."""
        pooled = self.positions.chain(self.alpha)
        if not match:
            return pooled
        start = self.prior_at_start
        prior = start.estimates(match, pooled) if start is not None else pooled
        own = self.by_match.get(match)
        return own.over(prior) if own is not None else prior

    def planned_acceptance(self, match: int, k_max: int, cost: CostModel) -> tuple[float, ...]:
        """What a batch plans a lookup draft of a `match`-token n-gram with: the
        estimate, or the prior `alpha` when the estimate would skip it and a probe of
        that match length is due (`MatchProbes`)."""
        acceptance = self.acceptance(match)
        if best_draft_length(acceptance, k_max, cost, self.method) == 0 and self.probes.skip(match):
            return (self.alpha,)
        return acceptance

    def expected(self, k: int) -> float:
        return expected_tokens(self.acceptance(), k)

    def draft_length(
        self,
        k_max: int,
        cost: CostModel,
        measured: Measured | None = None,
        match: int = 0,
        trusted: bool = False,
    ) -> int:
        """How many tokens to draft this step (0 = do not draft with this method). An open
        gate that finds no k worth drafting for any match length closes, so the steps
        until its probe are pipelined plain steps: a gate that is open but never drafts
        would cost every step its pipelining and gather no evidence. (One weak match
        that does not pay is skipped without closing.)"""
        if self.open:
            k = self.open_length(k_max, cost, measured, match, trusted)
            if k == 0 and match and self.probes.skip(match):
                return min(self.probe_k, k_max)
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
            for match in {0, *self.by_match, *(self.prior.matches if self.prior else ())}
        )

    def open_length(
        self,
        k_max: int,
        cost: CostModel,
        measured: Measured | None,
        match: int = 0,
        trusted: bool = False,
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
        acceptance = self.acceptance(match)
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
        self.positions.record(drafted, accepted)
        if match and drafted:
            self.by_match.setdefault(match, PositionRates(self.weight)).record(drafted, accepted)
            if self.prior is not None:
                self.prior.record(match, drafted, accepted)
            pays = self.open_length(k_max, cost, measured, match, trusted) > 0
            self.probes.verified(match, pays)
        pays = self._pays(k_max, cost, measured, trusted)
        was_open, self.open = self.open, pays
        if pays:
            self.backoff = self.min_backoff
            return False
        self.cooldown = self.backoff
        self.backoff = min(self.backoff * 2, self.max_backoff)
        return was_open

    def observe_outcome(self, seconds: float, tokens: int) -> None:
        """A verify of this method as served: its wall time and the tokens it committed."""
        self.outcomes += 1
        self.outcome_tokens = self._learned(self.outcome_tokens, float(tokens), self.outcomes)
        self.outcome_seconds = self._learned(self.outcome_seconds, seconds, self.outcomes)

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
        """Start closed (prompt gate): the first probe comes after a doubled back-off."""
        self.open = False
        self.backoff = min(self.backoff * 2, self.max_backoff)
        self.cooldown = self.backoff

    def postpone(self, tokens: int = 4) -> None:
        """A probe was due but had nothing to propose; look again a bit later."""
        self.cooldown = tokens

    def plain_token(self) -> None:
        if not self.open and self.cooldown > 0:
            self.cooldown -= 1

    @property
    def due(self) -> bool:
        """True if this method may draft at the next step."""
        return self.open or self.cooldown <= 0


@dataclass
class OnlineCosts:
    """Step costs learned while serving, starting from the startup measurement.

    A startup benchmark on a busy or thermally throttled machine can be off by tens of
    percent, and a gate that believes verifies are cheap drafts at a loss. So the
    engine times its own steps -- pipelined plain steps, verifies by size, draft-model
    proposals per token -- and the gates read ratios of those running averages."""

    base: CostModel
    learn: bool = True
    weight: float = 0.1
    min_samples: int = 4
    plain_s: float | None = None
    verify_s: dict[int, float] = field(default_factory=dict)
    draft_token_s: float | None = None
    samples: dict[str, int] = field(default_factory=dict)
    _model: CostModel | None = None
    # the latest model and sample counts, replaced whole: safe to read from any thread
    published: tuple[CostModel, dict[str, int]] | None = None

    def _average(self, old: float | None, value: float, key: str) -> float | None:
        """Running average; the first sample of each kind is dropped (warm-up: graph
        building, allocations), so it cannot skew the average for many steps."""
        seen = self.samples.get(key, 0)
        self.samples[key] = seen + 1
        if seen == 0:
            return old
        return running_average(old, value, self.weight)

    def observe_plain(self, seconds: float) -> None:
        if self.learn:
            self.plain_s = self._average(self.plain_s, seconds, "plain")
            self._model = None

    def observe_verify(self, tokens: int, seconds: float) -> None:
        if self.learn:
            self.verify_s[tokens] = self._average(self.verify_s.get(tokens), seconds, f"v{tokens}")
            self._model = None

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if self.learn and tokens:
            self.draft_token_s = self._average(self.draft_token_s, seconds / tokens, "draft")
            self._model = None

    def model(self) -> CostModel:
        """The current cost model: learned ratios where there are enough samples.
        Engine thread only; other threads read `published`."""
        if self._model is None:
            self._model = self._combine()
            self.published = (self._model, dict(self.samples))
        return self._model

    def snapshot(self) -> dict:
        """What /v1/stats shows: the costs in use, the start-up measurement, samples."""
        current, samples = self.published or (self.base, {})
        return {
            **current.as_dict(),
            "measured_at_startup": self.base.as_dict(),
            "learning": self.learn,
            "samples": samples,
        }

    def _combine(self) -> CostModel:
        """Learned verify costs where a size has enough samples; elsewhere the start-up
        measurement's extra cost over a plain step, scaled by how far the learned sizes
        say it was off (a start-up on a busy machine is off for every size alike)."""
        base = self.base
        if self.plain_s is None or self.samples.get("plain", 0) <= self.min_samples:
            return base
        learned = {
            n: max(1.0, seconds / self.plain_s)
            for n, seconds in self.verify_s.items()
            if seconds is not None and self.samples.get(f"v{n}", 0) > self.min_samples
        }
        excess = [
            (learned[n] - 1) / (base.verify_cost(n) - 1)
            for n in learned
            if base.verify_cost(n) > 1.0
        ]
        scale = statistics.median(excess) if excess else 1.0
        ratios = [
            learned.get(n, 1 + (base.verify_cost(n) - 1) * scale)
            for n in range(1, base.max_tokens + 1)
        ]
        draft = base.draft_step
        if self.draft_token_s is not None and self.samples.get("draft", 0) > self.min_samples:
            draft = self.draft_token_s / self.plain_s
        return CostModel(tuple(monotone_fit(ratios)), draft, base.plain_seconds)


@dataclass(frozen=True)
class Measured:
    """What drafting with a method gave as served: its speed-up over plain steps, and
    per draft length k how its measured speed-up compared with the prediction."""

    speedup: float
    factors: dict[int, float]

    def calibration(self, k: int) -> float:
        return self.factors.get(k, 1.0)


@dataclass
class RealizedRates:
    """Committed tokens per second as served, for plain steps and for drafting steps by
    method: what drafting actually gave, beside what the cost model predicts.

    Running averages of seconds and of tokens per step (their ratio is the rate), and
    per draft length k of the real and the predicted tokens and costs (in plain steps),
    whose ratio calibrates that k's prediction (one request's drafts stop at varying
    lengths, so every k is seen). `plain_probe_due` asks the engine for a few plain
    steps now and then while drafting runs without pause, so the comparison does not
    go stale."""

    weight: float = 0.1
    min_steps: int = 4  # plain steps (they start from the start-up measurement)
    min_draft_steps: int = 12  # drafting steps: their yield varies step to step (a few
    # unlucky drafts must not decide that drafting is slower)
    stale_after: int = 48
    wide_margin: float = 1.25  # drafting this much faster than plain is probed less often
    wide_margin_spacing: int = 4
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    since_plain: int = 0
    by_k: dict[int, list[float]] = field(default_factory=dict)  # real/predicted tok, cost
    k_steps: dict[int, int] = field(default_factory=dict)

    @classmethod
    def starting_from(cls, plain_seconds: float) -> RealizedRates:
        """Plain steps start at the start-up measurement, as if seen `min_steps` times,
        so drafting is judged from its first steps; A/B probes then correct it."""
        rates = cls()
        if plain_seconds > 0:
            rates.seconds[PLAIN], rates.tokens[PLAIN] = plain_seconds, 1.0
            rates.steps[PLAIN] = rates.min_steps + 1
        return rates

    def observe(self, kind: str, seconds: float, tokens: int) -> None:
        seen = self.steps.get(kind, 0)
        self.steps[kind] = seen + 1
        if seen == 0:  # warm-up, like OnlineCosts
            return
        for average, value in ((self.seconds, seconds), (self.tokens, float(tokens))):
            average[kind] = mean_then_running(average.get(kind), value, self.weight, seen)
        self.since_plain = 0 if kind == PLAIN else self.since_plain + 1

    def observe_draft(
        self, method: str, k: int, seconds: float, tokens: int, predicted: tuple[float, float]
    ) -> None:
        """A drafting step of length k: its real seconds and committed tokens, and the
        (tokens, cost in plain steps) predicted for it."""
        self.observe(method, seconds, tokens)
        plain = self.seconds.get(PLAIN)
        if plain is None:
            return
        values = (float(tokens), seconds / plain, *predicted)
        old = self.by_k.get(k) or [None] * len(values)
        self.k_steps[k] = self.k_steps.get(k, 0) + 1  # before by_k: stats read both
        self.by_k[k] = [
            running_average(o, v, self.weight) for o, v in zip(old, values, strict=True)
        ]

    def rate(self, kind: str) -> float | None:
        enough = self.min_steps if kind == PLAIN else self.min_draft_steps
        if self.steps.get(kind, 0) <= enough:
            return None
        return self.tokens[kind] / self.seconds[kind]

    def speedup(self, method: str) -> float | None:
        """Measured tokens/s drafting with `method` over plain tokens/s, or None."""
        plain, drafting = self.rate(PLAIN), self.rate(method)
        return None if plain is None or drafting is None else drafting / plain

    def measured(self, method: str) -> Measured | None:
        speedup = self.speedup(method)
        if speedup is None:
            return None
        factors = {
            k: (tokens / cost) / (predicted_tokens / predicted_cost)
            for k, (tokens, cost, predicted_tokens, predicted_cost) in list(self.by_k.items())
            if self.k_steps.get(k, 0) > self.min_steps
        }
        return Measured(speedup, factors)

    def plain_probe_due(self) -> bool:
        if self.steps.get(PLAIN, 0) <= self.min_steps:
            return True
        return self.since_plain >= self.probe_interval()

    def probe_interval(self) -> int:
        """Drafting steps between plain probes: `stale_after`, or `wide_margin_spacing`
        times that while some drafting is measured at least `wide_margin` times as fast
        as plain steps. Only a large change in the machine's speed could reverse such a
        verdict, and each probe gives up a few drafting steps: with a matched draft at
        ~4x plain, probing every 48 steps cost about 3% of its throughput."""
        speedups = [self.speedup(kind) for kind in list(self.steps) if kind != PLAIN]
        if max((s for s in speedups if s is not None), default=0.0) >= self.wide_margin:
            return self.stale_after * self.wide_margin_spacing
        return self.stale_after

    def snapshot(self) -> dict:
        kinds = sorted(list(self.steps))  # one atomic copy: the engine thread adds keys
        rates = {kind: round(rate, 2) for kind in kinds if (rate := self.rate(kind))}
        measured = self.measured(DRAFT)
        if measured is not None:
            rates["draft_calibration_by_k"] = {
                k: round(f, 3) for k, f in sorted(list(measured.factors.items()))
            }
        return rates
