"""The exact acceptance rule of speculative decoding (Leviathan et al. / Chen et al.).

Given target probabilities p over positions 0..k (position i scores the token after
draft i), draft probabilities q over positions 0..k-1 and the drafted tokens:

  * accept draft i with probability min(1, p_i(d_i) / q_i(d_i));
  * at the first rejection, sample from norm(max(0, p_i - q_i));
  * if all k are accepted, sample a bonus token from p_k.

The bonus case is the residual rule with q_k = 0, which is how it is computed here.
Every committed token is then distributed exactly as p, whatever q is. Greedy
decoding is the deterministic limit: accept while the draft equals the target argmax.

Functions are batched over a leading axis so the statistical tests can run 10^5
trials in one call; the engine calls them with a batch of one.
"""

from __future__ import annotations

import mlx.core as mx


def one_hot_probs(drafts: mx.array, vocab_size: int) -> mx.array:
    """Draft 'probabilities' of a deterministic drafter (prompt lookup): q(d) = 1."""
    return (drafts[..., None] == mx.arange(vocab_size)).astype(mx.float32)


def accept_greedy(target_tokens: list[int], drafts: list[int]) -> int:
    """Number of leading drafts equal to the target's argmax at their position."""
    accepted = 0
    for draft, target in zip(drafts, target_tokens, strict=False):
        if draft != target:
            break
        accepted += 1
    return accepted


def accept_sampled(
    p: mx.array, q: mx.array, drafts: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Apply the rejection rule.

    Args:
        p: (B, k+1, V) float32 target probabilities after all sampling transforms.
        q: (B, k, V) float32 draft probabilities after the same transforms.
        drafts: (B, k) drafted token ids (sampled from q).
        key: PRNG key; split internally for the uniforms and the final draw.

    Returns:
        (num_accepted (B,), next_token (B,)): accepted drafts are drafts[:, :n];
        next_token is the resampled (on rejection) or bonus (all accepted) token.
    """
    batch, k = drafts.shape
    accept_key, sample_key = mx.random.split(key)
    p_draft = mx.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_draft = mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    ratio = mx.where(q_draft > 0, p_draft / mx.maximum(q_draft, 1e-30), 0.0)
    uniforms = mx.random.uniform(shape=(batch, k), key=accept_key)
    accepted = (uniforms < mx.minimum(ratio, 1.0)).astype(mx.int32)
    num_accepted = mx.cumprod(accepted, axis=1).sum(axis=1) if k else mx.zeros((batch,), mx.int32)

    q_with_bonus = mx.concatenate([q, mx.zeros_like(p[:, :1])], axis=1)
    residual = mx.maximum(p - q_with_bonus, 0.0)
    index = num_accepted[:, None, None]
    row = mx.take_along_axis(residual, index, axis=1)[:, 0]
    fallback = mx.take_along_axis(p, index, axis=1)[:, 0]
    # p == q at the rejected position leaves no residual mass; rejection then has
    # probability zero, so any choice is exact. Fall back to p to stay well-defined.
    row = mx.where(row.sum(axis=-1, keepdims=True) > 0, row, fallback)
    next_token = mx.random.categorical(mx.log(row), key=sample_key)
    return num_accepted, next_token


def pad_vocab(probs: mx.array, vocab_size: int) -> mx.array:
    """Draft distributions over a smaller (unpadded) vocabulary get zero mass beyond it."""
    missing = vocab_size - probs.shape[-1]
    if missing <= 0:
        return probs[..., :vocab_size]
    return mx.concatenate([probs, mx.zeros((*probs.shape[:-1], missing), probs.dtype)], axis=-1)
