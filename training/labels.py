"""The target labels its own training data: one forward per batch of chunks gives the
features the drafter reads (the inputs of its aux layers, tapped as serving taps them)
and the target's distribution at every position, the drafter's soft target.

Nothing is kept between batches: a batch's features and labels are made, trained on
and dropped, so memory is one batch's, whatever the corpus' size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engines.model.taps import INPUT, OUTPUT, LayerTaps, decoder_layers


def aux_layer_ids(layers: int) -> tuple[int, ...]:
    """EAGLE-3's taps: the inputs of layers (2, L//2, L-3) (low, middle, high); a
    target of fewer than 8 layers gets distinct ones spread over it instead."""
    if layers >= 8:
        return (2, layers // 2, layers - 3)
    return tuple(sorted({min(1, layers - 1), layers // 2, layers - 1}))


def tap_points(ids: tuple[int, ...], layers: int) -> tuple[tuple[int, str], ...]:
    """Aux id k is the input of target layer k; k = L the last layer's output (as the
    serving loader reads them)."""
    return tuple((k, INPUT) if k < layers else (layers - 1, OUTPUT) for k in ids)


@dataclass
class Batch:
    """Pairs (features[:, t], tokens[:, t]) = (g_t, x_{t+1}) and what follows them:
    the target's distribution over the draft vocabulary for x_{t+2} (`labels`), its top
    token (`target_top`, target ids) and which positions count (`mask`: a label exists
    and the target's top token is in the draft vocabulary, as SpecForge masks)."""

    features: mx.array
    tokens: mx.array
    labels: mx.array
    target_top: mx.array
    mask: mx.array


class Teacher:
    """The target model with taps at the drafter's aux layers."""

    def __init__(self, model: Any, aux_ids: tuple[int, ...], draft_ids: list[int]) -> None:
        self.model = model
        layers = len(decoder_layers(model))
        self.taps = LayerTaps(model, tap_points(aux_ids, layers))
        self.draft_ids = mx.array(draft_ids, dtype=mx.int32)
        vocab = int(self.taps.parts.embed_tokens.weight.shape[0])
        in_draft = np.zeros(max(vocab, max(draft_ids) + 1), dtype=bool)
        in_draft[draft_ids] = True
        self.in_draft = mx.array(in_draft)

    def label(self, chunks: np.ndarray) -> Batch:
        """One batch (B, N) of chunks to its training pairs (B, N-2 positions: the last
        two tokens have no x_{t+2} in the chunk)."""
        tokens = mx.array(chunks, dtype=mx.int32)
        logits, features = self.taps.forward(tokens, cache=None)
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        # the distribution for x_{t+2} is the target's output at t+1
        following = logprobs[:, 1:-1]
        top = mx.argmax(following, axis=-1)
        draft = mx.exp(mx.take(following, self.draft_ids, axis=-1))
        mass = draft.sum(axis=-1, keepdims=True)
        labels = draft / mx.maximum(mass, 1e-20)
        mask = self.in_draft[top].astype(mx.float32)
        batch = Batch(features[:, :-2], tokens[:, 1:-1], labels, top, mask)
        mx.eval(batch.features, batch.labels, batch.target_top, batch.mask, batch.tokens)
        return batch
