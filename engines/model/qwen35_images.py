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
from mlx_lm.models.qwen3_next import Qwen3NextAttention

from engines.model.mrope import position_ids, row_positions_of


@dataclass(frozen=True)
class RowTurn:
    """One forward's 3-D position ids (3, B, L) and which of its rows have images
    (None: all of them)."""

    positions: mx.array
    image_rows: mx.array | None


class RowRope(nn.Module):
    """A Qwen3.5 attention layer's rotation: mlx-lm's RoPE at each row's index, or,
    for a forward with image rows (`turn`), mlx-vlm's interleaved 3-D rotation of
    those rows. `turn` is set and cleared around one attention call, on the engine
    thread (`ImageRowAttention`)."""

    def __init__(self, text: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.text = text  # mlx-lm's RoPE (no parameters)
        self.rotary = rotary  # mlx-vlm's Qwen3_5RotaryEmbedding (no parameters)
        self.turn: RowTurn | None = None

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        turn = self.turn
        if turn is None:
            return self.text(x, offset=offset)
        # mlx-vlm rotates queries and keys alike, element by element: one at a time
        # gives the same bits (the unused second output is never computed)
        rotated = self.rotary.apply_rotary(x, x, turn.positions, unsqueeze_dim=1)[0]
        if turn.image_rows is None:
            return rotated
        text = self.text(x, offset=offset)
        return mx.where(turn.image_rows[:, None, None, None], rotated, text)


class ImageRowAttention(Qwen3NextAttention):
    """mlx-lm's Qwen3.5 attention, its rotation told which rows have images."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        turn = image_turn(cache, x.shape[0], x.shape[1]) if cache is not None else None
        if turn is None:
            return super().__call__(x, mask, cache)
        self.rope.turn = turn
        try:
            return super().__call__(x, mask, cache)
        finally:
            self.rope.turn = None


def image_turn(cache: Any, batch: int, count: int) -> RowTurn | None:
    """The `RowTurn` of a forward writing `count` tokens after each row's cached ones,
    or None when no row has images."""
    _, rows = row_positions_of(cache)
    with_images = [p is not None for p in rows]
    if not any(with_images):
        return None
    image_rows = None if all(with_images) else mx.array(with_images)
    return RowTurn(position_ids(cache, batch, count), image_rows)


def qwen3_5_text(vlm: Any) -> tuple[nn.Module, list]:
    """Qwen3.5's (or its MoE's) language half as mlx-lm's model over mlx-vlm's weights,
    its attention layers rotating image rows as mlx-vlm does."""
    config = vlm.config
    module = importlib.import_module(f"mlx_lm.models.{config.model_type}")
    text = {**vars(config.text_config), "model_type": config.model_type}
    model = module.Model(
        module.ModelArgs.from_dict({"model_type": config.model_type, "text_config": text})
    )
    theirs = vlm.language_model.model.layers
    for layer, their_layer in zip(model.language_model.model.layers, theirs, strict=True):
        if layer.is_linear:
            continue
        attention = layer.self_attn
        attention.__class__ = ImageRowAttention
        attention.rope = RowRope(attention.rope, their_layer.self_attn.rotary_emb)
    weights = [
        (f"language_model.{name}", value)
        for name, value in tree_flatten(vlm.language_model.parameters())
    ]
    return model, weights
