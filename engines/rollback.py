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

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from engines.lockstep import CacheHandle


class RollbackError(RuntimeError):
    """A cache could not remove as many positions as asked."""


def trim_exact(cache: list, n: int) -> None:
    """Remove the newest `n` positions from every layer, or raise."""
    if n <= 0:
        return
    if not can_trim_prompt_cache(cache):
        # Recurrent state (`ArraysCache`, which has no offset at all) or a sliding
        # window past its size: nothing can be removed.
        kinds = sorted({type(layer).__name__ for layer in cache if not layer.is_trimmable()})
        raise RollbackError(f"asked to roll back {n} cached tokens, but {', '.join(kinds)} cannot")
    before = [_offset(layer) for layer in cache]
    trimmed = trim_prompt_cache(cache, n)
    after = [_offset(layer) for layer in cache]
    if trimmed != n or any(b - a != n for b, a in zip(before, after, strict=True)):
        raise RollbackError(f"asked to roll back {n} cached tokens, the cache removed {trimmed}")


def _offset(layer: Any) -> int:
    return int(layer.offset)


@dataclass
class CacheSnapshot:
    """Every layer's state before a forward, for caches that cannot trim: recurrent
    state (`ArraysCache`) and a sliding window (`RotatingKVCache`) past its size.

    Taking one costs nothing: MLX arrays are values, and a cache's in-place update
    makes a new one, so the snapshot keeps the old ones by reference (a view of each,
    so an update through the layer's own attribute cannot reach it)."""

    layers: list[dict[str, Any]]


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
    a KV cache; a sliding window that trims now may not after the next forward)."""
    if all(isinstance(layer, (KVCache, QuantizedKVCache)) for layer in cache):
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
    `replay` and the `n` positions after it) and feeding `replay` to `model` again."""
    if n <= 0:
        return
    if snapshot is None or can_trim_prompt_cache(cache):  # a window not yet full trims
        trim_exact(cache, n)
        return
    for layer, saved in zip(cache, snapshot.layers, strict=True):
        layer.__dict__.update({k: _detached(v) for k, v in saved.items()})
    if replay:
        model(mx.array(replay)[None], cache=cache)
        mx.eval([layer.state for layer in cache])


def _detached(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value[...]
    if isinstance(value, list):
        return [_detached(item) for item in value]
    return value


def supports_rollback(model: Any) -> bool:
    """True when every layer's cache is a plain `KVCache`, which trims any number of
    positions exactly (and which the batched engine's ragged cache mirrors); a sharded
    model's `CacheHandle` is one too."""
    return all(
        type(layer) is KVCache or isinstance(layer, CacheHandle)
        for layer in make_prompt_cache(model)
    )
