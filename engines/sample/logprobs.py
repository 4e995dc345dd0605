"""Log-probabilities of generated tokens, for the `logprobs` API options.

Reported from the distribution the token was verified against: the target's
logits after penalties and logit bias, before temperature and top-p/k/min-p (vLLM's
default "raw" mode). In a speculative verify, row j scores exactly the position the
j-th committed token was drawn at, so accepted draft tokens get the same numbers a
plain step would have produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # most likely first


# What OpenAI reports for a token with no probability at all; JSON has no -Infinity.
FLOOR = -9999.0


def token_logprob(row: mx.array, token: int, top: int) -> TokenLogprob:
    """`row`: normalised log-probabilities over the vocabulary, shape (V,)."""
    return token_logprobs(row[None], [token], top)[0]


def token_logprobs(rows: mx.array, tokens: list[int], top: int) -> list[TokenLogprob]:
    """`rows`: normalised log-probabilities, shape (n, V); row i scores tokens[i]. One
    evaluation for all rows, each with its `top` most likely alternatives."""
    rows = mx.nan_to_num(rows.astype(mx.float32), nan=FLOOR, neginf=FLOOR, posinf=0.0)
    rows = mx.maximum(rows, FLOOR)
    chosen = mx.take_along_axis(rows, mx.array(tokens)[:, None], axis=-1)[:, 0]
    if top <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen.tolist(), strict=True)]
    ids = mx.argpartition(-rows, kth=top - 1, axis=-1)[:, :top]
    values = mx.take_along_axis(rows, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1)
    values = mx.take_along_axis(values, order, axis=-1)
    return [
        TokenLogprob(t, lp, list(zip(i, v, strict=True)))
        for t, lp, i, v in zip(tokens, chosen.tolist(), ids.tolist(), values.tolist(), strict=True)
    ]
