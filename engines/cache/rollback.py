"""Cache rollback that is checked, never silent.

mlx-lm's `trim_prompt_cache` returns how many positions it removed and does nothing
for caches that cannot roll back (recurrent `ArraysCache` state, a `RotatingKVCache`
past its window). Speculation and migration rely on removing rejected tokens; a
trim that silently removes fewer leaves them in the KV cache and corrupts every
later token. So every rollback goes through `trim_exact`, which raises instead, and
the registry decides at load whether a model's caches can roll back at all
(`supports_rollback`): a model whose caches cannot serves with drafting off.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    make_prompt_cache,
)

from engines.cache.ragged_cache import RaggedKVCache, is_sliding_window
from engines.cache.ragged_recurrent import RaggedArraysCache, finish_rows, is_recurrent


class RollbackError(RuntimeError):
    """A cache could not remove as many positions as asked."""


def can_trim(cache: list, n: int) -> bool:
    """Whether every layer can remove its newest `n` positions: mlx-lm's answer
    (`is_trimmable`), or for a sliding window kept in order (`RaggedKVCache`), its own
    for exactly n (it keeps a few positions past its window)."""
    return all(
        layer.trimmable(n) if isinstance(layer, RaggedKVCache) else layer.is_trimmable()
        for layer in cache
    )


def trim_exact(cache: list, n: int) -> None:
    """Remove the newest `n` positions from every layer, or raise."""
    if n <= 0:
        return
    if not can_trim(cache, n):
        # Recurrent state (`ArraysCache`, which has no offset at all) or a sliding
        # window past its size: nothing can be removed.
        kinds = sorted({type(layer).__name__ for layer in cache if not can_trim([layer], n)})
        raise RollbackError(f"asked to roll back {n} cached tokens, but {', '.join(kinds)} cannot")
    before = [_offset(layer) for layer in cache]
    trimmed = [layer.trim(n) for layer in cache]
    after = [_offset(layer) for layer in cache]
    if set(trimmed) != {n} or any(b - a != n for b, a in zip(before, after, strict=True)):
        raise RollbackError(f"asked to roll back {n} cached tokens, the cache removed {trimmed}")


def _offset(layer: Any) -> int:
    return int(layer.offset)


@dataclass
class CacheSnapshot:
    """Every layer's state before a forward, for caches that cannot trim: recurrent
    state (`ArraysCache`) and a sliding window (`RotatingKVCache`) past its size.

    Taking one costs nothing: MLX arrays are values, and a cache's in-place update
    makes a new one, so the snapshot keeps the old ones by reference (a view of each,
    so an update through the layer's own attribute cannot reach it).

    `inputs` (filled by `capturing_inputs` during the forward after the snapshot):
    what each recurrent layer received, so a rollback can rerun just those layers on
    the kept positions instead of the whole model."""

    layers: list[dict[str, Any]]
    inputs: dict[int, tuple[Any, mx.array]] = field(default_factory=dict)  # i: (layer, x)


def supports_snapshot(model: Any) -> bool:
    """True when every layer of the model's cache keeps only arrays and plain values
    (lists of arrays included), which `take_snapshot` can hold on to; a layer holding
    other objects (mlx-lm's `CacheList` of caches) could change under it."""
    return all(
        _plain(value) for layer in make_prompt_cache(model) for value in vars(layer).values()
    )


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    return value is None or isinstance(value, (mx.array, int, float, bool, str))


def take_snapshot(cache: list) -> CacheSnapshot | None:
    """A snapshot to roll back to, or None when trimming will always do (every layer
    a KV cache, batched or not; a sliding window that trims now may not after the next
    forward)."""
    if all(isinstance(layer, (KVCache, QuantizedKVCache, RaggedKVCache)) for layer in cache):
        return None
    return CacheSnapshot([{k: _detached(v) for k, v in vars(layer).items()} for layer in cache])


def roll_back(
    cache: list,
    n: int,
    snapshot: CacheSnapshot | None,
    model: Any = None,
    replay: list[int] | None = None,
) -> None:
    """Remove the newest `n` positions: by trimming (`trim_exact`), or, for a cache
    that cannot trim, by restoring `snapshot` (taken before the forward that added
    `replay` and the `n` positions after it) and feeding `replay` again: to the
    recurrent layers alone when the forward's inputs to them were captured (the other
    layers' KV caches trim), else to the whole `model`."""
    if n <= 0:
        return
    if snapshot is None or can_trim(cache, n):  # a window not yet full trims
        trim_exact(cache, n)
        return
    captured = snapshot.inputs
    if captured and replay:
        trim_exact([layer for i, layer in enumerate(cache) if i not in captured], n)
        for i in captured:
            _restore(cache[i], snapshot.layers[i])
        _rerun_captured(cache, captured, len(replay))
        return
    for layer, saved in zip(cache, snapshot.layers, strict=True):
        _restore(layer, saved)
    if replay:
        model(mx.array(replay)[None], cache=cache)
        mx.eval([layer.state for layer in cache])


def roll_back_rows(
    cache: list, snapshot: CacheSnapshot, before: list[int], kept: list[int]
) -> None:
    """`roll_back` for a batch whose rows keep different amounts: after a verify that
    started with row i holding `before[i]` tokens, keep `kept[i]`. KV layers cut their
    rows; recurrent layers (`RaggedArraysCache`) get their state from `snapshot`
    (taken before the verify) and rerun on their captured inputs, row i on its first
    `kept[i] - before[i]` positions (the rest masked out)."""
    counts = [k - b for k, b in zip(kept, before, strict=True)]
    for i, layer in enumerate(cache):
        if isinstance(layer, RaggedArraysCache):
            _restore(layer, snapshot.layers[i])
            layer.prepare(counts)
        else:
            layer.set_lengths(kept)
    _rerun_captured(cache, snapshot.inputs, max(counts))
    finish_rows(cache)


def restore_rows(cache: list, snapshot: CacheSnapshot | None, before: list[int]) -> None:
    """Undo a batched forward that started with row i holding `before[i]` tokens (it
    failed part-way, or its result is dropped): KV layers cut their rows back,
    recurrent layers take their state from `snapshot` (taken before the forward)."""
    for i, layer in enumerate(cache):
        if isinstance(layer, RaggedArraysCache):
            _restore(layer, snapshot.layers[i])
        else:
            layer.set_lengths(before)


def _rerun_captured(cache: list, captured: dict[int, tuple[Any, mx.array]], width: int) -> None:
    """Feed each captured recurrent layer its first `width` inputs again, on its
    restored state; only the cache is evaluated, so MLX computes just what updates it.
    The cache's own mask (None for one sequence, each row's count in a batch) keeps
    padding out."""
    for i, (layer, inputs) in captured.items():
        layer(inputs[:, :width], mask=cache[i].make_mask(width), cache=cache[i])
    mx.eval([cache[i].state for i in captured])


def _restore(layer: Any, saved: dict[str, Any]) -> None:
    layer.__dict__.update({k: _detached(v) for k, v in saved.items()})


@contextmanager
def capturing_inputs(model: Any, cache: list, snapshot: CacheSnapshot | None) -> Iterator[None]:
    """Record into `snapshot.inputs` what each recurrent layer receives during the one
    forward of a single sequence run inside, when every layer that cannot trim keeps
    recurrent state (`ArraysCache`) and the others are plain KV caches: then a
    rollback reruns only those layers (their mixers; the rest of a layer's output is
    never evaluated) instead of the whole model. Otherwise (a sliding window, whose
    masks a lone layer cannot rebuild) nothing is captured and a rollback replays all."""
    layers = None if snapshot is None else _layer_list(model, len(cache))
    recurrent = [i for i, layer in enumerate(cache) if is_recurrent(layer)]
    plain = all(is_recurrent(layer) or _trims_exactly(layer) for layer in cache)
    if layers is None or not recurrent or not plain:
        yield
        return
    originals = {i: layers[i] for i in recurrent}
    for i, layer in originals.items():
        layers[i] = _InputRecorder(layer, i, snapshot.inputs)
    try:
        yield
    finally:
        for i, layer in originals.items():
            layers[i] = layer


def _trims_exactly(layer: Any) -> bool:
    return type(layer) is KVCache or isinstance(layer, RaggedKVCache)


class _InputRecorder:
    """Stands in for a decoder layer during one forward: notes its input, runs it."""

    def __init__(self, layer: Any, index: int, sink: dict[int, tuple[Any, mx.array]]) -> None:
        self.layer, self.index, self.sink = layer, index, sink

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        self.sink[self.index] = (self.layer, x)
        return self.layer(x, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # what the forward reads (is_linear, ...)
        return getattr(self.layer, name)


def _layer_list(model: Any, count: int) -> list | None:
    """The list of decoder layers the model's forward iterates (mlx-lm keeps it as
    `layers` on the model, its `model`, or its language model's `model`)."""
    text = getattr(model, "language_model", model)
    for owner in (model, getattr(model, "model", None), text, getattr(text, "model", None)):
        if isinstance(owner, dict) and isinstance(owner.get("layers"), list):
            layers = owner["layers"]
            if len(layers) == count:
                return layers
    return None


def detached_copy(cache: list) -> list:
    """A copy of every layer that later updates of `cache` cannot reach -- free, the
    arrays are shared values (a prompt checkpoint kept while the sequence goes on). A
    sharded model's named cache gets a name of its own (`CacheHandle.__copy__`)."""
    copies = []
    for layer in cache:
        twin = copy.copy(layer)
        twin.__dict__.update({k: _detached(v) for k, v in vars(twin).items()})
        copies.append(twin)
    return copies


def _detached(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value[...]
    if isinstance(value, list):
        return [_detached(item) for item in value]
    return value


def supports_rollback(model: Any) -> bool:
    """True when every layer's cache trims exactly: a plain `KVCache` (which the
    batched engine's ragged cache mirrors), a sliding window kept in order
    (`RaggedKVCache`, see `ragged_cache.trimmable_windows`), or a sharded model's
    `CacheHandle`."""
    return all(
        plain_kv(layer) or isinstance(layer, RaggedKVCache) for layer in make_prompt_cache(model)
    )


def cuts_back_anywhere(model: Any) -> bool:
    """True when every layer's cache can be cut back to any shorter prefix (plain KV):
    a finished request's cache then serves any prompt that shares a prefix with it,
    so prompt checkpoints are not needed."""
    return all(
        plain_kv(layer) or type(layer) is QuantizedKVCache for layer in make_prompt_cache(model)
    )


def plain_kv(layer: Any) -> bool:
    """A plain `KVCache`, or a subclass that says it behaves as one (`plain_kv = True`:
    a sharded model's `CacheHandle`, which only names the cache to the other ranks).
    Other subclasses (mlx-lm's chunked and rotating caches) trim differently."""
    return type(layer) is KVCache or getattr(type(layer), "plain_kv", False) is True


def supports_batched_rows(model: Any) -> bool:
    """True when batched speculation can hold the model's caches with rows that roll
    back alone: plain KV layers and sliding-window layers (`RaggedKVCache`, the window
    kept in temporal order), and recurrent layers beside at least one of those
    (`RaggedArraysCache`: restored and rerun from the verify's captured inputs, which
    needs the decoder layers where `capturing_inputs` finds them)."""
    if supports_rollback(model):
        return True
    cache = make_prompt_cache(model)
    attention = [layer for layer in cache if _batched_attention(layer)]
    recurrent = [layer for layer in cache if isinstance(layer, ArraysCache)]
    if len(attention) + len(recurrent) != len(cache) or not attention:
        return False
    return not recurrent or _layer_list(model, len(cache)) is not None


def _batched_attention(layer: Any) -> bool:
    """A KV cache `RaggedKVCache` mirrors: plain, or a window that keeps no sink."""
    return type(layer) is KVCache or isinstance(layer, RaggedKVCache) or is_sliding_window(layer)
