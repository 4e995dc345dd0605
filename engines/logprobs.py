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
    row = mx.nan_to_num(row.astype(mx.float32), nan=FLOOR, neginf=FLOOR, posinf=0.0)
    row = mx.maximum(row, FLOOR)
    if top > 0:
        top_ids = mx.argpartition(-row, kth=top - 1)[:top]
        top_values = row[top_ids]
        order = mx.argsort(-top_values)
        ranked = list(zip(top_ids[order].tolist(), top_values[order].tolist(), strict=True))
    else:
        ranked = []
    return TokenLogprob(token, float(row[token].item()), ranked)
