"""Plain batched steps queued one ahead, the way mlx-lm's generate loops pipeline.

While no row of a batch drafts, step n+1's forward is queued -- fed each row's token
of step n as a lazy array -- before step n's tokens are read, committed, detokenized
and published: that host work runs while the device computes the next step
(`mx.async_eval`), instead of the device waiting for it.

Invariant while a step is in flight: row i's cache holds exactly its committed tokens
(the newest was the in-flight forward's input), and `InFlight.tokens[i]` is row i's
next token, sampled (as a plain step samples it) but not yet committed.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engines.batched.drafting import BatchRow
from engines.cache.ragged_cache import RaggedKVCache
from engines.sample.sampling import sample_token


@dataclass
class InFlight:
    """A queued plain step: each row's next token and the log-probabilities it was
    drawn from (both lazy), and how many rows the forward ran over."""

    tokens: mx.array  # (B,)
    logprobs: mx.array  # (B, V)
    width: int

    def kept(self, rows: list[int]) -> InFlight:
        """The same step for `rows` only (the others left the batch)."""
        index = mx.array(rows, dtype=mx.int32)
        return InFlight(self.tokens[index], self.logprobs[index], self.width)


def queue_plain(
    model, cache: list[RaggedKVCache], rows: list[BatchRow], inputs: mx.array, ahead: int
) -> InFlight:
    """Queue one plain forward of `inputs` (B,): each row's newest token, which may
    itself still be in flight. Row i's next token is sampled for output position
    `len(generated) + ahead` (1 when its input is not committed yet); every row's
    cache advances by one position."""
    logits = model(inputs[:, None], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tokens = sample_rows(rows, logprobs, ahead)
    mx.async_eval(tokens, logprobs)
    return InFlight(tokens, logprobs, len(rows))


def sample_rows(rows: list[BatchRow], logprobs: mx.array, ahead: int) -> mx.array:
    """Each row's plain-step token from `logprobs` (B, V): one batched argmax for
    greedy rows, the row's own sampler and RNG for the others (a seeded row keyed by
    its output position, so it draws what a plain step there would)."""
    argmax = mx.argmax(logprobs, axis=-1)
    if all(row.seq.request.sampling.greedy for row in rows):
        return argmax
    picks = []
    for i, row in enumerate(rows):
        params = row.seq.request.sampling
        if params.greedy:
            picks.append(argmax[i : i + 1])
        else:
            position = len(row.seq.generated) + ahead
            picks.append(sample_token(params, logprobs[i : i + 1], row.seq.rng, position))
    return mx.concatenate(picks)


def pipelinable(rows: list[BatchRow]) -> bool:
    """Rows whose plain steps can be queued ahead: none has logits processors, which
    need the newest token's value (a grammar reads it) before the next forward."""
    return bool(rows) and not any(row.seq.processors for row in rows)
