"""Token-wise layers that skip a padded batch's padding.

A batched verify feeds `[B, 1 + K]`: row i's newest token and its k_i drafts, shorter
rows padded at the end. Attention needs the rectangle (each row reads its own cache),
but every projection, MLP and the output head work token by token, and on a
compute-bound device (a CPU) they are most of a forward's cost: padding costs as much
as real tokens. With packing on, each of those layers gathers the real tokens, runs
on just them, and scatters its output back into the rectangle, zeros at the padding.
A forward then costs about its real tokens, so one row may draft 8 tokens beside
rows that draft none without the others paying for 8 each.

Invariant: a real position's output is unchanged. Only attention mixes positions, and
no real query attends a padded position (`RaggedKVCache.make_mask`); a padded
position's values are zeros or functions of zeros, never read. Packing is on only
inside `PackedTokens.feeding`; otherwise the wrapped layers are the layers themselves,
so every other forward (prefill, plain steps, the single-stream engine on the same
model) is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

_TOKEN_WISE = (nn.Linear, nn.QuantizedLinear)


class PackedTokens:
    """The packing state shared by every wrapped layer of one model: the flat indices
    of the real tokens in the `[B, W]` rectangle being fed, or None (packing off)."""

    def __init__(self) -> None:
        self.shape: tuple[int, int] | None = None
        self.index: mx.array | None = None  # rectangle position of each real token
        self.source: mx.array | None = None  # each position's real token, or the zero row

    @classmethod
    def install(cls, model: nn.Module) -> PackedTokens:
        """Wrap the model's token-wise layers (once per model: a second install returns
        the state the first one made)."""
        existing = _find_state(model)
        if existing is not None:
            return existing
        state = cls()
        _wrap(model, state)
        return state

    @contextmanager
    def feeding(self, lengths: list[int], width: int) -> Iterator[None]:
        """Pack the next forward: row i's first `lengths[i]` of `width` positions are
        real. Nothing is packed when no row is padded."""
        if all(length == width for length in lengths):
            yield
            return
        flat = [i * width + t for i, length in enumerate(lengths) for t in range(length)]
        source = [len(flat)] * (len(lengths) * width)
        for packed, position in enumerate(flat):
            source[position] = packed
        self.shape = (len(lengths), width)
        self.index = mx.array(flat, dtype=mx.uint32)
        self.source = mx.array(source, dtype=mx.uint32)
        try:
            yield
        finally:
            self.shape = self.index = self.source = None

    def apply(self, layer, x: mx.array) -> mx.array:
        """`layer(x)` on the real tokens only, when x is the rectangle being packed."""
        if self.shape is None or tuple(x.shape[:2]) != self.shape:
            return layer(x)
        rows, width = self.shape
        flat = x.reshape(rows * width, *x.shape[2:])
        out = layer(flat[self.index])
        # back into the rectangle by a gather from the outputs and one zero row (a
        # scatter into zeros cost MLX's CPU about as much as the padding it saved)
        zero = mx.zeros((1, *out.shape[1:]), dtype=out.dtype)
        full = mx.concatenate([out, zero])[self.source]
        return full.reshape(rows, width, *out.shape[1:])


def _packed_call(self, x: mx.array) -> mx.array:
    return self._packing.apply(super(type(self), self).__call__, x)


def _packed_as_linear(self, x: mx.array) -> mx.array:
    return self._packing.apply(super(type(self), self).as_linear, x)


@functools.cache
def _packed_class(base: type) -> type:
    """The subclass of `base` whose token-wise call packs. A wrapped layer keeps its
    object, parameters and names -- only its class changes -- so loading, isinstance
    checks and weight sharing see the layer they saw."""
    embedding = issubclass(base, (nn.Embedding, nn.QuantizedEmbedding))
    method = {"as_linear": _packed_as_linear} if embedding else {"__call__": _packed_call}
    return type(f"Packed{base.__name__}", (base,), method)


def _wrap(model: nn.Module, state: PackedTokens) -> None:
    kinds = (*_TOKEN_WISE, nn.Embedding, nn.QuantizedEmbedding)
    for _, module in model.named_modules():
        if type(module) in kinds:
            module.__class__ = _packed_class(type(module))
            module._packing = state


def _find_state(model: nn.Module) -> PackedTokens | None:
    for _, module in model.named_modules():
        state = getattr(module, "_packing", None)
        if isinstance(state, PackedTokens):
            return state
    return None
