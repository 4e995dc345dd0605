"""What one sequence's verify scores mean: its processed log-probabilities and, for a
sampled request, the exact accept decision.

Both engines verify with these (the single-stream engine for its one sequence, the
batched engine per row), so a draft is judged by one routine whichever engine runs it.
"""

from __future__ import annotations

import mlx.core as mx

from engines.request import SamplingParams
from engines.sample.acceptance import accept_sampled, one_hot_probs, pad_vocab
from engines.sample.sampling import RandomStream, filter_logprobs


def processed_logits(
    logits: mx.array, history: mx.array, fed: list[int], processors: list
) -> mx.array:
    """`logits` (positions, V) after the request's processors (penalties, bias, grammar),
    position j seeing exactly the history a plain step would have seen there: `history`
    (the tokens before `fed`) then `fed[: j + 1]`. Positions past `fed` (a batch's
    padding) are left as they are."""
    if not processors:
        return logits
    positions = []
    for j in range(logits.shape[0]):
        position = logits[j : j + 1]
        if j < len(fed):
            context = mx.concat([history, mx.array(fed[: j + 1], dtype=history.dtype)])
            for processor in processors:
                position = processor(context, position)
        positions.append(position)
    return mx.concatenate(positions, axis=0)


def accept_sampled_draft(
    params: SamplingParams,
    rng: RandomStream,
    logprobs: mx.array,
    drafts: list[int],
    probs: mx.array | None,
) -> tuple[mx.array, mx.array]:
    """Leviathan's rule for one sampled sequence: (accepted drafts, next token), lazy.
    `probs` is the drafter's q for its drafts (None: a deterministic drafter, q = 1)."""
    scaled = filter_logprobs(params, logprobs.astype(mx.float32)) * (1.0 / params.temperature)
    p = mx.softmax(scaled, axis=-1)
    tokens = mx.array(drafts)
    q = one_hot_probs(tokens, p.shape[-1]) if probs is None else pad_vocab(probs, p.shape[-1])
    accepted, token = accept_sampled(p[None], q[None], tokens[None], key=rng.next_key())
    return accepted[0], token[0]
