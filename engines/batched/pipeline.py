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
    drawn from (both lazy), how many rows the forward ran over, and whether the step
    after it is planned plain too (planned from the tokens committed before it)."""

    tokens: mx.array  # (B,)
    logprobs: mx.array  # (B, V)
    width: int
    plain_after: bool = False

    def kept(self, rows: list[int]) -> InFlight:
        """The same step for `rows` only (the others left the batch)."""
        index = mx.array(rows, dtype=mx.int32)
        return InFlight(self.tokens[index], self.logprobs[index], self.width, self.plain_after)


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


MAX_HOST_GAP = 0.5  # seconds between steps beyond which the caller idled, not worked


@dataclass
class Cadence:
    """The batch's step timing: the host time between two steps (what the caller did
    in between, publishing the last step's outputs: a pipelined plain step overlaps it
    with its forward, a drafting step waits for it), and the time between two calls
    that each queued a plain step (what a plain step costs as served)."""

    pipelined_at: float | None = None  # when the last call that queued a step ended
    returned_at: float | None = None  # when the last step with rows returned
    host_seconds: float = 0.0  # the caller's time between that return and this step

    def begin_step(self, now: float) -> None:
        returned, self.returned_at = self.returned_at, None
        gap = now - returned if returned is not None else 0.0
        self.host_seconds = gap if gap < MAX_HOST_GAP else 0.0  # longer: the caller idled

    def plain_step(self, now: float, queued: bool) -> float | None:
        """A plain step as served in the pipeline costs the time between two commits
        (the host's work overlaps the forward): what a drafting step must beat. Only
        steady calls count, each of which queued a step: where `async_eval` runs most
        of a forward before returning (MLX on a CPU), the call that starts a pipeline
        pays for two steps and the one that ends it for almost none. Returns that
        time, None when this call is no steady one."""
        seconds = now - self.pipelined_at if self.pipelined_at is not None and queued else None
        self.pipelined_at = now if queued else None
        return seconds
