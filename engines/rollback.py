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

from typing import Any

from mlx_lm.models.cache import (
    KVCache,
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


def supports_rollback(model: Any) -> bool:
    """True when every layer's cache is a plain `KVCache`, which trims any number of
    positions exactly (and which the batched engine's ragged cache mirrors); a sharded
    model's `CacheHandle` is one too."""
    return all(
        type(layer) is KVCache or isinstance(layer, CacheHandle)
        for layer in make_prompt_cache(model)
    )
