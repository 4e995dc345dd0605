"""EAGLE-3's training-time test: the drafter trained on the chains it will draft.

Served (`engines/drafting/feature_drafters.py`), the drafter's entry at position i is
the pair (fused target features g_i, token x_{i+1}) and its output there predicts
x_{i+2}; a chain then feeds its own output back: the entry at i+1 is (its output at i,
the drafted token), attending over the true entries up to i and the chain's own. Trained
on true entries only, a drafter never sees its own outputs as input and its second and
later drafts are weak (EAGLE-3's paper, section 3). So each batch is unrolled `depth`
steps over whole sequences at once: step j's input at position t is step j-1's output
at t-1 (step 0's: the target's features at t), and its query at t attends to step 0's
keys at positions <= t-j and to step m's key at t-j+m for each 1 <= m <= j -- exactly
what the served chain's j-th draft attends to. Every step predicts x_{t+2} at t and
learns the target's own distribution there (self-distillation), step j weighted
`STEP_WEIGHT ** j`.

The modules are the served drafter's own (`Eagle3DraftModel`): its embedding (the
target's), `fc`, decoder layer, norm and reduced-vocabulary head, so what is trained is
what `tandem serve --draft-model` loads.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engines.drafting.eagle3_model import Eagle3DraftModel

STEP_WEIGHT = 0.8  # EAGLE-3 / SpecForge: later chain steps count less


def _heads(x: mx.array, heads: int) -> mx.array:
    batch, n, _ = x.shape
    return x.reshape(batch, n, heads, -1).transpose(0, 2, 1, 3)


def _shift(x: mx.array, by: int, axis: int) -> mx.array:
    """`x` moved `by` positions later along `axis`, zeros in front (position t holds
    what was at t - by)."""
    if by == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (by, 0)
    keep = [slice(None)] * x.ndim
    keep[axis] = slice(0, x.shape[axis])
    return mx.pad(x, pad)[tuple(keep)]


def unrolled_outputs(
    model: Eagle3DraftModel, features: mx.array, tokens: mx.array, depth: int
) -> list[mx.array]:
    """Each step's layer output (B, T, hidden) before the final norm, over pairs
    (features[:, t], tokens[:, t]) = (g_t, x_{t+1}); see the module."""
    layer = model.layers[0]
    attn = layer.self_attn
    batch, length, _ = features.shape
    heads, kv_heads = attn.heads, attn.kv_heads
    repeat = heads // kv_heads
    embeds = layer.input_layernorm(model.embed(tokens).astype(features.dtype))
    positions = mx.arange(length)
    hidden = model.fuse(features)
    keys: list[mx.array] = []
    values: list[mx.array] = []
    outputs = []
    for step in range(depth):
        normed = layer.hidden_norm(hidden)
        x = mx.concatenate([embeds, normed], axis=-1)
        q = attn.rope(_heads(attn.q_proj(x), heads)) * attn.scale
        k = attn.rope(_heads(attn.k_proj(x), kv_heads))
        v = _heads(attn.v_proj(x), kv_heads)
        if repeat > 1:
            k, v = mx.repeat(k, repeat, axis=1), mx.repeat(v, repeat, axis=1)
        keys.append(k)
        values.append(v)
        # step 0's keys: position s <= t - step (query t, key s)
        allowed = positions[None, :] <= positions[:, None] - step
        scores = [mx.where(allowed, q @ keys[0].swapaxes(-1, -2), -mx.inf)]
        # the chain's own keys: step m's at t - step + m (one key each; zeros before the
        # sequence, so every row has a finite score and t < step rows, left out of the
        # loss, still softmax to numbers)
        for m in range(1, step + 1):
            own = _shift(keys[m], step - m, axis=2)
            scores.append((q * own).sum(axis=-1, keepdims=True))
        weights = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1, precise=True)
        out = weights[..., :length] @ values[0]
        for m in range(1, step + 1):
            own = _shift(values[m], step - m, axis=2)
            out = out + weights[..., length + m - 1 : length + m] * own
        out = attn.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))
        residual = normed if layer.norm_before_residual else hidden
        h = residual + out
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        outputs.append(h)
        hidden = _shift(h, 1, axis=1)  # the next step's input at t: this step's at t-1
    return outputs


def ttt_loss(
    model: Eagle3DraftModel,
    features: mx.array,
    tokens: mx.array,
    labels: mx.array,
    mask: mx.array,
    depth: int,
) -> mx.array:
    """The weighted soft cross-entropy of every step against the target's distribution
    over the draft vocabulary (`labels`, (B, T, draft_vocab), rows summing to 1);
    `mask` (B, T) marks positions with a label. Step j leaves out t < j (no true entry
    before its chain)."""
    total = mx.array(0.0)
    norm = 0.0
    positions = mx.arange(features.shape[1])[None, :]
    for step, h in enumerate(unrolled_outputs(model, features, tokens, depth)):
        logprobs = nn.log_softmax(model.lm_head(model.norm(h)).astype(mx.float32), axis=-1)
        valid = mask * (positions >= step)
        per_position = -(labels * logprobs).sum(axis=-1)
        step_loss = (per_position * valid).sum() / mx.maximum(valid.sum(), 1)
        total = total + (STEP_WEIGHT**step) * step_loss
        norm += STEP_WEIGHT**step
    return total / norm


def step_agreement(
    model: Eagle3DraftModel,
    features: mx.array,
    tokens: mx.array,
    target_top: mx.array,
    mask: mx.array,
    depth: int,
) -> list[float]:
    """Per chain step, the share of positions where the drafter's top token (mapped to
    the target's ids) is the target's own top token (`target_top`, (B, T) target ids):
    an estimate of greedy acceptance at each draft position, on teacher-forced text."""
    rates = []
    positions = mx.arange(features.shape[1])[None, :]
    for step, h in enumerate(unrolled_outputs(model, features, tokens, depth)):
        top = model.target_ids(mx.argmax(model.lm_head(model.norm(h)), axis=-1))
        valid = mask * (positions >= step)
        hits = ((top == target_top) * valid).sum() / mx.maximum(valid.sum(), 1)
        rates.append(float(hits.item()))
    return rates


def expected_accepted(rates: list[float]) -> float:
    """Mean accepted draft tokens per verify implied by per-step rates, each step's
    taken as conditional on the ones before (a chain stops at its first miss)."""
    total, reach = 0.0, 1.0
    for rate in rates:
        reach *= rate
        total += reach
    return total
