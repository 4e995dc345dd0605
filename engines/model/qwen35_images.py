"""Qwen3.5 / Qwen3.6 reading images: mlx-lm's Qwen3.5 over mlx-vlm's weights.

The language half is the mlx-lm model Tandem serves for Qwen3.5 text -- its
gated-delta layers with the batch's ragged recurrent caches, speculation's rollback
and the MTP head -- built over the very arrays mlx-vlm loaded. Its layers compute
what mlx-vlm's compute, to the bit (measured on CPU, layer by layer), with one
exception that is not a difference of model: on a machine without Metal, mlx-vlm
prefills the recurrence with a chunked parallel scan (64-token blocks) whose rounding
depends on where its prefill chunks begin, where mlx-lm (and mlx-vlm on Metal) runs
it token by token; the tests take mlx-vlm's token-by-token recurrence as the reference.

Only the full-attention layers' rotation differs for a row with images: its tokens
are rotated at their 3-D positions (`engines.model.mrope`, read from the row's
cache) by mlx-vlm's own interleaved rotary embedding, as its `generate` rotates the
whole sequence. A row without images keeps mlx-lm's rotation at its index, so text
is served bit for bit as a text-only Qwen3.5 serves it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3_5 import Qwen3_5TextModel

from engines.model.mrope import ids_of_rows, row_positions_of


@dataclass(frozen=True)
class RowTurn:
    """One forward's 3-D position ids (3, B, L) and which of its rows have images
    (None: all of them)."""

    positions: mx.array
    image_rows: mx.array | None


@dataclass
class TurnHolder:
    """The forward's `RowTurn`, shared by the backbone (which sets it once around its
    layers) and every full-attention layer's `RowRope` (which reads it). None: no row
    has images. Owned by the engine thread, like the model."""

    turn: RowTurn | None = None


class RowRope(nn.Module):
    """A Qwen3.5 attention layer's rotation: mlx-lm's RoPE at each row's index, or,
    for a forward with image rows (`holder.turn`), mlx-vlm's interleaved 3-D rotation
    of those rows."""

    def __init__(self, text: nn.Module, rotary: nn.Module, holder: TurnHolder) -> None:
        super().__init__()
        self.text = text  # mlx-lm's RoPE (no parameters)
        self.rotary = rotary  # mlx-vlm's Qwen3_5RotaryEmbedding (no parameters)
        self.holder = holder

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        turn = self.holder.turn
        if turn is None:
            return self.text(x, offset=offset)
        # mlx-vlm rotates queries and keys alike, element by element: one at a time
        # gives the same bits (the unused second output is never computed)
        rotated = self.rotary.apply_rotary(x, x, turn.positions, unsqueeze_dim=1)[0]
        if turn.image_rows is None:
            return rotated
        text = self.text(x, offset=offset)
        return mx.where(turn.image_rows[:, None, None, None], rotated, text)


class ImageRowBackbone(Qwen3_5TextModel):
    """mlx-lm's Qwen3.5 backbone that reads its rows' 3-D positions once a forward,
    from its first full-attention layer's cache, for every `RowRope` (as mlx-vlm's
    backbone makes its position ids once). `holder` is set at load."""

    holder: TurnHolder

    def __call__(
        self,
        inputs: mx.array,
        cache: Any = None,
        input_embeddings: mx.array | None = None,
    ) -> mx.array:
        tokens = input_embeddings if input_embeddings is not None else inputs
        if cache is not None and self.fa_idx is not None:
            self.holder.turn = image_turn(cache[self.fa_idx], *tokens.shape[:2])
        try:
            return super().__call__(inputs, cache, input_embeddings=input_embeddings)
        finally:
            self.holder.turn = None


def image_turn(cache: Any, batch: int, count: int) -> RowTurn | None:
    """The `RowTurn` of a forward writing `count` tokens after each row's cached ones,
    or None when no row has images."""
    starts, rows = row_positions_of(cache)
    with_images = [p is not None for p in rows]
    if not any(with_images):
        return None
    image_rows = None if all(with_images) else mx.array(with_images)
    return RowTurn(ids_of_rows(starts, rows, batch, count), image_rows)


def qwen3_5_text(vlm: Any) -> tuple[nn.Module, list]:
    """Qwen3.5's (or its MoE's) language half as mlx-lm's model over mlx-vlm's weights,
    its attention layers rotating image rows as mlx-vlm does."""
    config = vlm.config
    module = importlib.import_module(f"mlx_lm.models.{config.model_type}")
    text = {**vars(config.text_config), "model_type": config.model_type}
    model = module.Model(
        module.ModelArgs.from_dict({"model_type": config.model_type, "text_config": text})
    )
    backbone, holder = model.language_model.model, TurnHolder()
    backbone.__class__, backbone.holder = ImageRowBackbone, holder
    theirs = vlm.language_model.model.layers
    for layer, their_layer in zip(backbone.layers, theirs, strict=True):
        if not layer.is_linear:
            rope = layer.self_attn.rope
            layer.self_attn.rope = RowRope(rope, their_layer.self_attn.rotary_emb, holder)
    weights = [
        (f"language_model.{name}", value)
        for name, value in tree_flatten(vlm.language_model.parameters())
    ]
    return model, weights
