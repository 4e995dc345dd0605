"""One target forward over two batches at once: the decoding rows and a prefill chunk.

Where a forward costs mostly a pass over the weights (every decode step, on any
machine), a prompt chunk and the running rows' next tokens can share that pass: the
rows' projections and MLP run as one matrix product over all their tokens, with no
padding between the batches, while attention runs per batch with its own cache, RoPE
offsets and mask (vLLM's chunked prefill mixes decode and prefill tokens the same way).
So a prompt prefills in chunks small enough that a decoding row's next token never
waits long, and the rows' tokens cost little beside the chunk.

Supported: decoder blocks of the llama and qwen2 shape (pre-norm attention and MLP,
RoPE at the cache's offset, or Qwen-VL's 3-D positions read from the cache rows:
`engines.model.mrope`), full attention only, one process; `supports_packing` says so.
Anything else prefills in chunks alternating with decode steps.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import llama, qwen2
from mlx_lm.models.base import create_attention_mask

from engines.cache.ragged_cache import RaggedKVCache, feed_rows
from engines.model.mrope import MRopeModel, is_mrope_block, rotate, rotation
from engines.platform.cpu_attention import attention_of

_BLOCKS = (llama.TransformerBlock, qwen2.TransformerBlock)


def supports_packing(model: Any) -> bool:
    """Whether `packed_logits` computes exactly what `model(inputs, cache)` would."""
    model = getattr(model, "_model", model)  # a GuardedModel's model
    inner = getattr(model, "model", None)
    if type(model) not in (llama.Model, qwen2.Model, MRopeModel) or inner is None:
        return False
    if getattr(inner, "pipeline_size", 1) != 1:
        return False
    layers = getattr(inner, "layers", [])
    return bool(layers) and all(
        (type(layer) in _BLOCKS or is_mrope_block(layer))
        and not getattr(layer, "use_sliding", False)
        for layer in layers
    )


def packed_logits(model: Any, parts: list[tuple[mx.array, list]]) -> list[mx.array]:
    """`[model(inputs, cache=cache) for inputs, cache in parts]`, in one pass over the
    weights. Each part is a batch (B, L) of token ids with its own per-layer caches."""
    if hasattr(model, "guard"):  # the engine's ownership check, once per forward
        model.guard(mx.zeros((sum(inputs.size for inputs, _ in parts),)))
        model = model._model
    inner = model.model
    hidden = [inner.embed_tokens(inputs) for inputs, _ in parts]
    masks = [create_attention_mask(h, c[0]) for h, (_, c) in zip(hidden, parts, strict=True)]
    shapes = [h.shape for h in hidden]
    turns = [None] * len(parts)
    if isinstance(model, MRopeModel):  # each part's rows' 3-D positions, once a forward
        rotary = inner.layers[0].self_attn.rotary_emb
        turns = [rotation(rotary, c[0], h) for h, (_, c) in zip(hidden, parts, strict=True)]
    flat = mx.concatenate([h.reshape(-1, h.shape[-1]) for h in hidden])
    for index, layer in enumerate(inner.layers):
        caches = [cache[index] for _, cache in parts]
        flat = _block(layer, flat, shapes, masks, caches, turns)
    head = inner.embed_tokens.as_linear if model.args.tie_word_embeddings else model.lm_head
    logits, start = [], 0
    for batch, length, _ in shapes:
        # each part's own head: logits nobody reads (a prompt chunk's) are never
        # computed, where one product over all tokens would cost a vocabulary-wide
        # matmul per prompt token (a quarter of a 0.5B model's work)
        part = inner.norm(flat[start : start + batch * length])
        logits.append(head(part).reshape(batch, length, -1))
        start += batch * length
    return logits


def _block(
    layer: Any, flat: mx.array, shapes: list, masks: list, caches: list, turns: list
) -> mx.array:
    """One transformer block over every part's tokens (`TransformerBlock.__call__`);
    `turns`: each part's `mrope.Rotation`, or None for RoPE at the cache's offset."""
    attention = layer.self_attn
    attend = attention_of(attention)  # what the architecture calls (head-parallel on a CPU)
    normed = layer.input_layernorm(flat)
    queries, keys, values = (
        attention.q_proj(normed),
        attention.k_proj(normed),
        attention.v_proj(normed),
    )
    outputs, start = [], 0
    for (batch, length, _), mask, cache, turn in zip(shapes, masks, caches, turns, strict=True):
        end = start + batch * length
        q, k, v = (
            _heads(x[start:end], batch, length, count)
            for x, count in (
                (queries, attention.n_heads),
                (keys, attention.n_kv_heads),
                (values, attention.n_kv_heads),
            )
        )
        if turn is not None:  # Qwen-VL's: each row's 3-D positions
            q, k = rotate(attention, q, k, turn)
        else:
            q = attention.rope(q, offset=cache.offset)
            k = attention.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = attend(q, k, v, cache=cache, scale=attention.scale, mask=mask)
        outputs.append(out.transpose(0, 2, 1, 3).reshape(batch * length, -1))
        start = end
    hidden = flat + attention.o_proj(mx.concatenate(outputs))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _heads(x: mx.array, batch: int, length: int, count: int) -> mx.array:
    """(batch * length, count * dim) -> (batch, count, length, dim), as the block shapes it."""
    return x.reshape(batch, length, count, -1).transpose(0, 2, 1, 3)


def feed_together(
    model: Any, jobs: list[tuple[list[RaggedKVCache], list[list[int]] | None]], *given: mx.array
) -> list:
    """`[feed_rows(model, cache, rows) for cache, rows in jobs]` in one packed forward:
    each job's rows fed their own tokens (padded at the end), each row's cache advanced
    by its own count. A job whose rows are None is fed the next of `given` (B, T) as
    `model(inputs, cache=cache)` would be. Returns each job's logits (B, T, V), lazily."""
    parts, lengths, supplied = [], [], iter(given)
    for cache, rows in jobs:
        if rows is None:
            parts.append((next(supplied), cache))
            lengths.append(None)
            continue
        width = max(1, max(len(r) for r in rows))
        parts.append((mx.array([r + [0] * (width - len(r)) for r in rows]), cache))
        lengths.append([held + len(r) for held, r in zip(cache[0].held, rows, strict=True)])
    logits = packed_logits(model, parts)
    for (cache, _), new in zip(jobs, lengths, strict=True):
        for layer in cache if new is not None else ():
            layer.set_lengths(new)
    return logits


class ChunkFeed:
    """The target forward of a prefill chunk (`feed_rows`'s signature, for
    `prefill_chunk`), counting the prompt tokens it feeds; given the decoding rows'
    step (`inputs` over `cache`), the chunk's forward carries it, packed, and keeps its
    logits (`logits`) for the rows' verify. Lives for one engine step."""

    def __init__(self, inputs: mx.array | None = None, cache: list | None = None) -> None:
        self.inputs, self.cache = inputs, cache
        self.logits: mx.array | None = None  # the carried step's, once the chunk ran
        self.tokens = 0  # prompt tokens fed

    def __call__(
        self, model: Any, cache: list, rows: list[list[int]], embeddings: mx.array | None = None
    ) -> mx.array:
        self.tokens += sum(len(r) for r in rows)
        if self.inputs is None or self.logits is not None or embeddings is not None:
            # a chunk with images runs alone; the rows' step then runs as its own forward
            return feed_rows(model, cache, rows, embeddings)
        chunk, self.logits = feed_together(model, [(cache, rows), (self.cache, None)], self.inputs)
        return chunk
