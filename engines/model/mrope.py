"""Qwen-VL's language half: 3-D rotary positions (M-RoPE) that travel with each row.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL rotate every token by a (time, height, width) position. A
text token's three are equal; an image token's are its place on the image's merged
grid; and text after an image goes on from the image's largest position plus one, so
its position trails its index in the sequence by a fixed `shift`. The positions of a
row's tokens are therefore a property of the prompt, fixed when it is rendered
(`RowPositions`, made by `prompt_positions` from the images' grids), and a row's KV
cache carries them (`RaggedKVCache.positions`, a single-sequence cache's
`rope_positions`) through every path that moves a row -- the batch's joins and
leaves, migration, prefill followers -- from where a sequence gets its first cache
(`attach`, called by `starting_state`). A row without images is at its index, as in
any text model.

The layers, norm and head are mlx-vlm's own (no copy, nothing re-implemented): the
forward here only gives them each row's position ids, as mlx-vlm's `generate` does,
so greedy output is the same to the bit. Qwen3-VL also adds the tower's features to
its first layers' outputs at the image tokens (deepstack): a chunk with images then
carries them beside its embeddings (`VisionParts.embed_text`'s shape).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass(frozen=True)
class RowPositions:
    """The 3-D positions of a prompt with images: `table` (3, n) for its first n
    tokens (through its last image), then index + `shift` for every later token."""

    table: np.ndarray
    shift: int

    def at(self, start: int, count: int) -> np.ndarray:
        """(3, count) positions of the tokens at indices [start, start + count)."""
        index = np.arange(start, start + count)
        out = np.broadcast_to(index + self.shift, (3, count)).copy()
        inside = index < self.table.shape[1]
        out[:, inside] = self.table[:, index[inside]]
        return out


def prompt_positions(images: Sequence) -> RowPositions | None:
    """A prompt's positions from its images (`PromptImage`s whose spans carry their
    position `grid`), as mlx-vlm's `get_rope_index` computes them: text advances by
    one, an image's tokens sit at (t, h, w) on its merged grid after the text before
    it, and the text after it starts past the image's largest position. None when the
    model places image tokens at their indices (no grids)."""
    if not images or images[0].span.grid is None:
        return None
    parts, cursor, position = [], 0, 0
    for image in images:
        text = image.start - cursor
        parts.append(np.broadcast_to(np.arange(text) + position, (3, text)))
        position += text
        axes = [np.arange(n) for n in image.span.grid]
        grid = np.stack(np.meshgrid(*axes, indexing="ij")).reshape(3, -1) + position
        if grid.shape[1] != image.end - image.start:
            raise ValueError("an image's tokens do not fill its grid")
        parts.append(grid)
        position = int(grid.max()) + 1
        cursor = image.end
    table = np.concatenate(parts, axis=1).astype(np.int32)
    return RowPositions(table, position - cursor)


def attach(layers: list, row: int, positions: RowPositions | None) -> None:
    """Give row `row` of a sequence's (or the batch's) per-layer caches its prompt's
    positions, replacing any a cached prefix's entry brought from another prompt."""
    if positions is None:
        return
    for layer in layers:
        if hasattr(layer, "positions"):  # a RaggedKVCache: one entry per row
            layer.positions[row] = positions
        elif hasattr(layer, "offset"):
            layer.rope_positions = positions


def row_positions_of(cache: Any) -> tuple[list[int], list[RowPositions | None]]:
    """Each row's next index and its positions, read from one layer's cache."""
    if hasattr(cache, "positions"):
        return list(cache.lengths), list(cache.positions)
    offset = cache.offset
    starts = offset.tolist() if isinstance(offset, mx.array) else [int(offset)]
    return starts, [getattr(cache, "rope_positions", None)] * len(starts)


def position_ids(cache: Any, batch: int, count: int) -> mx.array:
    """(3, B, count) position ids of the tokens a forward writes after each row's
    cached ones."""
    if cache is None:
        return mx.broadcast_to(mx.arange(count)[None, None], (3, batch, count))
    starts, positions = row_positions_of(cache)
    return ids_of_rows(starts, positions, batch, count)


def ids_of_rows(
    starts: list[int], positions: list[RowPositions | None], batch: int, count: int
) -> mx.array:
    """`position_ids` from the rows `row_positions_of` read."""
    if all(p is None for p in positions):
        rows = mx.array(starts)[:, None] + mx.arange(count)[None]
        return mx.broadcast_to(rows[None], (3, batch, count))
    rows = [
        np.broadcast_to(np.arange(start, start + count), (3, count))
        if p is None
        else p.at(start, count)
        for start, p in zip(starts, positions, strict=True)
    ]
    return mx.array(np.stack(rows, axis=1).astype(np.int32))


@dataclass(frozen=True)
class Rotation:
    """One forward's position ids (3, B, L), and mlx-vlm's cos/sin of them where its
    fused kernel does not apply: made once per forward, as mlx-vlm's backbone makes
    them, and handed to every layer."""

    positions: mx.array
    cos_sin: tuple[mx.array, mx.array] | None


def rotation(rotary: Any, cache: Any, hidden: mx.array) -> Rotation:
    """The `Rotation` of a forward over `hidden` (B, L, D) after each row's cached
    tokens (`rotary`: the first layer's `rotary_emb`)."""
    positions = position_ids(cache, hidden.shape[0], hidden.shape[1])
    return Rotation(positions, None if rotary.fused_apply else rotary(hidden, positions))


def rotate(attention: Any, q: mx.array, k: mx.array, turn: Rotation) -> tuple:
    """q and k (B, heads, L, dim) rotated as mlx-vlm's Qwen-VL attention rotates them
    given `turn`: for a forward that runs the blocks' parts itself (`packed_forward`)."""
    if turn.cos_sin is None:
        return attention.rotary_emb.apply_rotary(q, k, turn.positions, unsqueeze_dim=1)
    language = sys.modules[type(attention).__module__]
    return language.apply_multimodal_rotary_pos_emb(q, k, *turn.cos_sin, unqueeze_dim=1)


def is_mrope_block(layer: Any) -> bool:
    """A decoder block of mlx-vlm's Qwen-VL language half (what `rotate` serves)."""
    return type(layer).__name__ == "Qwen2VLDecoderLayer" and hasattr(layer.self_attn, "rotary_emb")


class MRopeBackbone(nn.Module):
    """mlx-vlm's Qwen2 backbone called as mlx-lm's (`inputs, cache, input_embeddings`),
    each row's position ids read from its cache."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = backbone.embed_tokens
        self.layers = backbone.layers
        self.norm = backbone.norm

    def __call__(
        self, inputs: mx.array, cache: list | None = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        from mlx_vlm.models.base import create_attention_mask

        deepstack = ()
        if input_embeddings is None:
            h = self.embed_tokens(inputs)
        elif input_embeddings.ndim == 4:  # Qwen3-VL: (1 + D, B, T, hidden)
            h, deepstack = input_embeddings[0], input_embeddings[1:]
        else:
            h = input_embeddings
        cache = cache if cache is not None else [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        turn = rotation(self.layers[0].self_attn.rotary_emb, cache[0], h)
        for index, (layer, layer_cache) in enumerate(zip(self.layers, cache, strict=True)):
            h = layer(h, mask, layer_cache, turn.positions, turn.cos_sin)
            if index < len(deepstack):  # what mlx-vlm adds at the image tokens' rows
                h = h + deepstack[index]
        return h if self.norm is None else self.norm(h)


class MRopeModel(nn.Module):
    """Qwen2-VL's, Qwen2.5-VL's or Qwen3-VL's language half with mlx-lm's model
    interface."""

    def __init__(self, language_model: nn.Module) -> None:
        super().__init__()
        self.args = language_model.args
        self.model_type = language_model.model_type
        self.model = MRopeBackbone(language_model.model)
        if not self.args.tie_word_embeddings:
            self.lm_head = language_model.lm_head

    def __call__(
        self, inputs: mx.array, cache: list | None = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        out = self.model(inputs, cache, input_embeddings)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

    @property
    def layers(self) -> list:
        return self.model.layers


def qwen_vl_text(vlm: Any) -> tuple[nn.Module, list]:
    """The language half of mlx-vlm's Qwen2-VL / Qwen2.5-VL / Qwen3-VL, sharing its modules (and
    so its weights); no weights to load."""
    return MRopeModel(vlm.language_model), []
