"""Gemma-4's language half reading images: mlx-lm's Gemma-4 over mlx-vlm's weights.

mlx-lm's `gemma4_text` computes what mlx-vlm's Gemma-4 language model computes, to
the bit (measured on text), so the engines run it as any text model. A forward of a
prompt chunk that reaches an image differs from mlx-lm's in three ways, each as
mlx-vlm's Gemma-4 does it (`Gemma4ImageText`):

- its embeddings arrive as mlx-vlm makes them (text rows already scaled, image rows
  the tower's features), so they are not scaled again;
- the per-layer inputs read the ids with each image token replaced by 0;
- an image's tokens attend to each other both ways (the released checkpoints'
  `use_bidirectional_attention: "vision"`), so the causal masks gain each image's
  block. That needs every image inside one forward: the engines never end a
  prompt chunk inside one (`engines.prompt_images.whole_images`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text


class ChunkBlocks:
    """The image blocks of the forward under way (`image_blocks`), or None: set and
    cleared around one forward, on the engine thread."""

    blocks: mx.array | None = None


class Gemma4ImageText(gemma4_text.Gemma4TextModel):
    """mlx-lm's Gemma-4 backbone that also takes mlx-vlm's image-chunk embeddings.
    `image_token_id`, `bidirectional` and `chunk` are set once at load."""

    image_token_id: int = -1
    bidirectional: bool = False
    chunk: ChunkBlocks

    def __call__(
        self,
        inputs: mx.array = None,
        cache=None,
        input_embeddings: mx.array | None = None,
        per_layer_inputs: mx.array | None = None,
    ):
        if input_embeddings is None:
            return super().__call__(inputs, cache, None, per_layer_inputs)
        images = inputs == self.image_token_id
        scale, self.embed_scale = self.embed_scale, 1.0  # mlx-vlm's are scaled already
        self.chunk.blocks = image_blocks(images) if self.bidirectional else None
        try:
            text_ids = mx.where(images, 0, inputs)  # what the per-layer inputs read
            return super().__call__(text_ids, cache, input_embeddings, per_layer_inputs)
        finally:
            self.embed_scale, self.chunk.blocks = scale, None

    def _make_masks(self, h, cache):
        masks = super()._make_masks(h, cache)
        blocks = self.chunk.blocks
        if blocks is None:
            return masks
        widened: dict[str, mx.array] = {}  # one mask per layer type, as mlx-lm shares them
        for layer, c, mask in zip(self.layers, cache, masks, strict=True):
            if layer.layer_type not in widened:
                window = self.window_size if layer.layer_type == "sliding_attention" else None
                widened[layer.layer_type] = with_blocks(c, mask, blocks, window)
        return [widened[layer.layer_type] for layer in self.layers]


def image_blocks(images: mx.array) -> mx.array:
    """(B, N): each token's image block in its row (a run of image tokens), -1 for
    text: as mlx-vlm numbers them."""
    previous = mx.concatenate([mx.zeros_like(images[:, :1]), images[:, :-1]], axis=1)
    starts = images & ~previous
    blocks = mx.cumsum(starts.astype(mx.int32), axis=1) - 1
    return mx.where(images, blocks, -1)


def with_blocks(cache: Any, mask: Any, blocks: mx.array, window: int | None) -> mx.array:
    """A layer's causal mask with each image block's tokens also seeing each other
    (B, 1, N, K): the forward's N tokens sit at columns `first .. first + N` of row
    b's keys, after what the row holds (the first layer of its type's cache)."""
    count = blocks.shape[1]
    if not isinstance(mask, mx.array):  # "causal" or None: the array it stands for
        mask = cache.make_mask(count, return_array=True, window_size=window)
    first = mx.array(cache.columns if hasattr(cache, "columns") else [cache.offset])
    batch, width = blocks.shape[0], mask.shape[-1]
    column = mx.arange(width)[None] - first[:, None]  # (B, K): index in this forward
    inside = (column >= 0) & (column < count)
    key_blocks = mx.take_along_axis(blocks, mx.clip(column, 0, count - 1), axis=1)
    key_blocks = mx.where(inside, key_blocks, -2)
    same = (blocks[:, :, None] == key_blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    mask = mx.broadcast_to(mask, (batch, 1, count, width)) if mask.ndim < 4 else mask
    return mask | same[:, None]


def gemma4_text_model(vlm: Any) -> tuple[nn.Module, list]:
    """Gemma-4's language half as mlx-lm's Gemma-4 (whose backbone takes image chunks)
    over mlx-vlm's weights."""
    text = vars(vlm.config.text_config)
    args = gemma4_text.ModelArgs.from_dict({**text, "model_type": "gemma4_text"})
    model = gemma4_text.Model(args)
    model.model.__class__ = Gemma4ImageText
    model.model.image_token_id = int(vlm.config.image_token_id)
    model.model.bidirectional = text.get("use_bidirectional_attention") == "vision"
    model.model.chunk = ChunkBlocks()
    return model, list(tree_flatten(vlm.language_model.parameters()))
