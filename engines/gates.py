"""When drafting pays, and how far to draft: the gates and adaptive k.

Plain decoding yields one token per target step (cost 1). Drafting k tokens with
per-position acceptance probability a yields E(k) = 1 + a + ... + a^k tokens at
cost V(k+1) (target forward over k+1 tokens, measured relative to a plain step)
plus k draft-model steps for the draft method. We draft the k that maximises
E(k)/cost(k), and not at all (k = 0) when no k beats plain decoding.

* Prompt gate: a prompt with little n-gram repetition starts with PLD closed.
* Runtime gate: a running acceptance estimate closes a method when it stops paying;
  a closed method is re-probed after a back-off, so PLD re-engages when the output
  turns repetitive.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from engines.drafters import DRAFT

MIN_SPEEDUP = 1.03  # a draft length must beat plain decoding by this much


@dataclass(frozen=True)
class CostModel:
    """verify[n-1] = cost of a target forward over n tokens / cost of a plain step;
    draft_step = cost of one draft-model token / cost of a plain target step."""

    verify: tuple[float, ...]
    draft_step: float = 0.0

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
    def measure(cls, model, draft_model, max_tokens: int, repeats: int = 7) -> CostModel:
        """Time forwards of 1..max_tokens tokens on a warm cache, against pipelined
        plain steps (what drafting must beat). Minimum over repeats (interference only
        ever adds time), made non-decreasing in n (more tokens never cost less)."""
        plain = _pipelined_step_seconds(model, repeats)
        ratios = [_forward_seconds(model, n, repeats) / plain for n in range(1, max_tokens + 1)]
        verify = tuple(itertools.accumulate((max(1.0, r) for r in ratios), max))
        draft = _pipelined_step_seconds(draft_model, repeats) / plain if draft_model else 0.0
        return cls(verify, draft)


def _warm_cache(model, context: int = 32):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, context), dtype=mx.int32), cache=cache))
    return cache


def _forward_seconds(model, n: int, repeats: int) -> float:
    cache = _warm_cache(model)
    tokens = mx.zeros((1, n), dtype=mx.int32)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        logits = model(tokens, cache=cache)
        mx.eval(mx.argmax(logits[0], axis=-1))
        times.append(time.perf_counter() - start)
        trim_prompt_cache(cache, n)
    return min(times[1:])


def _pipelined_step_seconds(model, repeats: int) -> float:
    cache = _warm_cache(model)
    token = mx.zeros((1,), dtype=mx.int32)
    steps = 4 * repeats
    token = mx.argmax(model(token[None], cache=cache)[0, -1:], axis=-1)
    mx.eval(token)
    best = float("inf")
    for _ in range(3):  # best of three runs of `steps` pipelined steps
        start = time.perf_counter()
        for _ in range(steps):
            following = mx.argmax(model(token[None], cache=cache)[0, -1:], axis=-1)
            mx.async_eval(following)
            token.item()
            token = following
        token.item()
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def expected_tokens(alpha: float, k: int) -> float:
    return sum(alpha**i for i in range(k + 1))


def speedup(alpha: float, k: int, cost: CostModel, method: str) -> float:
    """Expected tokens per unit of plain-step cost when drafting k with `method`."""
    return expected_tokens(alpha, k) / cost.step_cost(k, method)


def best_draft_length(alpha: float, k_max: int, cost: CostModel, method: str) -> int:
    """The k in 1..k_max with the best tokens-per-cost, or 0 if none beats plain."""
    best_k, best = 0, MIN_SPEEDUP
    for k in range(1, k_max + 1):
        gain = speedup(alpha, k, cost, method)
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

    alpha is an exponential moving average of per-position acceptance; a closed
    gate waits `cooldown` plain tokens before a probe, doubling the wait after each
    failed probe (so a novel stream pays for at most a few probes)."""

    method: str
    alpha: float
    open: bool = True
    cooldown: int = 0
    backoff: int = 8
    min_backoff: int = 8
    max_backoff: int = 256
    weight: float = 0.25
    probe_k: int = 2

    def draft_length(self, k_max: int, cost: CostModel) -> int:
        """How many tokens to draft this step (0 = do not draft with this method)."""
        if self.open:
            return best_draft_length(self.alpha, k_max, cost, self.method)
        return min(self.probe_k, k_max) if self.cooldown <= 0 else 0

    def record(self, drafted: int, accepted: int, k_max: int, cost: CostModel) -> bool:
        """Update after a verify; returns True if this closed the gate (a trip)."""
        attempts = accepted + (1 if accepted < drafted else 0)
        for i in range(attempts):
            hit = 1.0 if i < accepted else 0.0
            self.alpha += self.weight * (hit - self.alpha)
        pays = best_draft_length(self.alpha, k_max, cost, self.method) > 0
        was_open, self.open = self.open, pays
        if pays:
            self.backoff = self.min_backoff
            return False
        self.cooldown = self.backoff
        self.backoff = min(self.backoff * 2, self.max_backoff)
        return was_open

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

    def _average(self, old: float | None, value: float, key: str) -> float | None:
        """Running average; the first sample of each kind is dropped (warm-up: graph
        building, allocations), so it cannot skew the average for many steps."""
        seen = self.samples.get(key, 0)
        self.samples[key] = seen + 1
        if seen == 0:
            return old
        self._model = None
        return value if old is None else old + self.weight * (value - old)

    def observe_plain(self, seconds: float) -> None:
        if self.learn:
            self.plain_s = self._average(self.plain_s, seconds, "plain")

    def observe_verify(self, tokens: int, seconds: float) -> None:
        if self.learn:
            self.verify_s[tokens] = self._average(self.verify_s.get(tokens), seconds, f"v{tokens}")

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if self.learn and tokens:
            self.draft_token_s = self._average(self.draft_token_s, seconds / tokens, "draft")

    def model(self) -> CostModel:
        """The current cost model: learned ratios where there are enough samples."""
        if self._model is None:
            self._model = self._combine()
        return self._model

    def _combine(self) -> CostModel:
        base = self.base
        if self.plain_s is None or self.samples.get("plain", 0) <= self.min_samples:
            return base
        ratios = []
        for n in range(1, base.max_tokens + 1):
            learned = self.verify_s.get(n)
            if learned is not None and self.samples.get(f"v{n}", 0) > self.min_samples:
                ratios.append(max(1.0, learned / self.plain_s))
            else:
                ratios.append(base.verify_cost(n))
        draft = base.draft_step
        if self.draft_token_s is not None and self.samples.get("draft", 0) > self.min_samples:
            draft = self.draft_token_s / self.plain_s
        return CostModel(tuple(itertools.accumulate(ratios, max)), draft)
