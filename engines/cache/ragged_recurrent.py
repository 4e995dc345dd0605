"""Batched recurrent state whose rows roll back alone, beside `RaggedKVCache`.

Hybrid models (Qwen3.5/3.6, Qwen3-Next, LFM2) keep recurrent state (`ArraysCache`:
conv and delta-rule state) in some layers and KV caches in the others. In a batch,
row i's state is row i of each array. It has no positions, so a rollback cannot be a
change of length as in `RaggedKVCache`: after a verify over `[B, 1 + K]`, each
recurrent layer's state is restored from before the verify and that layer alone is
rerun on the positions each row keeps, from its input captured during the verify
(`rollback.capturing_inputs`), with a mask so row i absorbs exactly its own
`1 + accepted_i` tokens (`rollback.roll_back_rows`).

A forward whose rows feed different numbers of tokens (a ragged prefill, a rollback
replay) is prepared with each row's count (`prepare`): mlx-lm's recurrent layers then
read it as `lengths` (the conv state ends at each row's last real token) and as the
mask from `make_mask` (padding never enters the state), as its BatchGenerator's
right-padded prefill does. A forward that is not prepared (a plain step, one token
per row; a verify, whose state is restored afterwards) advances every row alike.

Invariant: row i holds the state after exactly `held[i]` tokens of its sequence --
the same count its KV layers hold (`RaggedKVCache.lengths`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache


class RaggedArraysCache:
    def __init__(self, arrays: list[mx.array | None], held: list[int]) -> None:
        self.cache = arrays  # per state kind, (B, ...) or None before any token
        self.held = list(held)
        self.valid: mx.array | None = None  # per-row token counts of a prepared forward
        self._after: list[int] | None = None

    # ---- mlx-lm's recurrent cache protocol ----------------------------------------

    def __getitem__(self, index: int) -> mx.array | None:
        return self.cache[index]

    def __setitem__(self, index: int, value: mx.array) -> None:
        self.cache[index] = value

    @property
    def lengths(self) -> mx.array | None:
        """What mlx-lm's layers read: each row's real tokens in this forward, or None
        (every position real)."""
        return self.valid

    def make_mask(self, count: int) -> mx.array | None:
        if self.valid is None:
            return None
        return mx.arange(count)[None] < self.valid[:, None]

    def advance(self, count: int) -> None:
        if self.valid is None:
            self.held = [h + count for h in self.held]

    @property
    def state(self) -> list[mx.array]:
        return [a for a in self.cache if a is not None]

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    # ---- ragged forwards --------------------------------------------------------------

    def prepare(self, counts: list[int]) -> None:
        """The next forward feeds row i `counts[i]` real tokens (padding after them)."""
        self.valid = mx.array(counts)
        self._after = [h + c for h, c in zip(self.held, counts, strict=True)]

    def finish(self) -> None:
        self.held, self.valid, self._after = self._after, None, None

    # ---- row membership -----------------------------------------------------------------

    def filter(self, rows: list[int]) -> None:
        index = mx.array(rows, dtype=mx.int32)
        self.cache = [a[index] if a is not None and rows else None for a in self.cache]
        self.held = [self.held[i] for i in rows]

    def take(self, rows: list[int]) -> RaggedArraysCache:
        taken = RaggedArraysCache(list(self.cache), self.held)
        taken.filter(rows)
        return taken

    def extend(self, other: RaggedArraysCache) -> None:
        self.cache = [
            _concat(a, b, len(self.held), len(other.held))
            for a, b in zip(self.cache, other.cache, strict=True)
        ]
        self.held += other.held

    def extract(self, row: int) -> ArraysCache:
        """Row `row` as mlx-lm's single-sequence `ArraysCache`."""
        cache = ArraysCache(len(self.cache))
        cache.cache = [a[row : row + 1] if a is not None else None for a in self.cache]
        return cache

    @classmethod
    def from_caches(cls, caches: list[ArraysCache], held: list[int]) -> RaggedArraysCache:
        """Rows from single-sequence caches holding `held[i]` tokens each."""
        arrays: list[mx.array | None] = [None] * len(caches[0].cache)
        merged = cls(arrays, [])
        for cache, count in zip(caches, held, strict=True):
            merged.extend(cls(list(cache.cache), [count]))
        return merged


def _concat(a: mx.array | None, b: mx.array | None, rows_a: int, rows_b: int):
    """Rows of `a` then `b`; a side that holds no state yet is the zero state."""
    if a is None and b is None:
        return None
    like = a if a is not None else b
    if a is None:
        a = mx.zeros((rows_a, *like.shape[1:]), like.dtype)
    if b is None:
        b = mx.zeros((rows_b, *like.shape[1:]), like.dtype)
    return mx.concatenate([a, b])


def is_recurrent(layer: Any) -> bool:
    return isinstance(layer, (ArraysCache, RaggedArraysCache))


def prepare_rows(cache: list, counts: list[int]) -> None:
    for layer in cache:
        if isinstance(layer, RaggedArraysCache):
            layer.prepare(counts)


def finish_rows(cache: list) -> None:
    for layer in cache:
        if isinstance(layer, RaggedArraysCache):
            layer.finish()
