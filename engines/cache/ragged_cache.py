"""A batched KV cache whose rows have their own lengths, so each row rolls back alone.

mlx-lm's `BatchKVCache` left-pads rows to one shared write index, so a trim removes
the same number of positions from every row. Batched speculation needs the opposite:
after one verify forward over `[B, 1 + K]`, row i keeps `1 + accepted_i` of the
positions it wrote. Here row i always starts at position 0 and holds exactly
`lengths[i]` positions; a forward over T tokens writes row i's keys at
`lengths[i] .. lengths[i] + T` (a scatter, not a shared slice), and a rollback is a
change of `lengths[i]`: nothing is copied.

Invariant: for every row, positions `< lengths[i]` hold the KV of that row's tokens
in order; positions at or beyond it are garbage that no query ever attends, because
`make_mask` (built from the lengths before the forward) lets query t of row i see
only positions `<= lengths[i] + t`. Shorter rows in a forward are padded at the end,
so padding never changes a real position's logits.

The class speaks mlx-lm's cache protocol (`offset`, `update_and_fetch`, `make_mask`,
`state`, `is_trimmable`, `trim`) so mlx-lm's attention models run on it unchanged;
`offset` is a per-row array, which their RoPE accepts.

A sliding-window layer (gpt-oss, Gemma 3: mlx-lm's `RotatingKVCache`) is one with a
`window`. Its rows keep the window in temporal order instead of rotating, so they
roll back by a change of length as well: row i's column 0 holds its position
`starts[i]`, masks let a query see only the `window` positions up to its own, and
once a row holds a window's worth that no query can see again, the forward that
finds it shifts those rows left (`_slide`), keeping the `window + SLIDE_SLACK`
positions before that forward -- every position a rollback to its start, or any
later query, needs. Invariant: a row that has slid (`starts[i] > 0`) holds at least
`window` positions. `trimmable_windows` gives a model these caches (one row each)
for its sliding layers everywhere, so a single sequence rolls back the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from engines.cache.ragged_recurrent import RaggedArraysCache, finish_rows, prepare_rows

SLIDE_SLACK = 8  # positions a slid row keeps past its window: a short trim always fits


class RaggedKVCache:
    step = 256  # capacity grows in blocks of this many positions, like KVCache

    def __init__(
        self,
        lengths: list[int],
        keys: mx.array | None = None,
        values: mx.array | None = None,
        window: int | None = None,
        starts: list[int] | None = None,
        positions: list | None = None,
    ) -> None:
        self.lengths = list(lengths)
        self.keys = keys
        self.values = values
        self.window = window  # a sliding-window layer's size; None: full attention
        self.starts = list(starts) if starts is not None else [0] * len(self.lengths)
        # per row, its tokens' 3-D rotary positions where its prompt has images and the
        # model takes them (`engines.model.mrope.RowPositions`); None: at their indices
        self.positions = list(positions) if positions is not None else [None] * len(self.lengths)
        # per row, a length a later rollback must reach, however far it writes past it
        # meanwhile (`pinned`: a chain of one-token draft forwards); None: none
        self.pins: list[int] | None = None

    # ---- mlx-lm's cache protocol ------------------------------------------------

    @property
    def held(self) -> list[int]:
        """Positions each row holds (as `RaggedArraysCache.held` counts tokens)."""
        return self.lengths

    @property
    def offset(self) -> int | mx.array:
        """Per-row position of the next token (RoPE offset); an int for one row, as
        mlx-lm's own caches have it."""
        if len(self.lengths) == 1:
            return self.lengths[0]
        return mx.array(self.lengths)

    @property
    def columns(self) -> list[int]:
        """Positions each row keeps in its columns (all of them without a window)."""
        return [length - start for length, start in zip(self.lengths, self.starts, strict=True)]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write T new positions per row after each row's own length; every row
        advances by T (callers roll padded positions back with `set_lengths`)."""
        batch, heads, count, _ = keys.shape
        assert batch == len(self.lengths), "one row of keys per cache row"
        columns = self.columns
        end = max(columns) + count
        self._reserve(end, keys, values)
        if len(set(columns)) == 1:
            start = columns[0]
            self.keys[..., start : start + count, :] = keys
            self.values[..., start : start + count, :] = values
        else:
            positions = mx.array(columns)[:, None] + mx.arange(count)[None]
            index = positions[:, None, :, None]
            self.keys = mx.put_along_axis(
                self.keys, mx.broadcast_to(index, keys.shape), keys, axis=2
            )
            self.values = mx.put_along_axis(
                self.values, mx.broadcast_to(index, values.shape), values, axis=2
            )
        before, self.lengths = self.lengths, [length + count for length in self.lengths]
        fetched = self.keys[..., :end, :], self.values[..., :end, :]
        if self.window is not None:  # this forward's masks were built before the slide
            self._slide(before)
        return fetched

    def make_mask(self, count: int, return_array: bool = False, window_size=None, **_) -> mx.array:
        """(B, 1, count, max_columns + count): query t of row i sees its columns
        <= columns_i + t, and with a window only the `window_size` newest of them."""
        if window_size is not None and (self.window is None or window_size > self.window):
            raise ValueError(f"a window of {window_size} positions needs a cache that keeps it")
        columns = self.columns
        own = mx.array(columns)[:, None, None, None] + mx.arange(count)[None, None, :, None]
        keys = mx.arange(max(columns) + count)[None, None, None, :]
        mask = keys <= own
        if window_size is not None:
            mask = mask & (keys > own - window_size)
        return mask

    @property
    def state(self):
        return self.keys, self.values

    def is_trimmable(self) -> bool:
        """mlx-lm's question, asked without an amount: yes until a row slid (as its
        `RotatingKVCache` answers until it wraps); `trimmable(n)` answers for n."""
        return not any(self.starts)

    def trimmable(self, n: int) -> bool:
        return all(length - self._floor(i) >= n for i, length in enumerate(self.lengths))

    def trim(self, n: int) -> int:
        """Trim every row by n (the protocol's uniform trim); returns what was trimmed."""
        n = min(n, *(length - self._floor(i) for i, length in enumerate(self.lengths)))
        self.lengths = [length - n for length in self.lengths]
        return n

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # ---- per-row lengths and row membership ---------------------------------------

    def set_lengths(self, lengths: list[int]) -> None:
        """Roll rows back (never forward past what was written, nor before a slid
        row's window)."""
        assert len(lengths) == len(self.lengths)
        for i, (new, old) in enumerate(zip(lengths, self.lengths, strict=True)):
            if not self._floor(i) <= new <= old:
                raise ValueError(f"a row of {old} positions cannot become {new}")
        self.lengths = list(lengths)

    def take(self, rows: list[int]) -> RaggedKVCache:
        """A new cache of copies of `rows`, in that order; this one is unchanged."""
        taken = RaggedKVCache(
            self.lengths, self.keys, self.values, self.window, self.starts, self.positions
        )
        taken.filter(rows)
        return taken

    def filter(self, rows: list[int]) -> None:
        """Keep only `rows`, in that order (a copy of the kept rows)."""
        self.lengths = [self.lengths[i] for i in rows]
        self.starts = [self.starts[i] for i in rows]
        self.positions = [self.positions[i] for i in rows]
        if not rows:
            self.keys = self.values = None
        if self.keys is not None:
            index = mx.array(rows, dtype=mx.int32)
            capacity = _round_up(max(max(self.columns, default=0), 1), self.step)
            self.keys = self.keys[index, :, :capacity]
            self.values = self.values[index, :, :capacity]

    def extend(self, other: RaggedKVCache) -> None:
        """Append `other`'s rows after this cache's rows."""
        assert self.window == other.window, "rows of one layer share its window"
        self.starts += other.starts
        self.positions += other.positions
        if other.keys is None and self.keys is None:
            self.lengths += other.lengths
            return
        if self.keys is None:
            self.keys, self.values = _empty_rows(len(self.lengths), other)
        if other.keys is None:
            other = RaggedKVCache(other.lengths, *_empty_rows(len(other.lengths), self))
        capacity = max(self.keys.shape[2], other.keys.shape[2])
        self.keys = mx.concatenate([_pad_to(self.keys, capacity), _pad_to(other.keys, capacity)])
        self.values = mx.concatenate(
            [_pad_to(self.values, capacity), _pad_to(other.values, capacity)]
        )
        self.lengths += other.lengths

    def extract(self, row: int) -> KVCache | RaggedKVCache:
        """Row `row` as a single-sequence cache holding exactly its positions: a
        `KVCache`, or for a window a one-row copy (which trims; see `trimmable_windows`)."""
        if self.window is not None:
            return self.take([row])
        cache = KVCache()
        if self.positions[row] is not None:
            cache.rope_positions = self.positions[row]
        length = self.lengths[row]
        if length and self.keys is not None:
            cache.keys = mx.contiguous(self.keys[row : row + 1, :, :length])
            cache.values = mx.contiguous(self.values[row : row + 1, :, :length])
            cache.offset = length
        return cache

    @classmethod
    def from_caches(cls, caches: list) -> RaggedKVCache:
        """Rows from single-sequence caches of one layer: `KVCache`s (each `offset`
        positions long), a sliding window's `RotatingKVCache`s (each keeping its
        window), or `RaggedKVCache`s (copied, rows in order)."""
        rows = [
            c.take(list(range(len(c.lengths)))) if isinstance(c, RaggedKVCache) else cls._row(c)
            for c in caches
        ]
        merged = rows[0]
        for more in rows[1:]:
            merged.extend(more)
        return merged

    @classmethod
    def _row(cls, cache: KVCache | RotatingKVCache) -> RaggedKVCache:
        keys, values = _positions(cache)
        held = 0 if keys is None else keys.shape[2]
        row = cls(
            [cache.offset],
            window=_window_of(cache),
            starts=[cache.offset - held],
            positions=[getattr(cache, "rope_positions", None)],
        )
        if held:
            capacity = _round_up(held, cls.step)
            row.keys, row.values = _pad_to(keys, capacity), _pad_to(values, capacity)
        return row

    # ---- internals ------------------------------------------------------------------

    def _floor(self, row: int) -> int:
        """The shortest row `row` may roll back to: a slid row keeps its window."""
        return self.starts[row] + self.window if self.starts[row] else 0

    def _slide(self, before: list[int]) -> None:
        """Once some row holds a window's worth of positions no query will see again
        (older than the `window` before this forward, which any rollback keeps), shift
        every row left past its own such positions: one gather, every `window` tokens."""
        keep = self.window + SLIDE_SLACK
        if self.pins is not None:  # a row keeps the window before its pin too
            before = [min(b, pin) for b, pin in zip(before, self.pins, strict=True)]
        drop = [max(0, b - keep - s) for b, s in zip(before, self.starts, strict=True)]
        if max(drop) < self.window:
            return
        capacity = self.keys.shape[2]
        index = mx.minimum(mx.array(drop)[:, None] + mx.arange(capacity)[None], capacity - 1)
        index = index[:, None, :, None]
        self.keys = mx.take_along_axis(self.keys, mx.broadcast_to(index, self.keys.shape), axis=2)
        self.values = mx.take_along_axis(
            self.values, mx.broadcast_to(index, self.values.shape), axis=2
        )
        self.starts = [s + d for s, d in zip(self.starts, drop, strict=True)]

    def _reserve(self, end: int, keys: mx.array, values: mx.array) -> None:
        if self.keys is not None and end <= self.keys.shape[2]:
            return
        capacity = _round_up(end, self.step)
        batch, heads, _, k_dims = keys.shape
        if self.keys is None:
            self.keys = mx.zeros((batch, heads, capacity, k_dims), keys.dtype)
            self.values = mx.zeros((batch, heads, capacity, values.shape[3]), values.dtype)
        else:
            self.keys = _pad_to(self.keys, capacity)
            self.values = _pad_to(self.values, capacity)


def trimmable_windows(model: Any) -> bool:
    """Give the model's sliding-window layers one-row `RaggedKVCache`s with their window
    instead of mlx-lm's `RotatingKVCache`, which cannot trim once it wraps: every cache
    `make_prompt_cache` makes for the model afterwards has them, so a rejected draft
    rolls back by a change of length, alone as in the batch, and never replays.
    Returns whether the model had any such layer."""
    make_cache = getattr(model, "make_cache", None)
    if make_cache is None or not any(is_sliding_window(c) for c in make_cache()):
        return False

    def make_trimmable_cache() -> list:
        return [
            RaggedKVCache([0], window=c.max_size) if is_sliding_window(c) else c
            for c in make_cache()
        ]

    model.make_cache = make_trimmable_cache
    return True


def is_sliding_window(cache: Any) -> bool:
    """mlx-lm's sliding-window cache that a windowed `RaggedKVCache` mirrors: one that
    keeps no sink positions (`keep` 0; gpt-oss, Gemma 3)."""
    return type(cache) is RotatingKVCache and cache.keep == 0


def _window_of(cache: KVCache | RotatingKVCache) -> int | None:
    if not isinstance(cache, RotatingKVCache):
        return None
    if cache.keep:
        raise ValueError("a sliding window that keeps its first positions cannot be batched")
    return cache.max_size


def _positions(cache: KVCache | RotatingKVCache) -> tuple[mx.array | None, mx.array | None]:
    """The keys and values a cache holds, in temporal order, nothing unused: a
    `RotatingKVCache` may have wrapped around its window or hold spare capacity."""
    if cache.keys is None or cache.offset == 0:
        return None, None
    if isinstance(cache, RotatingKVCache):
        return cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


def _empty_rows(rows: int, like: RaggedKVCache) -> tuple[mx.array, mx.array]:
    """Zero-capacity keys and values for `rows` rows, shaped and typed like `like`'s."""
    k, v = like.keys, like.values
    return (
        mx.zeros((rows, k.shape[1], 0, k.shape[3]), k.dtype),
        mx.zeros((rows, v.shape[1], 0, v.shape[3]), v.dtype),
    )


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step


def _pad_to(array: mx.array, capacity: int) -> mx.array:
    """Pad (or cut) axis 2 to `capacity` positions."""
    size = array.shape[2]
    if size >= capacity:
        return array[:, :, :capacity]
    pad = mx.zeros((*array.shape[:2], capacity - size, array.shape[3]), array.dtype)
    return mx.concatenate([array, pad], axis=2)


def ragged_from_rows(rows: list[list]) -> list:
    """Per-layer batched caches from each row's per-layer caches: `RaggedKVCache` for
    KV layers, `RaggedArraysCache` for recurrent ones (each row holding as many tokens
    as its KV layers). A sharded model's caches are named by their first layer
    (`lockstep.CacheHandle`), which then makes the batched cache's first layer, named too."""
    gather_first = getattr(rows[0][0], "ragged_from", None)
    held = [_tokens_held(row) for row in rows]
    layers = []
    for index in range(len(rows[0])):
        caches = [row[index] for row in rows]
        if isinstance(caches[0], ArraysCache):
            layers.append(RaggedArraysCache.from_caches(caches, held))
        elif index == 0 and gather_first is not None:
            layers.append(gather_first(caches))
        else:
            layers.append(RaggedKVCache.from_caches(caches))
    return layers


def extend_rows(layers: list, extra: list) -> None:
    """Append `extra`'s rows to `layers`' (target and draft layers, in the same order).
    Every pair is checked before any layer changes, so rows that cannot join leave
    the batch's caches as they were."""
    check_joinable(layers, extra)
    for layer, more in zip(layers, extra, strict=True):
        layer.extend(more)


def check_joinable(layers: list, extra: list) -> None:
    """Raise unless `extra`'s layers can join `layers`' one for one."""
    if len(layers) != len(extra):
        raise ValueError(f"{len(extra)} layers of rows cannot join {len(layers)}")
    for layer, more in zip(layers, extra, strict=True):
        if isinstance(layer, RaggedArraysCache) != isinstance(more, RaggedArraysCache):
            raise ValueError("a recurrent layer's rows join only a recurrent layer")
        if getattr(layer, "window", None) != getattr(more, "window", None):
            raise ValueError("rows of one layer share its window")


def remove_rows(rows: list, cache: list, draft: list | None, indices: list[int]) -> None:
    """Remove `indices` from a batch's rows and from its target and draft caches."""
    keep = [i for i in range(len(rows)) if i not in set(indices)]
    for i in sorted(indices, reverse=True):
        del rows[i]
    for layer in [*cache, *(draft or [])]:
        layer.filter(keep)


def _tokens_held(row: list) -> int:
    """Tokens a sequence's cache holds, read from its KV layers (recurrent state has
    no count of its own)."""
    return next(layer.offset for layer in row if not isinstance(layer, ArraysCache))


# ---- forwards over ragged rows ------------------------------------------------------


def feed_rows(
    model, cache: list[RaggedKVCache], rows: list[list[int]], embeddings: mx.array | None = None
) -> mx.array:
    """One forward with each row's own tokens (padded at the end); each row's cache
    advances by its own count. Returns logits (B, T, V). With `embeddings` (B, T,
    hidden), the forward reads them in place of the tokens' own (prompt images)."""
    width = max(1, max(len(r) for r in rows))
    lengths = list(cache[0].held)
    inputs = mx.array([r + [0] * (width - len(r)) for r in rows])
    ragged = any(len(r) != width for r in rows)
    if ragged:  # recurrent rows must not absorb the padding
        prepare_rows(cache, [len(r) for r in rows])
    if embeddings is None:
        logits = model(inputs, cache=cache)
    else:
        logits = model(inputs, cache=cache, input_embeddings=embeddings)
    if ragged:
        finish_rows(cache)
    new = [length + len(r) for length, r in zip(lengths, rows, strict=True)]
    for layer in cache:
        if isinstance(layer, RaggedKVCache):
            layer.set_lengths(new)
    return logits


def feed_chunk(model, cache: list[RaggedKVCache], targets: list[list[int]], step: int) -> list[int]:
    """Feed each row up to `step` more of `targets[i]` (the tokens it should hold);
    returns each row's length after. Rows already complete feed nothing."""
    lengths = cache[0].held
    chunks = [t[length : length + step] for t, length in zip(targets, lengths, strict=True)]
    if any(chunks):
        feed_rows(model, cache, chunks)
    return list(cache[0].held)


@contextmanager
def pinned(cache: list, lengths: list[int]) -> Iterator[None]:
    """While inside, forwards keep each windowed row able to roll back to `lengths[i]`:
    a chain of one-token forwards (drafting k tokens) would otherwise slide a row past
    the start of its chain once it writes more than SLIDE_SLACK + 1 positions."""
    windowed = [layer for layer in cache if getattr(layer, "window", None) is not None]
    for layer in windowed:
        layer.pins = list(lengths)
    try:
        yield
    finally:
        for layer in windowed:
            layer.pins = None


def set_row_length(cache: list[RaggedKVCache], row: int, length: int) -> None:
    for layer in cache:
        lengths = list(layer.lengths)
        lengths[row] = length
        layer.set_lengths(lengths)


def warm_up(model) -> None:
    """Two small ragged forwards (a ragged prefill, then one token per row), so the
    first batched step after a mode switch does not pay MLX's first-use costs while
    a stream waits on it."""
    cache = ragged_from_rows([make_prompt_cache(model), make_prompt_cache(model)])
    mx.eval(feed_rows(model, cache, [[1, 2, 3], [4]]))
    mx.eval(feed_rows(model, cache, [[5], [6]]))
