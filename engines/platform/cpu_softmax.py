"""Attention's softmax on a CPU device, bit for bit MLX's, on every core.

MLX's CPU softmax computes each `exp` one value at a time through six out-of-line
`fma` calls (its x86 build has no vector width for float32): ~25 ns per score on the
2-core CPU box, 1.5 s of one layer's 1.8 s attention for a 512-token chunk at 8.7k
tokens of context on Qwen2.5-Coder-0.5B. `cpu_softmax.c` runs the same arithmetic
(the same polynomial, `floor(x + 0.5)` as MLX rounds it, hardware `fma`, which rounds
exactly as `fmaf` does), eight lanes at a time and on every core, and sums each row
one value at a time, left to right, as MLX does: the same bits, ~15x faster.

It is used only after it has reproduced `mx.softmax` bit for bit on this machine
(`SoftmaxKernel.load`), so an MLX whose softmax changes, or a build that vectorizes
it differently (macOS's Accelerate), gets MLX's own softmax back, never other bits.

`attention` is MLX's own CPU attention (`mlx/fast.cpp`'s fallback: scale the queries,
scores, mask, softmax, values) with this softmax, and the causal mask folded into it.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

NO_MASK = -1  # the kernel's `offset` when no causal mask applies
FLOAT32_MIN = float(np.finfo(np.float32).min)  # what MLX writes where a bool mask hides a key


class SoftmaxKernel:
    """The compiled softmax (`_cpu_softmax`), checked against MLX's before use."""

    def __init__(self, module: Any, threads: int) -> None:
        self.module = module
        self.threads = threads

    @classmethod
    def load(cls, threads: int) -> SoftmaxKernel | None:
        """The kernel, or None where it is not built or does not match MLX's bits here."""
        try:
            from engines.platform import _cpu_softmax
        except ImportError:
            log.info("the compiled CPU softmax is not built; attention uses MLX's softmax")
            return None
        kernel = cls(_cpu_softmax, threads)
        try:
            matches = kernel.matches_mlx()
        except (TypeError, ValueError, BufferError) as exc:  # e.g. MLX's buffers read-only
            log.warning("the compiled CPU softmax cannot run here (%s); not used", exc)
            return None
        if not matches:
            log.warning("the compiled CPU softmax differs from MLX's here; not used")
            return None
        return kernel

    def softmax_(self, scores: mx.array, query_len: int, offset: int) -> None:
        """Softmax over the last axis of evaluated float32 `scores`, in place. With
        `offset` >= 0, query row i sees key j only where j <= i + offset (MLX's causal
        mask: the hidden scores count as float32's lowest, as MLX's `where` makes them)."""
        self.module.softmax(memoryview(scores), scores.shape[-1], query_len, offset, self.threads)

    def matches_mlx(self) -> bool:
        """Whether this kernel gives MLX's softmax bit for bit on this machine: scores
        small and large, every row length modulo the vector width, masked and not."""
        rng = np.random.default_rng(0)
        for spread in (0.01, 1.0, 30.0, 300.0):
            for heads, length, cached in ((3, 5, 17), (2, 7, 7), (2, 33, 100), (1, 3, 1031)):
                values = (rng.standard_normal((heads, length, cached)) * spread).astype(np.float32)
                for offset in (NO_MASK, cached - length):
                    ours = mx.array(values)
                    mx.eval(ours)
                    self.softmax_(ours, length, offset)
                    if not mx.array_equal(ours, mlx_softmax(mx.array(values), offset)).item():
                        return False
        return True


def mlx_softmax(scores: mx.array, offset: int) -> mx.array:
    """MLX's own masked softmax, as its CPU attention runs it."""
    if offset != NO_MASK:
        length, cached = scores.shape[-2], scores.shape[-1]
        visible = mx.arange(offset, offset + length)[:, None] >= mx.arange(cached)[None]
        scores = mx.where(visible, scores, mx.array(FLOAT32_MIN, scores.dtype))
    return mx.softmax(scores, axis=-1, precise=True)


def attention(
    kernel: SoftmaxKernel,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: Any,
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` on a CPU for float32 without sinks, bit for
    bit: MLX's fallback's ops in its order, the softmax by `kernel`."""
    heads, kv_heads = queries.shape[1], keys.shape[1]
    repeats = heads // kv_heads
    q = mx.multiply(mx.array(scale, queries.dtype), queries)
    if repeats > 1:  # each key/value head against its query heads, as MLX groups them
        q = mx.unflatten(q, 1, (kv_heads, repeats))
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    scores = mx.matmul(q, mx.swapaxes(keys, -1, -2))
    length, cached = scores.shape[-2], scores.shape[-1]
    offset = NO_MASK
    if isinstance(mask, str):  # "causal": query i sees keys up to i + cached - length
        offset = cached - length
    elif mask is not None:
        mask = mx.broadcast_to(mask, (*queries.shape[:-1], cached))
        if repeats > 1:
            mask = mx.unflatten(mask, 1, (kv_heads, repeats))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(FLOAT32_MIN, scores.dtype))
        else:
            scores = mx.add(scores, mask.astype(scores.dtype))
    mx.eval(scores)  # the kernel writes these scores' own (private) buffer
    if memoryview(scores).c_contiguous:  # as a product's or a where's output always is
        kernel.softmax_(scores, length, offset)
    else:
        scores = mlx_softmax(scores, offset)
    out = mx.matmul(scores, values)
    return mx.flatten(out, 1, 2) if repeats > 1 else out
