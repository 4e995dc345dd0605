"""What steps cost and what drafting gave, as measured on this machine.

* `CostModel`: verify and draft-step costs relative to a plain step, measured at
  start-up robustly on a noisy shared machine.
* `OnlineCosts`: the same costs learned from the engine's own steps while serving.
* `RealizedRates` / `Measured`: committed tokens per second as served, drafting
  against plain steps, and how far each draft length's prediction was off.

The gates (`engines.gating.gates`) decide with these; nothing here decides anything.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from engines.drafting.draft import DRAFT

PLAIN = "plain"


@dataclass(frozen=True)
class CostModel:
    """verify[n-1] = cost of a target forward over n tokens / cost of a plain step;
    draft_step = cost of one draft-model token / cost of a plain target step -- or, for
    a block drafter (DFlash: k tokens in one forward), of one whole proposal."""

    verify: tuple[float, ...]
    draft_step: float = 0.0
    plain_seconds: float = 0.0  # a pipelined plain step at start-up (0 = not measured)
    block_draft: bool = False  # the model drafter drafts a proposal in one forward

    def draft_cost(self, k: int) -> float:
        """What drafting k tokens with the model drafter costs, in plain steps."""
        return self.draft_step * (min(k, 1) if self.block_draft else k)

    @property
    def max_tokens(self) -> int:
        return len(self.verify)

    def verify_cost(self, n: int) -> float:
        return self.verify[min(n, len(self.verify)) - 1]

    def step_cost(self, k: int, method: str) -> float:
        return self.verify_cost(k + 1) + (self.draft_cost(k) if method == DRAFT else 0.0)

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

    def extended(self, max_tokens: int) -> CostModel:
        """Verify costs up to `max_tokens`, sizes past the measured ones continued at the
        slope of the measured tail (up to four sizes back), so long lookup drafts need no
        longer start-up; served verifies then replace the guesses (`OnlineCosts`)."""
        if max_tokens <= len(self.verify):
            return self
        verify = list(self.verify)
        back = min(4, len(verify) - 1)
        slope = max((verify[-1] - verify[-1 - back]) / back, 0.0) if back else 0.0
        while len(verify) < max_tokens:
            verify.append(verify[-1] + slope)
        return CostModel(tuple(verify), self.draft_step, self.plain_seconds, self.block_draft)

    def as_dict(self) -> dict:
        return {
            "verify": [round(c, 4) for c in self.verify],
            "draft_step": round(self.draft_step, 4),
        }


def running_average(old: float | None, value: float, weight: float) -> float:
    """An exponential moving average; the first value starts it."""
    return value if old is None else old + weight * (value - old)


def mean_then_running(old: float | None, value: float, weight: float, observations: int) -> float:
    """An average after its n-th observation: a plain mean at first (no early value
    outweighs the rest), then a running average with `weight`."""
    return running_average(old, value, max(weight, 1.0 / observations))


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


def relative_step_cost(model, base, rounds: int = 5) -> float:
    """A pipelined step of `model` over one of `base` (two models of one tokenizer, e.g. a
    draft with a reduced vocabulary against its whole self): each round times `model`
    between two runs of `base`, and the median over rounds drops a disturbed one."""
    model_cache, base_cache = _warm_cache(model), _warm_cache(base)
    ratios = []
    for _ in range(rounds):
        before = _pipelined_step_seconds(base, base_cache)
        seconds = _pipelined_step_seconds(model, model_cache)
        after = _pipelined_step_seconds(base, base_cache)
        ratios.append(seconds / ((before + after) / 2))
    return statistics.median(ratios)


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
        return CostModel(tuple(monotone_fit(ratios)), draft, base.plain_seconds, base.block_draft)


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
