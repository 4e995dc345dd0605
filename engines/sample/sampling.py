"""Turning logits into the next token, per request, with a private seeded RNG.

Built from mlx-lm's pieces (`make_logits_processors`, `apply_top_p/top_k/min_p`) in
mlx-lm's order: penalties and bias on the logits, filters on the log-probabilities,
then temperature. Each request owns its RNG key chain, so a seeded request gives
the same tokens whatever else the server is doing, and the key can travel with the
request when it moves between engines.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
)

from engines.request import SamplingParams


def make_token_processors(params: SamplingParams) -> list:
    """Penalties and logit bias: the processors that depend on previous tokens."""
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )


def filter_logprobs(params: SamplingParams, logprobs: mx.array) -> mx.array:
    """Apply top-p, min-p and top-k to log-probabilities (masked entries become -inf)."""
    if 0.0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


def sampling_logits(params: SamplingParams, logprobs: mx.array) -> mx.array:
    """Unnormalised logits of the distribution a sampled token is drawn from."""
    return filter_logprobs(params, logprobs) * (1.0 / params.temperature)


@dataclass
class RandomStream:
    """A request's private RNG.

    Unseeded: a key split once per draw. Seeded: the randomness of the token at
    output position n is a function of (seed, n) alone (`key_at`), so a seeded
    request's tokens do not depend on how many draws drafting, batching or migration
    made before it: it gives the same tokens alone or under load."""

    key: mx.array
    seed: int | None = None

    @classmethod
    def from_seed(cls, seed: int | None) -> RandomStream:
        if seed is None:
            return cls(mx.random.key(secrets.randbits(63)))
        return cls(mx.random.key(seed % (1 << 64)), seed % (1 << 64))

    @property
    def seeded(self) -> bool:
        return self.seed is not None

    def next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def key_at(self, position: int) -> mx.array:
        """The key for the token at output `position` of a seeded request."""
        return mx.random.key((self.seed * _POSITION_MIX + position) % (1 << 64))

    def draw_key(self, position: int) -> mx.array:
        """The key to sample output `position` with: position-keyed when seeded."""
        return self.key_at(position) if self.seeded else self.next_key()


_POSITION_MIX = 0x9E3779B97F4A7C15  # spreads seeds apart so (seed, position) pairs differ


def sample_token(
    params: SamplingParams, logprobs: mx.array, rng: RandomStream, position: int
) -> mx.array:
    """Choose the token at output `position` from normalised log-probabilities of
    shape (1, vocab)."""
    if params.greedy:
        return mx.argmax(logprobs, axis=-1)
    return mx.random.categorical(sampling_logits(params, logprobs), key=rng.draw_key(position))


def coupled_tokens(
    params: SamplingParams, logprobs: mx.array, rng: RandomStream, position: int
) -> mx.array:
    """For a seeded request: the token each of the n rows of `logprobs` (n, vocab)
    would get from a plain step at output positions position..position+n-1, drawn
    with the same per-position keys. Verifying drafts against these (accept while
    equal) commits exactly the tokens plain seeded sampling gives."""
    rows = [
        sample_token(params, logprobs[j : j + 1], rng, position + j)
        for j in range(logprobs.shape[0])
    ]
    return mx.concatenate(rows)
